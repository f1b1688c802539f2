"""SingleTypeKVCacheManager: per-group block bookkeeping shared by every attention type.

One manager serves one KV-cache group. It keeps, per request, the position-indexed block
list (entry ``j`` covers tokens ``[j*B, (j+1)*B)``; skipped positions hold the null block)
and how many leading blocks are already registered in the prefix cache. A request is
*running* for a manager once it appears in ``num_cached_block``.

Subclasses define ``get_num_skipped_tokens`` (tokens no future step attends to) and the
classmethod ``find_longest_cache_hit``.

Pure Python (control plane).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.spec import KVCacheSpec, cdiv
from pagedkv.errors import InvariantError

if TYPE_CHECKING:
    from pagedkv.core.request import Request

# Shared empty result: nothing allocated (immutable, so it can be handed out freely).
NO_BLOCKS: tuple = ()


class SingleTypeKVCacheManager:
    """Block bookkeeping for one KV-cache group.

    Args:
        kv_cache_spec: the group's spec (``block_size`` = B tokens per block).
        block_pool: the pool shared by all groups.
        kv_cache_group_id: the group's index (part of the prefix-cache key).
        enable_caching: prefix caching on (hits are touched, full blocks registered).
        hash_block_size: tokens per entry of ``request.block_hashes`` (B must be a multiple).
        max_admission_blocks_per_request: cap on the blocks one request can hold at once
            (sliding window / chunked local only); applied by the full-sequence admission check.
        record_new_block_ids: remember newly allocated ids for the worker to zero.
    """

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        kv_cache_group_id: int,
        enable_caching: bool = True,
        hash_block_size: int | None = None,
        max_admission_blocks_per_request: int | None = None,
        record_new_block_ids: bool = False,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_size = kv_cache_spec.block_size
        self.block_pool = block_pool
        self.kv_cache_group_id = kv_cache_group_id
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size or kv_cache_spec.block_size
        self.prefix_cacheable = kv_cache_spec.prefix_cacheable
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self.record_new_block_ids = record_new_block_ids
        self.new_block_ids: list[int] = []
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block

    # ----- per-type rules ----------------------------------------------------------------
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Leading tokens no future step attends to (their blocks can be released)."""
        return 0

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[bytes],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        use_eagle: bool,
        alignment_tokens: int,
    ) -> tuple[list[KVCacheBlock], ...]:
        """Longest prefix hit of at most ``max_length`` tokens: one block list per group id
        (skipped positions hold the null block). The hit covers ``len(list) * B`` tokens."""
        return tuple([] for _ in kv_cache_group_ids)

    # ----- sizing ------------------------------------------------------------------------
    @staticmethod
    def _num_evictable(blocks: Sequence[KVCacheBlock]) -> int:
        n = 0
        for b in blocks:
            if b.ref_cnt == 0 and not b.is_null:
                n += 1
        return n

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        """Free blocks this request would consume to hold ``num_tokens`` slots: new blocks
        plus evictable prefix hits (touching those takes them out of the free queue)."""
        required = cdiv(num_tokens, self.block_size)
        if apply_admission_cap and self.max_admission_blocks_per_request is not None:
            required = min(required, self.max_admission_blocks_per_request)
        held = self.req_to_blocks.get(request_id)
        num_held = len(held) if held is not None else 0
        if request_id in self.num_cached_block:
            if new_computed_blocks:
                raise InvariantError(
                    "running_request_hit",
                    "a running request cannot adopt new prefix-cache hits",
                    request_id=request_id,
                )
            # After rejected drafts required may be below held; nothing is freed then.
            n = required - num_held
            return n if n > 0 else 0
        skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        local = len(new_computed_blocks) + num_held
        n = required - max(skipped_blocks, local)
        if n < 0:
            n = 0
        skipped_new = skipped_blocks - num_held
        if skipped_new < 0:
            skipped_new = 0
        return n + self._num_evictable(new_computed_blocks[skipped_new:])

    # ----- adoption of prefix hits (two phases, see the coordinator) ---------------------
    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> bool:
        """Phase 1: adopt the prefix-hit blocks of a request seen for the first time.

        Hits inside the skipped region become null blocks; the rest are touched. Returns
        False (and does nothing) for a request that is already running.
        """
        if request_id in self.num_cached_block:
            if new_computed_blocks:
                raise InvariantError(
                    "running_request_hit",
                    "a running request cannot adopt new prefix-cache hits",
                    request_id=request_id,
                )
            return False
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        elif req_blocks:
            raise InvariantError(
                "adopt_hits_once",
                "prefix hits can only be adopted before any block is allocated",
                request_id=request_id,
                num_blocks=len(req_blocks),
            )
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size
        if skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[skipped_blocks:]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        elif new_computed_blocks:
            raise InvariantError(
                "hits_without_caching", "prefix hits passed while prefix caching is off",
                request_id=request_id,
            )
        if skipped_blocks > 0:
            req_blocks.extend([self._null_block] * skipped_blocks)
        req_blocks.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        return True

    def allocate_external_computed_blocks(
        self, request_id: str, num_local_computed_tokens: int, num_external_computed_tokens: int
    ) -> None:
        """Phase 2: fresh blocks for connector-loaded tokens (after every group touched its
        hits, so this cannot evict another group's hit blocks)."""
        if num_external_computed_tokens <= 0:
            return
        req_blocks = self.req_to_blocks.setdefault(request_id, [])
        total = num_local_computed_tokens + num_external_computed_tokens
        n = cdiv(total, self.block_size) - len(req_blocks)
        if n > 0:
            new_blocks = self.block_pool.get_new_blocks(n)
            req_blocks.extend(new_blocks)
            if self.record_new_block_ids:
                self.new_block_ids.extend(b.block_id for b in new_blocks)

    # ----- allocation --------------------------------------------------------------------
    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> Sequence[KVCacheBlock]:
        """Grow the request's list to ``cdiv(num_tokens, B)`` blocks; return only new ones."""
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        n = -(-num_tokens // self.block_size) - len(req_blocks)
        if n <= 0:
            return NO_BLOCKS
        new_blocks = self.block_pool.get_new_blocks(n)
        req_blocks.extend(new_blocks)
        if self.record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new_blocks)
        return new_blocks

    def take_new_block_ids(self) -> list[int]:
        ids = self.new_block_ids
        self.new_block_ids = []
        return ids

    # ----- prefix caching ----------------------------------------------------------------
    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        """Register the request's full blocks covering ``num_tokens`` tokens (only those
        with a hash) in the prefix cache.

        Differs from vLLM deliberately in two bug-only paths: a request holding no blocks
        (unknown or freed) is ignored (vLLM would mark it running), and ``num_full`` is
        clamped to the blocks actually held.
        """
        if not self.prefix_cacheable:
            return
        request_id = request.request_id
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        num_cached = self.num_cached_block.get(request_id, 0)
        hashed_tokens = len(request.block_hashes) * self.hash_block_size
        num_full = (num_tokens if num_tokens < hashed_tokens else hashed_tokens) // self.block_size
        if num_full > len(blocks):
            num_full = len(blocks)
        if num_full <= num_cached:
            return
        self.block_pool.cache_full_blocks(
            request, blocks, num_cached, num_full, self.block_size, self.kv_cache_group_id
        )
        self.num_cached_block[request_id] = num_full

    # ----- release -----------------------------------------------------------------------
    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its blocks (allocation order) without freeing them."""
        self.num_cached_block.pop(request_id, None)
        return self.req_to_blocks.pop(request_id, None) or []

    def free(self, request_id: str) -> None:
        """Release the request's blocks, tail first (leading null blocks dropped)."""
        blocks = self.pop_blocks_for_free(request_id)
        if not blocks:
            return
        null = self._null_block
        start = 0
        n = len(blocks)
        while start < n and blocks[start] is null:
            start += 1
        if start < n:
            self.block_pool.free_blocks(reversed(blocks[start:]) if start else reversed(blocks))

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Replace blocks no future step attends to with the null block and free them.

        Walks from the last skipped block down to the first, stopping at the first null block
        already there (everything before it was released by an earlier call).
        """
        skipped = self.get_num_skipped_tokens(num_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        n = skipped // self.block_size
        if n > len(blocks):
            n = len(blocks)
        null = self._null_block
        if n == 0 or blocks[n - 1] is null:
            return  # the common decode case: already released by an earlier call
        removed: list[KVCacheBlock] = []
        for i in range(n - 1, -1, -1):
            block = blocks[i]
            if block is null:
                break
            removed.append(block)
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def new_step_starts(self) -> None:
        """Hook called once per scheduler step (Mamba clears its same-step cached set)."""

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """Leading blocks of ``running_request_id``'s list that every request holding blocks
        in this group shares (cascade attention's shared prefix). Default 0: a type whose
        leading entries are not shared context (the sliding window's null blocks, chunked
        local attention, state slots) never reports a shared prefix, as vLLM's managers."""
        return 0
