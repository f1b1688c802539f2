"""Smoke test of bench/bench_cascade_gpu.py: its main path with ``--tiny`` on the CPU (kernels
through the Triton interpreter): cascade taken, outputs checked, the bytes it reports against
hand counts."""

import importlib.util
import json
import os
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_cascade_gpu.py")


def load():
    spec = importlib.util.spec_from_file_location("bench_cascade_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_tiny_main_path(tmp_path, capsys):
    bench = load()
    out = tmp_path / "r.json"
    res = bench.main(["--tiny", "--out", str(out), "--generated", "3", "--sweep-prefix"])
    assert json.loads(out.read_text())["correctness_failures"] == []
    assert "tiny" in capsys.readouterr().out  # the table
    (r,) = res["cases"]
    assert r["cascade_taken"] and r["rel_err_vs_ref"] < 1e-5 and r["rel_err_vs_plain"] < 1e-5
    for k in ("plain_us", "cascade_us", "prefix_us", "suffix_us", "merge_us"):
        assert r[k] > 0
    sweep = r["prefix_sweep"]
    assert bench.PREFIX_SPLITS == (1, 2, 4, 8)
    assert sorted((row["pack_heads"], row["splits"]) for row in sweep) == [
        (p, s) for p in (1, 2) for s in (1, 2, 4, 8)]
    assert all(row["rel_err"] < 1e-5 and row["us"] > 0 for row in sweep)
    # 6 requests, 32 shared positions; a position's K and V: 2 heads x 16 x 2 x 4 bytes = 256
    step = bench.Step(bench.TINY, 3, 1, bench.torch.float32, "cpu", seed=3)
    total = sum(step.seq_lens)
    assert all(32 + 3 + 3 <= n <= 32 + 10 + 3 for n in step.seq_lens)
    assert r["plain_bytes"] == total * 256
    assert r["cascade_kv_bytes"] == (32 + total - 6 * 32) * 256
    # merge: two float32 partial outputs [6, 4, 16] and two lse [6, 4], each written and
    # read once, and the (here fp32) output [6, 4, 16] written
    assert r["merge_bytes"] == 2 * 2 * 6 * 4 * 16 * 4 + 2 * 2 * 6 * 4 * 4 + 6 * 4 * 16 * 4
