"""Split-K GEMM for few rows (decode steps): ``x [M, K] @ w[N, K]^T`` as ``S`` partial products.

``splitk_linear(x, w, splits) -> partials [S, M, N]`` (float32): partial ``s`` is the product
over the ``s``-th contiguous chunk of the inner dimension, ``sum(partials, 0) = x @ w^T``. The
caller adds the partials where it uses the product (a residual add: inside a compiled region
inductor folds the sum into the add + RMSNorm kernel that follows), so the split costs no
reduce launch and no atomics, and the result is deterministic.

Why: in a decode step ``M`` is the batch (1 to a few hundred rows), and the projections whose
output is narrow (o_proj ``N = 1024, K = 2048`` and down_proj ``N = 1024, K = 3072`` at the
Qwen3-0.6B shape) give a row-tiled GEMM only ``N / BLOCK_N`` programs: too few to keep the
H200's memory busy. cuBLAS took 5.8-6.4 us (o) and 7.3-7.9 us (down) at every ``M`` from 1 to
256 there, for 4.2 and 6.3 MB of weights (1-1.5 us at 4.27 TB/s; ``bench/bench_decode_gemm_gpu.py``).
Splitting the inner dimension gives ``S`` times the programs, each streaming ``K / S`` columns.

Kernel ``_splitk_gemm_kernel``, grid ``(cdiv(M, BLOCK_M), cdiv(N, BLOCK_N), S)``: a
``[BLOCK_M, BLOCK_N]`` float32 tile over its chunk in ``BLOCK_K`` steps with ``tl.dot`` (the
row tiles of one weight tile are neighbours in the grid: they share its bytes through the
L2), stored unrounded. ``M`` is not specialized (one compiled variant for every batch size).
Rows past ``M``, columns past ``N`` and inner indices past ``K`` are masked (never read).

``splitk_linear_ref`` is the torch twin (float32 products of the same chunks);
``splitk_linear_op`` the custom op ``pagedkv::splitk_linear`` that ``torch.compile`` regions keep
as one launch (its launch parameters depend on ``N``, ``K`` and ``S`` only, so a dynamic
batch dimension compiles one variant). No host syncs: CUDA-graph safe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton
from triton.runtime.interpreter import InterpretedFunction

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import arrive, cdiv, check_launch_config, use_triton
from pagedkv.kernels.pdl import pdl_chain_args, pdl_prologue, prefetch_weights_l2

GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class SplitKConfig:
    """Launch parameters: tile sizes (powers of two >= 16), warps, pipeline stages. Default:
    the H200 sweep's choice (``bench/bench_splitk_gemm_gpu.py``, o_proj 1024 x 2048 and
    down_proj 1024 x 3072 of the Qwen3-0.6B shape, summed over M = 64 / 128 / 256 with the
    consumer's extra read of the partials): 64 x 64 x 64 tiles, 4 warps, 5 stages, 4 splits."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 5

    def __post_init__(self):
        check_launch_config(self, ("block_m", "block_n", "block_k"))


INTERPRET_CONFIG = SplitKConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


@triton.jit
def _splitk_acc(x_rows, w_rows, m_ok, n_ok, k0, k1, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                RANGE_LOOP: tl.constexpr):
    """The float32 ``[BLOCK_M, BLOCK_N]`` product of the row tile (``x_rows``: ``[BLOCK_M, 1]``
    row pointers) and the weight tile (``w_rows``: ``[BLOCK_N, 1]``) over inner indices
    ``[k0, k1)``."""
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    if RANGE_LOOP:  # compiled: a for-range loop, software-pipelined by Triton
        for k in range(k0, k1, BLOCK_K):
            kk = k + rk
            k_ok = kk < k1
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
    else:  # the interpreter cannot iterate range() over runtime scalars
        k = k0
        while k < k1:
            kk = k + rk
            k_ok = kk < k1
            a = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PREC)
            k += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["M"])
