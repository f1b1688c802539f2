"""The read-floor bench's streaming probe (``bench/bench_read_floor_gpu.py``: one Triton
program a contiguous share, float32 partial sums) against its torch twin, on poisoned tails:
the last share is short and the buffer's neighbours hold NaN, which a read past the end or
past a share would carry into a sum."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "bench"))

from bench_read_floor_gpu import stream_sum, stream_sum_ref  # noqa: E402


@pytest.mark.parametrize("n,programs,block", [(1000, 3, 64), (4096, 4, 256), (777, 5, 128),
                                              (64, 8, 16)])
def test_stream_sum_matches_twin(n, programs, block):
    g = torch.Generator().manual_seed(n)
    backing = torch.full((n + 64,), float("nan"), dtype=torch.float16)
    x = backing[32:32 + n]
    x.copy_(torch.randn(n, generator=g).half())
    out = torch.full((programs,), float("nan"), dtype=torch.float32)
    got = stream_sum(x, programs, block, out)
    ref = stream_sum_ref(x, programs)
    assert got is out and not torch.isnan(got).any()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-3)


def test_stream_sum_ref_by_hand():
    x = torch.arange(10, dtype=torch.float16)
    assert stream_sum_ref(x, 3).tolist() == [0 + 1 + 2 + 3, 4 + 5 + 6 + 7, 8 + 9]
