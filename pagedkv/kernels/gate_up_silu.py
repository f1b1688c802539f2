"""The MLP's gate/up projection with its SiLU-gated activation in the epilogue:
``silu(x @ W_gate^T + b_gate) * (x @ W_up^T + b_up)`` in one launch for decode-sized batches,
instead of two (a cuBLAS GEMM into ``[T, 2I]``, then ``pagedkv.kernels.activation``'s kernel).

Why: a decode step's kernels each cost a launch floor of a few microseconds over little work
(W1's decode steps, BENCHMARKS.md nineteenth session: gate/up 5.1 us a layer for 2.9 us of
weight bytes, the activation 1.4 us more). The activation is elementwise on the product, so it
belongs in the GEMM's epilogue; the ``[T, 2I]`` product never goes to memory.

Weight layout: the stacked ``gate_up_proj`` weight ``[2I, K]``, gate rows first (the model's
layout, ``pagedkv.models.layers.GatedMLP``); bias ``[2I]`` the same way or None.

Kernel ``_gate_up_silu_kernel``, grid ``(cdiv(T, BLOCK_M), cdiv(I, BLOCK_N), SPLITS)``: program
``(m, n, s)`` multiplies ``BLOCK_M`` rows by the gate rows ``[n BN, (n+1) BN)`` and the matching
up rows ``I + [n BN, (n+1) BN)`` over the ``s``-th inner-dimension chunk
(:func:`pagedkv.kernels.paired_splitk.paired_dot`); one split applies the epilogue directly,
several sum in the last program to arrive (``paired_split_sum``; float32 scratch ``[SPLITS, T,
2I]``, counters ``paired_splitk.counters``). Epilogue: the biases, ``silu_mul`` (the
activation kernel's formula, float32), one rounding to ``x``'s dtype.

Rounding: the unfused path rounds the product to the model dtype before the activation; here
it stays float32 (as :func:`gate_up_silu_ref` states), so bf16 results may differ by about one
bf16 ulp.

Where it runs (:func:`fused_gate_up_applies`): ``FUSED_GATE_UP_ENABLED`` (environment
``PAGEDKV_FUSED_GATE_UP=1``; off until measured end to end on the H200), at most
``FUSED_GATE_UP_MAX_ROWS`` rows (prefill-sized products stay with cuBLAS), on CUDA or under
the Triton interpreter. ``gate_up_silu_op`` is the custom op ``pagedkv::gate_up_silu`` that
compiled regions keep as one opaque call. No host syncs: CUDA-graph safe.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import cdiv, check_launch_config, next_pow2, use_triton
from pagedkv.kernels.activation import silu_mul
from pagedkv.kernels.pdl import pdl_chain_args, pdl_prologue, prefetch_weights_l2
from pagedkv.kernels.paired_splitk import (
    chunk_and_splits,
    counters,
    paired_dot,
    paired_split_sum,
    normed_product,
    rms_scale,
)

FUSED_GATE_UP_ENABLED = os.environ.get("PAGEDKV_FUSED_GATE_UP", "0") == "1"
FUSED_GATE_UP_MAX_ROWS = 256
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@dataclass(frozen=True)
class GateUpConfig:
    """Launch parameters. ``block_m``: the most rows a program takes (a launch uses the next
    power of two of the row count, at least 16, up to this); ``block_n``: gate (and as many
    up) columns a program; ``splits``: inner-dimension splits, 0 = by rows
    (:func:`default_splits`). Swept on the H200 (``bench/bench_gate_up_silu_gpu.py``,
    BENCHMARKS.md, twenty-sixth session): it beats cuBLAS + SiLU only up to ~64 rows."""

    block_m: int = 64
    block_n: int = 32
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    splits: int = 0

    def __post_init__(self):
        check_launch_config(self, ("block_m", "block_n", "block_k"))
        if min(self.block_m, self.block_n, self.block_k) < 16:
            raise ConfigError("GateUpConfig: block_m, block_n and block_k must be >= 16 "
                              f"(tl.dot), got {self.block_m}, {self.block_n}, {self.block_k}")
        if isinstance(self.splits, bool) or not isinstance(self.splits, int) or not (
                0 <= self.splits <= 16):
            raise ConfigError(f"GateUpConfig: splits must be an int in [0, 16], got "
                              f"{self.splits!r}")


INTERPRET_CONFIG = GateUpConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


def default_splits(rows: int) -> int:
    """Inner-dimension splits for ``rows`` rows: 4 up to 16 rows (96 column tiles of 32 at the
    Qwen3-0.6B shape: 384 programs), 2 up to 32, 1 above (the scratch traffic grows with the
    rows). From the H200 sweep (twenty-sixth session, 28 layers in a graph, us a layer): 1 row
    6.45 / 6.97 / 7.35 at 4 / 2 / 1 splits, 32 rows 9.1 / 12.85 at 2 / 1."""
    return 4 if rows <= 16 else 2 if rows <= 32 else 1


@triton.jit
def _gate_up_epilogue(gate, up, ss, eps, rows, r_ok, cols, n_ok, b_ptr, out_ptr, o_s0,
                      I: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
                      NORM: tl.constexpr):
    if NORM:
        r = rms_scale(ss, eps, K)
        gate = gate * r
        up = up * r
    if HAS_BIAS:
        gate += tl.load(b_ptr + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(b_ptr + I + cols, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = silu_mul(gate, up)
    dst = out_ptr + rows.to(tl.int64)[:, None] * o_s0 + cols[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=r_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _gate_up_silu_kernel(
    x_ptr, x_s0, w_ptr, w_s0, b_ptr, ln_ptr, eps, out_ptr, o_s0, part_ptr, ss_ptr, cnt_ptr,
    num_rows,
    I: tl.constexpr, K: tl.constexpr, K_CHUNK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, DOT_PREC: tl.constexpr,
    PDL: tl.constexpr = 0, PF_LINES: tl.constexpr = 1, PF_EPL: tl.constexpr = 64,
):
    N_TILES: tl.constexpr = (I + BLOCK_N - 1) // BLOCK_N
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    s = tl.program_id(2)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = cols < I
    pf_rows = w_ptr + tl.where(n_ok, cols, 0).to(tl.int64) * w_s0
    pf_end = tl.minimum(s * K_CHUNK + K_CHUNK, K)
    prefetch_weights_l2(pf_rows, s * K_CHUNK, pf_end, PF_LINES, PF_EPL, PDL)
    prefetch_weights_l2(pf_rows + I * w_s0, s * K_CHUNK, pf_end, PF_LINES, PF_EPL, PDL)
    pdl_prologue(PDL)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < num_rows
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_s0
    g_rows = w_ptr + cols.to(tl.int64)[:, None] * w_s0
    gate, up, ss = paired_dot(x_rows, g_rows, g_rows + I * w_s0, r_ok, n_ok, s, ln_ptr, K,
                              K_CHUNK, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PREC, NORM)
    if SPLITS == 1:
        _gate_up_epilogue(gate, up, ss, eps, rows, r_ok, cols, n_ok, b_ptr, out_ptr, o_s0, I,
                          K, HAS_BIAS, NORM)
    else:
        part = part_ptr + rows.to(tl.int64)[:, None] * (2 * I) + cols[None, :]
        last, g_sum, u_sum, ss_sum = paired_split_sum(
            gate, up, ss, part, part + I, ss_ptr + rows, num_rows * (2 * I), num_rows, s,
            r_ok[:, None] & n_ok[None, :], r_ok, cnt_ptr + pid_m * N_TILES + pid_n, SPLITS,
            NORM)
        if last:
            _gate_up_epilogue(g_sum, u_sum, ss_sum, eps, rows, r_ok, cols, n_ok, b_ptr,
                              out_ptr, o_s0, I, K, HAS_BIAS, NORM)


def _check(fn: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
           ln_weight: torch.Tensor | None = None, eps: float = 0.0) -> int:
    """Metadata-only checks; returns ``I``."""
    for name, t in (("x", x), ("w", w), ("bias", bias), ("ln_weight", ln_weight)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise ConfigError(f"{fn}: {name} must be a tensor")
    if x.dim() != 2 or w.dim() != 2 or w.shape[1] != x.shape[1] or w.shape[0] % 2:
        raise ConfigError(f"{fn}: need x [T, K] and w [2I, K], got {tuple(x.shape)} and "
                          f"{tuple(w.shape)}")
    if x.dtype not in _DTYPES or w.dtype != x.dtype:
        raise ConfigError(f"{fn}: x and w must share one of bf16/fp16/fp32, got {x.dtype} and "
                          f"{w.dtype}")
    for name, t, n in (("bias", bias, w.shape[0]), ("ln_weight", ln_weight, x.shape[1])):
        if t is not None and (t.dim() != 1 or t.shape[0] != n or t.dtype != x.dtype):
            raise ConfigError(f"{fn}: {name} must be [{n}] {x.dtype}, got {tuple(t.shape)} "
                              f"{t.dtype}")
    if any(t is not None and t.device != x.device for t in (w, bias, ln_weight)):
        raise ConfigError(f"{fn}: x, w, bias and ln_weight must be on one device")
    if any(t is not None and t.shape[-1] > 1 and t.stride(-1) != 1
           for t in (x, w, bias, ln_weight)):
        raise ConfigError(f"{fn}: x, w, bias and ln_weight must be contiguous in their last "
                          "dimension")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not eps >= 0:
        raise ConfigError(f"{fn}: eps must be a non-negative host number, got {eps!r}")
    return w.shape[0] // 2


def gate_up_silu_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                     ln_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Plain torch twin: the float32 product (:func:`normed_product`: of the RMSNorm of ``x``
    with ``ln_weight``), the bias, ``silu(gate) * up`` in float32, one rounding to ``x``'s
    dtype."""
    _check("gate_up_silu_ref", x, w, bias, ln_weight, eps)
    prod = normed_product(x, w, ln_weight, eps)
    if bias is not None:
        prod = prod + bias.float()
    gate, up = prod.chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def fused_gate_up_silu(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                       config: GateUpConfig | None = None,
                       ln_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up`` of ``x @ w^T (+ bias)`` (module docstring) with the Triton kernel
    (CUDA tensors, or any tensor under the Triton interpreter); otherwise the torch twin. With
    ``ln_weight``, ``x`` is the MLP's un-normed input: the kernel applies the RMSNorm (weight
    ``ln_weight``, ``eps``) on the fly (:func:`normed_product`)."""
    inter = _check("fused_gate_up_silu", x, w, bias, ln_weight, eps)
    if not use_triton(_gate_up_silu_kernel, x):
        return gate_up_silu_ref(x, w, bias, ln_weight, eps)
    rows, K = x.shape
    out = torch.empty((rows, inter), dtype=x.dtype, device=x.device)
    if rows == 0 or inter == 0:
        return out
    if K == 0:  # the product is the bias (or zero)
        return gate_up_silu_ref(x, w, bias, ln_weight, eps)
    cfg = config or (GateUpConfig() if x.device.type == "cuda" else INTERPRET_CONFIG)
    block_m = min(cfg.block_m, max(16, next_pow2(rows)))
    chunk, splits = chunk_and_splits(K, cfg.splits or default_splits(rows), cfg.block_k)
    m_tiles, n_tiles = cdiv(rows, block_m), cdiv(inter, cfg.block_n)
    norm = ln_weight is not None
    if splits > 1:
        part = torch.empty((splits, rows, 2 * inter), dtype=torch.float32, device=x.device)
        ss = torch.empty((splits, rows), dtype=torch.float32, device=x.device) if norm else part
        cnt = counters(x.device, m_tiles * n_tiles)
    else:
        part = ss = cnt = out
    _gate_up_silu_kernel[(m_tiles, n_tiles, splits)](
        x, x.stride(0), w, w.stride(0), x if bias is None else bias,
        x if ln_weight is None else ln_weight, float(eps), out, out.stride(0),
        part, ss, cnt, rows,
        I=inter, K=K, K_CHUNK=chunk, BLOCK_M=block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, SPLITS=splits, HAS_BIAS=bias is not None, NORM=norm,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_chain_args(_gate_up_silu_kernel, x, chunk))
    return out


@torch.library.custom_op("pagedkv::gate_up_silu", mutates_args=())
def gate_up_silu_op(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                    ln_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """:func:`fused_gate_up_silu` as a custom op: one opaque call inside compiled regions."""
    return fused_gate_up_silu(x, w, bias, None, ln_weight, eps)


@gate_up_silu_op.register_fake
def _gate_up_silu_fake(x, w, bias, ln_weight=None, eps=0.0):
    return x.new_empty((x.shape[0], w.shape[0] // 2))


def fused_gate_up_applies(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the MLP takes the fused kernel for ``x``: the switch, a 2-D decode-sized
    batch (at most ``FUSED_GATE_UP_MAX_ROWS`` rows), a float dtype, and a device the kernel
    runs on (CUDA, or CPU under the Triton interpreter)."""
    return (FUSED_GATE_UP_ENABLED and x.dim() == 2 and x.shape[0] <= FUSED_GATE_UP_MAX_ROWS
            and x.dtype in _DTYPES and w.dtype == x.dtype
            and use_triton(_gate_up_silu_kernel, x))


__all__ = ["FUSED_GATE_UP_ENABLED", "FUSED_GATE_UP_MAX_ROWS", "GateUpConfig", "INTERPRET_CONFIG",
           "default_splits", "fused_gate_up_applies", "fused_gate_up_silu", "gate_up_silu_op",
           "gate_up_silu_ref"]
