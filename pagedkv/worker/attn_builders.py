"""Attention metadata builders: CommonAttentionMetadata -> what one backend's kernels read.

Three page-index formats (design doc, "page index"):

* :class:`FlashAttentionMetadataBuilder`: the block table itself plus its strides. The table
  handed in is a view of the shared multi-group buffer, so its row stride is the buffer's
  total width, not the group's width; kernels must use ``block_table_stride``.
* :class:`FlashInferMetadataBuilder`: paged-KV CSR (``indptr``, ``indices``,
  ``last_page_len``) built on the device by ``build_page_indices`` into persistent buffers
  (reference sec. 15); a padded request (``seq_len = 0``) has 0 pages and ``last_page_len 0``.
* :class:`MambaMetadataBuilder`: per-request state indices from the block table (sec. 14):
  mode ``none``/``all`` -> the table as is; ``align`` -> ``table[r, start : start+1+spec]`` with
  ``start = max((seq_len - 1) // B, 0)``.

Deliberate differences: Mamba "align" columns are clamped to the table width (vLLM's gather
would fail out of range); FlashInfer does not support ``update_block_table`` (its CSR depends on
the table's contents), so each group builds its own CSR into its own persistent buffers.

A builder receives the spec with the *kernel* block size (see
:class:`pagedkv.worker.metadata.AttentionGroup`). Builders whose metadata depends on the block
table only through the table and the slot mapping set ``supports_update_block_table`` and
implement ``update_block_table(prev, block_table, slot_mapping)``, which the per-group loop uses
to reuse metadata across groups with the same spec.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import numpy as np
import torch

from pagedkv.core.spec import KVCacheSpec, MambaCacheMode, MambaSpec
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import PAD_SLOT_ID
from pagedkv.kernels.page_indices import build_page_indices
from pagedkv.worker.metadata import CommonAttentionMetadata


class AttentionMetadataBuilder:
    """Base builder. One instance per attention group (it may own persistent buffers)."""

    supports_update_block_table: ClassVar[bool] = False
    # Rows with at most this many scheduled tokens count as decodes (None: no reordering).
    reorder_batch_threshold: ClassVar[int | None] = None

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        layer_names: Sequence[str],
        device: torch.device | str,
        max_num_reqs: int,
        max_num_pages_per_req: int,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.layer_names = tuple(layer_names)
        self.device = torch.device(device)
        self.max_num_reqs = max_num_reqs
        self.max_num_pages_per_req = max_num_pages_per_req

    def build(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool = False) -> Any:
        raise ConfigError(f"{type(self).__name__} does not implement build(); subclass it")

    def update_block_table(self, metadata: Any, block_table: torch.Tensor, slot_mapping: torch.Tensor) -> Any:
        raise ConfigError(
            f"{type(self).__name__} cannot reuse metadata across groups "
            "(supports_update_block_table is False)"
        )


class CommonMetadataBuilder(AttentionMetadataBuilder):
    """The group's metadata is the step's :class:`CommonAttentionMetadata` with the group's
    block table and slot mapping (``build_attention_metadata`` swaps them in): what the
    Triton and torch-reference backends read."""

    supports_update_block_table = True

    def build(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool = False) -> CommonAttentionMetadata:
        return common

    def update_block_table(self, metadata: CommonAttentionMetadata, block_table: torch.Tensor,
                           slot_mapping: torch.Tensor) -> CommonAttentionMetadata:
        return dataclasses.replace(metadata, block_table_tensor=block_table, slot_mapping=slot_mapping)


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor  # [num_reqs, width] int32, strided view
    block_table_stride: tuple[int, int]  # (row, column) strides in elements
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    page_size: int  # kernel block size
    causal: bool = True


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    supports_update_block_table = True

    def build(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool = False) -> FlashAttentionMetadata:
        bt = common.block_table_tensor
        return FlashAttentionMetadata(
            num_actual_tokens=common.num_actual_tokens,
            max_query_len=common.max_query_len,
            query_start_loc=common.query_start_loc,
            max_seq_len=common.max_seq_len,
            seq_lens=common.seq_lens,
            block_table=bt,
            block_table_stride=(bt.stride(0), bt.stride(1)),
            slot_mapping=common.slot_mapping,
            page_size=self.kv_cache_spec.block_size,
            causal=common.causal,
        )

    def update_block_table(self, metadata: FlashAttentionMetadata, block_table: torch.Tensor, slot_mapping: torch.Tensor) -> FlashAttentionMetadata:
        """Shallow copy with the block table and slot mapping replaced."""
        return dataclasses.replace(
            metadata,
            block_table=block_table,
            block_table_stride=(block_table.stride(0), block_table.stride(1)),
            slot_mapping=slot_mapping,
        )


@dataclass
class FlashInferMetadata:
    num_actual_tokens: int
    num_reqs: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    paged_kv_indptr: torch.Tensor  # [num_reqs + 1] int32
    paged_kv_indices: torch.Tensor  # [max pages] int32; valid prefix indptr[num_reqs]
    paged_kv_last_page_len: torch.Tensor  # [num_reqs] int32
    slot_mapping: torch.Tensor
    page_size: int
    max_query_len: int
    max_seq_len: int


class FlashInferMetadataBuilder(AttentionMetadataBuilder):
    """CSR over the (kernel) block table. ``seq_len`` is the DCP-local length under DCP."""

    reorder_batch_threshold = 1

    def __init__(self, kv_cache_spec, layer_names, device, max_num_reqs, max_num_pages_per_req) -> None:
        super().__init__(kv_cache_spec, layer_names, device, max_num_reqs, max_num_pages_per_req)
        dev = self.device
        self.paged_kv_indptr = torch.zeros(max_num_reqs + 1, dtype=torch.int32, device=dev)
        self.paged_kv_indices = torch.zeros(max_num_reqs * max_num_pages_per_req, dtype=torch.int32, device=dev)
        self.paged_kv_last_page_len = torch.zeros(max_num_reqs, dtype=torch.int32, device=dev)

    def build(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool = False) -> FlashInferMetadata:
        seq_lens = common.dcp_local_seq_lens if common.dcp_local_seq_lens is not None else common.seq_lens
        n = common.num_reqs
        build_page_indices(
            common.block_table_tensor,
            seq_lens,
            self.kv_cache_spec.block_size,
            common.num_actual_reqs,
            n,
            self.paged_kv_indptr,
            self.paged_kv_indices,
            self.paged_kv_last_page_len,
        )
        return FlashInferMetadata(
            num_actual_tokens=common.num_actual_tokens,
            num_reqs=n,
            query_start_loc=common.query_start_loc,
            seq_lens=seq_lens,
            paged_kv_indptr=self.paged_kv_indptr[: n + 1],
            paged_kv_indices=self.paged_kv_indices,
            paged_kv_last_page_len=self.paged_kv_last_page_len[:n],
            slot_mapping=common.slot_mapping,
            page_size=self.kv_cache_spec.block_size,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
        )


def mamba_state_indices(block_table: torch.Tensor, seq_lens: torch.Tensor, spec: MambaSpec,
                        num_reqs: int) -> torch.Tensor:
    """State indices per request row (sec. 14): int32 ``[len(seq_lens), 1 + spec_blocks]``.

    ``none``/``all``: columns ``[0, 1 + spec_blocks)`` of the row. ``align``: columns
    ``[start, start + 1 + spec_blocks)`` with ``start = max((seq_len - 1) // B, 0)`` (the block
    holding the last token). Padded rows are ``PAD_SLOT_ID`` whatever the table holds there,
    so a padded row never aliases a live request's state (state kernels skip ``PAD_SLOT_ID``):
    rows ``>= num_reqs``, and rows with ``seq_len`` 0 (how padding looks on the device, so the
    rule also holds inside a CUDA graph captured with ``num_reqs`` = the padded size; a real
    request always has ``seq_len >= 1``).
    """
    rows = seq_lens.shape[0]
    if not 0 <= num_reqs <= rows or rows > block_table.shape[0]:
        raise ConfigError(
            f"mamba_state_indices: num_reqs {num_reqs} must lie in [0, {rows}] (seq_lens rows) "
            f"and the table needs {rows} rows, has {block_table.shape[0]}"
        )
    width = 1 + spec.num_speculative_blocks
    offs = torch.arange(width, device=block_table.device, dtype=torch.int64)
    if spec.mamba_cache_mode == MambaCacheMode.ALIGN:
        start = torch.clamp((seq_lens.to(torch.int64) - 1) // spec.block_size, min=0)
        cols = (start[:, None] + offs[None, :]).clamp(max=block_table.shape[1] - 1)
    else:
        cols = offs[None, :].expand(rows, width).clamp(max=block_table.shape[1] - 1)
    out = torch.gather(block_table[:rows], 1, cols).to(torch.int32)
    out.masked_fill_((seq_lens <= 0)[:, None], PAD_SLOT_ID)
    out[num_reqs:] = PAD_SLOT_ID
    return out


@dataclass
class MambaMetadata:
    """What a state layer's mixer reads in one step (rows reordered decodes first).

    Rows ``[0, num_decodes)`` are decodes (one token, a state exists); rows ``[num_decodes,
    num_actual_reqs)`` prefill chunks (``has_initial_state`` says whether they continue a
    state: a later chunk, a prefix hit); rows ``>= num_actual_reqs`` padding (state index
    ``PAD_SLOT_ID``, ``seq_len`` 0). The host counts come from the host copies of the lengths;
    ``has_initial_state`` is computed on the device (so it is part of a captured graph)."""

    num_reqs: int
    num_actual_tokens: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    state_indices: torch.Tensor  # int32 [rows, 1 + spec_blocks]; padded rows PAD_SLOT_ID
    has_initial_state: torch.Tensor  # bool [num_reqs]: tokens computed before this step
    block_table: torch.Tensor
    num_actual_reqs: int  # rows >= this are padding (state index PAD_SLOT_ID)
    num_decodes: int = 0
    num_decode_tokens: int = 0
    num_prefills: int = 0
    num_prefill_tokens: int = 0


def _decode_prefill_split(common: CommonAttentionMetadata) -> tuple[int, int, int, int]:
    """``(num_decodes, num_decode_tokens, num_prefills, num_prefill_tokens)``: the leading
    rows with one scheduled token and computed tokens before it are decodes (the runner's
    reorder puts decodes and one-token extends first, vLLM's regions); every later real row
    is a prefill chunk (a fresh one-token prompt included)."""
    n = common.num_actual_reqs
    qsl = common.query_start_loc_cpu
    qsl = qsl.numpy() if isinstance(qsl, torch.Tensor) else np.asarray(qsl)
    qlens = np.diff(qsl[: n + 1].astype(np.int64))
    seq = common.seq_lens_cpu
    seq = seq.numpy() if isinstance(seq, torch.Tensor) else np.asarray(seq)
    is_dec = (qlens == 1) & (seq[:n].astype(np.int64) > 1)
    d = n if is_dec.all() else int(np.argmin(is_dec))
    if is_dec[d:].any():
        raise ConfigError("state groups need their decode rows first (reorder_batch_threshold 1)")
    return d, d, n - d, int(qsl[n] - qsl[d])


class MambaMetadataBuilder(AttentionMetadataBuilder):
    supports_update_block_table = True
    reorder_batch_threshold = 1

    def __init__(self, kv_cache_spec, layer_names, device, max_num_reqs, max_num_pages_per_req) -> None:
        if not isinstance(kv_cache_spec, MambaSpec):
            raise ConfigError(f"MambaMetadataBuilder needs a MambaSpec, got {type(kv_cache_spec).__name__}")
        super().__init__(kv_cache_spec, layer_names, device, max_num_reqs, max_num_pages_per_req)

    def build(self, common: CommonAttentionMetadata, for_cudagraph_capture: bool = False) -> MambaMetadata:
        qsl = common.query_start_loc[: common.num_reqs + 1]
        has_init = (common.seq_lens - (qsl[1:] - qsl[:-1])) > 0
        if for_cudagraph_capture:  # a pure-decode graph: every row is a decode (or padding)
            split = (common.num_reqs, common.num_reqs, 0, 0)
        else:
            split = _decode_prefill_split(common)
        return MambaMetadata(
            num_reqs=common.num_reqs,
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=common.query_start_loc,
            seq_lens=common.seq_lens,
            state_indices=mamba_state_indices(common.block_table_tensor, common.seq_lens,
                                              self.kv_cache_spec, common.num_actual_reqs),
            has_initial_state=has_init,
            block_table=common.block_table_tensor,
            num_actual_reqs=common.num_actual_reqs,
            num_decodes=split[0], num_decode_tokens=split[1], num_prefills=split[2],
            num_prefill_tokens=split[3],
        )

    def update_block_table(self, metadata: MambaMetadata, block_table: torch.Tensor, slot_mapping: torch.Tensor) -> MambaMetadata:
        """Recompute the state indices from the other group's table."""
        return dataclasses.replace(
            metadata,
            block_table=block_table,
            state_indices=mamba_state_indices(block_table, metadata.seq_lens, self.kv_cache_spec,
                                              metadata.num_actual_reqs),
        )
