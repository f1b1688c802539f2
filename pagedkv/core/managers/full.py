"""FullAttentionManager: causal attention over the whole context.

Every token keeps its block until the request is freed (nothing is ever skipped). MLA and
compressed MLA specs are full attention for allocation purposes: a block of B tokens is
one block whatever number of states it stores.

Pure Python (control plane).
"""

from __future__ import annotations

from typing import Sequence

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.managers.base import SingleTypeKVCacheManager
from pagedkv.core.spec import KVCacheSpec, cdiv


class FullAttentionManager(SingleTypeKVCacheManager):
    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Full attention never skips a token: nothing to release."""

    def get_num_common_prefix_blocks(self, running_request_id: str) -> int:
        """vLLM's rule: walk the request's blocks from the first and count those whose
        ``ref_cnt`` equals the number of requests holding blocks in this group (every holder
        shares it; a shared block sits at the same position in every list, its hash being
        chained); the first other block ends the count. Requests that hold blocks but are not
        scheduled this step count as holders, so the result may be lower than what the
        scheduled requests share (never higher)."""
        blocks = self.req_to_blocks.get(running_request_id)
        if not blocks:
            return 0
        holders = len(self.req_to_blocks)
        n = 0
        for block in blocks:
            if block.ref_cnt != holders:
                break
            n += 1
        return n

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
        """Left-to-right scan; the first miss ends the hit (hashes are chained).

        With EAGLE one block is dropped (its hidden states must be recomputed). The hit is
        then rounded down to ``alignment_tokens``.
        """
        block_size = kv_cache_spec.block_size
        max_blocks = min(max_length // block_size, len(block_hashes))
        if len(kv_cache_group_ids) == 1:
            get = block_pool.cached_block_hash_to_block.get_one_block
            gid = kv_cache_group_ids[0].to_bytes(4, "big")
            hits: list[KVCacheBlock] = []
            for i in range(max_blocks):
                block = get(block_hashes[i] + gid)
                if block is None:
                    break
                hits.append(block)
            computed: tuple[list[KVCacheBlock], ...] = (hits,)
        else:
            computed = tuple([] for _ in kv_cache_group_ids)
            for i in range(max_blocks):
                cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
                if cached is None:
                    break
                for lst, block in zip(computed, cached):
                    lst.append(block)
        num_blocks = len(computed[0])
        if use_eagle and num_blocks > 0:
            num_blocks -= 1
        if alignment_tokens != block_size:
            hit_tokens = num_blocks * block_size
            num_blocks = cdiv(hit_tokens // alignment_tokens * alignment_tokens, block_size)
        if num_blocks < len(computed[0]):
            for lst in computed:
                del lst[num_blocks:]
        return computed