def _splitk_gemm_kernel(
    x_ptr, x_s0, w_ptr, w_s0, out_ptr, o_split, o_s0,
    M, N, K, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PREC: tl.constexpr, RANGE_LOOP: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    k0 = s * k_per_split
    acc = _splitk_acc(x_ptr + rm.to(tl.int64)[:, None] * x_s0,
                      w_ptr + rn.to(tl.int64)[:, None] * w_s0, m_ok, n_ok, k0,
                      tl.minimum(k0 + k_per_split, K), BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC,
                      RANGE_LOOP)
    out = out_ptr + s.to(tl.int64) * o_split + rm.to(tl.int64)[:, None] * o_s0 + rn[None, :]
    tl.store(out, acc, mask=m_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["M"])
def _splitk_residual_kernel(
    x_ptr, x_s0, w_ptr, w_s0, b_ptr, h_ptr, h_s0, out_ptr, o_s0, part_ptr, cnt_ptr,
    M, N, K, k_per_split,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_PREC: tl.constexpr,
    RANGE_LOOP: tl.constexpr,
    PDL: tl.constexpr = 0, PF_LINES: tl.constexpr = 1, PF_EPL: tl.constexpr = 64,
):
    """``out = hidden + x @ w^T (+ b)``: the split-K product summed by the last split to
    arrive (in split order, ``pagedkv.kernels._common.arrive``), the bias and the residual
    added in float32, one rounding (:func:`splitk_residual`). With PDL its weight lines are
    requested before the wait (``pdl.prefetch_weights_l2``)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    prefetch_weights_l2(w_ptr + tl.where(n_ok, rn, 0).to(tl.int64) * w_s0, s * k_per_split,
                        tl.minimum(s * k_per_split + k_per_split, K), PF_LINES, PF_EPL, PDL)
    pdl_prologue(PDL)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = rm < M
    mask = m_ok[:, None] & n_ok[None, :]
    rm64 = rm.to(tl.int64)
    k0 = s * k_per_split
    acc = _splitk_acc(x_ptr + rm64[:, None] * x_s0, w_ptr + rn.to(tl.int64)[:, None] * w_s0,
                      m_ok, n_ok, k0, tl.minimum(k0 + k_per_split, K), BLOCK_M, BLOCK_N,
                      BLOCK_K, DOT_PREC, RANGE_LOOP)
    last = True
    if SPLITS > 1:
        part = part_ptr + rm64[:, None] * N + rn[None, :]
        tl.store(part + s.to(tl.int64) * M * N, acc, mask=mask)
        last = arrive(cnt_ptr + pid_m * tl.cdiv(N, BLOCK_N) + pid_n, SPLITS)
        acc = tl.zeros_like(acc)
        if last:
            for j in tl.static_range(SPLITS):
                acc += tl.load(part + j * M * N, mask=mask, other=0.0, cache_modifier=".cg")
    if last:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        h = tl.load(h_ptr + rm64[:, None] * h_s0 + rn[None, :], mask=mask, other=0.0)
        res = h.to(tl.float32) + acc
        tl.store(out_ptr + rm64[:, None] * o_s0 + rn[None, :],
                 res.to(out_ptr.dtype.element_ty), mask=mask)


def _check(fn: str, x: torch.Tensor, w: torch.Tensor, splits: int) -> tuple[int, int, int]:
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        raise ConfigError(f"{fn}: x and w must be tensors")
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ConfigError(f"{fn}: need x [M, K] and w [N, K], got {tuple(x.shape)} and "
                          f"{tuple(w.shape)}")
    if x.dtype not in GEMM_DTYPES or w.dtype != x.dtype:
        raise ConfigError(f"{fn}: x and w must share one of bf16/fp16/fp32, got {x.dtype} and "
                          f"{w.dtype}")
    if x.device != w.device:
        raise ConfigError(f"{fn}: x on {x.device}, w on {w.device}")
    if (x.shape[1] > 1 and x.stride(1) != 1) or (w.shape[1] > 1 and w.stride(1) != 1):
        raise ConfigError(f"{fn}: x and w must be contiguous in their last dimension")
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= 64:
        raise ConfigError(f"{fn}: splits must be an int in [1, 64], got {splits!r}")
    # N and K from the weight: a parameter's dims stay static in a compiled region, where the
    # activation's inner dim can be a product of symbols (``attn_out.reshape(T, -1)``), which
    # the launch table cannot be keyed on (the H200 suite's failure at a1cac97)
    return x.shape[0], w.shape[0], w.shape[1]


def split_chunk(K: int, splits: int, block_k: int) -> int:
    """Inner-dimension columns per split: ``K / splits`` rounded up to whole ``block_k`` steps
    (the last split takes the rest; a split past ``K`` contributes zeros)."""
    return cdiv(cdiv(K, splits), block_k) * block_k


def splitk_linear_ref(x: torch.Tensor, w: torch.Tensor, splits: int,
                      config: SplitKConfig | None = None) -> torch.Tensor:
    """Plain torch twin: float32 products over the same inner-dimension chunks as the kernel
    (``config``'s ``block_k`` rounds the chunk; default the device's config)."""
    M, N, K = _check("splitk_linear_ref", x, w, splits)
    cfg = config or default_splitk_config(x.device)
    chunk = split_chunk(K, splits, cfg.block_k)
    out = torch.zeros(splits, M, N, dtype=torch.float32, device=x.device)
    xf, wf = x.float(), w.float()
    for s in range(splits):
        lo, hi = s * chunk, min((s + 1) * chunk, K)
        if lo < hi:
            out[s] = xf[:, lo:hi] @ wf[:, lo:hi].T
    return out


def default_splitk_config(device: torch.device) -> SplitKConfig:
    return SplitKConfig() if device.type == "cuda" else INTERPRET_CONFIG


def _launch(launcher, x, w, out, splits: int, cfg: SplitKConfig, range_loop: bool) -> None:
    M = x.shape[0]
    N, K = w.shape
    chunk = split_chunk(K, splits, cfg.block_k)
    grid = (cdiv(M, cfg.block_m), cdiv(N, cfg.block_n), splits)
    launcher[grid](
        x, x.stride(0), w, w.stride(0), out, out.stride(0), out.stride(1),
        M, N, K, chunk,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", RANGE_LOOP=range_loop,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def splitk_linear(x: torch.Tensor, w: torch.Tensor, splits: int,
                  config: SplitKConfig | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The ``splits`` float32 partial products ``[S, M, N]`` of ``x @ w^T`` (module docstring)
    with the Triton kernel (CUDA tensors, or any tensor under the Triton interpreter);
    otherwise the torch twin. ``out``: a float32 ``[S, M, N]`` buffer to write."""
    M, N, K = _check("splitk_linear", x, w, splits)
    cfg = config or default_splitk_config(x.device)
    if out is not None and (out.shape != (splits, M, N) or out.dtype != torch.float32
                            or out.device != x.device or (N > 1 and out.stride(2) != 1)):
        raise ConfigError(f"splitk_linear: out must be float32 [{splits}, {M}, {N}] on "
                          f"{x.device}, contiguous in its last dimension")
    if not use_triton(_splitk_gemm_kernel, x):
        res = splitk_linear_ref(x, w, splits, cfg)
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if M and N:
        if K == 0:
            return out.zero_()
        _launch(_splitk_gemm_kernel, x, w, out, splits, cfg,
                range_loop=not isinstance(_splitk_gemm_kernel, InterpretedFunction))
    return out


@triton_op("pagedkv::splitk_linear", mutates_args={})
def splitk_linear_op(x: torch.Tensor, w: torch.Tensor, splits: int) -> torch.Tensor:
    """``splitk_linear`` as a custom op ``torch.compile`` can trace (one launch inside a compiled
    graph, launch parameters from ``N``, ``K`` and ``splits`` only); the torch twin on a
    non-CUDA tensor."""
    if x.device.type != "cuda":
        return splitk_linear_ref(x, w, splits)
    M, N, K = _check("splitk_linear", x, w, splits)
    cfg = splitk_config_for(N, K)
    out = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    if K == 0:
        return out.zero_()
    _launch(wrap_triton(_splitk_gemm_kernel), x, w, out, splits, cfg, range_loop=True)
    return out


def _check_residual(fn: str, x, w, bias, hidden, splits) -> tuple[int, int, int]:
    M, N, K = _check(fn, x, w, splits)
    if bias is not None and (not isinstance(bias, torch.Tensor) or bias.shape != (N,)
                             or bias.dtype != x.dtype or bias.device != x.device):
        raise ConfigError(f"{fn}: bias must be [{N}] {x.dtype} on {x.device}")
    if (not isinstance(hidden, torch.Tensor) or hidden.shape != (M, N)
            or hidden.dtype not in GEMM_DTYPES or hidden.device != x.device
            or (N > 1 and hidden.stride(1) != 1)):
        raise ConfigError(f"{fn}: hidden must be a float tensor [{M}, {N}] on {x.device}, "
                          "contiguous in its last dimension")
    return M, N, K


def splitk_residual_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                        hidden: torch.Tensor, splits: int,
                        config: SplitKConfig | None = None) -> torch.Tensor:
    """Plain torch twin of :func:`splitk_residual`: the float32 partial products summed in
    split order, the bias, ``hidden`` added in float32, one rounding to ``hidden``'s dtype."""
    _check_residual("splitk_residual_ref", x, w, bias, hidden, splits)
    parts = splitk_linear_ref(x, w, splits, config)
    return (hidden.float() + _sum_partials(parts, splits, bias)).to(hidden.dtype)


