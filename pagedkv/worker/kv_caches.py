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

When every layer's spec agrees on the tensor geometry (block size, KV heads, head size,
dtype: the families served so far), each slot is one plain tensor of that shape. Groups of
different geometries (an MLA latent cache beside a full-attention group, a sliding-window
group of another head size, as DeepSeek-V4 and the trace's mixed groups have) share raw byte
slots instead: slot ``j`` is ``num_blocks`` pages of ``P_j`` bytes (the largest page of the
layers using it; smaller pages are padded), block-major, and each layer's tensor is a strided
view of it in its own logical layout: ``[2, N, B, H, D]`` with K and V of block ``b`` both
inside page ``b`` (strides ``(B*H*D, P_j, H*D, D, 1)`` in elements), or the MLA
``[N, B, D]`` with block stride ``P_j``. A block id's bytes are thus the same page in every
view, whichever group holds it. The kernels address caches through their strides.

State layers (``MambaSpec``: Mamba / gated-delta mixers, the seeds' ``SlotMappingMode.NONE``
groups) live in the same pool: a state block is one page of the layer's slot, holding the
layer's state tensors one after the other (conv state, then SSM / recurrent state, each at an
offset aligned to its element size); the layer's entry is a tuple of views ``[num_blocks,
*shape]`` with block stride ``P_j``. A state group's block table holds state indices (block
ids) instead of token positions. A model with state layers always uses byte slots.
:class:`KVPool` keeps the byte pages ``[num_blocks, P_j]`` for the runner's block operations
(zeroing new blocks, copying a state checkpoint to the next block).

``kv_block_bytes`` is the bytes one block id takes across all slots (what the engine sizes the
pool by), ``kv_block_dim`` the block dimension of a slot's tensor (1 for ``[2, num_blocks,
...]``, 0 for the MLA layout).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from pagedkv.attention.kv_cache import kv_cache_shape
from pagedkv.attention.mla import mla_kv_cache_shape
from pagedkv.core.spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
)
from pagedkv.errors import ConfigError

_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}


def _layer_specs(kv_cache_config: KVCacheConfig | Sequence[KVCacheGroupSpec]
                 ) -> dict[str, AttentionSpec | MambaSpec]:
    groups = (kv_cache_config.kv_cache_groups if isinstance(kv_cache_config, KVCacheConfig)
              else kv_cache_config)
    out: dict[str, AttentionSpec | MambaSpec] = {}
    for g in groups:
        for name in g.layer_names:
            s = g.layer_spec(name)
            if not isinstance(s, (AttentionSpec, MambaSpec)):
                raise ConfigError(
                    f"layer {name!r}: {type(s).__name__} layers have no tensor layout here "
                    "(attention and Mamba-style state layers do)")
            out[name] = s
    return out


def layer_slots(kv_cache_config: KVCacheConfig) -> dict[str, int]:
    """Layer name -> the tensor slot it uses (its position in its group)."""
    return {name: j for g in kv_cache_config.kv_cache_groups for j, name in enumerate(g.layer_names)}


@dataclass
class KVPool:
    """The KV memory of a runner: ``caches`` per layer (model cache-layer order; an attention
    layer's tensor, or a state layer's tuple of state tensors ``[num_blocks, *shape]``), and
    the tensors a block id addresses, for the runner's block operations (zeroing new blocks,
    copying blocks): ``pages``, ``[num_blocks, page_bytes]`` byte views of block-major slots
    (mixed geometries, state layers), and ``plain``, single-geometry slot tensors whose block
    dimension is ``kv_block_dim``."""

    caches: list
    pages: list[torch.Tensor]
    plain: list[torch.Tensor]

    def zero_blocks(self, block_ids: torch.Tensor) -> None:
        """Zero every byte of the given blocks in every slot."""
        for p in self.pages:
            p.index_fill_(0, block_ids, 0)
        for t in self.plain:
            _bytes_if_fp8(t).index_fill_(kv_block_dim(t), block_ids, 0)

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Block ``dst[i]`` becomes a copy of block ``src[i]`` in every slot (sources are read
        before any destination is written)."""
        for p in self.pages:
            p.index_copy_(0, dst, p.index_select(0, src))
        for t in self.plain:
            d = kv_block_dim(t)
            b = _bytes_if_fp8(t)
            b.index_copy_(d, dst, b.index_select(d, src))

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (each shared tensor counted once)."""
        return (sum(p.numel() for p in self.pages)
                + sum(t.numel() * t.element_size() for t in self.plain))


def allocate_group_kv_caches(
    kv_cache_config: KVCacheConfig,
    layer_names: Sequence[str],
    *,
    device: torch.device | str,
    fill: float | None = 0.0,
) -> list:
    """The KV tensor of each of ``layer_names`` (model layer order), shared across groups by
    slot (see the module docstring); a state layer's entry is the tuple of its state
    tensors. Every layer of the model must be in exactly one group."""
    return allocate_kv_pool(kv_cache_config, layer_names, device=device, fill=fill).caches


