"""The KV writer: scatter each token's K (and V) into the paged cache at its slot.

``key_cache[slot // bs, slot % bs] = key[t]`` (same for V) for every ``t < T`` with
``T = slot_mapping.numel()``, where ``bs`` is read from the cache's shape. Consequences:
  * a kernel-block view ``[num_blocks * ratio, kernel_block_size, H, D]`` of the same memory
    gives the identical result (dense layouts: ``b*B + off == (b*ratio + off//kbs)*kbs +
    off%kbs``);
  * a compressed MLA cache ``[num_blocks, storage_block_size, 1, D]`` works with the compressed
    slot mapping (slots count states, not tokens).

Rules (DESIGN.md): the token count comes from the slot mapping, never from K/V (which may be
padded longer); ``slot < 0`` (PAD) is skipped, so padded tokens and the null block are never
written. Values are cast to the cache dtype on store (bf16 / fp16 / fp32; round to nearest even
on the GPU); an FP8 cache (``float8_e4m3fn``) stores ``e4m3(x / k_scale)`` for K and
``e4m3(x / v_scale)`` for V (:mod:`pagedkv.kernels.fp8_kv`: nearest even, saturating). All
index * stride products are int64; any tensor strides are accepted.

Deliberate, documented choice: a slot ``>= num_blocks * block_size`` is skipped as well (vLLM
would write out of bounds).
Launch: grid ``(T,)``; each program copies one token's ``H x D`` (and ``H x Dv``) tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import (
    KV_DTYPES,
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

# dtypes a cache may have: the model's, or FP8 (quantized on store)
CACHE_DTYPES = KV_DTYPES + FP8_KV_DTYPES

_MAX_TILE = 2048


@triton.jit
def _copy_token(
    src_ptr,
    src_s0,
    src_s1,
    src_s2,
    dst_ptr,
    dst_s0,
    dst_s1,
    dst_s2,
    dst_s3,
    t,
    blk,
    off,
    num_heads,
    head_dim,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    scale=1.0,
    FP8: tl.constexpr = False,
):
    """Copy token ``t``'s ``num_heads x head_dim`` tile to ``(blk, off)``; ``num_heads == 0``
    copies nothing (the caller passes 0 for a skipped slot). ``FP8``: store the tile
    quantized by ``scale`` (``fp8_quantize``)."""
    d = tl.arange(0, BLOCK_D)[None, :]
    src_tok = src_ptr + t.to(tl.int64) * src_s0
    dst_tok = dst_ptr + blk * dst_s0 + off * dst_s1
    h0 = tl.full([], 0, tl.int32)
    while h0 < num_heads:
        h = h0 + tl.arange(0, BLOCK_H)[:, None]
        m = (h < num_heads) & (d < head_dim)
        hh = h.to(tl.int64)
        dd = d.to(tl.int64)
        x = tl.load(src_tok + hh * src_s1 + dd * src_s2, mask=m)
        if FP8:
            x = fp8_quantize(x, scale)
        tl.store(dst_tok + hh * dst_s2 + dd * dst_s3, x.to(dst_ptr.dtype.element_ty), mask=m)
        h0 += BLOCK_H


@triton.jit
def _reshape_and_cache_kernel(
    slot_ptr,
    k_ptr, k_s0, k_s1, k_s2,
    kc_ptr, kc_s0, kc_s1, kc_s2, kc_s3,
    v_ptr, v_s0, v_s1, v_s2,
    vc_ptr, vc_s0, vc_s1, vc_s2, vc_s3,
    num_slots,
    block_size,
    num_heads,
    head_dim,
    head_dim_v,
    HAS_VALUE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    k_scale=1.0,
    v_scale=1.0,
    FP8: tl.constexpr = False,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = (slot >= 0) & (slot < num_slots)
    safe = tl.where(ok, slot, 0)
    blk = safe // block_size
    off = safe % block_size
    # A skipped slot copies zero heads. The scalar predicate `ok` never enters a block mask:
    # broadcast into one, its data is not boolean in the Triton interpreter, and triton >= 3.9
    # rejects such a mask ("mask has unsupported dtype").
    heads = tl.where(ok, num_heads, 0)
    _copy_token(k_ptr, k_s0, k_s1, k_s2, kc_ptr, kc_s0, kc_s1, kc_s2, kc_s3, t, blk, off,
                heads, head_dim, BLOCK_H, BLOCK_D, k_scale, FP8)
    if HAS_VALUE:
        _copy_token(v_ptr, v_s0, v_s1, v_s2, vc_ptr, vc_s0, vc_s1, vc_s2, vc_s3, t, blk, off,
                    heads, head_dim_v, BLOCK_HV, BLOCK_DV, v_scale, FP8)


def _check(fn, key, value, key_cache, value_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    check_tensor(fn, "slot_mapping", slot_mapping, dtypes=(torch.int64, torch.int32), ndim=1,
                 contiguous_last=True)
    check_tensor(fn, "key", key, dtypes=KV_DTYPES, ndim=3)
    check_tensor(fn, "key_cache", key_cache, dtypes=CACHE_DTYPES, ndim=4)
    check_kv_scale(fn, "k_scale", k_scale)
    check_kv_scale(fn, "v_scale", v_scale)
    num_tokens = slot_mapping.numel()
    n_blocks, block_size, heads, dim = key_cache.shape
    if not (key.shape[0] >= num_tokens):
        raise ConfigError(
            f"{fn}: key has {key.shape[0]} tokens, slot_mapping has {num_tokens}"
        )
    if not (tuple(key.shape[1:]) == (heads, dim)):
        raise ConfigError(
            f"{fn}: key [T, H, D] = {tuple(key.shape)} does not match key_cache "
            f"[num_blocks, block_size, H, D] = {tuple(key_cache.shape)}"
        )
    if value is None:
        if not (value_cache is None):
            raise ConfigError(
                f"{fn}: value is None (MLA latent cache) but value_cache was given"
            )
    else:
        if not (value_cache is not None):
            raise ConfigError(
                f"{fn}: value was given but value_cache is None"
            )
        check_tensor(fn, "value", value, dtypes=KV_DTYPES, ndim=3)
        check_tensor(fn, "value_cache", value_cache, dtypes=CACHE_DTYPES, ndim=4)
        if is_fp8_kv(value_cache.dtype) != is_fp8_kv(key_cache.dtype):
            raise ConfigError(f"{fn}: key_cache ({key_cache.dtype}) and value_cache "
                              f"({value_cache.dtype}) must both be FP8 or neither")
        if not (value.shape[0] >= num_tokens):
            raise ConfigError(
                f"{fn}: value has {value.shape[0]} tokens, slot_mapping has {num_tokens}"
            )
        if not (tuple(value_cache.shape[:3]) == (n_blocks, block_size, heads)):
            raise ConfigError(
                f"{fn}: value_cache {tuple(value_cache.shape)} must share num_blocks, "
                f"block_size and H with key_cache {tuple(key_cache.shape)}"
            )
        if not (tuple(value.shape[1:]) == tuple(value_cache.shape[2:])):
            raise ConfigError(
                f"{fn}: value {tuple(value.shape)} does not match value_cache "
                f"{tuple(value_cache.shape)}"
            )
    check_same_device(fn, key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                      slot_mapping=slot_mapping)


def _tile(heads: int, dim: int) -> tuple[int, int]:
    block_d = next_pow2(dim)
    block_h = max(1, min(next_pow2(heads), _MAX_TILE // block_d))
    return block_h, block_d


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write K (and V) of the ``T = slot_mapping.numel()`` tokens into the paged caches.

    Args:
        key: ``[>= T, H, D]``; value: ``[>= T, H, Dv]`` or None (MLA latent, K only).
        key_cache: ``[num_blocks, block_size, H, D]``; value_cache: ``[num_blocks, block_size,
            H, Dv]`` or None. bf16 / fp16 / fp32, or both FP8 (``float8_e4m3fn``); any
            strides; block_size from the shape.
        slot_mapping: int64 ``[T]``; ``slot < 0`` is skipped.
        k_scale, v_scale: the per-tensor FP8 scales (host floats > 0; used by FP8 caches only).
    """
    fn = "reshape_and_cache"
    _check(fn, key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    num_tokens = slot_mapping.numel()
    if num_tokens == 0:
        return
    if not use_triton(_reshape_and_cache_kernel, key_cache):
        _reshape_and_cache_torch(key, value, key_cache, value_cache, slot_mapping, k_scale,
                                 v_scale)
        return
    n_blocks, block_size, heads, dim = key_cache.shape
    block_h, block_d = _tile(heads, dim)
    has_value = value is not None
    v, vc = (value, value_cache) if has_value else (key, key_cache)
    block_hv, block_dv = _tile(heads, v.shape[2])
    _reshape_and_cache_kernel[(num_tokens,)](
        slot_mapping,
        key, *key.stride(),
        key_cache, *key_cache.stride(),
        v, *v.stride(),
        vc, *vc.stride(),
        n_blocks * block_size, block_size, heads, dim, v.shape[2],
        HAS_VALUE=has_value, BLOCK_H=block_h, BLOCK_D=block_d, BLOCK_HV=block_hv,
        BLOCK_DV=block_dv, k_scale=float(k_scale), v_scale=float(v_scale),
        FP8=is_fp8_kv(key_cache.dtype), num_warps=4,
    )


def reshape_and_cache_ref(
    key: torch.Tensor,
    value: torch.Tensor | None,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor | None,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain torch twin of :func:`reshape_and_cache`."""
    _check("reshape_and_cache_ref", key, value, key_cache, value_cache, slot_mapping, k_scale,
           v_scale)
    if slot_mapping.numel() == 0:
        return
    _reshape_and_cache_torch(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def _reshape_and_cache_torch(key, value, key_cache, value_cache, slot_mapping, k_scale=1.0,
                             v_scale=1.0):
    n_blocks, block_size = key_cache.shape[:2]
    slots = slot_mapping.to(torch.int64)
    tok = torch.nonzero((slots >= 0) & (slots < n_blocks * block_size)).flatten()
    if tok.numel() == 0:
        return
    s = slots[tok]
    blk, off = s // block_size, s % block_size
    key_cache[blk, off] = store_value(key[tok], k_scale, key_cache.dtype)
    if value is not None:
        value_cache[blk, off] = store_value(value[tok], v_scale, value_cache.dtype)
