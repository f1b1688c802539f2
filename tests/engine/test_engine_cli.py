"""The command line (``pagedkv demo``, ``generate``, ``bench``) end to end on tiny checkpoints,
and the W1 workload definition."""

import json
import os
import subprocess
import sys

import pytest
import torch

from pagedkv.cli import main
from pagedkv.errors import ConfigError
from pagedkv.tools.benchmark import (
    W1_TOTAL_OUTPUT_TOKENS,
    w1_workload,
    w2_workload,
    w3_workload,
    workload,
)


def test_w1_workload_matches_perf_md():
    wl = w1_workload()
    assert wl.name == "W1" and wl.num_requests == 256
    assert wl.requested_output_tokens == W1_TOTAL_OUTPUT_TOKENS == 133_966
    assert all(100 <= len(p) <= 1024 for p in wl.prompts)
    assert all(0 <= t <= 10000 for p in wl.prompts for t in p)
    small = w1_workload(8, scale=0.1)
    assert small.num_requests == 8
    assert [len(p) for p in small.prompts] == [max(1, round(len(p) * 0.1)) for p in wl.prompts[:8]]
    assert small.prompts[0] == wl.prompts[0][: len(small.prompts[0])]
    assert wl.fit_vocab(200_000) is wl and max(max(p) for p in wl.fit_vocab(512).prompts) < 512


def test_w2_w3_workloads_as_issue_13_defines_them():
    w2 = w2_workload()
    assert w2.name == "W2" and w2.num_requests == 64 and set(w2.max_tokens) == {512}
    assert all(6000 <= len(p) <= 8000 for p in w2.prompts)
    assert all(0 <= t <= 10000 for p in w2.prompts for t in p)
    w3 = w3_workload()
    assert w3.name == "W3" and w3.num_requests == 256 and set(w3.max_tokens) == {256}
    prefix = w3.prompts[0][:2048]
    assert all(p[:2048] == prefix and 50 <= len(p) - 2048 <= 200 for p in w3.prompts)
    # the tails are unique: no two requests share more than the system prompt's blocks
    assert len({tuple(p[2048:2064]) for p in w3.prompts}) == 256
    assert workload("W3").prompts == w3.prompts and workload("w2", 4).num_requests == 4
    small = w3_workload(4, scale=0.01, seed=0)
    assert len({tuple(p[:20]) for p in small.prompts}) == 1 and small.max_tokens == [3] * 4
    assert w2_workload(seed=1).prompts != w2.prompts  # seeded
    with pytest.raises(ConfigError, match="unknown workload"):
        workload("w4")


