"""Fused q/k RMSNorm + RoPE + paged KV write: everything a decoder layer does between its fused
QKV projection and attention, in one launch instead of five (q norm, k norm, q rope, k rope,
``reshape_and_cache``).

Layout. ``qkv [T, (H + 2*Hkv) * D]`` holds per row the ``H`` query heads, then the ``Hkv`` key
heads, then the ``Hkv`` value heads, each ``D`` wide (the output of the fused projection; a
view whose row stride exceeds the width is fine, the last dimension must be contiguous). The
caches are ``[num_blocks, block_size, Hkv, D]`` with any strides (e.g. ``kv_cache[0]`` and
``kv_cache[1]`` of one ``[2, num_blocks, block_size, Hkv, D]`` buffer), in qkv's dtype or FP8
(``float8_e4m3fn``: K stored as ``e4m3(k / k_scale)`` from its float32 value, V as
``e4m3(v / v_scale)``, :mod:`pagedkv.kernels.fp8_kv`).

Semantics (:func:`qk_norm_rope_cache_ref` is the plain torch statement of them):
  * per head of q and of k, when norm weights are given (Qwen3; Llama / Qwen2 pass None):
    ``x = x * rsqrt(mean(x**2 over D) + eps) * w``;
  * RoPE, "rotate half" (neox) convention, ``half = D // 2``, ``x1 = x[:half]``,
    ``x2 = x[half:]``: ``out = [x1*c - x2*s, x2*c + x1*s]`` with ``c = cos[t]``, ``s = sin[t]``
    (``[T, D // 2]``, any float dtype) shared by all heads of token ``t``;
  * ``q_out[t]`` (``[T, H, D]``) gets the rotated, normed q for every one of the ``T`` rows;
  * the caches are written only for rows ``t < T_slots = slot_mapping.numel()`` whose slot is
    in ``[0, num_blocks * block_size)``: ``key_cache[slot // bs, slot % bs]`` gets the rotated,
    normed k, ``value_cache[...]`` gets v unchanged. A negative slot (PAD) or one past the
    cache's capacity is skipped (as in :mod:`pagedkv.kernels.reshape_and_cache`); rows
    ``t >= T_slots`` (padding of the token batch) write nothing. Nothing else of the caches is
    touched.

Rounding. All arithmetic is fp32 (inputs, weights, cos and sin are widened when loaded) and the
results are rounded once, when stored. The unfused eager path rounds after the norm and after
the rotation in the model dtype, so bf16 results may differ from it by about one bf16 ulp
(fp32 results agree to fp32 rounding).

Launch: grid ``(T, NQB + 2 * NKB)``. Axis 1 splits a token's heads into blocks of ``BLOCK_H``
heads: programs ``[0, NQB)`` do q head blocks, ``[NQB, NQB + NKB)`` the k blocks (norm, rope,
cache store), the last ``NKB`` the v blocks (cache copy). A program loads the two halves of its
heads as ``[BLOCK_H, HALF_PAD]`` tiles, so the norm sums both tiles and the rotation pairs them
elementwise without a shuffle. ``BLOCK_H`` is the next power of two of ``Hkv``, capped so that a
head block holds at most ``_MAX_TILE`` elements (Qwen3-0.6B: H=16, Hkv=8, D=128 -> 8 heads of
128, 2 + 1 + 1 programs per token, 4 warps each). ``T`` is on axis 0, which has no 65535
limit. ``H``, ``Hkv`` and ``D`` are compile-time constants (one compiled variant per model
shape). Cache offsets are int64 products. Two rows mapped to one slot leave either row's values.

CUDA graphs: the checks read only metadata (shapes, dtypes, strides, devices), the grid depends
only on ``T`` and the model's head counts, and the number of slot rows is not specialized on,
so the launcher runs without host syncs, can be captured, and does not recompile when the batch
size changes. (The reference twin selects the written rows with ``nonzero``, a host sync: it is
the CPU path, not a capturable one.)
"""

from __future__ import annotations

