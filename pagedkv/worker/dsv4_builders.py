"""DeepSeek-V4 style index channels as attention-metadata builders.

A DeepSeek-V4 forward reads three KV channels, each a KV-cache group with its own block table
(all drawn from the one block pool, all fed by the same ``SchedulerOutput``):

1. the main compressed MLA cache (``MLAAttentionSpec`` with ``compress_ratio`` C > 1): a block of
   B tokens stores ``S = B // C`` states; only the token closing a group of C tokens writes, to
   ``table[r, c // S] * S + c % S`` with ``c = pos // C`` (reference sec. 17.1):
   :class:`CompressedMLAMetadataBuilder`;
2. the indexer cache (also an ``MLAAttentionSpec`` with the same C): the same compressed slot
   mapping, plus the translation of the indexer's per-token top-k picks (request-local compressed
   indices) into global slots of that cache (sec. 17.2): the same builder, method
   :meth:`CompressedMLAMetadata.topk_to_global`;
3. the sliding-window cache (``SlidingWindowMLASpec``): the ordinary token slot mapping (one slot
   per token) plus, per query token, the list of KV slots of its window (sec. 17.3):
   :class:`SlidingWindowMLAMetadataBuilder`.

Builders keep their outputs in persistent device buffers, grown (outside CUDA-graph capture) when
a step has more tokens than any step before. Their outputs depend on the block table's contents,
so they do not support ``update_block_table`` (every group builds its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.core.spec import AttentionSpec, SlidingWindowSpec
from pagedkv.errors import ConfigError, InvariantError
from pagedkv.kernels.compressed_slot_mapping import compute_compressed_slot_mapping
from pagedkv.kernels.sparse_index import convert_req_index_to_global_index
from pagedkv.kernels.swa_indices import compute_swa_indices
from pagedkv.worker.attn_builders import AttentionMetadataBuilder
from pagedkv.worker.metadata import CommonAttentionMetadata


def _grown(buf: torch.Tensor | None, rows: int, shape_tail: tuple, dtype, device, capturing: bool):
    """``buf`` if it has ``rows`` rows, else a larger replacement (never during capture)."""
    if buf is not None and buf.shape[0] >= rows:
        return buf
    if capturing:
        raise InvariantError(
            "persistent-buffer", "a DSV4 index buffer would have to grow during CUDA-graph capture; "
            "build metadata once at the largest captured size before capturing", rows=rows)
    return torch.empty((max(rows, 1), *shape_tail), dtype=dtype, device=device)


@dataclass
class CompressedMLAMetadata:
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, width] manager blocks of this group
    compressed_slot_mapping: torch.Tensor  # int64 [num_actual_tokens]; -1 = no write
    storage_block_size: int  # states per block (S = B // C)
    compress_ratio: int

    def topk_to_global(self, req_id_per_token: torch.Tensor, topk_indices: torch.Tensor,
                       out: torch.Tensor | None = None, lens: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Request-local compressed indices ``[T, K]`` (``-1`` = none) -> global state slots of
        this cache: ``table[req, idx // S] * S + idx % S``; -1 stays -1, out of range -> -1.
        Returns ``(slots, lens)``: ``lens[t]`` = valid slots of token ``t`` (int32)."""
        num_t = topk_indices.shape[0]
        if out is None:
            out = torch.empty(topk_indices.shape, dtype=torch.int64, device=topk_indices.device)
        if lens is None:
            lens = torch.empty(num_t, dtype=torch.int32, device=topk_indices.device)
        convert_req_index_to_global_index(req_id_per_token, self.block_table, topk_indices,
                                          self.storage_block_size, out, lens)
        return out, lens[:num_t]


class CompressedMLAMetadataBuilder(AttentionMetadataBuilder):
    """Main MLA cache and indexer cache of a DeepSeek-V4 model (``compress_ratio`` > 1)."""

    def __init__(self, kv_cache_spec, layer_names, device, max_num_reqs, max_num_pages_per_req) -> None:
        if not isinstance(kv_cache_spec, AttentionSpec) or kv_cache_spec.compress_ratio < 2:
            raise ConfigError(
                "CompressedMLAMetadataBuilder serves attention specs with compress_ratio >= 2, got "
                f"{kv_cache_spec!r}"
            )
        super().__init__(kv_cache_spec, layer_names, device, max_num_reqs, max_num_pages_per_req)
        self._slots: torch.Tensor | None = None

    def build(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool = False) -> CompressedMLAMetadata:
        spec = self.kv_cache_spec
        n_tok = common.num_actual_tokens
        self._slots = _grown(self._slots, n_tok, (), torch.int64, self.device, for_cudagraph_capture)
        compute_compressed_slot_mapping(
            common.block_table_tensor, common.query_start_loc, common.seq_lens, self._slots,
            common.num_reqs, n_tok, spec.storage_block_size, spec.compress_ratio,
            own_slot_mapping=common.slot_mapping, max_query_len=common.max_query_len or None,
        )
        return CompressedMLAMetadata(
            num_reqs=common.num_reqs,
            num_actual_tokens=n_tok,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table_tensor,
            compressed_slot_mapping=self._slots[:n_tok],
            storage_block_size=spec.storage_block_size,
            compress_ratio=spec.compress_ratio,
        )


@dataclass
class SlidingWindowMLAMetadata:
    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor  # int64 [num_actual_tokens]: each token's own slot
    swa_indices: torch.Tensor  # int32 [num_actual_tokens, window]: KV slots of each window
    swa_lens: torch.Tensor  # int32 [num_actual_tokens]
    window: int


class SlidingWindowMLAMetadataBuilder(AttentionMetadataBuilder):
    """The sliding-window channel: per-token window slot lists (sec. 17.3)."""

    def __init__(self, kv_cache_spec, layer_names, device, max_num_reqs, max_num_pages_per_req) -> None:
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise ConfigError(
                f"SlidingWindowMLAMetadataBuilder needs a sliding-window spec, got {kv_cache_spec!r}"
            )
        super().__init__(kv_cache_spec, layer_names, device, max_num_reqs, max_num_pages_per_req)
        self.window = kv_cache_spec.sliding_window
        self._indices: torch.Tensor | None = None
        self._lens: torch.Tensor | None = None

    def build(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool = False) -> SlidingWindowMLAMetadata:
        n_tok = common.num_actual_tokens
        cap = for_cudagraph_capture
        self._indices = _grown(self._indices, n_tok, (self.window,), torch.int32, self.device, cap)
        self._lens = _grown(self._lens, n_tok, (), torch.int32, self.device, cap)
        compute_swa_indices(
            common.block_table_tensor, common.query_start_loc, common.seq_lens, common.slot_mapping,
            self._indices, self._lens, common.num_reqs, n_tok, self.window,
            self.kv_cache_spec.block_size,
        )
        return SlidingWindowMLAMetadata(
            num_reqs=common.num_reqs,
            num_actual_tokens=n_tok,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            block_table=common.block_table_tensor,
            slot_mapping=common.slot_mapping,
            swa_indices=self._indices[:n_tok],
            swa_lens=self._lens[:n_tok],
            window=self.window,
        )