def test_cli_bench_w3_small_variant_hits_the_prefix(tiny_dir, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rc = main(["bench", "--workload", "w3", "--model", tiny_dir("qwen3"), "--num-requests", "4",
               "--scale", "0.02", "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
               "--kv-cache-memory-bytes", "2000000", "--quiet", "--json", str(out_json)])
    assert rc == 0
    res = json.loads(out_json.read_text())["result"]
    assert res["workload"].startswith("W3-variant(n=4, scale=0.02")
    assert res["output_tokens"] == res["requested_output_tokens"] == 4 * 5
    assert res["prefix_cache_hit_rate"] > 0  # the shared system prompt is read from the cache


def test_demo_end_to_end(tmp_path, capsys, monkeypatch):
    """The random-weight checkpoint: first as the fallback when the real model's package is
    missing (a package name that does not exist), then chosen with PAGEDKV_DEMO_MODEL=tiny.
    The real model's demo is tested in tests/models/test_real_model.py."""
    from pagedkv.models import smollm2

    monkeypatch.setenv("PAGEDKV_CACHE", str(tmp_path))
    monkeypatch.setattr(smollm2, "PACKAGE", "pagedkv_no_such_package")
    assert main(["demo", "--device", "cpu", "--max-tokens", "8", "--num-prompts", "6"]) == 0
    first = capsys.readouterr().out
    monkeypatch.setenv("PAGEDKV_DEMO_MODEL", "tiny")
    assert main(["demo", "--device", "cpu", "--max-tokens", "8", "--num-prompts", "6"]) == 0
    second = capsys.readouterr().out
    assert "real model is unavailable" in first and "FALLING BACK" in first
    assert "FALLING BACK" not in second and not os.path.exists(tmp_path / smollm2.DIR_NAME)
    assert "built now" in first and "cached" in second
    assert os.path.isdir(tmp_path / "tiny")
    for text in (first, second):
        assert "prefix cache" in text and "preemptions" in text and "free now" in text
        assert "all returned: True" in text
        assert text.count("-> ") == 6
    # deterministic: the same outputs on the second run
    assert [l for l in first.splitlines() if "-> " in l] == [l for l in second.splitlines() if "-> " in l]
    hits = int(next(l for l in first.splitlines() if l.strip().startswith("prefix cache")).split()[2])
    assert hits > 0


def test_cli_generate(tiny_dir, tmp_path, capsys):
    path = tiny_dir("llama")
    out_json = tmp_path / "gen.json"
    rc = main(["generate", "--model", path, "--prompt", "Hello", "--prompt", "The block table",
               "--max-tokens", "5", "--ignore-eos", "--device", "cpu", "--dtype", "float32",
               "--max-model-len", "128", "--kv-cache-memory-bytes", "1000000", "--logprobs", "2",
               "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("prompt: ") == 2 and "finish length" in text
    data = json.loads(out_json.read_text())
    assert [len(o["token_ids"]) for o in data["outputs"]] == [5, 5]
    assert data["kv"]["free_blocks"] == data["kv"]["num_blocks"] - 1


def test_cli_errors_are_reported(tiny_dir, capsys):
    rc = main(["generate", "--model", tiny_dir("llama"), "--prompt", "x", "--temperature", "-1",
               "--device", "cpu", "--max-model-len", "64", "--kv-cache-memory-bytes", "1000000"])
    assert rc == 2 and "temperature" in capsys.readouterr().err


def test_cli_bench_small_variant(tiny_dir, tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    rc = main(["bench", "--model", tiny_dir("qwen3"), "--num-requests", "3", "--scale", "0.03",
               "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
               "--kv-cache-memory-bytes", "2000000", "--quiet", "--json", str(out_json)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "output throughput" in text
    record = json.loads(out_json.read_text())
    res = record["result"]
    # the record says whether prefills could take cuDNN's paged attention (not on a CPU)
    assert "cudnn_frontend" in record["environment"]
    if not torch.cuda.is_available():
        assert record["environment"]["cudnn_frontend"] is None
    assert res["num_requests"] == 3
    assert res["output_tokens"] == res["requested_output_tokens"] > 0
    assert res["output_tokens_per_s"] > 0


def test_cli_bench_defaults_on_cpu(tmp_path, capsys, monkeypatch):
    """`pagedkv bench` with no arguments on a CPU machine: the qwen3-0.6b shape on a small W1
    variant, max_model_len fitted to the CPU pool; no JSON unless --json is given."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("the defaults differ on a GPU (full W1)")
    monkeypatch.chdir(tmp_path)
    rc = main(["bench", "--quiet"])
    text = capsys.readouterr().out
    assert rc == 0 and "qwen3-0.6b" in text and "W1-variant(n=8, scale=0.05" in text
    assert "output throughput" in text and "187 of 187 requested" in text
    assert list(tmp_path.iterdir()) == []  # nothing written without --json


def test_cli_generate_shows_logprob_alternatives(tiny_dir, capsys):
    rc = main(["generate", "--model", tiny_dir("llama"), "--prompt", "Hello", "--max-tokens", "3",
               "--ignore-eos", "--device", "cpu", "--dtype", "float32", "--max-model-len", "64",
               "--kv-cache-memory-bytes", "1000000", "--logprobs", "2"])
    assert rc == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.strip().startswith("[")]
    assert len(lines) == 3
    assert all("(rank " in ln and "alternatives:" in ln for ln in lines)


def test_cli_pool_errors_name_the_flags(tiny_dir, capsys):
    rc = main(["generate", "--model", tiny_dir("llama"), "--prompt", "x", "--device", "cpu",
               "--max-model-len", "256", "--num-gpu-blocks", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--num-gpu-blocks" in err and "--max-model-len" in err


def test_console_entry_point_runs():
    proc = subprocess.run([sys.executable, "-m", "pagedkv.cli", "generate", "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--max-tokens" in proc.stdout
