"""Greedy sampling's argmax over the vocabulary: ``torch.argmax(logits, dim=-1)``, in two
launches that keep the whole device busy.

``logits [M, V]`` (bf16 / fp16 / fp32, last dimension contiguous) -> ``int64 [M]``: per row the
index of its largest value, as torch defines it: the first index among equal maxima, NaN
larger than every number (the first NaN wins), ``-0.0`` equal to ``+0.0``.

Why a kernel: torch's reduction gives each row to one block, so a decode step's few rows over
151,936 logits leave most multiprocessors idle (on the H200, 256 rows took 57 us, ~1.4 TB/s;
64 rows 23 us: BENCHMARKS.md, sixth session, "LM head (+argmax)").

Kernel 1 (``_argmax_chunks_kernel``), grid ``(M, C)``: program ``(r, c)`` scans chunk ``c`` of
row ``r`` (``C`` chunks of whole ``BLOCK``-wide tiles, so that ``M x C`` programs fill the
device) and writes its best key and index. Values are compared as int32 keys: the float's
bits made order-preserving (negative floats have their magnitude bits flipped), ``-0.0``
first turned into ``+0.0``, NaN mapped above ``+inf``. Each lane keeps its own running best
over the tiles (replaced only when strictly larger: the lane's first maximum), so the loop
streams with no reduction; whole tiles load unmasked (16-byte vector loads: a mask that
depends on the row length made them 2-byte loads) and the partial last tile of a row
masked, after the loop; at the end the chunk's best key is the lanes' max and its index the
smallest lane index holding it. Kernel 2
(``_argmax_reduce_kernel``), one program a row: the best key over its ``C`` partials and,
among the chunks holding it, the smallest index (the chunks are in index order, so that is
the row's first maximum).

Every host int but the row stride is a runtime argument, not specialized (a chunk count of 1
would otherwise compile another variant mid-run): one compiled variant per dtype and stride.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import cdiv, check_tensor, next_pow2, use_triton

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BLOCK = 1024  # logits a tile: 8 per thread at 4 warps (16-byte loads of bf16)
_MAX_CHUNKS = 256
_PROGRAMS_PER_SM = 16  # num_chunks: programs the chunking aims at, a multiprocessor
_INT32_MIN = tl.constexpr(-2147483648)


@triton.jit
def _keys(x):
    """Order-preserving int32 keys of float32 values (module docstring)."""
    x = x + 0.0  # -0.0 -> +0.0
    bits = x.to(tl.int32, bitcast=True)
    key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    return tl.where(x != x, 0x7FFFFFFF, key)


@triton.jit
def _fold(key, i, best, best_idx):
    """A tile's keys folded into the per-lane running best (elementwise, no reduction in the
    loop; strictly larger only, so each lane keeps its first maximum)."""
    take = key > best
    return tl.where(take, key, best), tl.where(take, i, best_idx)


@triton.jit(do_not_specialize=["n", "tiles", "p_s0"])
def _argmax_chunks_kernel(x_ptr, x_s0, n, tiles, key_ptr, idx_ptr, p_s0,
                          BLOCK: tl.constexpr, RANGE_LOOP: tl.constexpr):
    r = tl.program_id(0)
    c = tl.program_id(1)
    row = x_ptr + r.to(tl.int64) * x_s0
    lo = c * tiles * BLOCK  # a chunk is `tiles` whole tiles (the last one ends at n)
    hi = tl.minimum(lo + tiles * BLOCK, n)
    full = (hi - lo) // BLOCK  # whole tiles: unmasked loads (vectorized), then the tail
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], _INT32_MIN, tl.int32)
    best_idx = lo + offs
    if RANGE_LOOP:  # compiled: a for-range loop
        for t in range(full):
            i = lo + t * BLOCK + offs
            best, best_idx = _fold(_keys(tl.load(row + i).to(tl.float32)), i, best, best_idx)
    else:  # the interpreter cannot iterate a range over runtime scalars
        t = 0
        while t < full:
            i = lo + t * BLOCK + offs
            best, best_idx = _fold(_keys(tl.load(row + i).to(tl.float32)), i, best, best_idx)
            t += 1
    i = lo + full * BLOCK + offs  # the partial last tile of the row's last chunk (if any)
    live = i < hi
    x = tl.load(row + i, mask=live, other=0.0).to(tl.float32)
    best, best_idx = _fold(tl.where(live, _keys(x), _INT32_MIN), i, best, best_idx)
    m = tl.max(best, axis=0)  # the chunk's best key, then the first lane index holding it
    first = tl.min(tl.where(best == m, best_idx, 2147483647), axis=0)
    tl.store(key_ptr + r * p_s0 + c, m)
    tl.store(idx_ptr + r * p_s0 + c, first)


@triton.jit(do_not_specialize=["p_s0", "num_chunks"])
def _argmax_reduce_kernel(key_ptr, idx_ptr, p_s0, num_chunks, out_ptr, BLOCK_C: tl.constexpr):
    r = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    live = c < num_chunks
    key = tl.load(key_ptr + r * p_s0 + c, mask=live, other=_INT32_MIN)
    idx = tl.load(idx_ptr + r * p_s0 + c, mask=live, other=2147483647)
    m = tl.max(key, axis=0)
    first = tl.min(tl.where(live & (key == m), idx, 2147483647), axis=0)
    tl.store(out_ptr + r, first.to(tl.int64))


@functools.lru_cache(maxsize=None)
def _num_sms(index: int | None) -> int:
    return torch.cuda.get_device_properties(
        index if index is not None else torch.cuda.current_device()).multi_processor_count


def _check(fn: str, logits: torch.Tensor) -> None:
    check_tensor(fn, "logits", logits, dtypes=_DTYPES, ndim=2, contiguous_last=True)
    if logits.shape[1] == 0:
        raise ConfigError(f"{fn}: logits need at least one column, got {tuple(logits.shape)}")
    if logits.shape[1] >= 2 ** 31:
        raise ConfigError(f"{fn}: at most 2^31 - 1 columns, got {logits.shape[1]}")


def num_chunks(rows: int, cols: int, sms: int) -> int:
    """Chunks a row is split into: enough programs for sixteen a multiprocessor, at most one
    per ``BLOCK`` logits (and at most 256). H200, 151,936 bf16 logits a row, device us
    (``bench/bench_argmax_gpu.py``), sixteen / four programs a multiprocessor: 256 rows 45.7 /
    50.7, 64 rows 15.2 / 17.9 (torch.argmax 55.3 / 24.6)."""
    want = cdiv(_PROGRAMS_PER_SM * max(1, sms), max(1, rows))
    return max(1, min(want, cdiv(cols, _BLOCK), _MAX_CHUNKS))


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` (int64 ``[M]``) for ``logits [M, V]``; on CUDA (or
    under the Triton interpreter) the two kernels of the module docstring, else torch."""
    _check("greedy_argmax", logits)
    if not use_triton(_argmax_chunks_kernel, logits):
        return greedy_argmax_ref(logits)
    rows, cols = logits.shape
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    sms = _num_sms(logits.device.index) if logits.is_cuda else 4
    chunks = num_chunks(rows, cols, sms)
    chunk = cdiv(cdiv(cols, chunks), _BLOCK) * _BLOCK
    chunks = cdiv(cols, chunk)
    keys = torch.empty(rows, chunks, dtype=torch.int32, device=logits.device)
    idx = torch.empty_like(keys)
    _argmax_chunks_kernel[(rows, chunks)](
        logits, logits.stride(0), cols, chunk // _BLOCK, keys, idx, chunks, BLOCK=_BLOCK,
        RANGE_LOOP=not isinstance(_argmax_chunks_kernel, InterpretedFunction), num_warps=4)
    _argmax_reduce_kernel[(rows,)](keys, idx, chunks, chunks, out,
                                   BLOCK_C=max(16, next_pow2(chunks)), num_warps=1)
    return out


def greedy_argmax_ref(logits: torch.Tensor) -> torch.Tensor:
    """Plain torch twin of :func:`greedy_argmax`."""
    _check("greedy_argmax_ref", logits)
    return logits.argmax(dim=-1)


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """The engine's greedy argmax (the runner's all-greedy path, the sampler's greedy rows):
    :func:`greedy_argmax` on CUDA tensors the kernels take (2-D, bf16 / fp16 / fp32, last
    dimension contiguous, at least one column), ``torch.argmax`` on any other (an engine on
    the CPU takes torch's, not the kernels through the Triton interpreter)."""
    if (logits.is_cuda and logits.dim() == 2 and logits.dtype in _DTYPES
            and 0 < logits.shape[1] < 2 ** 31 and logits.stride(-1) == 1):
        return greedy_argmax(logits)
    return logits.argmax(dim=-1)


__all__ = ["argmax_rows", "greedy_argmax", "greedy_argmax_ref", "num_chunks"]