def allocate_kv_pool(
    kv_cache_config: KVCacheConfig,
    layer_names: Sequence[str],
    *,
    device: torch.device | str,
    fill: float | None = 0.0,
) -> KVPool:
    """:func:`allocate_group_kv_caches` with the pool's block-addressed tensors."""
    specs = _layer_specs(kv_cache_config)
    missing = [n for n in layer_names if n not in specs]
    extra = sorted(set(specs) - set(layer_names))
    if missing or extra:
        raise ConfigError(f"the KV-cache groups must hold every cache layer once: missing "
                          f"{missing[:3]}, unknown {extra[:3]}")
    if any(isinstance(s, MambaSpec) for s in specs.values()):
        return _allocate_byte_slots(kv_cache_config, specs, layer_names, device, fill)
    shapes = {_slot_layout(s) for s in specs.values()}
    if len(shapes) != 1:
        return _allocate_byte_slots(kv_cache_config, specs, layer_names, device, fill)
    kind, block_size, heads, head_size, v_size, dtype_name = shapes.pop()
    if kind == "kv" and v_size != head_size:
        raise ConfigError("K and V of different sizes need separate K/V tensors (not built yet)")
    dtype = _torch_dtype(dtype_name)
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
    return KVPool([tensors[slots[name]] for name in layer_names], [], tensors)


def _bytes_if_fp8(t: torch.Tensor) -> torch.Tensor:
    """An FP8 slot as its bytes (same shape; zero bytes are 0.0): torch has no index_fill_ /
    index_copy_ for float8 tensors on the CPU; other tensors as they are."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _torch_dtype(name: str) -> torch.dtype:
    dtype = _TORCH_DTYPES.get(name)
    if dtype is None:
        raise ConfigError(f"KV-cache dtype {name!r} has no torch dtype here")
    return dtype


def _typed_view(raw: torch.Tensor, page: int, offset: int, dtype: torch.dtype, shape, what: str
                ) -> torch.Tensor:
    """``[num_blocks, *shape]`` of ``dtype`` at byte ``offset`` of every ``page``-byte page
    of ``raw`` (block stride = the page, inner dimensions contiguous)."""
    es = torch.empty((), dtype=dtype).element_size()
    if page % es or offset % es:
        raise ConfigError(f"{what}: a {page}-byte page (offset {offset}) does not hold whole "
                          f"{dtype} elements")
    n = raw.numel() // page
    inner = [1] * len(shape)
    for i in range(len(shape) - 2, -1, -1):
        inner[i] = inner[i + 1] * shape[i + 1]
    return raw.view(dtype).as_strided((n, *shape), (page // es, *inner), offset // es)


def _allocate_byte_slots(kv_cache_config: KVCacheConfig, specs: dict, layer_names, device,
                         fill) -> KVPool:
    """Mixed geometries or state layers: one raw block-major byte tensor per slot, a strided
    view per layer (see the module docstring)."""
    slots = layer_slots(kv_cache_config)
    n = kv_cache_config.num_blocks
    page: dict[int, int] = {}
    for name, spec in specs.items():
        page[slots[name]] = max(page.get(slots[name], 0), spec.page_size_bytes)
    raws = {j: torch.zeros(n * pb, dtype=torch.uint8, device=device) for j, pb in page.items()}
    views = {}
    for name in layer_names:
        spec, j = specs[name], slots[name]
        if isinstance(spec, MambaSpec):
            views[name] = _state_views(raws[j], page[j], spec, name, fill)
            continue
        kind, block_size, heads, head_size, v_size, dtype_name = _slot_layout(spec)
        dtype = _torch_dtype(dtype_name)
        if kind == "mla":
            if heads != 1:
                raise ConfigError(f"an MLA latent cache has one KV head, the spec has {heads}")
            view = _typed_view(raws[j], page[j], 0, dtype, (block_size, head_size),
                               f"layer {name!r}")
        else:
            if v_size != head_size:
                raise ConfigError("K and V of different sizes need separate K/V tensors "
                                  "(not built yet)")
            es = torch.empty((), dtype=dtype).element_size()
            if page[j] % es:
                raise ConfigError(f"layer {name!r}: a {page[j]}-byte page does not hold whole "
                                  f"{dtype_name} elements")
            pe = page[j] // es
            plane = block_size * heads * head_size
            view = raws[j].view(dtype).as_strided((2, n, block_size, heads, head_size),
                                                  (plane, pe, heads * head_size, head_size, 1))
        if fill not in (None, 0.0):
            view.fill_(fill)
        views[name] = view
    pages = [raws[j].view(n, page[j]) for j in sorted(raws)]
    return KVPool([views[name] for name in layer_names], pages, [])


def _state_views(raw: torch.Tensor, page: int, spec: MambaSpec, name: str, fill
                 ) -> tuple[torch.Tensor, ...]:
    """A state layer's tensors, one per ``spec.shapes`` entry, packed in order inside each
    page (each at an offset aligned to its element size)."""
    out, offset = [], 0
    for shape, dtype_name in zip(spec.shapes, spec.dtypes):
        dtype = _torch_dtype(dtype_name)
        es = torch.empty((), dtype=dtype).element_size()
        offset = -(-offset // es) * es
        view = _typed_view(raw, page, offset, dtype, tuple(shape), f"state layer {name!r}")
        if fill not in (None, 0.0):
            view.fill_(fill)
        out.append(view)
        offset += math.prod(shape) * es
    if offset > page:
        raise ConfigError(f"state layer {name!r}: its states ({offset} bytes with alignment) "
                          f"exceed the {page}-byte page")
    return tuple(out)


def _slot_layout(s: AttentionSpec) -> tuple:
    """``(kind, block dimension length, heads, head size, V size, dtype)`` of a spec's tensor:
    kind "mla" (``[N, storage_block_size, head_size]``, one latent per token) or "kv"
    (``[2, N, block_size, heads, head_size]``)."""
    if isinstance(s, (MLAAttentionSpec, SlidingWindowMLASpec)):  # one latent per token
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


__all__ = ["KVPool", "allocate_group_kv_caches", "allocate_kv_pool", "kv_block_bytes", "kv_block_dim", "kv_slot_count",
           "layer_slots"]
