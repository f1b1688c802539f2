"""Smoke test of bench/bench_swa_mla_decode_gpu.py: its main path with ``--tiny`` on the CPU
(kernels through the Triton interpreter), the byte counts it reports against hand counts, and
its poisoning (a read outside the window would show as NaN)."""

import importlib.util
import json
import os
import sys

import pytest
import torch

from pagedkv.attention.triton_decode import paged_decode_attention

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_swa_mla_decode_gpu.py")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_swa_mla_decode_gpu", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def test_tiny_main_path(bench, tmp_path, capsys):
    out = tmp_path / "r.json"
    res = bench.main(["--tiny", "--out", str(out)])
    assert json.loads(out.read_text())["correctness_failures"] == []
    assert "tiny-mla-h20" in capsys.readouterr().out  # the table
    swa = {(r["shape"], r["batch"], r["ctx"]): r for r in res["swa"]}
    mla = {(r["shape"], r["batch"], r["ctx"]): r for r in res["mla"]}
    for r in res["swa"] + res["mla"]:
        assert r["rel_err"] < 1e-5 and r["us"] > 0 and r["rotations"] == 2
    # W 24, block 16, lengths 64, 57: positions [40, 64) and [33, 57), columns 2-3 each;
    # columns 0-1 of both rows are the null block; 2 (K, V) x 1 head x 32 x 4 bytes per slot
    r = swa[("tiny-swa", 2, 64)]
    assert (r["window_tokens"], r["blocks_read"], r["null_entries_outside"]) == (48, 4, 4)
    assert r["bytes"] == 48 * 256 and r["block_bytes"] == 4 * 16 * 256
    assert r["full_context_bytes"] == (64 + 57) * 256
    # lengths 40, 33, 26: windows from 16, 9, 2 -> columns 1-2, 0-2, 0-1; one null column
    r = swa[("tiny-swa", 3, 40)]
    assert (r["window_tokens"], r["blocks_read"], r["null_entries_outside"]) == (72, 7, 1)
    # 2 KV heads x 16 x 4 bytes x 2; W 20 at lengths 48, 41
    r = swa[("tiny-swa-gqa", 2, 48)]
    assert (r["window_tokens"], r["bytes"]) == (40, 40 * 256)
    # MLA: every position, (32 + 16) x 4 bytes a row; 20 heads -> two head tiles of 16
    r = mla[("tiny-mla-h16", 2, 40)]
    assert (r["tokens"], r["blocks_read"], r["bytes"], r["head_tiles"]) == (73, 6, 73 * 192, 1)
    r = mla[("tiny-mla-h20", 2, 24)]
    assert (r["tokens"], r["head_tiles"], r["loaded_bytes"]) == (41, 2, 2 * 41 * 192)


def test_window_read_refuses_a_null_window_block(bench):
    table = torch.tensor([[0, 0, 5, 0]], dtype=torch.int32)  # column 3 is in the window
    with pytest.raises(ValueError, match="null block"):
        bench.window_read(table, [64], 24, 16)


def test_poison_would_show_a_read_outside_the_window(bench):
    """The bench's layout: without the window the kernel reads the null block and the slots
    before the window, which are NaN; with it, nothing NaN is read."""
    lens = [64, 57]
    rot = bench.Rotations(2, lens, 24, 16, 8, "cpu", 0, seed=0)
    cache = torch.randn(2, rot.num_blocks, 16, 1, 8)
    rot.poison_outside(cache.permute(1, 2, 0, 3, 4), 24)
    assert torch.isnan(cache[:, 0]).all()
    q = torch.randn(2, 2, 8)
    for window, nan in ((24, False), (None, True)):
        out = torch.zeros_like(q)
        paged_decode_attention(q, cache, rot.tables[0], rot.qsl, rot.seq, 2, 0.3, out,
                               sliding_window=window)
        assert bool(torch.isnan(out).any()) == nan
