"""ChunkedLocalAttentionManager: attention inside fixed chunks of ``attention_chunk_size``.

Once a token starts a new chunk, every block of earlier chunks is released (null).

Pure Python (control plane).
"""

from __future__ import annotations

from typing import Sequence

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.managers.base import SingleTypeKVCacheManager
from pagedkv.core.spec import ChunkedLocalAttentionSpec, KVCacheSpec
from pagedkv.errors import ConfigError


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *args, **kwargs):
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise ConfigError(
                f"ChunkedLocalAttentionManager needs a ChunkedLocalAttentionSpec, got {kv_cache_spec!r}"
            )
        super().__init__(kv_cache_spec, block_pool, *args, **kwargs)
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        """Every token of the chunks before the current one: ``(n // chunk) * chunk``."""
        chunk = self.attention_chunk_size
        return (num_computed_tokens // chunk) * chunk

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
        """``[null] * (start // B)`` for the chunks before ``max_length``'s chunk, then
        left-to-right hits from there until the first miss. EAGLE is not supported."""
        if use_eagle:
            raise ConfigError("chunked local attention does not support EAGLE prefix-cache hits")
        block_size = kv_cache_spec.block_size
        chunk = kv_cache_spec.attention_chunk_size
        start_block = (max_length // chunk) * chunk // block_size
        max_blocks = min(max_length // block_size, len(block_hashes))
        null = block_pool.null_block
        computed = tuple([null] * start_block for _ in kv_cache_group_ids)
        for i in range(start_block, max_blocks):
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                break
            for lst, block in zip(computed, cached):
                lst.append(block)
        return computed
