"""KV-cache blocks, the free-block queue and the block pool (vLLM 0.33.0 semantics).

* ``KVCacheBlock``: one physical block id with a reference count, an optional prefix-cache
  key and intrusive free-list links.
* ``FreeKVCacheBlockQueue``: a doubly linked list with two sentinels; every operation is
  O(1) per block. Allocation pops from the head. Freed blocks without a hash are prepended
  (LIFO reuse), hashed ones appended (LRU eviction).
* ``BlockHashToBlockMap``: prefix-cache map ``BlockHashWithGroupId -> block`` without dedup
  (several blocks may carry one key).
* ``BlockPool``: owns all of the above. Block 0 is the null block: popped at construction,
  never freed, cached or ref-counted.

Pure Python (control plane).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable, Sequence

from pagedkv.core.hashing import resolve_block_hashes
from pagedkv.errors import BlockStateError, ConfigError, InvariantError, NoFreeBlocksError

if TYPE_CHECKING:
    from pagedkv.core.request import Request


class KVCacheBlock:
    """One physical KV-cache block.

    ``_block_hash`` is the prefix-cache key (``BlockHashWithGroupId``) or None;
    ``_block_hash_num_tokens`` is the prefix length that key covers.
    """

    __slots__ = (
        "block_id",
        "ref_cnt",
        "_block_hash",
        "_block_hash_num_tokens",
        "prev_free_block",
        "next_free_block",
        "is_null",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self._block_hash: bytes | None = None
        self._block_hash_num_tokens = 0
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    @property
    def block_hash(self) -> bytes | None:
        return self._block_hash

    @property
    def block_hash_num_tokens(self) -> int:
        return self._block_hash_num_tokens

    def set_block_hash(self, key: bytes, num_tokens: int = 0) -> None:
        if self._block_hash is not None:
            raise BlockStateError(
                f"block {self.block_id} already has a hash; reset_hash() it before re-hashing"
            )
        self._block_hash = key
        self._block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self._block_hash = None
        self._block_hash_num_tokens = 0

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self._block_hash is not None}{', null' if self.is_null else ''})"
        )


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (head = next to allocate / evict).

    Sentinels (``block_id == -1``) sit before the head and after the tail, so a block is in
    the queue exactly when both of its links are set.
    """

    __slots__ = ("num_free_blocks", "fake_head", "fake_tail")

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self.fake_head = KVCacheBlock(-1)
        self.fake_tail = KVCacheBlock(-1)
        prev = self.fake_head
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = prev

    def popleft(self) -> KVCacheBlock:
        block = self.fake_head.next_free_block
        if block is self.fake_tail:
            raise NoFreeBlocksError("No free blocks available")
        nxt = block.next_free_block
        self.fake_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_head
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"asked for {n} blocks but only {self.num_free_blocks} are free"
            )
        out: list[KVCacheBlock] = []
        if n <= 0:
            return out
        append = out.append
        block = self.fake_head.next_free_block
        for _ in range(n):
            append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self.fake_head.next_free_block = block
        block.prev_free_block = self.fake_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise BlockStateError(f"remove() of block {block.block_id}, which is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise BlockStateError(f"block {block.block_id} is already in the free queue")
        last = self.fake_tail.prev_free_block
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the tail, keeping their order."""
        if not blocks:
            return
        last = self.fake_tail.prev_free_block
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise BlockStateError(f"block {block.block_id} is already in the free queue")
            block.prev_free_block = last
            last.next_free_block = block
            last = block
        last.next_free_block = self.fake_tail
        self.fake_tail.prev_free_block = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Put ``blocks`` at the head, keeping their order (``blocks[0]`` becomes the head)."""
        if not blocks:
            return
        first = self.fake_head.next_free_block
        prev = self.fake_head
        for block in blocks:
            if block.prev_free_block is not None or block.next_free_block is not None:
                raise BlockStateError(f"block {block.block_id} is already in the free queue")
            block.prev_free_block = prev
            prev.next_free_block = block
            prev = block
        prev.next_free_block = first
        first.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All free blocks, head to tail (O(n); tests and logs)."""
        out = []
        block = self.fake_head.next_free_block
        tail = self.fake_tail
        while block is not tail:
            out.append(block)
            block = block.next_free_block
        return out


class BlockHashToBlockMap:
    """``BlockHashWithGroupId`` -> one block, or ``{block_id: block}`` when several blocks hold
    the same key (no dedup: block tables are append-only, so ids are never rewritten)."""

    __slots__ = ("_cache",)

    def __init__(self) -> None:
        self._cache: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        v = self._cache.get(key)
        if v is None or type(v) is KVCacheBlock:
            return v
        return next(iter(v.values()))

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        v = self._cache.get(key)
        if v is None:
            self._cache[key] = block
        elif type(v) is KVCacheBlock:
            if v is not block:
                self._cache[key] = {v.block_id: v, block.block_id: block}
        else:
            v[block.block_id] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        """Remove only ``block_id`` under ``key``; the other blocks stay."""
        v = self._cache.pop(key, None)
        if v is None:
            return None
        if type(v) is KVCacheBlock:
            if v.block_id == block_id:
                return v
            self._cache[key] = v
            return None
        block = v.pop(block_id, None)
        if v:
            self._cache[key] = v
        return block

    def __len__(self) -> int:
        return len(self._cache)

    def __contains__(self, key: bytes) -> bool:
        return key in self._cache

    def clear(self) -> None:
        self._cache.clear()


class BlockPool:
    """All ``num_blocks`` blocks of one KV-cache pool, shared by every group.

    Args:
        num_blocks: pool size including the null block 0.
        enable_caching: keep a prefix-cache map (hashed blocks stay reusable after free).
        hash_block_size: tokens per entry of ``request.block_hashes``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True, hash_block_size: int = 16):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ConfigError(f"num_blocks must be an int >= 1 (block 0 is the null block), got {num_blocks!r}")
        if not isinstance(hash_block_size, int) or hash_block_size < 1:
            raise ConfigError(f"hash_block_size must be a positive int, got {hash_block_size!r}")
        self.num_gpu_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True

    # ----- counts ------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of usable (non-null) blocks not in the free queue."""
        total = self.num_gpu_blocks - 1
        if total <= 0:
            return 0.0
        return 1.0 - self.free_block_queue.num_free_blocks / total

    # ----- allocation --------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` blocks from the head of the free queue (evicting their cached
        hashes) and give each ``ref_cnt = 1``."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise NoFreeBlocksError(
                f"cannot get {num_blocks} free blocks from the pool "
                f"({self.free_block_queue.num_free_blocks} free)"
            )
        if num_blocks == 1:
            blocks = [self.free_block_queue.popleft()]
        else:
            blocks = self.free_block_queue.popleft_n(num_blocks)
        caching = self.enable_caching
        for block in blocks:
            if block.ref_cnt != 0:
                raise InvariantError(
                    "free_block_ref_cnt",
                    "a block in the free queue has a non-zero ref count",
                    block_id=block.block_id,
                    ref_cnt=block.ref_cnt,
                )
            if caching and block._block_hash is not None:
                self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        """Drop ``block``'s prefix-cache entry (if any). True if something was evicted."""
        key = block._block_hash
        if key is None:
            return False
        self.cached_block_hash_to_block.pop(key, block.block_id)
        block._block_hash = None
        block._block_hash_num_tokens = 0
        return True

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks (null blocks are skipped). A block with
        ``ref_cnt == 0`` is an eviction candidate and leaves the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction-priority order (first = evicted
        first). Blocks reaching 0 go to the free queue: unhashed ones are prepended (the
        first of them becomes the head), hashed ones appended (LRU).

        Raises ``BlockStateError`` on a double free (``ref_cnt`` already 0) and leaves every
        ref count as it was before the call.
        """
        evict_first: list[KVCacheBlock] = []
        evict_last: list[KVCacheBlock] = []
        caching = self.enable_caching
        done: list[KVCacheBlock] = []
        for block in ordered_blocks:
            if block.is_null:
                continue
            rc = block.ref_cnt
            if rc <= 0:
                for b in done:  # roll back this call's decrements: nothing was queued yet
                    b.ref_cnt += 1
                raise BlockStateError(
                    f"double free of block {block.block_id} (ref_cnt is already {rc})"
                )
            block.ref_cnt = rc - 1
            done.append(block)
            if rc == 1:
                if caching and block._block_hash is not None:
                    evict_last.append(block)
                else:
                    evict_first.append(block)
        queue = self.free_block_queue
        if evict_first:
            queue.prepend_n(evict_first)
        if evict_last:
            queue.append_n(evict_last)

    # ----- prefix cache ------------------------------------------------------------------
    def get_cached_block(
        self, block_hash: bytes, kv_cache_group_ids: Sequence[int]
    ) -> list[KVCacheBlock] | None:
        """One cached block per group for ``block_hash``, or None if any group misses."""
        get = self.cached_block_hash_to_block.get_one_block
        out: list[KVCacheBlock] = []
        for gid in kv_cache_group_ids:
            block = get(block_hash + gid.to_bytes(4, "big"))
            if block is None:
                return None
            out.append(block)
        return out

    def cache_full_blocks(
        self,
        request: "Request",
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Register ``blocks[num_cached_blocks:num_full_blocks]`` in the prefix cache.

        Block ``i`` gets the request's hash of group-block ``i`` (the last fine hash inside it
        when ``block_size`` is a multiple of ``hash_block_size``). Null and masked-out blocks
        are skipped; a block that already carries a key loses the old key first.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        hashes = request.block_hashes
        if block_size != self.hash_block_size:
            hashes = resolve_block_hashes(hashes, self.hash_block_size, block_size)
        if len(hashes) < num_full_blocks:
            raise InvariantError(
                "cache_full_blocks",
                "asked to cache blocks the request has no hash for",
                request_id=request.request_id,
                num_full_blocks=num_full_blocks,
                num_hashes=len(hashes),
            )
        gid = kv_cache_group_id.to_bytes(4, "big")
        cache = self.cached_block_hash_to_block
        entries = cache._cache
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null or (block_mask is not None and not block_mask[i]):
                continue
            key = hashes[i] + gid
            if block._block_hash is not None:
                cache.pop(block._block_hash, block.block_id)
            block._block_hash = key
            block._block_hash_num_tokens = (i + 1) * block_size
            # BlockHashToBlockMap.insert, with one dict lookup for a new key.
            if entries.setdefault(key, block) is not block:
                cache.insert(key, block)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the prefix-cache entries of these blocks; ref counts are unchanged."""
        n = self.num_gpu_blocks
        for block_id in block_ids:
            if not isinstance(block_id, int) or not 0 <= block_id < n:
                raise BlockStateError(f"evict_blocks: no block {block_id!r} in a pool of {n}")
            self._maybe_evict_cached_block(self.blocks[block_id])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Only allowed while no block is in use (returns False)."""
        if self.free_block_queue.num_free_blocks != self.num_gpu_blocks - 1:
            return False
        self.cached_block_hash_to_block.clear()
        for block in self.blocks:
            block._block_hash = None
            block._block_hash_num_tokens = 0
        return True
