"""A minimal attention-metadata object for tests and reference drivers.

The worker builds its own metadata; backends accept any object with these attributes (see
``AttentionMetadataLike``). ``build_attention_metadata`` fills one from per-request query
lengths, sequence lengths, a block table and a slot mapping.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pagedkv.errors import InvalidRequestError


@dataclass
class SimpleAttentionMetadata:
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1], device
    query_start_loc_cpu: torch.Tensor  # int32 [num_reqs + 1], cpu
    seq_lens: torch.Tensor  # int32 [num_reqs], device
    seq_lens_cpu: torch.Tensor  # int32 [num_reqs], cpu
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_table_tensor: torch.Tensor  # int32 [num_reqs, width], device
    slot_mapping: torch.Tensor  # int64 [>= num_actual_tokens], device
    # cascade attention (AttentionMetadataLike): the shared leading positions, on the device,
    # and a baked decision (None: the backend decides)
    common_prefix_len: int = 0
    common_prefix_len_device: torch.Tensor | None = None
    use_cascade: bool | None = None


def build_attention_metadata(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    device: str | torch.device | None = None,
    common_prefix_len: int = 0,
) -> SimpleAttentionMetadata:
    """Metadata for requests with ``query_lens[r]`` new tokens and ``seq_lens[r]`` tokens in
    total (context + new). ``block_table``: int ``[num_reqs, width]``; ``slot_mapping``: int64
    ``[>= sum(query_lens)]`` (entries past the real tokens must be ``-1``).
    ``common_prefix_len``: positions every request shares in the same blocks, at most every
    request's context (``seq_len - query_len``; cascade attention, see ``AttentionBackend``),
    also put on the device (``common_prefix_len_device``: what a CUDA graph's cascade plan
    reads) when positive."""
    query_lens = [int(x) for x in query_lens]
    seq_lens = [int(x) for x in seq_lens]
    if len(query_lens) != len(seq_lens):
        raise InvalidRequestError(
            f"query_lens ({len(query_lens)}) and seq_lens ({len(seq_lens)}) differ in length"
        )
    for r, (q, s) in enumerate(zip(query_lens, seq_lens)):
        if q < 0 or s < q:
            raise InvalidRequestError(f"request {r}: need 0 <= query_len <= seq_len, got {q} and {s}")
    n = len(query_lens)
    if isinstance(common_prefix_len, bool) or not isinstance(common_prefix_len, int) \
            or common_prefix_len < 0 \
            or any(s - q < common_prefix_len for q, s in zip(query_lens, seq_lens)):
        raise InvalidRequestError(
            f"common_prefix_len must be an int in [0, min context length], got "
            f"{common_prefix_len!r}")
    device = torch.device(device) if device is not None else block_table.device
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    if n:
        qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.int64), 0).to(torch.int32)
    sl = torch.tensor(seq_lens, dtype=torch.int32)
    total = int(qsl[-1])
    if slot_mapping.shape[0] < total:
        raise InvalidRequestError(
            f"slot_mapping has {slot_mapping.shape[0]} entries for {total} scheduled tokens"
        )
    if block_table.dim() != 2 or block_table.shape[0] < n:
        raise InvalidRequestError(
            f"block_table must be [num_reqs={n}, width], got shape {tuple(block_table.shape)}"
        )
    return SimpleAttentionMetadata(
        query_start_loc=qsl.to(device),
        query_start_loc_cpu=qsl,
        seq_lens=sl.to(device),
        seq_lens_cpu=sl,
        num_reqs=n,
        num_actual_tokens=total,
        max_query_len=max(query_lens, default=0),
        max_seq_len=max(seq_lens, default=0),
        block_table_tensor=block_table[:n].to(device=device, dtype=torch.int32),
        slot_mapping=slot_mapping.to(device=device, dtype=torch.int64),
        common_prefix_len=common_prefix_len,
        common_prefix_len_device=torch.tensor([common_prefix_len], dtype=torch.int32,
                                              device=device) if common_prefix_len else None,
    )


__all__ = ["SimpleAttentionMetadata", "build_attention_metadata"]
