"""Smoke test of bench/bench_mamba2_decode.py: its main path with ``--tiny`` on the CPU (both
engines on the bamba-tiny shape), the JSON record and the table; on a GPU (not run here) the
bamba-9b shape's pagedkv side at a small batch, decode steps in CUDA graphs."""

import importlib.util
import json
import os
import sys

import pytest
from engine_helpers import assert_decode_records

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_mamba2_decode.py")


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_mamba2_decode", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_tiny_main_path(tmp_path, capsys):
    mod = load_bench()
    out = tmp_path / "r.json"
    res = mod.main(["--tiny", "--prompt-len", "20", "--new-tokens", "3", "--json", str(out)])
    assert json.loads(out.read_text())["shape"] == "bamba-tiny"
    engines = [r["engine"] for r in res["results"]]
    assert engines == ["pagedkv", "transformers generate (static batch)"]
    ours = res["results"][0]
    assert ours["state_groups"] >= 1 and ours["kv_cache_groups"] > ours["state_groups"]
    assert_decode_records(res, 3)
    assert "pagedkv / transformers (decode)" in capsys.readouterr().out


@pytest.mark.gpu
def test_gpu_bamba_9b_decode_in_cuda_graphs():
    res = load_bench().main(["--batch", "4", "--prompt-len", "256", "--new-tokens", "16",
                             "--no-hf"])
    (ours,) = res["results"]
    assert ours["cuda_graph_steps"] > 0 and ours["decode_tokens_per_s"] > 0