import functools
import numbers

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import (
    INDEX_DTYPES,
    KV_DTYPES,
    cdiv,
    check_int,
    check_same_device,
    check_tensor,
    next_pow2,
    use_triton,
)
from pagedkv.kernels.fp8_kv import (
    FP8_KV_DTYPES,
    check_kv_scale,
    fp8_quantize,
    is_fp8_kv,
    store_value,
)
from pagedkv.kernels.pdl import pdl_launch_args, pdl_prologue

# Most elements (BLOCK_H * next_pow2(D)) of one program's head block.
_MAX_TILE = 2048
# cos / sin may come in any float dtype (widened to fp32 on load).
_ROPE_DTYPES = KV_DTYPES + (torch.float64,)


@triton.jit
def norm_rope(x1, x2, w_ptr, d, eps, HAS_NORM: tl.constexpr, HEAD_DIM: tl.constexpr,
              HALF: tl.constexpr, c, s):
    """The two fp32 halves ``x1, x2`` (``[rows, HALF_PAD]``, one head a row, column ``d``):
    RMS-normalized per row with weight ``w_ptr`` (when ``HAS_NORM``), then rotated by ``c`` and
    ``s`` (broadcast against the halves); returns the two output halves. Shared with the fused
    QKV projection's epilogue (:mod:`pagedkv.kernels.qkv_rope_cache`)."""
    if HAS_NORM:
        dm = d < HALF
        w1 = tl.load(w_ptr + d, mask=dm, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + d, mask=dm, other=0.0).to(tl.float32)
        sum_sq = tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        r = tl.rsqrt(sum_sq / HEAD_DIM + eps)[:, None]
        x1 = x1 * r * w1
        x2 = x2 * r * w2
    o1 = x1 * c - x2 * s
    o2 = x2 * c + x1 * s
    return o1, o2


@triton.jit
def norm_rope_tile(src, w_ptr, d, m, c, s, eps, HAS_NORM: tl.constexpr,
                    HEAD_DIM: tl.constexpr, HALF: tl.constexpr):
    """Load the halves ``[BLOCK_H, HALF_PAD]`` of a block of heads at ``src + d``, then
    :func:`norm_rope`; returns the two fp32 output halves. Shared with the decode kernels'
    fused prologue (``pagedkv.attention.triton_decode``, ``QKPrologue``)."""
    x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
    return norm_rope(x1, x2, w_ptr, d, eps, HAS_NORM, HEAD_DIM, HALF, c, s)


