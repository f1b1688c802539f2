"""Per-layer paged KV cache tensors: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``."""

from __future__ import annotations

import torch

from pagedkv.errors import ConfigError


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
    for name, v in (("num_blocks", num_blocks), ("block_size", block_size),
                    ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise ConfigError(f"KV cache {name} must be a positive integer, got {v!r}")
    return (2, num_blocks, block_size, num_kv_heads, head_dim)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    fill: float | None = 0.0,
) -> list[torch.Tensor]:
    """One KV tensor per layer. ``fill=None`` leaves them uninitialized; tests pass ``nan`` to
    poison slots nobody may read."""
    shape = kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
    caches = []
    for _ in range(num_layers):
        t = torch.empty(shape, dtype=dtype, device=device)
        if fill is not None:
            t.fill_(fill)
        caches.append(t)
    return caches


__all__ = ["allocate_kv_caches", "kv_cache_shape"]
