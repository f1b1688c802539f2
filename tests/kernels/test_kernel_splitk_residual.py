"""The split-K projection with its residual add in the epilogue (``splitk_residual``): kernel vs
torch twin (one and several splits, partial tiles, bias, float32 and float16), against the
two-kernel path it replaces (``linear_partials`` + ``residual_add``), counters left at zero
and a deterministic result, the custom op, the typed errors."""

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.kernels.paired_splitk import counters
from pagedkv.kernels.splitk_gemm import (
    SplitKConfig,
    splitk_linear_ref,
    splitk_residual,
    splitk_residual_op,
    splitk_residual_ref,
)
from pagedkv.models.decoder import residual_add

SMALL = SplitKConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2**-9, atol=2e-3)}


def _case(gen, M, N, K, dtype, bias):
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    h = torch.randn(M, N, generator=gen).to(dtype)
    return x, w, b, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("M,N,K,bias", [(1, 40, 64, False), (5, 32, 70, True),
                                        (21, 48, 100, True)])
def test_kernel_matches_twin(kernel_device, dtype, splits, M, N, K, bias):
    gen = torch.Generator().manual_seed(M + N + K + splits)
    x, w, b, h = _case(gen, M, N, K, dtype, bias)
    want = splitk_residual_ref(x, w, b, h, splits, SMALL)
    d = [None if t is None else t.to(kernel_device) for t in (x, w, b, h)]
    got = splitk_residual(*d, splits, SMALL)
    assert got.shape == (M, N) and got.dtype == dtype
    torch.testing.assert_close(got.cpu(), want, **TOL[dtype])


def test_twin_is_the_two_kernel_path():
    """The twin is bitwise the unfused path's arithmetic: partials summed in split order, the
    bias, the float32 residual add with one rounding (``residual_add``)."""
    gen = torch.Generator().manual_seed(1)
    x, w, b, h = _case(gen, 6, 24, 64, torch.float16, True)
    parts = splitk_linear_ref(x, w, 4, SMALL)
    delta = parts[0] + parts[1] + parts[2] + parts[3] + b.float()
    assert torch.equal(splitk_residual_ref(x, w, b, h, 4, SMALL), residual_add(h, delta))


def test_counters_reset_and_deterministic(kernel_device):
    gen = torch.Generator().manual_seed(2)
    x, w, b, h = (t.to(kernel_device) for t in _case(gen, 20, 40, 96, torch.float32, True))
    a, c = splitk_residual(x, w, b, h, 3, SMALL), splitk_residual(x, w, b, h, 3, SMALL)
    assert torch.equal(a, c)
    assert int(counters(x.device, 0).abs().sum()) == 0


def test_custom_op_and_empty(kernel_device):
    gen = torch.Generator().manual_seed(3)
    x, w, b, h = (t.to(kernel_device) for t in _case(gen, 4, 16, 32, torch.float32, True))
    torch.library.opcheck(splitk_residual_op, (x, w, b, h, 2))
    torch.library.opcheck(splitk_residual_op, (x, w, None, h, 1))
    e = splitk_residual(x[:0], w, b, h[:0], 2, SMALL)
    assert e.shape == (0, 16)


@pytest.mark.parametrize("bad,pattern", [
    (lambda a: a.update(hidden=a["hidden"][:, :8]), "hidden must be"),
    (lambda a: a.update(hidden=a["hidden"].int()), "hidden must be"),
    (lambda a: a.update(bias=a["bias"][:3]), "bias must be"),
    (lambda a: a.update(w=a["w"].half()), "must share"),
    (lambda a: a.update(splits=0), "splits must be"),
])
def test_argument_errors(bad, pattern):
    kwargs = dict(x=torch.randn(4, 32), w=torch.randn(16, 32), bias=torch.randn(16),
                  hidden=torch.randn(4, 16), splits=2)
    bad(kwargs)
    for fn in (splitk_residual, splitk_residual_ref):
        with pytest.raises(ConfigError, match=pattern):
            fn(**kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64, 128, 256])
@pytest.mark.parametrize("N,K", [(1024, 2048), (1024, 3072)], ids=["o", "down"])
def test_gpu_decode_shapes_bf16(M, N, K):
    gen = torch.Generator().manual_seed(M)
    x, w, b, h = _case(gen, M, N, K, torch.bfloat16, False)
    want = splitk_residual_ref(x, w, None, h, 4)
    got = splitk_residual_op(x.cuda(), w.cuda(), None, h.cuda(), 4)
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2**-7, atol=3e-2)
