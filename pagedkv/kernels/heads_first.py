"""Rows of a ``[rows, heads, D]`` tensor gathered into a heads-first, zero-padded buffer.

cuDNN's fused attention runs one fresh prefill request as ``[heads, S', D]`` contiguous
tensors padded to ``S'`` tokens (``pagedkv.attention.cudnn_prefill``): its query rows are a
run of the step's rows, its K/V rows sit in the paged cache at the step's slots. One launch
per tensor makes the buffer::

    out[h, t, :] = src[row(t), h, :]     t < n,   row(t) = idx[t] (clamped at 0), or base + t
    out[h, t, :] = 0                     n <= t < padded

(a slot ``< 0``, a row the step does not store, reads row 0). Before this kernel the path
took a gather, a zero fill and a transposing copy per tensor, about 170 us around cuDNN's
391 us for a 7,168-token request on the H200 (BENCHMARKS.md, twelfth session).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import cdiv, check_int, check_tensor, next_pow2, use_triton

_BLOCK_T = 32
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit(do_not_specialize=["base", "n", "padded"])
def _heads_first_kernel(src_ptr, s_row, s_head, idx_ptr, base, n, padded, out_ptr, o_head,
                        o_tok, HAS_IDX: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1).to(tl.int64)
    d = tl.arange(0, D_PAD)
    live = t < n
    if HAS_IDX:
        row = tl.maximum(tl.load(idx_ptr + t, mask=live, other=0).to(tl.int64), 0)
    else:
        row = base + t.to(tl.int64)
    dm = (d < D)[None, :]
    x = tl.load(src_ptr + row[:, None] * s_row + h * s_head + d[None, :],
                mask=live[:, None] & dm, other=0.0)
    tl.store(out_ptr + h * o_head + t[:, None].to(tl.int64) * o_tok + d[None, :], x,
             mask=(t < padded)[:, None] & dm)


def _check(fn, src, idx, base, n, out):
    check_tensor(fn, "src", src, dtypes=_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "out", out, dtypes=(src.dtype,), ndim=3)
    n = check_int(fn, "n", n, lo=0, hi=out.shape[1])
    base = check_int(fn, "base", base, lo=0)
    if out.shape[0] != src.shape[1] or out.shape[2] != src.shape[2] or not out.is_contiguous():
        raise ConfigError(f"{fn}: out must be contiguous [heads={src.shape[1]}, padded, "
                          f"D={src.shape[2]}], got {tuple(out.shape)}")
    if out.device != src.device:
        raise ConfigError(f"{fn}: src on {src.device}, out on {out.device}")
    if idx is None:
        if base + n > src.shape[0]:
            raise ConfigError(f"{fn}: rows [{base}, {base + n}) past src's {src.shape[0]}")
    else:
        check_tensor(fn, "idx", idx, dtypes=(torch.int32, torch.int64), ndim=1)
        if idx.shape[0] < n or idx.device != src.device:
            raise ConfigError(f"{fn}: idx needs >= {n} entries on {src.device}")
    return base, n


def gather_heads_first(src: torch.Tensor, idx: torch.Tensor | None, base: int, n: int,
                       out: torch.Tensor) -> torch.Tensor:
    """``out [heads, padded, D]`` (contiguous) from ``src [rows, heads, D]`` (last dimension
    contiguous, any row / head strides): rows ``idx[:n]`` (int32/int64, clamped at 0) or, with
    ``idx`` None, rows ``[base, base + n)``; ``out[:, n:]`` zero. Returns ``out``."""
    base, n = _check("gather_heads_first", src, idx, base, n, out)
    if out.shape[1] == 0:
        return out
    if not use_triton(_heads_first_kernel, src):
        return _heads_first_torch(src, idx, base, n, out)
    dim = src.shape[2]
    _heads_first_kernel[(cdiv(out.shape[1], _BLOCK_T), src.shape[1])](
        src, src.stride(0), src.stride(1), src if idx is None else idx, base, n, out.shape[1],
        out, out.stride(0), out.stride(1), HAS_IDX=idx is not None, D=dim,
        D_PAD=max(16, next_pow2(dim)), BLOCK_T=_BLOCK_T, num_warps=4)
    return out


def gather_heads_first_ref(src: torch.Tensor, idx: torch.Tensor | None, base: int, n: int,
                           out: torch.Tensor) -> torch.Tensor:
    """Plain torch twin of :func:`gather_heads_first`."""
    base, n = _check("gather_heads_first_ref", src, idx, base, n, out)
    return _heads_first_torch(src, idx, base, n, out)


def _heads_first_torch(src, idx, base, n, out):
    rows = (torch.arange(base, base + n, device=src.device) if idx is None
            else idx[:n].long().clamp(min=0))
    out.zero_()
    out[:, :n] = src.index_select(0, rows).transpose(0, 1)
    return out


__all__ = ["gather_heads_first", "gather_heads_first_ref"]
