"""KVCacheManager: the scheduler's single entry point to KV-cache blocks (vLLM 0.33.0).

The scheduler asks ``get_computed_blocks`` for a new request's prefix hit (no side effects),
then ``allocate_slots`` for the tokens it schedules (touches hits, allocates blocks,
registers full blocks in the prefix cache), and ``free`` when the request finishes or is
preempted. Block ids go to the worker through ``KVCacheBlocks.get_block_ids()``.

Deliberate differences from vLLM 0.33.0 (all outside the default single-hash-size path that
the conformance vectors cover):
* ``get_computed_blocks`` returns ``(blocks, num_tokens)``; the hybrid "uncached shared prefix"
  boundary (only used by sparse retention intervals) is not computed.
* Errors are typed: ``allocate_slots`` with no new and no external tokens raises
  ``InvalidRequestError``, an exhausted pool ``NoFreeBlocksError`` (both ``ValueError``
  subclasses, as vLLM raises ``ValueError``); a double free raises ``BlockStateError`` and
  leaves every ref count unchanged (vLLM would corrupt the counts).
* ``take_new_block_ids`` reports the new blocks of every group when zeroing is needed (a Mamba
  group, or layers whose KV dtypes differ: a block freed by a bf16 group and taken by an fp8
  group holds bytes that are garbage, possibly NaN, in the new dtype; see
  ``needs_kv_zeroing``), zeroing a superset (harmless), and nothing otherwise.
* Not implemented: sub-block (partial) prefix hits and copy-on-write, the full-attention
  "partial tail" entry when ``B != hash_block_size``, KV-cache events, EAGLE hash lookahead,
  prefill-lookahead cacheable-token trimming, retention-interval masks, DCP/PCP, cross
  attention and circular-buffer groups, Mamba mode "all" (rejected with ``ConfigError``).

Pure Python (control plane).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from pagedkv.core.block_pool import KVCacheBlock
from pagedkv.core.coordinator import get_kv_cache_coordinator, resolve_block_sizes
from pagedkv.core.hashing import get_hash_fn, get_request_block_hasher
from pagedkv.core.managers import FullAttentionManager
from pagedkv.core.prefix_cache_stats import PrefixCacheStats
from pagedkv.core.request import RequestStatus
from pagedkv.core.spec import KVCacheConfig, KVCacheSpec, MambaSpec, UniformTypeKVCacheSpecs
from pagedkv.errors import ConfigError, InvalidRequestError

if TYPE_CHECKING:
    from pagedkv.core.request import BlockHasher, Request

_ADMISSION_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


class KVCacheBlocks:
    """Blocks per KV-cache group (``blocks[g][j]``: group g, j-th block of tokens).

    The interface between scheduler and manager. Null blocks appear as id 0 in block ids.
    """

    __slots__ = ("blocks",)

    def __init__(self, blocks: tuple[Sequence[KVCacheBlock], ...]):
        self.blocks = blocks

    def __add__(self, other: "KVCacheBlocks") -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self, allow_none: bool = False) -> tuple[list[int], ...] | None:
        """``tuple[list[int], ...]`` per group; None if ``allow_none`` and every group is empty."""
        blocks = self.blocks
        if len(blocks) == 1:  # one group (the common case), without the generic loops
            if allow_none and not blocks[0]:
                return None
            return ([b.block_id for b in blocks[0]],)
        if allow_none and not any(blocks):
            return None
        return tuple([b.block_id for b in group] for group in blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of the single group's blocks without a prefix-cache key."""
        if len(self.blocks) != 1:
            raise InvalidRequestError("get_unhashed_block_ids needs exactly one KV-cache group")
        return [b.block_id for b in self.blocks[0] if b.block_hash is None]

    def new_empty(self) -> "KVCacheBlocks":
        return KVCacheBlocks(tuple(() for _ in self.blocks))

    def __repr__(self) -> str:
        return f"KVCacheBlocks({self.get_block_ids()})"


def _layer_specs(spec: KVCacheSpec):
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return [s for _, s in spec.specs]
    return [spec]