@triton.jit(do_not_specialize=["num_slot_rows"])
def _qk_norm_rope_cache_kernel(
    qkv_ptr, qkv_s0,
    q_ptr, q_s0, q_s1,
    cos_ptr, cos_s0, cos_s1,
    sin_ptr, sin_s0, sin_s1,
    qw_ptr, kw_ptr,
    slot_ptr, num_slot_rows, num_slots, block_size,
    kc_ptr, kc_s0, kc_s1, kc_s2,
    vc_ptr, vc_s0, vc_s1, vc_s2,
    eps,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_NORM: tl.constexpr,
    k_scale=1.0,
    v_scale=1.0,
    FP8: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    NQB: tl.constexpr = (NUM_HEADS + BLOCK_H - 1) // BLOCK_H
    NKB: tl.constexpr = (NUM_KV_HEADS + BLOCK_H - 1) // BLOCK_H
    t = tl.program_id(0)
    p = tl.program_id(1)
    t64 = t.to(tl.int64)
    row = qkv_ptr + t64 * qkv_s0
    hb = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, HALF_PAD)[None, :]
    dm = d < HALF
    if p < NQB:
        # Branch-local names are distinct: Triton merges same-named values across branches.
        hq = p * BLOCK_H + hb
        mq = (hq < NUM_HEADS) & dm
        cq = tl.load(cos_ptr + t64 * cos_s0 + d * cos_s1, mask=dm, other=0.0).to(tl.float32)
        sq = tl.load(sin_ptr + t64 * sin_s0 + d * sin_s1, mask=dm, other=0.0).to(tl.float32)
        q1, q2 = norm_rope_tile(row + hq * HEAD_DIM + d, qw_ptr, d, mq, cq, sq, eps, HAS_NORM,
                                 HEAD_DIM, HALF)
        dst_q = q_ptr + t64 * q_s0 + hq.to(tl.int64) * q_s1 + d
        tl.store(dst_q, q1.to(q_ptr.dtype.element_ty), mask=mq)
        tl.store(dst_q + HALF, q2.to(q_ptr.dtype.element_ty), mask=mq)
    else:
        slot = tl.load(slot_ptr + t, mask=t < num_slot_rows, other=-1).to(tl.int64)
        if (slot >= 0) & (slot < num_slots):
            blk = slot // block_size
            off = slot - blk * block_size
            if p < NQB + NKB:
                hk = (p - NQB) * BLOCK_H + hb
                mk = (hk < NUM_KV_HEADS) & dm
                ck = tl.load(cos_ptr + t64 * cos_s0 + d * cos_s1, mask=dm, other=0.0).to(tl.float32)
                sk = tl.load(sin_ptr + t64 * sin_s0 + d * sin_s1, mask=dm, other=0.0).to(tl.float32)
                src_k = row + (NUM_HEADS + hk) * HEAD_DIM + d
                k1, k2 = norm_rope_tile(src_k, kw_ptr, d, mk, ck, sk, eps, HAS_NORM, HEAD_DIM,
                                         HALF)
                dst_k = kc_ptr + blk * kc_s0 + off * kc_s1 + hk.to(tl.int64) * kc_s2 + d
                if FP8:
                    k1 = fp8_quantize(k1, k_scale)
                    k2 = fp8_quantize(k2, k_scale)
                tl.store(dst_k, k1.to(kc_ptr.dtype.element_ty), mask=mk)
                tl.store(dst_k + HALF, k2.to(kc_ptr.dtype.element_ty), mask=mk)
            else:
                hv = (p - NQB - NKB) * BLOCK_H + hb
                e = tl.arange(0, DIM_PAD)[None, :]
                mv = (hv < NUM_KV_HEADS) & (e < HEAD_DIM)
                xv = tl.load(row + (NUM_HEADS + NUM_KV_HEADS + hv) * HEAD_DIM + e, mask=mv)
                dst_v = vc_ptr + blk * vc_s0 + off * vc_s1 + hv.to(tl.int64) * vc_s2 + e
                if FP8:
                    xv = fp8_quantize(xv, v_scale)
                tl.store(dst_v, xv.to(vc_ptr.dtype.element_ty), mask=mv)


def _check(fn, qkv, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, eps, cos,
           sin, slot_mapping, key_cache, value_cache, q_out, k_scale=1.0,
           v_scale=1.0) -> tuple[int, int, int]:
    """Validate every argument from metadata only; returns ``(H, Hkv, D)`` as host ints."""
    heads, kv_heads, dim = check_heads(fn, num_heads, num_kv_heads, head_dim, eps, k_scale,
                                       v_scale)
    check_tensor(fn, "qkv", qkv, dtypes=KV_DTYPES, ndim=2, contiguous_last=True)
    num_tokens, width = qkv.shape
    need = (heads + 2 * kv_heads) * dim
    if width < need:
        raise ConfigError(
            f"{fn}: qkv width {width} is less than (num_heads + 2 * num_kv_heads) * head_dim "
            f"= ({heads} + 2 * {kv_heads}) * {dim} = {need}"
        )
    check_targets(fn, "qkv", qkv, heads, kv_heads, dim, q_norm_weight, k_norm_weight, cos, sin,
                  slot_mapping, key_cache, value_cache, q_out)
    return heads, kv_heads, dim


def check_prologue(fn, qkv, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight,
                   eps, cos, sin, slot_mapping, key_cache, value_cache) -> tuple[int, int, int]:
    """:func:`qk_norm_rope_cache`'s checks of its arguments for a kernel that runs the same
    prologue itself (the decode kernels' ``QKPrologue``); returns ``(H, Hkv, D)``."""
    return _check(fn, qkv, num_heads, num_kv_heads, head_dim, q_norm_weight, k_norm_weight, eps,
                  cos, sin, slot_mapping, key_cache, value_cache, None)


