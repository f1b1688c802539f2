"""SlidingWindowManager: attention over the last ``sliding_window`` tokens.

Blocks that fall wholly out of the window are released and replaced by the null block, so a
request's list looks like ``[null, null, 7, 8]``. A prefix hit needs only the last
``cdiv(W - 1, B)`` blocks before the hit point, found by a right-to-left scan.

Pure Python (control plane).
"""

from __future__ import annotations

from typing import Sequence

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.managers.base import SingleTypeKVCacheManager
from pagedkv.core.spec import KVCacheSpec, SlidingWindowSpec, cdiv
from pagedkv.errors import ConfigError


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *args, **kwargs):
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise ConfigError(f"SlidingWindowManager needs a SlidingWindowSpec, got {kv_cache_spec!r}")
        super().__init__(kv_cache_spec, block_pool, *args, **kwargs)
        self.sliding_window = kv_cache_spec.sliding_window
        self.extra_retained_tokens = kv_cache_spec.extra_retained_tokens

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Tokens before the window of the next token: ``n - W + 1 - extra_retained``."""
        n = num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens
        return n if n > 0 else 0

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
        """Right-to-left scan for the first run of ``cdiv(W-1, B)`` (+1 with EAGLE) cached
        blocks; the hit is ``[null] * start + run``. Without such a run, the leading run that
        starts at block 0 (possibly empty) is the hit."""
        block_size = kv_cache_spec.block_size
        need = cdiv(kv_cache_spec.sliding_window - 1, block_size) + (1 if use_eagle else 0)
        max_blocks = min(max_length // block_size, len(block_hashes))
        null = block_pool.null_block
        computed = tuple([null] * max_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        for i in range(max_blocks - 1, -1, -1):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                run = 0
                continue
            for lst, block in zip(computed, cached):
                lst[i] = block
            run += 1
            if run >= need:
                for lst in computed:
                    del lst[i + run:]
                found = True
                break
        if not found:
            for lst in computed:
                del lst[run:]
        if use_eagle and computed[0]:
            for lst in computed:
                lst.pop()
        if alignment_tokens != block_size:
            n = len(computed[0])
            while n and (n * block_size) % alignment_tokens:
                n -= 1
            for lst in computed:
                del lst[n:]
        return computed
