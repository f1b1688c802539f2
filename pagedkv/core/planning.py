"""KV-cache planning: per-layer specs -> KV-cache groups, and the block sizes that follow.

* ``get_kv_cache_groups``: layers with the same spec share one group (one block table);
  layers of one attention type with different shapes share one group holding a
  ``UniformTypeKVCacheSpecs``; otherwise (hybrid) specs are bucketed, page sizes unified,
  and each bucket split into groups of ``group_size`` layers.
* ``generate_scheduler_kv_cache_config``: the scheduler's view of a config, where a
  ``UniformTypeKVCacheSpecs`` is replaced by one of its member specs.
* ``resolve_kv_cache_block_sizes``: the scheduler block size and the prefix-cache hash
  block size.
* ``hybrid_state_specs``: a state-space hybrid's specs as served (Mamba mode and block
  size, attention block size raised to hold a state page, state pages padded).

Pure Python (control plane).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from pagedkv.core.spec import (
    AttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    UniformTypeKVCacheSpecs,
    cdiv,
)
from pagedkv.errors import ConfigError

# Fields that only describe the shape of one layer's tensors. Specs that differ only in
# these are "the same type" and can share one block table.
_SHAPE_FIELDS = frozenset({"num_kv_heads", "head_size", "head_size_v", "dtype"})

# A hybrid model whose largest bucket has fewer than this many times the layers of its
# smallest one uses the largest bucket size as the group size (padding the others).
_GROUP_SIZE_PAD_RATIO = 1.5


def _type_key(spec: KVCacheSpec) -> tuple:
    """Everything about a spec except per-layer tensor shapes (class, block size, window,
    chunk size, compression ...). Mamba specs keep their state shapes: states of different
    shapes never share a group."""
    items = tuple(
        (f.name, getattr(spec, f.name))
        for f in dataclasses.fields(spec)
        if f.name not in _SHAPE_FIELDS or not isinstance(spec, AttentionSpec)
    )
    return (type(spec), items)


def _validate_specs(per_layer_specs: Mapping[str, KVCacheSpec]) -> None:
    if not isinstance(per_layer_specs, Mapping):
        raise ConfigError(
            f"per_layer_specs must be a dict of layer name -> KVCacheSpec, "
            f"got {type(per_layer_specs).__name__}"
        )
    for name, spec in per_layer_specs.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"layer names must be non-empty strings, got {name!r}")
        if not isinstance(spec, KVCacheSpec):
            raise ConfigError(
                f"layer {name!r}: expected a KVCacheSpec, got {type(spec).__name__}"
            )
        if isinstance(spec, UniformTypeKVCacheSpecs):
            raise ConfigError(
                f"layer {name!r}: pass each layer's own spec, not a UniformTypeKVCacheSpecs"
            )


def unify_kv_cache_spec_page_size(
    per_layer_specs: Mapping[str, KVCacheSpec],
) -> dict[str, KVCacheSpec]:
    """Give every layer the same page size (bytes per block) by growing the block size of
    layers with smaller pages. Raises ``ConfigError`` when the largest page is not a whole
    multiple of a smaller one, or when a spec's page does not grow with its block size."""
    page_sizes = {name: spec.page_size_bytes for name, spec in per_layer_specs.items()}
    if len(set(page_sizes.values())) <= 1:
        return dict(per_layer_specs)
    max_page = max(page_sizes.values())
    out: dict[str, KVCacheSpec] = {}
    for name, spec in per_layer_specs.items():
        page = page_sizes[name]
        if page == max_page:
            out[name] = spec
            continue
        if max_page % page:
            raise ConfigError(
                f"cannot unify KV page sizes: layer {name!r} has {page} bytes per block, "
                f"which does not divide the largest page ({max_page} bytes); choose head "
                "sizes/dtypes whose page sizes divide each other, or pad the page size"
            )
        new_spec = spec.copy_with_new_block_size(spec.block_size * (max_page // page))
        if new_spec.page_size_bytes != max_page:
            raise ConfigError(
                f"cannot unify KV page sizes: the page of layer {name!r} "
                f"({type(spec).__name__}, {page} bytes) does not scale with its block size; "
                f"pad its page to {max_page} bytes or change the other layers' block size"
            )
        out[name] = new_spec
    return out


def _merge_group_spec(layer_names: Sequence[str], specs: Mapping[str, KVCacheSpec]) -> KVCacheSpec:
    first = specs[layer_names[0]]
    if all(specs[n] == first for n in layer_names):
        return first
    return UniformTypeKVCacheSpecs(
        block_size=first.block_size, specs=tuple((n, specs[n]) for n in layer_names)
    )


# Attention block sizes of hybrid state models are multiples of this (vLLM's kernel alignment).
STATE_HYBRID_BLOCK_ALIGNMENT = 16


def hybrid_state_specs(
    per_layer_specs: Mapping[str, KVCacheSpec],
    *,
    block_size: int,
    max_model_len: int,
    enable_prefix_caching: bool,
    mamba_block_size: int | None = None,
    alignment: int = STATE_HYBRID_BLOCK_ALIGNMENT,
) -> tuple[dict[str, KVCacheSpec], int]:
    """A state-space hybrid's per-layer specs as the engine serves them, and the attention
    block size: ``(specs, attention_block_size)``; specs without a ``MambaSpec`` come back as
    they are (with ``block_size``).

    As vLLM's hybrid allocator lays out Mamba hybrids:

    * mode: prefix caching on -> ``align`` (a state checkpoint per block), off -> ``none``
      (one block holds the request's whole state);
    * the attention block size grows to the smallest multiple of ``alignment`` whose page
      holds the largest state page (``block_size`` when that is already enough), so one block
      id's page serves either kind;
    * each ``MambaSpec`` takes block size ``max_model_len`` (``none``) or the attention block
      size (``align``, unless ``mamba_block_size`` is given), and its page is padded to the
      largest attention page (``page_size_padded``).

    Raises ``ConfigError`` for a model made of state layers only (no attention page to match).
    """
    _validate_specs(per_layer_specs)
    states = {n: s for n, s in per_layer_specs.items() if isinstance(s, MambaSpec)}
    if not states:
        return dict(per_layer_specs), block_size
    attn = {n: s for n, s in per_layer_specs.items() if not isinstance(s, MambaSpec)}
    if not attn:
        raise ConfigError("a model of state layers only has no attention page to size the "
                          "pool's blocks by; pagedkv serves hybrids (state + attention layers)")
    bad = [n for n, s in attn.items() if not isinstance(s, AttentionSpec)]
    if bad:
        raise ConfigError(f"layer {bad[0]!r}: a hybrid state model's other layers must be "
                          f"attention layers, got {type(attn[bad[0]]).__name__}")
    state_page = max(s.state_bytes for s in states.values())
    per_token = min(s.page_size_bytes / s.block_size for s in attn.values())
    need = alignment * cdiv(state_page, int(alignment * per_token)) if per_token else alignment
    attn_block = max(block_size, need)
    resized = {n: s.copy_with_new_block_size(attn_block) for n, s in attn.items()}
    page = max(s.page_size_bytes for s in resized.values())
    mode = MambaCacheMode.ALIGN if enable_prefix_caching else MambaCacheMode.NONE
    if mode == MambaCacheMode.ALIGN:
        sblock = mamba_block_size if mamba_block_size is not None else attn_block
    else:
        sblock = max_model_len
    out: dict[str, KVCacheSpec] = {}
    for name, spec in per_layer_specs.items():
        if isinstance(spec, MambaSpec):
            out[name] = dataclasses.replace(spec, block_size=sblock, mamba_cache_mode=mode,
                                            page_size_padded=page)
        else:
            out[name] = resized[name]
    return out, attn_block


def get_kv_cache_groups(per_layer_specs: Mapping[str, KVCacheSpec]) -> list[KVCacheGroupSpec]:
    """Form KV-cache groups from per-layer specs (layer order = dict order).

    * no layers: no groups (attention-free model);
    * all specs equal: one group;
    * all specs of one type (equal except head counts/sizes/dtype): one group with a
      ``UniformTypeKVCacheSpecs``;
    * hybrid: page sizes are unified, specs bucketed by (unified) spec in first-appearance
      order, and each bucket split into ``cdiv(len, group_size)`` groups, group i of a
      bucket taking ``layers[i::num_groups]``. ``group_size`` is the smallest bucket size,
      or the largest one when max < 1.5 x min (smaller buckets then get fewer layers in a
      group than ``group_size``: the missing ones are padding).
    """
    _validate_specs(per_layer_specs)
    if not per_layer_specs:
        return []
    specs = list(per_layer_specs.values())
    names = list(per_layer_specs)
    first = specs[0]
    if all(s == first for s in specs):
        return [KVCacheGroupSpec(tuple(names), first)]
    key0 = _type_key(first)
    if all(_type_key(s) == key0 for s in specs):
        return [KVCacheGroupSpec(tuple(names), _merge_group_spec(names, per_layer_specs))]

    unified = unify_kv_cache_spec_page_size(per_layer_specs)
    buckets: dict[KVCacheSpec, list[str]] = {}
    for name, spec in unified.items():
        buckets.setdefault(spec, []).append(name)
    sizes = [len(v) for v in buckets.values()]
    lo, hi = min(sizes), max(sizes)
    group_size = hi if hi < _GROUP_SIZE_PAD_RATIO * lo else lo
    groups: list[KVCacheGroupSpec] = []
    for spec, layers in buckets.items():
        num_groups = cdiv(len(layers), group_size)
        for i in range(num_groups):
            groups.append(KVCacheGroupSpec(tuple(layers[i::num_groups]), spec))
    return groups


def generate_scheduler_kv_cache_config(
    kv_cache_config: KVCacheConfig | Sequence[KVCacheConfig],
) -> KVCacheConfig:
    """The scheduler's copy of a KV-cache config: each ``UniformTypeKVCacheSpecs`` group
    spec is replaced by its first member spec. Given one config per worker, they must all
    agree on the pool size and the groups' layers (the first one is used)."""
    if isinstance(kv_cache_config, KVCacheConfig):
        configs = [kv_cache_config]
    else:
        configs = list(kv_cache_config)
        if not configs or not all(isinstance(c, KVCacheConfig) for c in configs):
            raise ConfigError("pass a KVCacheConfig or a non-empty list of KVCacheConfig")
    base = configs[0]
    for other in configs[1:]:
        if other.num_blocks != base.num_blocks or [g.layer_names for g in other.kv_cache_groups] != [
            g.layer_names for g in base.kv_cache_groups
        ]:
            raise ConfigError(
                "workers disagree on the KV-cache config (num_blocks or groups); give every "
                "worker the same pool size and layer grouping"
            )
    groups = tuple(
        KVCacheGroupSpec(g.layer_names, g.kv_cache_spec.representative())
        if isinstance(g.kv_cache_spec, UniformTypeKVCacheSpecs)
        else g
        for g in base.kv_cache_groups
    )
    return dataclasses.replace(base, kv_cache_groups=groups)


def _scaled_block_size(spec: KVCacheSpec, dcp: int) -> int:
    # Decode context parallelism shards token positions of attention KV across ranks.
    return spec.block_size * dcp if isinstance(spec, AttentionSpec) else spec.block_size


def resolve_kv_cache_block_sizes(
    groups: Sequence[KVCacheGroupSpec],
    cache_block_size: int,
    enable_prefix_caching: bool,
    dcp: int = 1,
    prefix_match_unit: int | None = None,
    kv_connector: bool = False,
) -> tuple[int, int]:
    """``(scheduler_block_size, hash_block_size)``.

    * zero or one group: both are ``cache_block_size * dcp``;
    * several groups: the scheduler block size is the lcm of the group block sizes
      (attention groups scaled by ``dcp``); the hash block size is ``prefix_match_unit``
      if given, else the gcd of the prefix-cacheable groups' sizes, and must divide each of
      them. Without prefix caching (and no connector), with a Mamba group not in "align"
      mode, or without any prefix-cacheable group, it falls back to the scheduler size.
    """
    for name, v in (("cache_block_size", cache_block_size), ("dcp", dcp)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{name} must be an int >= 1, got {v!r}")
    if prefix_match_unit is not None and (
        isinstance(prefix_match_unit, bool)
        or not isinstance(prefix_match_unit, int)
        or prefix_match_unit < 1
    ):
        raise ConfigError(f"prefix_match_unit must be an int >= 1 or None, got {prefix_match_unit!r}")
    groups = list(groups)
    if len(groups) <= 1:
        size = cache_block_size * dcp
        return size, size
    sizes = [_scaled_block_size(g.kv_cache_spec, dcp) for g in groups]
    scheduler_block_size = math.lcm(*sizes)
    mamba_not_aligned = any(
        isinstance(g.kv_cache_spec, MambaSpec)
        and g.kv_cache_spec.mamba_cache_mode != MambaCacheMode.ALIGN
        for g in groups
    )
    cacheable = [s for g, s in zip(groups, sizes) if g.kv_cache_spec.prefix_cacheable]
    if not (enable_prefix_caching or kv_connector) or mamba_not_aligned or not cacheable:
        return scheduler_block_size, scheduler_block_size
    hash_block_size = prefix_match_unit if prefix_match_unit is not None else math.gcd(*cacheable)
    bad = [s for s in cacheable if s % hash_block_size]
    if bad:
        raise ConfigError(
            f"prefix-cache hash block size {hash_block_size} must divide every prefix-cacheable "
            f"group's block size, but {bad} are not multiples of it; choose a prefix_match_unit "
            f"that divides {sorted(set(cacheable))}"
        )
    return scheduler_block_size, hash_block_size
