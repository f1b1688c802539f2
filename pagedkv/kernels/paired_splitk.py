"""Two weight tiles against one row tile, optionally split over the inner dimension and summed
by the last program to arrive: the main loop and the split reduction that the fused decode
projections share.

* :mod:`pagedkv.kernels.qkv_rope_cache`: a head's two RoPE halves (weight rows ``[hD, hD +
  D/2)`` and ``[hD + D/2, (h+1)D)``), epilogue q/k norm + RoPE + KV write;
* :mod:`pagedkv.kernels.gate_up_silu`: matching gate and up columns (rows ``[j, j + BN)`` and
  ``[I + j, I + j + BN)`` of the stacked gate/up weight), epilogue ``silu(gate) * up``.

Both epilogues need the whole inner-dimension sum of both products, so a split launch cannot
leave the sum to a later kernel as ``pagedkv.kernels.splitk_gemm`` does; instead each split
stores its two float32 products, counts itself at its output tile's counter
(:func:`pagedkv.kernels._common.arrive`), and the last to arrive reads the ``SPLITS`` partials
back in split order (deterministic, whichever program is last; L2-only ``.cg`` loads) and runs
the epilogue. The counters are left at zero for the next launch.

``paired_dot``: ``x_rows`` ``[BLOCK_M, 1]`` row pointers of the activation, ``w1_rows`` /
``w2_rows`` ``[BLOCK_N, 1]`` row pointers of the two weight tiles, ``n_ok`` ``[BLOCK_N]`` the
weight rows that exist; chunk ``s`` covers inner indices ``[s K_CHUNK, min((s+1) K_CHUNK, K))``
(``K_CHUNK`` a multiple of ``BLOCK_K``); masked loads read nothing past ``K`` or the rows.

Counters: one int32 buffer per (device, stream) (:func:`counters`), so two engines on two
streams of one device never share one; a launch needs one entry per output tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels._common import arrive, cdiv
from pagedkv.kernels.splitk_gemm import split_chunk

MIN_COUNTERS = 4096


@triton.jit
def paired_dot(x_rows, w1_rows, w2_rows, r_ok, n_ok, s, ln_ptr, K: tl.constexpr,
               K_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr, NORM: tl.constexpr):
    """The two float32 products ``[BLOCK_M, BLOCK_N]`` of the row tile with the two weight
    tiles over inner-dimension chunk ``s``, and the rows' float32 sum of squares over the chunk
    (``[BLOCK_M]``, zeros without ``NORM``). With ``NORM`` the activation rows are an RMSNorm's
    input: each loaded tile is multiplied by the norm weight ``ln_ptr`` (float32, rounded back
    to the input dtype for the product) and the caller scales the products by the rows'
    ``rsqrt(mean of squares + eps)`` (:func:`rms_scale`)."""
    rk = tl.arange(0, BLOCK_K)
    acc1 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for kk in range(0, K_CHUNK, BLOCK_K):
        kidx = s * K_CHUNK + kk + rk
        k_ok = kidx < K
        a = tl.load(x_rows + kidx[None, :], mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        if NORM:
            af = a.to(tl.float32)
            ss += tl.sum(af * af, axis=1)
            lw = tl.load(ln_ptr + kidx, mask=k_ok, other=0.0).to(tl.float32)
            a = (af * lw[None, :]).to(a.dtype)
        wm = n_ok[:, None] & k_ok[None, :]
        b1 = tl.load(w1_rows + kidx[None, :], mask=wm, other=0.0)
        b2 = tl.load(w2_rows + kidx[None, :], mask=wm, other=0.0)
        acc1 = tl.dot(a, tl.trans(b1), acc1, input_precision=DOT_PREC)
        acc2 = tl.dot(a, tl.trans(b2), acc2, input_precision=DOT_PREC)
    return acc1, acc2, ss


@triton.jit
def rms_scale(ss, eps, K: tl.constexpr):
    """The RMSNorm scale ``rsqrt(ss / K + eps)`` of rows whose squares sum to ``ss``, as a
    ``[rows, 1]`` column."""
    return tl.rsqrt(ss / K + eps)[:, None]


@triton.jit
def paired_split_sum(acc1, acc2, ss, part1, part2, ss_part, split_stride, ss_stride, s, mask,
                     r_ok, cnt, SPLITS: tl.constexpr, NORM: tl.constexpr):
    """Split ``s`` stores its products at ``part1 / part2 + s * split_stride`` (``[BLOCK_M,
    BLOCK_N]`` pointer tiles of split 0, ``mask`` the valid entries) and, with ``NORM``, its
    rows' sums of squares at ``ss_part + s * ss_stride`` (``[BLOCK_M]`` pointers, rows
    ``r_ok``: every output tile of the rows stores the same values there), then counts itself
    at ``cnt``. Returns ``(last, sum1, sum2, ss_sum)``: for the last to arrive the sums over
    all splits (in split order), zeros elsewhere."""
    off = s.to(tl.int64) * split_stride
    tl.store(part1 + off, acc1, mask=mask)
    tl.store(part2 + off, acc2, mask=mask)
    if NORM:
        tl.store(ss_part + s.to(tl.int64) * ss_stride, ss, mask=r_ok)
    last = arrive(cnt, SPLITS)
    sum1 = tl.zeros_like(acc1)
    sum2 = tl.zeros_like(acc2)
    ss_sum = tl.zeros_like(ss)
    if last:
        for j in tl.static_range(SPLITS):
            sum1 += tl.load(part1 + j * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            sum2 += tl.load(part2 + j * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
            if NORM:
                ss_sum += tl.load(ss_part + j * ss_stride, mask=r_ok, other=0.0,
                                  cache_modifier=".cg")
    return last, sum1, sum2, ss_sum


def chunk_and_splits(K: int, splits: int, block_k: int) -> tuple[int, int]:
    """``(K_CHUNK, splits)``: ``pagedkv.kernels.splitk_gemm.split_chunk``'s columns a split, and
    the split count that leaves no split past ``K``."""
    chunk = split_chunk(K, splits, block_k)
    return chunk, max(1, cdiv(K, chunk))


def normed_product(x: torch.Tensor, w: torch.Tensor, ln_weight: torch.Tensor | None,
                   eps: float) -> torch.Tensor:
    """The float32 product ``x @ w^T`` the fused kernels compute, or with ``ln_weight`` that of
    the RMSNorm of ``x`` as they compute it: ``(x * ln_weight)`` rounded to ``x``'s dtype,
    times ``w^T`` in float32, scaled per row by ``rsqrt(mean(x^2) + eps)`` (mathematically the
    norm then the product; one rounding fewer than the eager norm's two)."""
    xf = x.float()
    if ln_weight is None:
        return xf @ w.float().T
    a = (xf * ln_weight.float()).to(x.dtype).float()
    return (a @ w.float().T) * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


_COUNTERS: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, entries: int) -> torch.Tensor:
    """The arrival counters of the current stream on ``device`` (int32, zero between launches),
    at least ``entries`` long (at least ``MIN_COUNTERS``). Created by the first launch that
    needs them on that stream; inside a CUDA-graph capture a first call allocates from the
    graph's pool (its zero fill then replays with the graph, harmlessly)."""
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    cnt = _COUNTERS.get(key)
    if cnt is None or cnt.shape[0] < entries:
        cnt = torch.zeros(max(entries, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[key] = cnt
    return cnt


__all__ = ["MIN_COUNTERS", "chunk_and_splits", "counters", "normed_product", "paired_dot",
           "paired_split_sum", "rms_scale"]
