"""The fused QKV projection of a decode step: ``x @ W_qkv^T (+ b)``, then per head the q/k
RMSNorm, RoPE and the paged K/V write, in one launch instead of two (a cuBLAS GEMM, then
:mod:`pagedkv.kernels.qk_norm_rope_cache`).

Why. In a decode step a layer's kernels each cost a launch floor of a few microseconds over
little work (W1's decode steps: ~1.16 ms of fixed cost a step over 28 layers, BENCHMARKS.md,
nineteenth session): the QKV GEMM took 6.2 us for 2 us of weight bytes and the norm + RoPE +
write kernel 1.9 us more. Here the projection's epilogue does the second kernel's work on the
float32 product while it is still in registers.

Semantics: exactly :func:`pagedkv.kernels.qk_norm_rope_cache.qk_norm_rope_cache` applied to
``qkv = x @ weight^T + bias`` computed in float32 and never rounded (:func:`qkv_rope_cache_ref`
is the torch statement): ``q_out [T, H, D]`` gets every row's normed, rotated q heads; rows
``t < slot_mapping.numel()`` with a slot in ``[0, num_blocks * block_size)`` write their normed,
rotated k and their v (FP8 caches: quantized with the per-tensor scales); nothing else of the
caches is touched. The unfused path rounds ``qkv`` to the model dtype before the norms, so bf16
results differ from it by about one bf16 ulp.

Kernel ``_qkv_rope_cache_kernel``, grid ``(cdiv(T, BLOCK_M), H + 2 * Hkv, SPLITS)``: program
``(m, h, s)`` multiplies ``BLOCK_M`` rows of ``x`` by head ``h``'s ``D`` weight rows over the
``s``-th chunk of the inner dimension, as two ``[BLOCK_M, D / 2]`` float32 products (the
halves RoPE pairs, so the rotation needs no shuffle). With one split it runs the epilogue on
them; with more, it stores them to a float32 scratch ``[SPLITS, T, (H + 2 Hkv) D]`` and counts
itself at the counter of ``(m, h)``; the last to arrive sums the ``SPLITS`` partials in split
order and runs the epilogue (:mod:`pagedkv.kernels.paired_splitk`, shared with the fused
gate/up projection). Splitting the
inner dimension gives few-row launches enough programs to keep the memory busy (the split-K
sweep for this projection, nineteenth session: 4 splits best at 1-8 rows, 2 at 32-64).

Where it applies (:func:`fused_applies`): ``D / 2`` a power of two of at least 16 (``tl.dot``
tiles: head sizes 32, 64, 128, 256). ``T``, the slot rows and the row count are not
specialized (one compiled variant per model shape, ``BLOCK_M`` and split count). No host
syncs: CUDA-graph safe (the scratch comes from the caller's allocator, inside a capture from
the graph's pool; the counters: ``paired_splitk.counters``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import (
    KV_DTYPES,
    cdiv,
    check_launch_config,
    check_tensor,
    next_pow2,
    use_triton,
)
from pagedkv.kernels.fp8_kv import fp8_quantize, is_fp8_kv
from pagedkv.kernels.pdl import pdl_chain_args as _pdl_args
from pagedkv.kernels.pdl import pdl_prologue, prefetch_weights_l2
from pagedkv.kernels.paired_splitk import (
    chunk_and_splits,
    counters,
    paired_dot,
    normed_product,
    paired_split_sum,
    rms_scale,
)
from pagedkv.kernels.qk_norm_rope_cache import (
    _qk_norm_rope_cache_torch,
    check_heads,
    check_targets,
    norm_rope,
)


@dataclass(frozen=True)
class QKVRopeConfig:
    """Launch parameters. ``block_m``: the most rows a program takes (a launch uses the next
    power of two of the row count, at least 16, up to this); ``splits``: inner-dimension
    splits, 0 = by rows (:func:`default_splits`)."""

    block_m: int = 64
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 4
    splits: int = 0

    def __post_init__(self):
        check_launch_config(self, ("block_m", "block_k"))
        if self.block_m < 16 or self.block_k < 16:
            raise ConfigError(f"QKVRopeConfig: block_m and block_k must be >= 16 (tl.dot), got "
                              f"{self.block_m} and {self.block_k}")
        if isinstance(self.splits, bool) or not isinstance(self.splits, int) or not (
                0 <= self.splits <= 16):
            raise ConfigError(f"QKVRopeConfig: splits must be an int in [0, 16], got "
                              f"{self.splits!r}")


INTERPRET_CONFIG = QKVRopeConfig(block_m=16, block_k=16, num_warps=1, num_stages=1)


def default_splits(rows: int) -> int:
    """Inner-dimension splits for a launch of ``rows`` rows: 4 up to 16 rows, 2 up to 64, 1
    above (the nineteenth session's split-K sweep of this projection, 4096 x 1024)."""
    return 4 if rows <= 16 else 2 if rows <= 64 else 1


def fused_applies(head_dim: int) -> bool:
    """Whether the kernel serves heads of ``head_dim``: half of it a power of two >= 16."""
    half = head_dim // 2
    return head_dim % 2 == 0 and half >= 16 and next_pow2(half) == half


@triton.jit
def _qkv_epilogue(acc1, acc2, ss, ln_eps, rows, r_ok, h, d,
                  b_ptr, q_ptr, q_s0, q_s1,
                  cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1,
                  qw_ptr, kw_ptr,
                  slot_ptr, num_slot_rows, num_slots, block_size,
                  kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
                  eps, k_scale, v_scale,
                  NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, FP8: tl.constexpr,
                  K: tl.constexpr, LN: tl.constexpr):
    """Head ``h``'s float32 product halves ``[BLOCK_M, HALF]`` of rows ``rows``: the input
    RMSNorm's row scale (``LN``, from the rows' sums of squares ``ss``), bias, then a q head's
    norm + RoPE into ``q_out``, a k head's norm + RoPE into the key cache, a v head into the
    value cache (rows with a valid slot)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    rows64 = rows.to(tl.int64)
    dd = d[None, :]
    if LN:
        r = rms_scale(ss, ln_eps, K)
        acc1 = acc1 * r
        acc2 = acc2 * r
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + h * HEAD_DIM + dd).to(tl.float32)
        acc2 += tl.load(b_ptr + h * HEAD_DIM + HALF + dd).to(tl.float32)
    rm = r_ok[:, None]
    if h < NUM_HEADS:
        # Branch-local names are distinct: Triton merges same-named values across branches.
        cq = tl.load(cos_ptr + rows64[:, None] * cos_s0 + dd * cos_s1, mask=rm, other=0.0)
        sq = tl.load(sin_ptr + rows64[:, None] * sin_s0 + dd * sin_s1, mask=rm, other=0.0)
        q1, q2 = norm_rope(acc1, acc2, qw_ptr, dd, eps, HAS_NORM, HEAD_DIM, HALF,
                           cq.to(tl.float32), sq.to(tl.float32))
        dst_q = q_ptr + rows64[:, None] * q_s0 + h * q_s1 + dd
        tl.store(dst_q, q1.to(q_ptr.dtype.element_ty), mask=rm)
        tl.store(dst_q + HALF, q2.to(q_ptr.dtype.element_ty), mask=rm)
    else:
        slot = tl.load(slot_ptr + rows, mask=rows < num_slot_rows, other=-1).to(tl.int64)
        ok = ((slot >= 0) & (slot < num_slots))[:, None]
        blk = slot // block_size
        off = slot - blk * block_size
        if h < NUM_HEADS + NUM_KV_HEADS:
            hk = h - NUM_HEADS
            ck = tl.load(cos_ptr + rows64[:, None] * cos_s0 + dd * cos_s1, mask=ok, other=0.0)
            sk = tl.load(sin_ptr + rows64[:, None] * sin_s0 + dd * sin_s1, mask=ok, other=0.0)
            k1, k2 = norm_rope(acc1, acc2, kw_ptr, dd, eps, HAS_NORM, HEAD_DIM, HALF,
                               ck.to(tl.float32), sk.to(tl.float32))
            dst_k = kc_ptr + blk[:, None] * kc_s0 + off[:, None] * kc_s1 + hk * kc_s2 + dd
            if FP8:
                k1 = fp8_quantize(k1, k_scale)
                k2 = fp8_quantize(k2, k_scale)
            tl.store(dst_k, k1.to(kc_ptr.dtype.element_ty), mask=ok)
            tl.store(dst_k + HALF, k2.to(kc_ptr.dtype.element_ty), mask=ok)
        else:
            hv = h - NUM_HEADS - NUM_KV_HEADS
            v1 = acc1
            v2 = acc2
            if FP8:
                v1 = fp8_quantize(v1, v_scale)
                v2 = fp8_quantize(v2, v_scale)
            dst_v = vc_ptr + blk[:, None] * vc_s0 + off[:, None] * vc_s1 + hv * vc_s2 + dd
            tl.store(dst_v, v1.to(vc_ptr.dtype.element_ty), mask=ok)
            tl.store(dst_v + HALF, v2.to(vc_ptr.dtype.element_ty), mask=ok)


@triton.jit
def qkv_rope_tile(
    mt, h, s,
    x_ptr, x_s0, w_ptr, w_s0, b_ptr, ln_ptr, ln_eps,
    q_ptr, q_s0, q_s1,
    cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1,
    qw_ptr, kw_ptr,
    slot_ptr, num_slot_rows, num_slots, block_size,
    kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
    part_ptr, ss_ptr, cnt_ptr,
    num_rows, eps,
    K: tl.constexpr, K_CHUNK: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, LN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    k_scale, v_scale, FP8: tl.constexpr,
):
    """Program ``(mt, h, s)`` of the launch below: row tile ``mt``, head ``h``, inner split
    ``s`` (its product, then the epilogue, or its partials and, last to arrive, the sum and
    the epilogue). Also called by the persistent decode-layer probe
    (``pagedkv.kernels.persistent_layer``), which deals these tiles to resident programs."""
    HALF: tl.constexpr = HEAD_DIM // 2
    NH: tl.constexpr = NUM_HEADS + 2 * NUM_KV_HEADS
    N: tl.constexpr = NH * HEAD_DIM
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    r_ok = rows < num_rows
    d = tl.arange(0, HALF)
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * x_s0
    w_rows = w_ptr + (h * HEAD_DIM + d).to(tl.int64)[:, None] * w_s0
    acc1, acc2, ss = paired_dot(x_rows, w_rows, w_rows + HALF * w_s0, r_ok, d < HALF, s, ln_ptr,
                                K, K_CHUNK, BLOCK_M, HALF, BLOCK_K, DOT_PREC, LN)
    if SPLITS == 1:
        _qkv_epilogue(acc1, acc2, ss, ln_eps, rows, r_ok, h, d, b_ptr, q_ptr, q_s0, q_s1,
                      cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1, qw_ptr, kw_ptr,
                      slot_ptr, num_slot_rows, num_slots, block_size,
                      kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
                      eps, k_scale, v_scale, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                      HAS_NORM, HAS_BIAS, FP8, K, LN)
    else:
        part = part_ptr + rows.to(tl.int64)[:, None] * N + h * HEAD_DIM + d[None, :]
        last, sum1, sum2, ss_sum = paired_split_sum(
            acc1, acc2, ss, part, part + HALF, ss_ptr + rows, num_rows * N, num_rows, s,
            r_ok[:, None], r_ok, cnt_ptr + mt * NH + h, SPLITS, LN)
        if last:
            _qkv_epilogue(sum1, sum2, ss_sum, ln_eps, rows, r_ok, h, d, b_ptr, q_ptr, q_s0,
                          q_s1, cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1, qw_ptr,
                          kw_ptr, slot_ptr, num_slot_rows, num_slots, block_size,
                          kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
                          eps, k_scale, v_scale, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                          HAS_NORM, HAS_BIAS, FP8, K, LN)


@triton.jit(do_not_specialize=["num_rows", "num_slot_rows"])
def _qkv_rope_cache_kernel(
    x_ptr, x_s0, w_ptr, w_s0, b_ptr, ln_ptr, ln_eps,
    q_ptr, q_s0, q_s1,
    cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1,
    qw_ptr, kw_ptr,
    slot_ptr, num_slot_rows, num_slots, block_size,
    kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
    part_ptr, ss_ptr, cnt_ptr,
    num_rows, eps,
    K: tl.constexpr, K_CHUNK: tl.constexpr,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_BIAS: tl.constexpr, LN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, SPLITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    k_scale=1.0, v_scale=1.0, FP8: tl.constexpr = False,
    PDL: tl.constexpr = 0, PF_LINES: tl.constexpr = 1, PF_EPL: tl.constexpr = 64,
):
    mt = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    prefetch_weights_l2(w_ptr + (h * HEAD_DIM + tl.arange(0, HEAD_DIM)).to(tl.int64) * w_s0,
                        s * K_CHUNK, tl.minimum(s * K_CHUNK + K_CHUNK, K), PF_LINES, PF_EPL, PDL)
    pdl_prologue(PDL)
    qkv_rope_tile(mt, h, s, x_ptr, x_s0, w_ptr, w_s0, b_ptr, ln_ptr, ln_eps, q_ptr, q_s0, q_s1,
                  cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1, qw_ptr, kw_ptr,
                  slot_ptr, num_slot_rows, num_slots, block_size,
                  kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
                  part_ptr, ss_ptr, cnt_ptr, num_rows, eps, K, K_CHUNK,
                  NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_NORM, HAS_BIAS, LN,
                  BLOCK_M, BLOCK_K, SPLITS, DOT_PREC, k_scale, v_scale, FP8)


def _check(fn, x, weight, bias, num_heads, num_kv_heads, head_dim, q_norm_weight,
           k_norm_weight, eps, cos, sin, slot_mapping, key_cache, value_cache, q_out, k_scale,
           v_scale, ln_weight=None, ln_eps=0.0) -> tuple[int, int, int]:
    heads, kv_heads, dim = check_heads(fn, num_heads, num_kv_heads, head_dim, eps, k_scale,
                                       v_scale)
    check_tensor(fn, "x", x, dtypes=KV_DTYPES, ndim=2, contiguous_last=True)
    check_tensor(fn, "weight", weight, dtypes=(x.dtype,), ndim=2, contiguous_last=True)
    n = (heads + 2 * kv_heads) * dim
    if tuple(weight.shape) != (n, x.shape[1]):
        raise ConfigError(
            f"{fn}: weight must have shape [(num_heads + 2 * num_kv_heads) * head_dim, K] = "
            f"[{n}, {x.shape[1]}] for x {tuple(x.shape)}, got {tuple(weight.shape)}")
    if bias is not None:
        check_tensor(fn, "bias", bias, dtypes=(x.dtype,), ndim=1, contiguous_last=True)
        if bias.shape[0] != n:
            raise ConfigError(f"{fn}: bias must have shape [{n}], got {tuple(bias.shape)}")
    if ln_weight is not None:
        check_tensor(fn, "ln_weight", ln_weight, dtypes=(x.dtype,), ndim=1, contiguous_last=True)
        if ln_weight.shape[0] != x.shape[1]:
            raise ConfigError(f"{fn}: ln_weight must have shape [{x.shape[1]}], got "
                              f"{tuple(ln_weight.shape)}")
    if isinstance(ln_eps, bool) or not isinstance(ln_eps, (int, float)) or not ln_eps >= 0:
        raise ConfigError(f"{fn}: ln_eps must be a non-negative host number, got {ln_eps!r}")
    if any(t is not None and t.device != x.device for t in (weight, bias, ln_weight)):
        raise ConfigError(f"{fn}: x, weight, bias and ln_weight must be on one device")
    check_targets(fn, "x", x, heads, kv_heads, dim, q_norm_weight, k_norm_weight, cos, sin,
                  slot_mapping, key_cache, value_cache, q_out)
    return heads, kv_heads, dim


def qkv_rope_cache(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_out: torch.Tensor | None = None,
    check: bool = True,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    config: QKVRopeConfig | None = None,
    ln_weight: torch.Tensor | None = None,
    ln_eps: float = 0.0,
) -> torch.Tensor:
    """The QKV projection of ``x [T, K]`` by ``weight [(H + 2 Hkv) D, K]`` (+ ``bias``), the
    q/k norms, RoPE and the paged K/V write, in one launch; returns ``q_out [T, H, D]``. The
    other arguments are :func:`pagedkv.kernels.qk_norm_rope_cache.qk_norm_rope_cache`'s; x,
    weight and bias share one dtype, the caches have it or are FP8. With ``ln_weight``, ``x``
    is the layer's un-normed input and the kernel applies its input RMSNorm (``ln_weight``,
    ``ln_eps``) on the fly (``paired_splitk.normed_product``). The Triton kernel runs on CUDA
    tensors (and under the interpreter); elsewhere the torch twin."""
    fn = "qkv_rope_cache"
    if check:
        heads, kv_heads, dim = _check(fn, x, weight, bias, num_heads, num_kv_heads, head_dim,
                                      q_norm_weight, k_norm_weight, eps, cos, sin, slot_mapping,
                                      key_cache, value_cache, q_out, k_scale, v_scale,
                                      ln_weight, ln_eps)
    else:
        heads, kv_heads, dim = num_heads, num_kv_heads, head_dim
    rows = x.shape[0]
    if q_out is None:
        q_out = torch.empty((rows, heads, dim), dtype=x.dtype, device=x.device)
    if rows == 0:
        return q_out
    if not use_triton(_qkv_rope_cache_kernel, x):
        _reference(x, weight, bias, heads, kv_heads, dim, q_norm_weight, k_norm_weight, eps,
                   cos, sin, slot_mapping, key_cache, value_cache, q_out, k_scale, v_scale,
                   ln_weight, ln_eps)
        return q_out
    if not fused_applies(dim):
        raise ConfigError(f"{fn}: head_dim {dim} is not served (half of it must be a power of "
                          "two >= 16); use F.linear + qk_norm_rope_cache")
    cfg = config or (QKVRopeConfig() if x.device.type == "cuda" else INTERPRET_CONFIG)
    block_m = min(cfg.block_m, max(16, next_pow2(rows)))
    splits = cfg.splits or default_splits(rows)
    K = x.shape[1]
    chunk, splits = chunk_and_splits(K, splits, cfg.block_k)
    nh = heads + 2 * kv_heads
    m_tiles = cdiv(rows, block_m)
    ln = ln_weight is not None
    if splits > 1:
        part = torch.empty((splits, rows, nh * dim), dtype=torch.float32, device=x.device)
        ss = torch.empty((splits, rows), dtype=torch.float32, device=x.device) if ln else part
        cnt = counters(x.device, m_tiles * nh)
    else:
        part = ss = cnt = x
    n_blocks, block_size = key_cache.shape[:2]
    has_norm = q_norm_weight is not None
    qw, kw = (q_norm_weight, k_norm_weight) if has_norm else (x, x)
    _qkv_rope_cache_kernel[(m_tiles, nh, splits)](
        x, x.stride(0), weight, weight.stride(0), x if bias is None else bias,
        x if ln_weight is None else ln_weight, float(ln_eps),
        q_out, q_out.stride(0), q_out.stride(1),
        cos, *cos.stride(), sin, *sin.stride(),
        qw, kw,
        slot_mapping, slot_mapping.shape[0], n_blocks * block_size, block_size,
        key_cache, *key_cache.stride()[:3], value_cache, *value_cache.stride()[:3],
        part, ss, cnt,
        rows, float(eps),
        K=K, K_CHUNK=chunk, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim,
        HAS_NORM=has_norm, HAS_BIAS=bias is not None, LN=ln,
        BLOCK_M=block_m, BLOCK_K=cfg.block_k, SPLITS=splits,
        DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32",
        k_scale=float(k_scale), v_scale=float(v_scale), FP8=is_fp8_kv(key_cache.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **_pdl_args(_qkv_rope_cache_kernel, x, chunk),
    )
    return q_out


def qkv_rope_cache_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    q_out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    ln_weight: torch.Tensor | None = None,
    ln_eps: float = 0.0,
) -> torch.Tensor:
    """Plain torch twin of :func:`qkv_rope_cache`: the float32 product (with ``ln_weight``:
    ``paired_splitk.normed_product``), the bias, then the torch twin of
    ``qk_norm_rope_cache`` on it unrounded (one rounding or FP8 quantization at the stores)."""
    fn = "qkv_rope_cache_ref"
    heads, kv_heads, dim = _check(fn, x, weight, bias, num_heads, num_kv_heads, head_dim,
                                  q_norm_weight, k_norm_weight, eps, cos, sin, slot_mapping,
                                  key_cache, value_cache, q_out, k_scale, v_scale, ln_weight,
                                  ln_eps)
    if q_out is None:
        q_out = torch.empty((x.shape[0], heads, dim), dtype=x.dtype, device=x.device)
    if x.shape[0]:
        _reference(x, weight, bias, heads, kv_heads, dim, q_norm_weight, k_norm_weight, eps,
                   cos, sin, slot_mapping, key_cache, value_cache, q_out, k_scale, v_scale,
                   ln_weight, ln_eps)
    return q_out


def _reference(x, weight, bias, heads, kv_heads, dim, q_norm_weight, k_norm_weight, eps, cos,
               sin, slot_mapping, key_cache, value_cache, q_out, k_scale, v_scale,
               ln_weight=None, ln_eps=0.0) -> None:
    qkv = normed_product(x, weight, ln_weight, ln_eps)
    if bias is not None:
        qkv = qkv + bias.float()
    _qk_norm_rope_cache_torch(qkv, heads, kv_heads, dim, q_norm_weight, k_norm_weight, eps, cos,
                              sin, slot_mapping, key_cache, value_cache, q_out, k_scale, v_scale)


__all__ = ["INTERPRET_CONFIG", "QKVRopeConfig", "default_splits", "fused_applies",
           "qkv_rope_cache", "qkv_rope_cache_ref"]
