"""KV write for the ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per-layer layout.

Delegates to the index layer's writer (``pagedkv.kernels.reshape_and_cache``): the Triton
kernel (``writer="kernel"``; on CUDA, or on CPU under ``TRITON_INTERPRET=1``) or its plain
torch twin (``writer="ref"``). ``"auto"`` picks the kernel for CUDA caches and the torch twin
for CPU caches. Same rules either way: the token count comes from the slot mapping (never from
a padded K/V tensor), ``slot < 0`` is skipped, and so is a slot past the end of the cache.
"""

from __future__ import annotations

import torch

from pagedkv.errors import ConfigError, InvariantError
from pagedkv.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

WRITERS = ("auto", "kernel", "ref")


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    writer: str = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``kv_cache[0/1][slot // B, slot % B] = key/value[t]`` for every ``t < len(slot_mapping)``
    with ``0 <= slot_mapping[t] < num_blocks * B``.

    ``key``/``value``: ``[>= N, num_kv_heads, head_dim]``; ``kv_cache``:
    ``[2, num_blocks, block_size, num_kv_heads, head_dim]``; ``slot_mapping``: int64 ``[N]``.
    An FP8 cache stores ``e4m3(key / k_scale)`` and ``e4m3(value / v_scale)``.
    """
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise InvariantError(
            "kv-cache-shape",
            "KV cache must be [2, num_blocks, block_size, num_kv_heads, head_dim]",
            cache_shape=tuple(kv_cache.shape),
        )
    if writer == "auto":
        fn = reshape_and_cache if kv_cache.is_cuda else reshape_and_cache_ref
    elif writer == "kernel":
        fn = reshape_and_cache
    elif writer == "ref":
        fn = reshape_and_cache_ref
    else:
        raise ConfigError(f"unknown KV writer {writer!r}; use one of {', '.join(WRITERS)}")
    fn(key, value, kv_cache[0], kv_cache[1], slot_mapping, k_scale, v_scale)


__all__ = ["WRITERS", "write_kv"]
