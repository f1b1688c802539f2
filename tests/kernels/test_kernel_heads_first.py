"""The heads-first gather of the cuDNN fresh-prefill path (``pagedkv.kernels.heads_first``):
a hand example, kernel vs twin on random poisoned inputs (CPU through the interpreter, the
GPU natively), and its errors."""

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.kernels.heads_first import gather_heads_first, gather_heads_first_ref

IMPLS = {"kernel": gather_heads_first, "ref": gather_heads_first_ref}


@pytest.mark.parametrize("impl", list(IMPLS))
def test_heads_first_hand_example(kernel_device, impl):
    """src[r, h, d] = 100 r + 10 h + d: rows 3, 0 (and -1 -> row 0) by slots, rows 1-2 by
    base; two heads, D = 2, padded to 4 (the rest zero, NaN poison overwritten)."""
    r, h, d = torch.meshgrid(torch.arange(5), torch.arange(2), torch.arange(2), indexing="ij")
    src = (100 * r + 10 * h + d).float().to(kernel_device)
    out = torch.full((2, 4, 2), float("nan"), device=kernel_device)
    IMPLS[impl](src, torch.tensor([3, 0, -1], device=kernel_device), 0, 3, out)
    assert out.cpu().tolist() == [[[300, 301], [0, 1], [0, 1], [0, 0]],
                                  [[310, 311], [10, 11], [10, 11], [0, 0]]]
    out.fill_(float("nan"))
    IMPLS[impl](src, None, 1, 2, out)
    assert out.cpu().tolist() == [[[100, 101], [200, 201], [0, 0], [0, 0]],
                                  [[110, 111], [210, 211], [0, 0], [0, 0]]]


@pytest.mark.parametrize("dtype,dim,heads,n,padded,by_idx", [
    (torch.float32, 16, 4, 37, 64, True), (torch.float16, 24, 2, 50, 50, True),
    (torch.float32, 16, 3, 70, 96, False), (torch.float16, 8, 1, 0, 32, True)])
def test_heads_first_kernel_matches_twin(kernel_device, dtype, dim, heads, n, padded, by_idx):
    """Random rows of a strided view (a cache half with NaN in rows not gathered), slots in
    any order with some < 0, or a run of rows from a base; a poisoned output."""
    gen = torch.Generator().manual_seed(n + dim)
    rows = 200
    full = torch.randn(rows, heads + 1, dim + 8, generator=gen).to(dtype)
    src = full[:, 1:, 4:4 + dim]  # row / head strides of a wider buffer, last dim contiguous
    idx = torch.randperm(rows, generator=gen)[:n]
    idx[::7] = -1
    keep = torch.zeros(rows, dtype=torch.bool)
    keep[idx.clamp(min=0)] = True
    keep[0] = True
    if by_idx:
        src[~keep] = float("nan")  # rows never read
    src, idx = src.to(kernel_device), idx.to(kernel_device)
    outs = []
    for fn in (gather_heads_first, gather_heads_first_ref):
        out = torch.full((heads, padded, dim), float("nan"), dtype=dtype, device=kernel_device)
        fn(src, idx if by_idx else None, 0 if by_idx else 11, n, out)
        outs.append(out.cpu())
    assert not torch.isnan(outs[0]).any()
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    assert (outs[0][:, n:] == 0).all()


def test_heads_first_errors(kernel_device):
    src = torch.zeros(10, 2, 8, device=kernel_device)
    out = torch.zeros(2, 16, 8, device=kernel_device)
    with pytest.raises(ConfigError, match="rows"):
        gather_heads_first(src, None, 5, 6, out)
    with pytest.raises(ConfigError, match="out must be contiguous"):
        gather_heads_first(src, None, 0, 4, torch.zeros(3, 16, 8, device=kernel_device))
    with pytest.raises(ConfigError, match="n must be <="):
        gather_heads_first(src, None, 0, 17, out)
    with pytest.raises(ConfigError, match="idx needs"):
        gather_heads_first(src, torch.zeros(2, dtype=torch.int64, device=kernel_device), 0, 4,
                           out)
    with pytest.raises(ConfigError, match="dtype"):
        gather_heads_first(src, None, 0, 4, out.half())


@pytest.mark.gpu
def test_heads_first_gpu_model_shape():
    """The W2 shape natively: 7,000 rows of a bf16 cache half (8 K/V heads, D 128) by random
    slots padded to 7,168, and 7,000 query rows (16 heads) from a base, against the twin."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    cache = torch.randn(20000, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    slots = torch.randperm(20000, device="cuda", generator=gen)[:7000]
    q = torch.randn(9000, 16, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    for src, idx, base, heads in ((cache, slots, 0, 8), (q, None, 1500, 16)):
        a = torch.full((heads, 7168, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
        b = a.clone()
        gather_heads_first(src, idx, base, 7000, a)
        gather_heads_first_ref(src, idx, base, 7000, b)
        assert torch.equal(a, b)
