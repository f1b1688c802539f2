"""``bench/profile_w1_gpu.py`` runs end to end on CPU on a tiny shape (timeline, a profiler
window with its breakdown and gap analysis, the decode-step fit, the JSON files), so the GPU call that uses it
does not find it stale."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_profile_w1_script_runs_on_cpu(tmp_path):
    env = dict(os.environ, PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_w1_gpu.py"),
                        "--shape", "llama-tiny", "--num-requests", "4", "--scale", "0.05",
                        "--out", str(tmp_path), "--windows", "2:4", "--no-trace-files"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "timeline run:" in r.stdout and "window 2:4 device gaps" in r.stdout
    timeline = json.load(open(tmp_path / "timeline.json"))
    assert timeline["summary"]["steps"] == len(timeline["steps"]) > 2
    # the decode steps' fixed cost and per-token cost, with the K/V bytes a token of the pool
    fit = timeline["summary"]["decode_fit"]
    assert "decode step = " in r.stdout and fit["steps"] >= 2 and "tb_per_s" in fit
    bd = json.load(open(tmp_path / "breakdown.json"))
    assert "gaps" in bd["windows"]["2:4"]
    assert not (tmp_path / "trace_2_4.json").exists()


def test_profile_w1_script_decode_config_reaches_the_backend(tmp_path):
    """``--decode-config`` builds the engine's backend with that config (the backend, not the
    module default, decides the engine's decode launches)."""
    env = dict(os.environ, PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN="1", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_w1_gpu.py"),
                        "--shape", "llama-tiny", "--num-requests", "4", "--scale", "0.05",
                        "--out", str(tmp_path), "--skip-profile",
                        "--decode-config", "balanced_fraction=1.0,flat_split=0"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("decode config for this run:"))
    assert "balanced_fraction=1.0" in line and "flat_split=False" in line
    bad = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "profile_w1_gpu.py"),
                          "--shape", "llama-tiny", "--out", str(tmp_path), "--skip-profile",
                          "--decode-config", "no_such_field=1"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert bad.returncode != 0 and "no_such_field" in bad.stderr


def test_decode_config_fields_by_hand():
    """``--decode-config`` text of the bench scripts (``bench_w1.decode_config_fields``): bools
    as 0 / 1, floats and ints by the field's default type (ints where it is None), ``none``
    as None, an unknown field exits."""
    import pytest

    bench = os.path.join(ROOT, "bench")
    sys.path.insert(0, bench)
    try:
        from bench_w1 import decode_config_fields
    finally:
        sys.path.remove(bench)
    got = decode_config_fields("balanced_fraction=1.0,flat_split=0,mid_splits=2,use_order=1")
    assert got == {"balanced_fraction": 1.0, "flat_split": False, "mid_splits": 2,
                   "use_order": True}
    assert type(got["mid_splits"]) is int
    got = decode_config_fields("balanced_max_excess=none,min_split_tokens=64,"
                               "flat_max_registers=None")
    assert got == {"balanced_max_excess": None, "min_split_tokens": 64,
                   "flat_max_registers": None}
    assert decode_config_fields("balanced_max_excess=300000") == {"balanced_max_excess": 300000}
    with pytest.raises(SystemExit, match="no_such_field"):
        decode_config_fields("no_such_field=1")
