"""Per-spec single-type KV-cache managers and the spec -> manager registry.

The lookup walks the spec's MRO, so subclasses (e.g. ``MLAAttentionSpec`` ->
``FullAttentionSpec``) find their manager.
"""

from __future__ import annotations

from pagedkv.core.managers.base import SingleTypeKVCacheManager
from pagedkv.core.managers.chunked_local import ChunkedLocalAttentionManager
from pagedkv.core.managers.full import FullAttentionManager
from pagedkv.core.managers.mamba import MambaManager
from pagedkv.core.managers.sliding_window import SlidingWindowManager
from pagedkv.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    UniformTypeKVCacheSpecs,
)
from pagedkv.errors import ConfigError

SPEC_MANAGER_MAP: dict[type[KVCacheSpec], type[SingleTypeKVCacheManager]] = {
    FullAttentionSpec: FullAttentionManager,
    SlidingWindowSpec: SlidingWindowManager,
    ChunkedLocalAttentionSpec: ChunkedLocalAttentionManager,
    MambaSpec: MambaManager,
}


def scheduler_spec(spec: KVCacheSpec) -> KVCacheSpec:
    """The spec the scheduler manages (a ``UniformTypeKVCacheSpecs`` by its first member)."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        if not spec.specs:
            raise ConfigError("UniformTypeKVCacheSpecs has no member spec")
        return spec.representative()
    return spec


def get_manager_class(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    for cls in type(scheduler_spec(spec)).__mro__:
        manager = SPEC_MANAGER_MAP.get(cls)
        if manager is not None:
            return manager
    raise ConfigError(
        f"no KV-cache manager for spec {type(spec).__name__}; supported: "
        f"{sorted(c.__name__ for c in SPEC_MANAGER_MAP)} and their subclasses"
    )


__all__ = [
    "SPEC_MANAGER_MAP",
    "ChunkedLocalAttentionManager",
    "FullAttentionManager",
    "MambaManager",
    "SingleTypeKVCacheManager",
    "SlidingWindowManager",
    "get_manager_class",
    "scheduler_spec",
]