def check_heads(fn, num_heads, num_kv_heads, head_dim, eps, k_scale, v_scale
                ) -> tuple[int, int, int]:
    """The host arguments: head counts, an even head size, ``eps``, the FP8 scales; returns
    ``(H, Hkv, D)``."""
    check_kv_scale(fn, "k_scale", k_scale)
    check_kv_scale(fn, "v_scale", v_scale)
    heads = check_int(fn, "num_heads", num_heads, lo=1)
    kv_heads = check_int(fn, "num_kv_heads", num_kv_heads, lo=1)
    dim = check_int(fn, "head_dim", head_dim, lo=2)
    if dim % 2:
        raise ConfigError(f"{fn}: head_dim must be even (RoPE rotates two halves), got {dim}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ConfigError(f"{fn}: eps must be a non-negative host number, got {eps!r}")
    return heads, kv_heads, dim


def check_targets(fn, src_name, src, heads, kv_heads, dim, q_norm_weight, k_norm_weight, cos,
                  sin, slot_mapping, key_cache, value_cache, q_out) -> None:
    """Everything but the source of the values (``src``, ``[T, ...]``: the qkv rows, or the
    fused projection's input): norm weights, cos / sin, the slot mapping, the caches (``src``'s
    dtype or FP8) and ``q_out``, all on ``src``'s device."""
    num_tokens = src.shape[0]
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ConfigError(
            f"{fn}: give both q_norm_weight and k_norm_weight (Qwen3) or neither (Llama, Qwen2)"
        )
    for name, w in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if w is None:
            continue
        check_tensor(fn, name, w, dtypes=KV_DTYPES, ndim=1, contiguous_last=True)
        if w.shape[0] != dim:
            raise ConfigError(f"{fn}: {name} must have shape [{dim}] (head_dim), got "
                              f"{tuple(w.shape)}")
    for name, cs in (("cos", cos), ("sin", sin)):
        check_tensor(fn, name, cs, dtypes=_ROPE_DTYPES, ndim=2)
        if cs.shape[0] < num_tokens or cs.shape[1] != dim // 2:
            raise ConfigError(
                f"{fn}: {name} must have shape [>= T, head_dim // 2] = [>= {num_tokens}, "
                f"{dim // 2}], got {tuple(cs.shape)}"
            )
    check_tensor(fn, "slot_mapping", slot_mapping, dtypes=INDEX_DTYPES, ndim=1,
                 contiguous_last=True)
    if slot_mapping.shape[0] > num_tokens:
        raise ConfigError(
            f"{fn}: slot_mapping has {slot_mapping.shape[0]} rows, more than {src_name}'s "
            f"{num_tokens} tokens"
        )
    for name, cache in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_tensor(fn, name, cache, dtypes=KV_DTYPES + FP8_KV_DTYPES, ndim=4,
                     contiguous_last=True)
        if cache.dtype != src.dtype and not is_fp8_kv(cache.dtype):
            raise ConfigError(
                f"{fn}: {name} must have the same dtype as {src_name} ({src.dtype}) or be FP8 "
                f"(float8_e4m3fn), got {cache.dtype}"
            )
        if tuple(cache.shape[2:]) != (kv_heads, dim):
            raise ConfigError(
                f"{fn}: {name} [num_blocks, block_size, Hkv, D] = {tuple(cache.shape)} does not "
                f"match num_kv_heads={kv_heads}, head_dim={dim}"
            )
    if value_cache.dtype != key_cache.dtype:
        raise ConfigError(f"{fn}: value_cache ({value_cache.dtype}) must have key_cache's dtype "
                          f"({key_cache.dtype})")
    if tuple(value_cache.shape) != tuple(key_cache.shape):
        raise ConfigError(
            f"{fn}: value_cache {tuple(value_cache.shape)} must have key_cache's shape "
            f"{tuple(key_cache.shape)}"
        )
    if q_out is not None:
        check_tensor(fn, "q_out", q_out, dtypes=KV_DTYPES, ndim=3, contiguous_last=True)
        if tuple(q_out.shape) != (num_tokens, heads, dim):
            raise ConfigError(
                f"{fn}: q_out must have shape [T, H, D] = [{num_tokens}, {heads}, {dim}], got "
                f"{tuple(q_out.shape)}"
            )
    check_same_device(fn, **{src_name: src}, q_norm_weight=q_norm_weight,
                      k_norm_weight=k_norm_weight, cos=cos, sin=sin, slot_mapping=slot_mapping,
                      key_cache=key_cache, value_cache=value_cache, q_out=q_out)


@functools.lru_cache(maxsize=64)
def launch_geometry(num_heads: int, num_kv_heads: int, head_dim: int) -> dict:
    """``BLOCK_H`` (heads per program), the padded tile widths, ``num_warps`` and the number of
    programs per token (``NQB + 2 * NKB``), from host ints only."""
    dim_pad = next_pow2(head_dim)
    block_h = max(1, min(next_pow2(num_kv_heads), _MAX_TILE // dim_pad))
    parts = cdiv(num_heads, block_h) + 2 * cdiv(num_kv_heads, block_h)
    num_warps = max(1, min(8, block_h * dim_pad // 256))
    return {"BLOCK_H": block_h, "HALF_PAD": next_pow2(head_dim // 2), "DIM_PAD": dim_pad,
            "num_warps": num_warps, "parts": parts}


def qk_norm_rope_cache(
    qkv: torch.Tensor,
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
) -> torch.Tensor:
    """Per-head q/k RMSNorm (when weights are given), RoPE of q and k, and the paged write of
    k and v, in one launch. Returns ``q_out`` ``[T, H, D]``.

    Args:
        qkv: ``[T, >= (H + 2*Hkv) * D]``: q heads, k heads, v heads per row (bf16/fp16/fp32).
        num_heads, num_kv_heads, head_dim: ``H``, ``Hkv``, ``D`` (``D`` even).
        q_norm_weight, k_norm_weight: ``[D]`` each, or both None (no q/k norm).
        eps: the norm's epsilon.
        cos, sin: ``[>= T, D // 2]``, any float dtype.
        slot_mapping: int64 / int32 ``[T_slots]``, ``T_slots <= T``; rows past it, negative
            slots and slots ``>= num_blocks * block_size`` write nothing.
        key_cache, value_cache: ``[num_blocks, block_size, Hkv, D]``, qkv's dtype or both FP8
            (``float8_e4m3fn``), any strides.
        q_out: ``[T, H, D]`` destination; allocated (contiguous, qkv's dtype) when None.
        check: validate the arguments (False: the caller validated the same shapes already,
            e.g. the decoder for every layer after the first of a forward).
        k_scale, v_scale: the per-tensor FP8 scales (host floats > 0; FP8 caches only).
    """
    fn = "qk_norm_rope_cache"
    if check:
        heads, kv_heads, dim = _check(fn, qkv, num_heads, num_kv_heads, head_dim, q_norm_weight,
                                      k_norm_weight, eps, cos, sin, slot_mapping, key_cache,
                                      value_cache, q_out, k_scale, v_scale)
    else:
        heads, kv_heads, dim = num_heads, num_kv_heads, head_dim
    num_tokens = qkv.shape[0]
    if q_out is None:
        q_out = torch.empty((num_tokens, heads, dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q_out
    if not use_triton(_qk_norm_rope_cache_kernel, qkv):
        _qk_norm_rope_cache_torch(qkv, heads, kv_heads, dim, q_norm_weight, k_norm_weight, eps,
                                  cos, sin, slot_mapping, key_cache, value_cache, q_out,
                                  k_scale, v_scale)
        return q_out
    geo = launch_geometry(heads, kv_heads, dim)
    n_blocks, block_size = key_cache.shape[:2]
    has_norm = q_norm_weight is not None
    qw, kw = (q_norm_weight, k_norm_weight) if has_norm else (qkv, qkv)
    _qk_norm_rope_cache_kernel[(num_tokens, geo["parts"])](
        qkv, qkv.stride(0),
        q_out, q_out.stride(0), q_out.stride(1),
        cos, *cos.stride(),
        sin, *sin.stride(),
        qw, kw,
        slot_mapping, slot_mapping.shape[0], n_blocks * block_size, block_size,
        key_cache, *key_cache.stride()[:3],
        value_cache, *value_cache.stride()[:3],
        float(eps),
        NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim, HALF_PAD=geo["HALF_PAD"],
        DIM_PAD=geo["DIM_PAD"], BLOCK_H=geo["BLOCK_H"], HAS_NORM=has_norm,
        k_scale=float(k_scale), v_scale=float(v_scale), FP8=is_fp8_kv(key_cache.dtype),
        num_warps=geo["num_warps"], **pdl_launch_args(_qk_norm_rope_cache_kernel, qkv.device),
    )
    return q_out


def qk_norm_rope_cache_ref(
    qkv: torch.Tensor,
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
) -> torch.Tensor:
    """Plain torch twin of :func:`qk_norm_rope_cache` (fp32 math, one cast or FP8
    quantization at the end)."""
    fn = "qk_norm_rope_cache_ref"
    heads, kv_heads, dim = _check(fn, qkv, num_heads, num_kv_heads, head_dim, q_norm_weight,
                                  k_norm_weight, eps, cos, sin, slot_mapping, key_cache,
                                  value_cache, q_out, k_scale, v_scale)
    if q_out is None:
        q_out = torch.empty((qkv.shape[0], heads, dim), dtype=qkv.dtype, device=qkv.device)
    if qkv.shape[0] == 0:
        return q_out
    _qk_norm_rope_cache_torch(qkv, heads, kv_heads, dim, q_norm_weight, k_norm_weight, eps, cos,
                              sin, slot_mapping, key_cache, value_cache, q_out, k_scale, v_scale)
    return q_out


def _norm_rope_torch(x, weight, eps, c, s):
    """fp32 ``x [T, heads, D]``: RMSNorm per head (when ``weight`` is given), then RoPE."""
    if weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.to(torch.float32)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _qk_norm_rope_cache_torch(qkv, heads, kv_heads, dim, q_norm_weight, k_norm_weight, eps, cos,
                              sin, slot_mapping, key_cache, value_cache, q_out, k_scale=1.0,
                              v_scale=1.0):
    num_tokens = qkv.shape[0]
    q_size, kv_size = heads * dim, kv_heads * dim
    x = qkv[:, : q_size + 2 * kv_size]
    q = x[:, :q_size].to(torch.float32).reshape(num_tokens, heads, dim)
    c = cos[:num_tokens].to(torch.float32).unsqueeze(1)
    s = sin[:num_tokens].to(torch.float32).unsqueeze(1)
    q_out.copy_(_norm_rope_torch(q, q_norm_weight, eps, c, s).to(q_out.dtype))

    n_slot_rows = slot_mapping.shape[0]
    if n_slot_rows == 0:
        return
    n_blocks, block_size = key_cache.shape[:2]
    slots = slot_mapping.to(torch.int64)
    tok = torch.nonzero((slots >= 0) & (slots < n_blocks * block_size)).flatten()
    if tok.numel() == 0:
        return
    k = x[tok, q_size:q_size + kv_size].to(torch.float32).reshape(-1, kv_heads, dim)
    v = x[tok, q_size + kv_size:].reshape(-1, kv_heads, dim)
    k = _norm_rope_torch(k, k_norm_weight, eps, c[tok], s[tok])
    slot = slots[tok]
    blk, off = slot // block_size, slot % block_size
    key_cache[blk, off] = store_value(k, k_scale, key_cache.dtype)
    value_cache[blk, off] = store_value(v, v_scale, value_cache.dtype)


__all__ = ["check_prologue", "launch_geometry", "norm_rope", "norm_rope_tile",
           "qk_norm_rope_cache", "qk_norm_rope_cache_ref"]