def splitk_residual(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                    hidden: torch.Tensor, splits: int,
                    config: SplitKConfig | None = None) -> torch.Tensor:
    """``hidden + x @ w^T (+ bias)`` in one launch: a projection into the residual stream
    with its residual add in the epilogue. ``splits`` inner-dimension chunks, each a program's
    float32 product; the last split to arrive at an output tile sums them in split order
    (``pagedkv.kernels.paired_splitk.counters``: the arrival counters), adds the bias and the
    residual in float32 and rounds once to ``hidden``'s dtype (what ``linear_partials`` +
    ``decoder.residual_add`` compute in two kernels). The Triton kernel on CUDA tensors (and
    under the interpreter); otherwise the torch twin."""
    M, N, K = _check_residual("splitk_residual", x, w, bias, hidden, splits)
    cfg = config or default_splitk_config(x.device)
    if not use_triton(_splitk_residual_kernel, x) or K == 0:
        return splitk_residual_ref(x, w, bias, hidden, splits, cfg)
    out = torch.empty_like(hidden, memory_format=torch.contiguous_format)
    if M == 0 or N == 0:
        return out
    from pagedkv.kernels.paired_splitk import counters

    chunk = split_chunk(K, splits, cfg.block_k)
    m_tiles, n_tiles = cdiv(M, cfg.block_m), cdiv(N, cfg.block_n)
    if splits > 1:
        part = torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
        cnt = counters(x.device, m_tiles * n_tiles)
    else:
        part = cnt = out
    _splitk_residual_kernel[(m_tiles, n_tiles, splits)](
        x, x.stride(0), w, w.stride(0), x if bias is None else bias, hidden, hidden.stride(0),
        out, out.stride(0), part, cnt, M, N, K, chunk,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLITS=splits,
        HAS_BIAS=bias is not None, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        RANGE_LOOP=not isinstance(_splitk_residual_kernel, InterpretedFunction),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_chain_args(_splitk_residual_kernel, x, chunk))
    return out


