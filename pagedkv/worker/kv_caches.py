"""KV tensors of every layer of every KV-cache group, laid out as vLLM's hybrid allocator does.

One block pool serves all groups: a physical block id belongs to one group at a time (the
scheduler's ``BlockPool`` hands it out), so the groups can share memory. Group ``g`` lists its
layers in order; the ``j``-th layer of every group uses the same tensor, ``slot j``. There are
``max(len(group.layer_names))`` slots, each ``[2, num_blocks, block_size, num_kv_heads,
head_size]`` (K then V), and a block's bytes across all slots are the same for every group
(``page bytes`` equal per layer, as the planner unifies them). A block freed by a
sliding-window layer's group can therefore serve a full-attention group's request at once.

With one group (every layer full attention) this is one tensor per layer, as before.

Multi-head latent attention (every layer an ``MLAAttentionSpec``, DeepSeek-V3): each slot is
``[num_blocks, storage_block_size, head_size]`` as vLLM lays out MLA caches: one latent vector
per token (``num_kv_heads`` 1, no separate V; ``storage_block_size = block_size //
compress_ratio`` states per block), so a block's bytes are the spec's ``page_size_bytes``.

The slots must have one shape: every layer's spec must agree on block size, KV heads, head
size and dtype (true for the families served: full / sliding-window layers of one head
geometry, or MLA layers of one latent width). Other geometries (MLA's latent cache beside a
full group, Mamba states) need per-group views of raw byte slots: ``ConfigError`` for now.

``kv_block_bytes`` is the bytes one block id takes across all slots (what the engine sizes the
pool by), ``kv_block_dim`` the block dimension of a slot's tensor (1 for ``[2, num_blocks,
...]``, 0 for the MLA layout).
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedkv.attention.kv_cache import kv_cache_shape
from pagedkv.attention.mla import mla_kv_cache_shape
from pagedkv.core.spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MLAAttentionSpec,
    UniformTypeKVCacheSpecs,
)
from pagedkv.errors import ConfigError

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _layer_specs(kv_cache_config: KVCacheConfig | Sequence[KVCacheGroupSpec]
                 ) -> dict[str, AttentionSpec]:
    groups = (kv_cache_config.kv_cache_groups if isinstance(kv_cache_config, KVCacheConfig)
              else kv_cache_config)
    out: dict[str, AttentionSpec] = {}
    for g in groups:
        spec = g.kv_cache_spec
        members = dict(spec.specs) if isinstance(spec, UniformTypeKVCacheSpecs) else {}
        for name in g.layer_names:
            s = members.get(name, spec)
            if not isinstance(s, AttentionSpec):
                raise ConfigError(
                    f"layer {name!r}: {type(s).__name__} groups need their own state tensors; the "
                    "runner serves attention groups only so far")
            out[name] = s
    return out


def layer_slots(kv_cache_config: KVCacheConfig) -> dict[str, int]:
    """Layer name -> the tensor slot it uses (its position in its group)."""
    return {name: j for g in kv_cache_config.kv_cache_groups for j, name in enumerate(g.layer_names)}


def allocate_group_kv_caches(
    kv_cache_config: KVCacheConfig,
    layer_names: Sequence[str],
    *,
    device: torch.device | str,
    fill: float | None = 0.0,
) -> list[torch.Tensor]:
    """The KV tensor of each of ``layer_names`` (model layer order), shared across groups by
    slot (see the module docstring). Every layer of the model must be in exactly one group."""
    specs = _layer_specs(kv_cache_config)
    missing = [n for n in layer_names if n not in specs]
    extra = sorted(set(specs) - set(layer_names))
    if missing or extra:
        raise ConfigError(f"the KV-cache groups must hold every attention layer once: missing "
                          f"{missing[:3]}, unknown {extra[:3]}")
    shapes = {_slot_layout(s) for s in specs.values()}
    if len(shapes) != 1:
        raise ConfigError(
            f"KV-cache groups of different page layouts {sorted(shapes, key=str)} need "
            "per-group views of shared byte slots, which the runner does not build yet")
    kind, block_size, heads, head_size, v_size, dtype_name = shapes.pop()
    if kind == "kv" and v_size != head_size:
        raise ConfigError("K and V of different sizes need separate K/V tensors (not built yet)")
    dtype = _TORCH_DTYPES.get(dtype_name)
    if dtype is None:
        raise ConfigError(f"KV-cache dtype {dtype_name!r} has no torch dtype here")
    slots = layer_slots(kv_cache_config)
    if kind == "mla":
        if heads != 1:
            raise ConfigError(f"an MLA latent cache has one KV head, the spec has {heads}")
        shape = mla_kv_cache_shape(kv_cache_config.num_blocks, block_size, head_size)
    else:
        shape = kv_cache_shape(kv_cache_config.num_blocks, block_size, heads, head_size)
    tensors = []
    for _ in range(max(slots.values()) + 1):
        t = torch.empty(shape, dtype=dtype, device=device)
        if fill is not None:
            t.fill_(fill)
        tensors.append(t)
    return [tensors[slots[name]] for name in layer_names]


def _slot_layout(s: AttentionSpec) -> tuple:
    """``(kind, block dimension length, heads, head size, V size, dtype)`` of a spec's tensor:
    kind "mla" (``[N, storage_block_size, head_size]``, one latent per token) or "kv"
    (``[2, N, block_size, heads, head_size]``)."""
    if isinstance(s, MLAAttentionSpec):
        return ("mla", s.storage_block_size, s.num_kv_heads, s.head_size, s.head_size, s.dtype)
    return ("kv", s.block_size, s.num_kv_heads, s.head_size, s.v_size, s.dtype)


def kv_slot_count(kv_cache_config: KVCacheConfig) -> int:
    """How many tensor slots the groups need (the most layers in one group)."""
    return max((len(g.layer_names) for g in kv_cache_config.kv_cache_groups), default=0)


def kv_block_bytes(groups: KVCacheConfig | Sequence[KVCacheGroupSpec]) -> int:
    """Bytes of one block id across the shared tensor slots: per slot the largest page
    (``page_size_bytes``) of the layers using it (equal for the layouts allocated here)."""
    gs = groups.kv_cache_groups if isinstance(groups, KVCacheConfig) else tuple(groups)
    specs = _layer_specs(gs)
    per_slot: dict[int, int] = {}
    for g in gs:
        for j, name in enumerate(g.layer_names):
            per_slot[j] = max(per_slot.get(j, 0), specs[name].page_size_bytes)
    return sum(per_slot.values())


def kv_block_dim(kv_cache: torch.Tensor) -> int:
    """The block dimension of a slot's tensor: 1 for ``[2, num_blocks, block_size, heads,
    head_size]``, 0 for the MLA latent cache ``[num_blocks, block_size, latent_dim]``."""
    return 1 if kv_cache.dim() == 5 else 0


__all__ = ["allocate_group_kv_caches", "kv_block_bytes", "kv_block_dim", "kv_slot_count",
           "layer_slots"]
