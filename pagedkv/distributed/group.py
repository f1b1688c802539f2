"""A tensor-parallel rank's view of its group: the collectives a model shard calls.

``TPGroup(rank, world_size)`` wraps the default ``torch.distributed`` process group (gloo on
CPU, NCCL on GPUs; ``pagedkv.distributed.worker`` initializes it). What a shard of
``DecoderForCausalLM`` needs (Megatron-style layout, ``pagedkv.distributed.shard``):

* ``all_reduce``: the sum of the row-parallel partial products (``o_proj`` over the rank's
  heads, ``down_proj`` over its MLP columns) and of the vocabulary-parallel embedding;
* ``embed``: a token's embedding row from the rank that holds it (zeros elsewhere), summed;
* ``gather_vocab``: the LM head's logits, each rank's vocabulary columns concatenated in rank
  order and the padding columns of the last shard dropped;
* ``regions``: the decoder's four layer regions with the all-reduces in place (the single-
  process regions of ``pagedkv.models.decoder`` otherwise).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class TPGroup:
    """Rank ``rank`` of ``world_size`` tensor-parallel ranks (the default process group)."""

    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        self.regions = _tp_regions(self)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place; returned)."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def embed(self, input_ids: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        """Embeddings of ``input_ids [T]`` from the vocabulary shard ``shard [V_local, H]``
        (rows ``rank * V_local ...`` of the full table): each id's row from the rank holding
        it, zeros on the others, summed over the ranks."""
        per_rank = shard.shape[0]
        local = input_ids - self.rank * per_rank
        outside = (local < 0) | (local >= per_rank)
        out = F.embedding(local.masked_fill(outside, 0), shard)
        out = out.masked_fill(outside[:, None], 0.0)
        return self.all_reduce(out)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """``logits [T, V_local]`` of every rank side by side (rank order), cut to
        ``vocab_size`` columns (the last shard's padding rows are zeros)."""
        if self.world_size == 1:
            return logits[:, :vocab_size]
        parts = [torch.empty_like(logits) for _ in range(self.world_size)]
        dist.all_gather(parts, logits.contiguous())
        return torch.cat(parts, dim=-1)[:, :vocab_size]


def _tp_regions(tp: TPGroup) -> tuple:
    """``(pre, post, pre_qkv, mid)`` for a shard: the decoder's regions, the pre-attention
    ones as they are (they act on the rank's heads only), the post-attention ones with the
    row-parallel products summed over the ranks (``reduce``)."""
    from functools import partial

    from pagedkv.models.decoder import (
        post_attention,
        post_pre_qkv,
        pre_attention,
        pre_attention_qkv,
    )

    return (pre_attention, partial(post_attention, reduce=tp.all_reduce), pre_attention_qkv,
            partial(post_pre_qkv, reduce=tp.all_reduce))


__all__ = ["TPGroup"]