@torch.library.custom_op("pagedkv::splitk_residual", mutates_args=())
def splitk_residual_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                       hidden: torch.Tensor, splits: int) -> torch.Tensor:
    """:func:`splitk_residual` with the weight shape's launch config (``splitk_config_for``)
    as a custom op: one opaque call inside compiled regions."""
    return splitk_residual(x, w, bias, hidden, splits,
                           splitk_config_for(w.shape[0], w.shape[1])
                           if x.device.type == "cuda" else None)


@splitk_residual_op.register_fake
def _splitk_residual_fake(x, w, bias, hidden, splits):
    return torch.empty_like(hidden, memory_format=torch.contiguous_format)


# Launch parameters and split counts per weight shape (N, K) on the GPU, measured
# (bench/bench_splitk_gemm_gpu.py); other shapes get the default config and ``splitk_splits``'
# rule.
SPLITK_CONFIGS: dict[tuple[int, int], SplitKConfig] = {}
SPLITK_SPLITS: dict[tuple[int, int], int] = {}
# Where ``linear_partials`` takes the split-K kernel: CUDA, at most ``SPLITK_MAX_ROWS`` rows
# (decode batches; prefill-sized products stay with cuBLAS), and a weight shape whose row-tiled
# GEMM has fewer than ``SPLITK_MIN_PROGRAMS`` tiles of ``block_n`` columns (narrow outputs).
# ``SPLITK_ENABLED`` (on by default): W1 with ``LLM()`` defaults on the H200, split-K on / off
# in alternating processes of one lease: 23,985 / 22,910 and 23,726 / 23,162 output tok/s
# (7ad6768), 25,109 / 24,550 in an earlier lease (a1cac97). The op takes N and K from the weight
# (a parameter: static): traced from the activation, a process that had compiled several models'
# shapes saw a product of symbols there and the launch-table lookup failed (a1cac97's suite).
# Measured on the H200 (us per GEMM, cold weights,
# split-K kernel + its partials' extra read / cuBLAS): o_proj 1024 x 2048 at M = 8 / 64 / 128 /
# 256: 4.5 / 4.7 / 5.1 / 7.0 against 5.9 / 5.9 / 6.1 / 6.5; down_proj 1024 x 3072: 5.5 / 5.7 /
# 6.1 / 8.2 against 7.5 / 7.9 / 8.0 / 7.7 (4 splits): a gain up to 128 rows, a loss at 256.
SPLITK_ENABLED = True
SPLITK_MAX_ROWS = 128
SPLITK_MIN_PROGRAMS = 64
SPLITK_MAX_SPLITS = 8
SPLITK_MIN_CHUNK = 256


def splitk_config_for(N: int, K: int) -> SplitKConfig:
    return SPLITK_CONFIGS.get((N, K), SplitKConfig())


