"""KV-cache coordinators: one per KVCacheManager, owning the block pool and one
single-type manager per KV-cache group (group id = position in the config).

* ``KVCacheCoordinatorNoPrefixCache``: prefix caching off; any number of groups; never hits.
* ``UnitaryKVCacheCoordinator``: exactly one group (``hash_block_size == block_size``).
* ``HybridKVCacheCoordinator``: several groups; the prefix hit is the fixed point of the
  per-type hit lengths.

Pure Python (control plane).
"""

from __future__ import annotations

from math import gcd, lcm
from typing import TYPE_CHECKING, Sequence

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.hashing import resolve_block_hashes
from pagedkv.core.managers import (
    FullAttentionManager,
    SingleTypeKVCacheManager,
    get_manager_class,
    scheduler_spec,
)
from pagedkv.core.managers.base import NO_BLOCKS
from pagedkv.core.spec import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaCacheMode,
    MambaSpec,
    SlidingWindowSpec,
    cdiv,
)
from pagedkv.errors import ConfigError

if TYPE_CHECKING:
    from pagedkv.core.request import Request

BlockLists = tuple[Sequence[KVCacheBlock], ...]


def max_admission_blocks_per_request(
    spec: KVCacheSpec, max_in_flight_tokens: int, max_model_len: int
) -> int | None:
    """Most blocks one request can hold at once for block-recycling specs (None = no cap).

    Sliding window: the last ``W - 1 (+ extra retained)`` tokens plus the in-flight tokens,
    +1 because the window may start mid-block. Chunked local: one chunk plus in-flight.
    (Counting ``extra_retained_tokens`` is our addition; it is 0 by default.)
    """
    if isinstance(spec, SlidingWindowSpec):
        n = min(spec.sliding_window - 1 + spec.extra_retained_tokens + max_in_flight_tokens, max_model_len)
        return cdiv(n, spec.block_size) + 1
    if isinstance(spec, ChunkedLocalAttentionSpec):
        n = min(spec.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(n, spec.block_size)
    return None


def resolve_block_sizes(
    kv_cache_config: KVCacheConfig, enable_caching: bool
) -> tuple[int, int]:
    """Default ``(scheduler_block_size, hash_block_size)`` for a config.

    One group: both are the group's block size. Several: the scheduler block size is the
    lcm of the group sizes; the hash block size is the gcd of the prefix-cacheable group
    sizes, falling back to the scheduler block size when caching is off, a Mamba group is
    not in "align" mode, or no group is prefix-cacheable.
    """
    specs = [scheduler_spec(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
    if not specs:
        raise ConfigError("the KV-cache config has no group; add at least one KVCacheGroupSpec")
    sizes = [s.block_size for s in specs]
    if len(specs) == 1:
        return sizes[0], sizes[0]
    sched = lcm(*sizes)
    cacheable = [s.block_size for s in specs if s.prefix_cacheable]
    mamba_not_align = any(
        isinstance(s, MambaSpec) and s.mamba_cache_mode != MambaCacheMode.ALIGN for s in specs
    )
    if not enable_caching or mamba_not_align or not cacheable:
        return sched, sched
    return sched, gcd(*cacheable)


class KVCacheCoordinator:
    """Shared behaviour: one pool, one manager per group, calls fanned out in group order."""

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        enable_caching: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        use_eagle: bool = False,
        max_in_flight_tokens: int | None = None,
        record_new_block_ids: bool = False,
    ) -> None:
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.use_eagle = use_eagle
        if max_in_flight_tokens is None:
            max_in_flight_tokens = max_model_len
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size)
        specs = [scheduler_spec(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
        self.specs = specs
        managers = []
        for gid, spec in enumerate(specs):
            if enable_caching and spec.prefix_cacheable and spec.block_size % hash_block_size:
                raise ConfigError(
                    f"group {gid} block size {spec.block_size} is not a multiple of "
                    f"hash_block_size {hash_block_size}"
                )
            cls = get_manager_class(spec)
            managers.append(
                cls(
                    spec,
                    self.block_pool,
                    gid,
                    enable_caching=enable_caching,
                    hash_block_size=hash_block_size,
                    max_admission_blocks_per_request=max_admission_blocks_per_request(
                        spec, max_in_flight_tokens, max_model_len
                    ),
                    record_new_block_ids=record_new_block_ids,
                )
            )
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(managers)
        self.num_groups = len(managers)
        self._empty_lists: tuple = tuple(NO_BLOCKS for _ in managers)
        # Managers that can release blocks (full attention never does): the hot path skips
        # the others.
        self._skipping_managers = tuple(
            m for m in managers
            if type(m).remove_skipped_blocks is not FullAttentionManager.remove_skipped_blocks
        )

    # ----- sizing and allocation ---------------------------------------------------------
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: BlockLists,
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        total = 0
        for manager, hits in zip(self.single_type_managers, new_computed_blocks):
            total += manager.get_num_blocks_to_allocate(
                request_id, num_tokens, hits, total_computed_tokens, num_tokens_main_model,
                apply_admission_cap,
            )
        return total

    def allocate_new_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: BlockLists,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """Two phases: every group adopts (touches) its hits first, then every group
        allocates blocks for external tokens, so no allocation can evict another group's
        hit blocks."""
        adopted = [
            manager.add_local_computed_blocks(
                request_id, hits, num_local_computed_tokens, num_external_computed_tokens
            )
            for manager, hits in zip(self.single_type_managers, new_computed_blocks)
        ]
        if num_external_computed_tokens > 0:
            for manager, is_new in zip(self.single_type_managers, adopted):
                if is_new:
                    manager.allocate_external_computed_blocks(
                        request_id, num_local_computed_tokens, num_external_computed_tokens
                    )

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> BlockLists:
        """One list of newly allocated blocks per group (``NO_BLOCKS`` where none)."""
        out = None
        for i, manager in enumerate(self.single_type_managers):
            blocks = manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
            if blocks:
                if out is None:
                    out = list(self._empty_lists)
                out[i] = blocks
        return self._empty_lists if out is None else tuple(out)

    def get_num_cacheable_tokens(self, num_tokens: int) -> int:
        return num_tokens

    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        n = self.get_num_cacheable_tokens(num_tokens)
        for manager in self.single_type_managers:
            manager.cache_blocks(request, n)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self._skipping_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def free(self, request_id: str) -> None:
        """Each group frees its own blocks with one ``free_blocks`` call, in group order."""
        for manager in self.single_type_managers:
            manager.free(request_id)

    def get_blocks(self, request_id: str) -> BlockLists:
        """The live per-group block lists of a request (empty for an unknown request)."""
        return tuple(m.req_to_blocks.get(request_id) or NO_BLOCKS for m in self.single_type_managers)

    def take_new_block_ids(self) -> list[int]:
        ids: list[int] = []
        for manager in self.single_type_managers:
            if manager.new_block_ids:
                ids.extend(manager.take_new_block_ids())
        return ids

    def new_step_starts(self) -> None:
        for manager in self.single_type_managers:
            manager.new_step_starts()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per group, in group order: the leading blocks every request holding blocks shares."""
        return [m.get_num_common_prefix_blocks(running_request_id)
                for m in self.single_type_managers]

    def find_longest_cache_hit(
        self, block_hashes: Sequence[bytes], max_cache_hit_length: int
    ) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Per-group hit blocks and the hit length in tokens (base: never a hit)."""
        return tuple([] for _ in range(self.num_groups)), 0


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Prefix caching off: no hits (the base lookup), nothing cached."""

    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        """Nothing is cached without prefix caching."""


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """Exactly one KV-cache group (alignment = its block size)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.num_groups != 1:
            raise ConfigError(f"UnitaryKVCacheCoordinator needs exactly one group, got {self.num_groups}")
        self.manager = self.single_type_managers[0]
        self.spec = self.specs[0]
        self.block_size = self.spec.block_size
        if self.enable_caching and self.hash_block_size != self.block_size:
            raise ConfigError(
                f"with one KV-cache group hash_block_size ({self.hash_block_size}) must equal "
                f"the block size ({self.block_size})"
            )

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        hits = type(self.manager).find_longest_cache_hit(
            block_hashes, max_cache_hit_length, (0,), self.block_pool, self.spec,
            self.use_eagle, self.block_size,
        )
        return hits, len(hits[0]) * self.block_size

    # Single-group fast paths (the decode hot path): no per-group loops.
    def get_num_blocks_to_allocate(
        self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
        num_tokens_main_model, apply_admission_cap=False,
    ) -> int:
        return self.manager.get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[0], total_computed_tokens,
            num_tokens_main_model, apply_admission_cap,
        )

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        new = self.manager.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        return self._empty_lists if not new else (new,)

    def cache_blocks(self, request, num_tokens) -> None:
        self.manager.cache_blocks(request, num_tokens)

    def remove_skipped_blocks(self, request_id, num_computed_tokens) -> None:
        self.manager.remove_skipped_blocks(request_id, num_computed_tokens)


class HybridKVCacheCoordinator(KVCacheCoordinator):
    """Several groups. Groups with identical specs form one *attention group* (one lookup
    for all of them); full attention is looked up first."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        attention_groups: list[tuple[KVCacheSpec, list[int], type[SingleTypeKVCacheManager]]] = []
        for gid, (spec, manager) in enumerate(zip(self.specs, self.single_type_managers)):
            for existing_spec, gids, cls in attention_groups:
                if existing_spec == spec and cls is type(manager):
                    gids.append(gid)
                    break
            else:
                attention_groups.append((spec, [gid], type(manager)))
        # Stable sort: full attention first (its hit is downward closed and cheap to trim).
        attention_groups.sort(key=lambda g: not issubclass(g[2], FullAttentionManager))
        self.attention_groups = attention_groups
        self.alignment_tokens = self.scheduler_block_size
        self._simple_hybrid = len(attention_groups) == 2 and issubclass(
            attention_groups[0][2], FullAttentionManager
        )

    def get_num_cacheable_tokens(self, num_tokens: int) -> int:
        """Hits are multiples of the scheduler block size, so cache only up to one."""
        s = self.scheduler_block_size
        return num_tokens // s * s

    def find_longest_cache_hit(self, block_hashes, max_cache_hit_length):
        """Fixed point: each attention type gets the current candidate length and returns a
        hit no longer than it; if any type shortens it, every type is checked again. Full
        attention is looked up once and afterwards only trimmed. With exactly
        {full, one other type} one pass is enough."""
        hit_length = max_cache_hit_length
        by_group: list[list[KVCacheBlock] | None] = [None] * self.num_groups
        eagle_done: set[int] = set()
        while True:
            curr = hit_length
            for idx, (spec, gids, cls) in enumerate(self.attention_groups):
                block_size = spec.block_size
                if issubclass(cls, FullAttentionManager) and by_group[gids[0]] is not None:
                    curr = curr // block_size * block_size
                    continue
                use_eagle = self.use_eagle and idx not in eagle_done
                max_length = min(curr + block_size, max_cache_hit_length) if use_eagle else curr
                hits = cls.find_longest_cache_hit(
                    resolve_block_hashes(block_hashes, self.hash_block_size, block_size),
                    max_length, gids, self.block_pool, spec, use_eagle, self.alignment_tokens,
                )
                for gid, lst in zip(gids, hits):
                    by_group[gid] = lst
                new_len = len(hits[0]) * block_size
                if use_eagle:
                    eagle_done.add(idx)
                elif new_len < curr:
                    eagle_done.clear()
                curr = new_len
            if curr >= hit_length:
                break
            hit_length = curr
            if self._simple_hybrid:
                break
        for spec, gids, cls in self.attention_groups:
            if issubclass(cls, FullAttentionManager):
                n = hit_length // spec.block_size
                for gid in gids:
                    lst = by_group[gid]
                    if lst is not None:
                        del lst[n:]
        return tuple(lst if lst is not None else [] for lst in by_group), hit_length


def get_kv_cache_coordinator(
    kv_cache_config: KVCacheConfig,
    max_model_len: int,
    enable_caching: bool,
    scheduler_block_size: int,
    hash_block_size: int,
    use_eagle: bool = False,
    max_in_flight_tokens: int | None = None,
    record_new_block_ids: bool = False,
) -> KVCacheCoordinator:
    args = (kv_cache_config, max_model_len, enable_caching, scheduler_block_size, hash_block_size)
    kwargs = dict(
        use_eagle=use_eagle,
        max_in_flight_tokens=max_in_flight_tokens,
        record_new_block_ids=record_new_block_ids,
    )
    if not enable_caching:
        return KVCacheCoordinatorNoPrefixCache(*args, **kwargs)
    if kv_cache_config.num_groups == 1:
        return UnitaryKVCacheCoordinator(*args, **kwargs)
    return HybridKVCacheCoordinator(*args, **kwargs)


__all__ = [
    "HybridKVCacheCoordinator",
    "KVCacheCoordinator",
    "KVCacheCoordinatorNoPrefixCache",
    "UnitaryKVCacheCoordinator",
    "get_kv_cache_coordinator",
    "max_admission_blocks_per_request",
    "resolve_block_sizes",
]
