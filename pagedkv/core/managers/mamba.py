"""MambaManager: recurrent state (Mamba / linear attention) blocks.

A block holds a state, not per-token KV. Only the state after the last processed token is
needed, so every block before the current one is released (``skipped = n - 1``).

* mode "none" (prefix caching off, ``block_size = max_model_len``): one block for the
  running state plus ``num_speculative_blocks`` scratch blocks.
* mode "align" (prefix caching on): the table holds nulls except the running-state block
  (and the speculative blocks after it); states at block boundaries are cached and can be
  hit. Each call allocates at most one block (1 + speculative blocks on the first one).

Pure Python (control plane).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from pagedkv.core.block_pool import BlockPool, KVCacheBlock
from pagedkv.core.managers.base import NO_BLOCKS, SingleTypeKVCacheManager
from pagedkv.core.spec import KVCacheSpec, MambaCacheMode, MambaSpec, cdiv
from pagedkv.errors import ConfigError, InvariantError

if TYPE_CHECKING:
    from pagedkv.core.request import Request


class MambaManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: KVCacheSpec, block_pool: BlockPool, *args, **kwargs):
        if not isinstance(kv_cache_spec, MambaSpec):
            raise ConfigError(f"MambaManager needs a MambaSpec, got {kv_cache_spec!r}")
        if kv_cache_spec.mamba_cache_mode == MambaCacheMode.ALL:
            raise ConfigError('mamba_cache_mode "all" is not supported; use "none" or "align"')
        super().__init__(kv_cache_spec, block_pool, *args, **kwargs)
        self.align = kv_cache_spec.mamba_cache_mode == MambaCacheMode.ALIGN
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        # Keys cached during the current step: their state is written only after the forward
        # pass, so a request hitting one must wait for the next step.
        self.cached_blocks_this_step: set[bytes] = set()
        # align: index of the block that held the state before the last allocation.
        self.last_state_block_idx: dict[str, int] = {}
        self._allocated_block_reqs: set[str] = set()

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens - 1

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
        """The last cached block whose end is aligned: ``[null] * i + [block]``."""
        block_size = kv_cache_spec.block_size
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in kv_cache_group_ids)
        if not kv_cache_spec.prefix_cacheable:
            return computed
        max_blocks = min(max_length // block_size, len(block_hashes))
        null = block_pool.null_block
        for i in range(max_blocks - 1, -1, -1):
            if block_size != alignment_tokens and ((i + 1) * block_size) % alignment_tokens:
                continue
            cached = block_pool.get_cached_block(block_hashes[i], kv_cache_group_ids)
            if cached is None:
                continue
            for lst, block in zip(computed, cached):
                lst.extend([null] * i)
                lst.append(block)
            break
        return computed

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        # As vLLM: assume every speculative token may be rejected (subtracts the number of
        # speculative *blocks* from the token count, a conservative margin).
        num_computed_tokens = max(0, num_computed_tokens - self.num_speculative_blocks)
        super().remove_skipped_blocks(request_id, num_computed_tokens)
        if not self.align:
            return
        last = self.last_state_block_idx.get(request_id)
        if last is not None and last < cdiv(num_computed_tokens, self.block_size) - 1:
            blocks = self.req_to_blocks[request_id]
            block = blocks[last]
            if not block.is_null:
                self.block_pool.free_blocks((block,))
                blocks[last] = self._null_block

    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
    ) -> int:
        if new_computed_blocks and new_computed_blocks[-1]._block_hash in self.cached_blocks_this_step:
            # The hit state is written by this step's forward pass: force "does not fit".
            return self.block_pool.num_gpu_blocks + 1
        if not self.align:
            return super().get_num_blocks_to_allocate(
                request_id,
                num_tokens + self.block_size * self.num_speculative_blocks,
                new_computed_blocks,
                total_computed_tokens,
                num_tokens_main_model,
                apply_admission_cap,
            )
        # Lookahead (draft) tokens get no state block: the rule uses the main-model count.
        # Deliberate difference: when the request holds more blocks than required (after
        # rejected drafts) the count is 0, where vLLM would return a negative number that
        # lowers the other groups' total.
        required = cdiv(num_tokens_main_model, self.block_size) + self.num_speculative_blocks
        held = self.req_to_blocks.get(request_id)
        n = required - len(new_computed_blocks) - (len(held) if held is not None else 0)
        if n > 0:
            n = 1 if request_id in self._allocated_block_reqs else 1 + self.num_speculative_blocks
        else:
            n = 0
        return n + self._num_evictable(new_computed_blocks)

    def allocate_new_blocks(
        self, request_id: str, num_tokens: int, num_tokens_main_model: int
    ) -> Sequence[KVCacheBlock]:
        if not self.align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model,
            )
        spec_blocks = self.num_speculative_blocks
        req_blocks = self.req_to_blocks.get(request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request_id] = []
        required = cdiv(num_tokens_main_model, self.block_size) + spec_blocks
        prev_len = len(req_blocks)
        if required <= prev_len:
            return NO_BLOCKS
        allocated_before = request_id in self._allocated_block_reqs
        if allocated_before:
            # The running state sits just before the speculative blocks.
            self.last_state_block_idx[request_id] = prev_len - 1 - spec_blocks
        elif prev_len > 0:
            # A prefix hit: its last block holds the hit state.
            self.last_state_block_idx[request_id] = prev_len - 1
        num_skipped = required - spec_blocks - 1
        null = self._null_block
        if prev_len < num_skipped:
            req_blocks.extend([null] * (num_skipped - prev_len))
        if allocated_before:
            # Reuse last step's speculative blocks: move them forward.
            for idx in range(prev_len - spec_blocks, prev_len):
                if idx >= num_skipped:
                    break
                req_blocks.append(req_blocks[idx])
                req_blocks[idx] = null
        n = required - len(req_blocks)
        limit = 1 if allocated_before else 1 + spec_blocks
        if n > limit:
            raise InvariantError(
                "mamba_align_alloc",
                "align mode allocates at most one state block per call",
                request_id=request_id,
                num_new_blocks=n,
            )
        if n > 0:
            new_blocks = self.block_pool.get_new_blocks(n)
            req_blocks.extend(new_blocks)
            if self.record_new_block_ids:
                self.new_block_ids.extend(b.block_id for b in new_blocks)
        self._allocated_block_reqs.add(request_id)
        return req_blocks[prev_len:]

    def cache_blocks(self, request: "Request", num_tokens: int) -> None:
        request_id = request.request_id
        before = self.num_cached_block.get(request_id, 0)
        super().cache_blocks(request, num_tokens)
        after = self.num_cached_block.get(request_id, 0)
        if after > before:
            for block in self.req_to_blocks[request_id][before:after]:
                if not block.is_null and block._block_hash is not None:
                    self.cached_blocks_this_step.add(block._block_hash)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._allocated_block_reqs.discard(request_id)
        self.last_state_block_idx.pop(request_id, None)
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        self.cached_blocks_this_step.clear()