def splitk_splits(N: int, K: int, min_programs: int | None = None) -> int:
    """The split count for a weight ``[N, K]`` (1: not worth splitting): its entry in
    ``SPLITK_SPLITS``, else enough programs for ``min_programs`` (``SPLITK_MIN_PROGRAMS``) at
    one row tile, at most ``SPLITK_MAX_SPLITS``, chunks of at least ``SPLITK_MIN_CHUNK``
    columns."""
    if (N, K) in SPLITK_SPLITS:
        return SPLITK_SPLITS[(N, K)]
    want = SPLITK_MIN_PROGRAMS if min_programs is None else min_programs
    tiles = cdiv(N, splitk_config_for(N, K).block_n)
    if tiles >= want:
        return 1
    return max(1, min(SPLITK_MAX_SPLITS, cdiv(want, tiles), K // SPLITK_MIN_CHUNK))


# The gate/up projection (``N = 2 x intermediate``: 6144 x 1024 at the Qwen3-0.6B shape) as
# split-K partials that the activation kernel sums (``pagedkv.kernels.activation.
# silu_and_mul_partials``: no reduce launch, the activation's one launch reads S float32
# partials instead of one bf16 product). cuBLAS took 5.9-7.4 us for it at M = 8-256 on the H200
# (12.6 MB of weights: 2.9 us at 4.27 TB/s; ``bench/bench_decode_gemm_gpu.py``). Off by default:
# measured slower (seventeenth session, ``bench/bench_splitk_gemm_gpu.py --shapes gate_up``):
# no split launch beat cuBLAS at M 64 / 128 / 256 (best 1.00x; 1.02x at M 8), and W1 with it
# on gave 25,990 / 26,006 output tok/s against 26,324 / 26,375 off (``bench_w1.py
# --splitk-gate-up``, alternating processes, one lease). Its split rule wants
# ``SPLITK_WIDE_MIN_PROGRAMS`` programs a row tile
# (96 column tiles of 64 -> 3 splits).
SPLITK_GATE_UP_ENABLED = False
SPLITK_WIDE_MIN_PROGRAMS = 256


def gate_up_partials(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                     ) -> torch.Tensor | None:
    """The split-K partials ``[S, M, N]`` (float32) of the gate/up product ``x @ w^T`` where
    the split runs (``SPLITK_GATE_UP_ENABLED``, CUDA, at most ``SPLITK_MAX_ROWS`` rows, no
    bias, more than one split); None where the plain product runs."""
    if SPLITK_GATE_UP_ENABLED and bias is None and x.is_cuda and x.dim() == 2 \
            and x.shape[0] <= SPLITK_MAX_ROWS:
        splits = splitk_splits(w.shape[0], w.shape[1], SPLITK_WIDE_MIN_PROGRAMS)
        if splits > 1:
            return splitk_linear_op(x, w, splits)
    return None


def _split_rows(x: torch.Tensor) -> bool:
    """A decode-sized CUDA operand the split-K kernel takes (``SPLITK_ENABLED``, 2-D, at most
    ``SPLITK_MAX_ROWS`` rows)."""
    return SPLITK_ENABLED and x.is_cuda and x.dim() == 2 and x.shape[0] <= SPLITK_MAX_ROWS


def _sum_partials(parts: torch.Tensor, splits: int, bias: torch.Tensor | None) -> torch.Tensor:
    # the partials added one by one (pointwise: inside a compiled region they fold into the
    # consumer's kernel; a .sum(0) is a reduction of its own, a kernel more)
    out = parts[0]
    for i in range(1, splits):
        out = out + parts[i]
    return out if bias is None else out + bias.float()


def linear_partials(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """``x @ w^T (+ bias)`` for a product that is added to something next (a residual stream):
    on CUDA for a decode-sized ``x`` and a narrow ``w`` (see ``SPLITK_*``), the float32 sum of
    the split-K partials, unrounded (inside a compiled region the sum and the cast fold into the
    consumer's kernel); otherwise ``F.linear`` in ``x``'s dtype. The caller adds it in float32
    (``pagedkv.models.decoder.residual_add``)."""
    if _split_rows(x):
        splits = splitk_splits(w.shape[0], w.shape[1])
        if splits > 1:
            return _sum_partials(splitk_linear_op(x, w, splits), splits, bias)
    return torch.nn.functional.linear(x, w, bias)


__all__ = ["INTERPRET_CONFIG", "SPLITK_CONFIGS", "SPLITK_SPLITS", "SplitKConfig",
           "default_splitk_config", "gate_up_partials", "linear_partials", "split_chunk",
           "splitk_residual", "splitk_residual_op", "splitk_residual_ref",
           "splitk_config_for", "splitk_linear", "splitk_linear_op", "splitk_linear_ref",
           "splitk_splits"]