def needs_kv_zeroing(kv_cache_config: KVCacheConfig) -> bool:
    """Whether the worker must zero newly allocated blocks (vLLM: Mamba or mixed precision).

    One pool serves every group, so a block can pass from one group to another. A Mamba
    state must start from zeros; and when the groups' layers store KV in different dtypes
    (e.g. a bf16 sliding-window group beside an fp8 one), a block's old bytes reinterpreted
    in the new dtype can be NaN, which masked attention still propagates (0 * NaN).
    """
    dtypes: set[str] = set()
    for g in kv_cache_config.kv_cache_groups:
        for spec in _layer_specs(g.kv_cache_spec):
            if isinstance(spec, MambaSpec):
                return True
            dtypes.add(getattr(spec, "dtype", None))
    return len(dtypes) > 1


class KVCacheManager:
    """Allocates KV-cache blocks for requests over one pool shared by every group.

    Args:
        kv_cache_config: the pool size and the KV-cache groups.
        max_model_len: longest sequence (slots are never allocated beyond it).
        hash_block_size: tokens per prefix-cache hash; default from the groups (one group:
            its block size; several: gcd of the cacheable sizes).
        enable_caching: automatic prefix caching.
        hash_algo: name in ``pagedkv.core.hashing.HASH_FUNCTIONS`` (default ``"sha256"``).
        log_stats: accumulate ``PrefixCacheStats`` (read with ``make_prefix_cache_stats``).
        watermark: fraction of ``num_blocks`` kept free when admitting waiting/preempted
            requests while others are scheduled.
        use_eagle: drop the last hit block (EAGLE needs its hidden states recomputed).
        scheduler_block_size: tokens per scheduler block; default one group's block size or
            the lcm of the group sizes.
        max_in_flight_tokens: scheduled-but-unsettled tokens (for the sliding-window /
            chunked-local admission cap); default ``max_model_len`` (no effective cap).
    """

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        hash_block_size: int | None = None,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        log_stats: bool = True,
        watermark: float = 0.0,
        use_eagle: bool = False,
        scheduler_block_size: int | None = None,
        max_in_flight_tokens: int | None = None,
    ) -> None:
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ConfigError(f"max_model_len must be a positive int, got {max_model_len!r}")
        if not 0.0 <= watermark < 1.0:
            raise ConfigError(f"watermark must be in [0, 1), got {watermark!r}")
        default_sched, default_hash = resolve_block_sizes(kv_cache_config, enable_caching)
        for name, v in (("hash_block_size", hash_block_size), ("scheduler_block_size", scheduler_block_size)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigError(f"{name} must be a positive int, got {v!r}")
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.use_eagle = use_eagle
        self.log_stats = log_stats
        self.block_size = scheduler_block_size or default_sched
        self.hash_block_size = hash_block_size or default_hash
        self.hash_fn = get_hash_fn(hash_algo)
        self.num_kv_cache_groups = kv_cache_config.num_groups
        self.needs_kv_zeroing = needs_kv_zeroing(kv_cache_config)
        self.coordinator = get_kv_cache_coordinator(
            kv_cache_config,
            max_model_len,
            enable_caching,
            self.block_size,
            self.hash_block_size,
            use_eagle=use_eagle,
            max_in_flight_tokens=max_in_flight_tokens,
            record_new_block_ids=self.needs_kv_zeroing,
        )
        self.block_pool = self.coordinator.block_pool
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.prefix_cache_stats: PrefixCacheStats | None = PrefixCacheStats() if log_stats else None
        # Shared immutable "nothing" result (nested tuples).
        self.empty_kv_cache_blocks = KVCacheBlocks(tuple(() for _ in range(self.num_kv_cache_groups)))
        self._block_hasher = (
            get_request_block_hasher(self.hash_block_size, self.hash_fn) if enable_caching else None
        )
        # The one group's manager when allocate_running_slots can take its fast path (a single
        # full-attention group: nothing is ever skipped or released), else None.
        managers = self.coordinator.single_type_managers
        self._fast_manager = (
            managers[0] if len(managers) == 1 and type(managers[0]) is FullAttentionManager else None
        )

    # ----- hashing -----------------------------------------------------------------------
    @property
    def block_hasher(self) -> "BlockHasher | None":
        """The block hasher Requests must be built with (None when caching is off)."""
        return self._block_hasher

    def make_block_hasher(self) -> "BlockHasher | None":
        return self._block_hasher

    # ----- pool state --------------------------------------------------------------------
    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.free_block_queue.num_free_blocks

    def make_prefix_cache_stats(self) -> PrefixCacheStats | None:
        """The stats accumulated since the last call (then reset); None without log_stats."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    # ----- prefix hits -------------------------------------------------------------------
    def get_computed_blocks(
        self, request: "Request", record_stats: bool = True
    ) -> tuple[KVCacheBlocks, int]:
        """The request's prefix-cache hit: (blocks per group, hit length in tokens).

        At most ``num_tokens - 1`` tokens hit (the last one is recomputed for its logits).
        No side effects on blocks (ref counts change only in ``allocate_slots``). With
        ``record_stats`` the lookup is counted in the prefix-cache stats; the scheduler
        passes False and counts the lookup only when it admits the request
        (:meth:`record_prefix_cache_lookup`), which is what vLLM 0.33.0's logs show.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        blocks, num_hit = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        if record_stats:
            self.record_prefix_cache_lookup(request, num_hit)
        return self.create_kv_cache_blocks(blocks), num_hit

    def record_prefix_cache_lookup(self, request: "Request", num_hits: int) -> None:
        """Count one lookup of ``request`` (fresh or resumed after preemption)."""
        stats = self.prefix_cache_stats
        if stats is not None and self.enable_caching and not request.skip_reading_prefix_cache:
            stats.record(request.num_tokens, num_hits, request.num_preemptions > 0)

    # ----- allocation --------------------------------------------------------------------
    def allocate_slots(
        self,
        request: "Request",
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: KVCacheBlocks | None = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        full_sequence_must_fit: bool = False,
        has_scheduled_reqs: bool = True,
        reserved_blocks: int = 0,
    ) -> KVCacheBlocks | None:
        """Give the request slots for ``num_new_tokens`` more tokens (plus lookahead).

        For a new request, ``new_computed_blocks`` / ``num_new_computed_tokens`` are the hit
        from ``get_computed_blocks``. Returns the newly allocated blocks only (hits not
        included), or None when the pool cannot hold them; then nothing was touched or
        allocated (only blocks out of an attention window may have been released).
        """
        if num_new_tokens <= 0 and (num_new_tokens < 0 or num_external_computed_tokens <= 0):
            raise InvalidRequestError(
                f"allocate_slots for {request.request_id!r}: num_new_tokens must be > 0 when "
                f"there are no external computed tokens (got {num_new_tokens})"
            )
        if new_computed_blocks is None:
            hits = self.empty_kv_cache_blocks.blocks
        else:
            hits = new_computed_blocks.blocks
            if len(hits) != self.num_kv_cache_groups:
                raise InvalidRequestError(
                    f"new_computed_blocks has {len(hits)} groups, the manager has "
                    f"{self.num_kv_cache_groups}"
                )
        coordinator = self.coordinator
        free = self.block_pool.free_block_queue
        request_id = request.request_id
        max_model_len = self.max_model_len
        local = request.num_computed_tokens + num_new_computed_tokens
        total = local + num_external_computed_tokens
        if total > max_model_len:
            total = max_model_len
        watermark = 0
        if self.watermark_blocks and has_scheduled_reqs and request.status in _ADMISSION_STATUSES:
            watermark = self.watermark_blocks

        if full_sequence_must_fit:
            full = request.num_tokens
            if full > max_model_len:
                full = max_model_len
            n = coordinator.get_num_blocks_to_allocate(request_id, full, hits, total, full, True)
            if n + watermark > free.num_free_blocks:
                return None

        tokens_main = total + num_new_tokens
        need_slot = tokens_main + num_lookahead_tokens
        if need_slot > max_model_len:
            need_slot = max_model_len

        # Release out-of-window blocks on the basis of *processed* tokens, even if this
        # allocation then fails.
        processed = total - request.num_in_flight_tokens
        coordinator.remove_skipped_blocks(request_id, processed if processed > 0 else 0)

        n = coordinator.get_num_blocks_to_allocate(
            request_id, need_slot, hits, local + num_external_computed_tokens, tokens_main
        )
        if n + watermark > free.num_free_blocks - reserved_blocks:
            return None

        if num_external_computed_tokens > 0 or any(hits):
            coordinator.allocate_new_computed_blocks(
                request_id, hits, local, num_external_computed_tokens
            )
        new_blocks = coordinator.allocate_new_blocks(request_id, need_slot, tokens_main)

        if self.enable_caching and not delay_cache_blocks:
            # Blocks are registered at scheduling time; draft tokens are never cached.
            num_cache = total + num_new_tokens
            if num_cache > request.num_tokens:
                num_cache = request.num_tokens
            coordinator.cache_blocks(request, num_cache)
        if new_blocks is coordinator._empty_lists or not any(new_blocks):
            return self.empty_kv_cache_blocks
        return KVCacheBlocks(new_blocks)

    def allocate_running_slots(
        self, request: "Request", num_new_tokens: int, num_lookahead_tokens: int = 0
    ) -> KVCacheBlocks | None:
        """``allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)`` for a request
        that adopts no prefix hits (the scheduler's running requests); same result, same effects.

        Fast path (one full-attention group: the decode hot path, every running request every
        step): nothing is ever skipped or released, so allocate_slots reduces to "grow the
        block list to cover the new tokens (None if the pool cannot), then register the held
        blocks that became full". This does exactly that with the group's manager directly,
        without the general per-group machinery. Anything else goes through ``allocate_slots``.
        """
        manager = self._fast_manager
        if manager is not None and num_new_tokens > 0:
            rid = request.request_id
            held = manager.req_to_blocks.get(rid)
            computed = request.num_computed_tokens
            max_model_len = self.max_model_len
            if (
                held is not None
                and computed <= max_model_len
                and (not self.watermark_blocks or request.status not in _ADMISSION_STATUSES)
            ):
                end = computed + num_new_tokens
                block_size = manager.block_size
                need = end + num_lookahead_tokens
                new_blocks = self.empty_kv_cache_blocks
                if need > len(held) * block_size:
                    if need > max_model_len:
                        need = max_model_len
                    num_blocks = -(-need // block_size) - len(held)
                    if num_blocks > 0:
                        if num_blocks > self.block_pool.free_block_queue.num_free_blocks:
                            return None
                        new_blocks = KVCacheBlocks((manager.allocate_new_blocks(rid, need, end),))
                if self.enable_caching:
                    # cache_blocks(request, min(end, num_tokens)) registers the held blocks
                    # that are full and hashed beyond the cached ones; end // block_size
                    # bounds them, so most steps stop at this comparison.
                    num_cached = manager.num_cached_block.get(rid, 0)
                    if end // block_size > num_cached:
                        num_cache = len(request._all_token_ids)
                        if end < num_cache:
                            num_cache = end
                        hashed = len(request.block_hashes) * manager.hash_block_size
                        if (num_cache if num_cache < hashed else hashed) // block_size > num_cached:
                            manager.cache_blocks(request, num_cache)
                return new_blocks
        return self.allocate_slots(
            request, num_new_tokens, num_lookahead_tokens=num_lookahead_tokens
        )

    def free(self, request: "Request") -> None:
        """Release the request's blocks (each group tail first). Unknown requests: no-op."""
        self.coordinator.free(request.request_id)

    def cache_blocks(self, request: "Request", num_computed_tokens: int) -> None:
        """Register the request's full blocks up to ``num_computed_tokens`` (async/spec)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        self.coordinator.remove_skipped_blocks(request_id, num_computed_tokens)

    def evict_blocks(self, block_ids) -> None:
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes; False (nothing done) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    # ----- views -------------------------------------------------------------------------
    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        """The request's full per-group tables (nulls included; empty if unknown)."""
        return self.create_kv_cache_blocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def take_new_block_ids(self) -> list[int]:
        """Ids allocated since the last call, for the worker to zero (only when
        ``needs_kv_zeroing``: a Mamba group or mixed KV dtypes; else always empty)."""
        return self.coordinator.take_new_block_ids()

    def new_step_starts(self) -> None:
        """Call once at the start of every scheduler step."""
        self.coordinator.new_step_starts()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Per KV-cache group, the number of leading blocks that every request holding blocks
        shares (walked along ``running_request_id``'s list: a block counts while its
        ``ref_cnt`` equals the number of holders; vLLM's rule, for cascade attention). Only
        full-attention groups report shared blocks; the other types report 0. Requests that
        hold blocks but are not scheduled count as holders, so the count can be 0 although
        every scheduled request shares a prefix (vLLM documents the same edge case)."""
        return self.coordinator.get_num_common_prefix_blocks(running_request_id)
