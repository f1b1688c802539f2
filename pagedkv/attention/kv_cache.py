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


def allocate_layer_caches(specs, num_blocks: int, *, device: str | torch.device = "cpu",
                          fill: float | None = 0.0) -> list:
    """Unshared caches, one per entry of ``specs`` (a model's ``kv_cache_specs`` values, in
    order; harnesses and tests, the engine's runner shares one pool instead): an attention
    spec's KV tensor ``[2, num_blocks, block_size, num_kv_heads, head_size]``, a ``MambaSpec``'s
    tuple of state tensors ``[num_blocks, *shape]``, a latent spec's (``MLAAttentionSpec``,
    ``SlidingWindowMLASpec``) ``[num_blocks, storage_block_size, head_size]``, each in its
    spec's dtype."""
    from pagedkv.attention.mla import allocate_mla_kv_caches
    from pagedkv.core.spec import AttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowMLASpec

    out: list = []
    for spec in specs:
        if isinstance(spec, (MLAAttentionSpec, SlidingWindowMLASpec)):
            out += allocate_mla_kv_caches(1, num_blocks, spec.storage_block_size, spec.head_size,
                                          dtype=getattr(torch, spec.dtype), device=device,
                                          fill=fill)
        elif isinstance(spec, MambaSpec):
            states = tuple(torch.empty(num_blocks, *shape, dtype=getattr(torch, dt), device=device)
                           for shape, dt in zip(spec.shapes, spec.dtypes))
            if fill is not None:
                for t in states:
                    t.fill_(fill)
            out.append(states)
        elif isinstance(spec, AttentionSpec) and not isinstance(spec, MLAAttentionSpec):
            out += allocate_kv_caches(1, num_blocks, spec.block_size, spec.num_kv_heads,
                                      spec.head_size, dtype=getattr(torch, spec.dtype),
                                      device=device, fill=fill)
        else:
            raise ConfigError(f"allocate_layer_caches: no unshared layout for {type(spec).__name__}")
    return out


__all__ = ["allocate_kv_caches", "allocate_layer_caches", "kv_cache_shape"]
