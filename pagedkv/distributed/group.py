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


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Attention over the union of disjoint key sets from the partial results over each:
    ``outs [M, T, H, D]`` (each normalized over its own keys), float32 natural-log ``lses [M,
    T, H]`` (-inf: no key); cascade attention's merge (``merge_attention_states``, its first
    part in ``M - 1`` pieces), float32 ``[T, H, D]``."""
    from pagedkv.attention.merge_states import merge_attention_states

    out = torch.empty(outs.shape[1:], dtype=torch.float32, device=outs.device)
    return merge_attention_states(out, outs[:-1].float(), lses[:-1].float().contiguous(),
                                  outs[-1].float(), lses[-1].float().contiguous(),
                                  outs.shape[1])


class DCPGroup:
    """Rank ``rank`` of a decode-context-parallel group of ``world_size`` tensor-parallel
    ranks (``group``: their ``torch.distributed`` process group, in rank order; ``interleave``:
    the CP interleave ``I``). The ranks hold the same KV heads, each its share of the tokens;
    a layer's attention on one rank (``attend``):

    1. the group's query heads: each rank's own heads gathered side by side (rank order);
    2. attention of every gathered head over the rank's local keys only (the torch reference
       with the CP view, ``paged_attention_ref(cp=...)``), with its log-sum-exp;
    3. the ranks' partial outputs merged with the log-sum-exp correction
       (``out = sum_r exp(lse_r - L) out_r``, ``L = logsumexp_r lse_r``) and the rank's own
       heads kept.

    ``check_steps`` (``PAGEDKV_DCP_CHECK=1``): before layer 0's attention, every step's slot
    mapping and local lengths are checked against the rule computed here by brute force
    (``check_step``); a mismatch raises ``InvariantError``.
    """

    def __init__(self, rank: int, world_size: int, interleave: int = 1, group=None,
                 check_steps: bool | None = None):
        import os

        self.rank, self.world_size, self.interleave, self.group = rank, world_size, interleave, group
        self.check_steps = (os.environ.get("PAGEDKV_DCP_CHECK") == "1" if check_steps is None
                            else check_steps)
        self.steps_checked = 0

    @property
    def cp(self) -> tuple[int, int, int]:
        return (self.world_size, self.rank, self.interleave)

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """``[world_size, *x.shape]``: every rank's ``x`` in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.stack(parts)

    def merge(self, out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
        """This rank's heads of the merge of every rank's partial ``out [T, H, D]`` (float32
        ``lse [T, H]``; -inf where a rank saw no key)."""
        merged = merge_partials(self.all_gather(out.float()), self.all_gather(lse)).to(out.dtype)
        per = out.shape[1] // self.world_size
        return merged[:, self.rank * per:(self.rank + 1) * per]

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, plan, scale: float, *,
               sliding_window=None, logits_soft_cap=None, k_scale=1.0, v_scale=1.0,
               layer_idx: int = 0) -> torch.Tensor:
        """Steps 1-3 for ``q [T, H_rank, D]`` (the KV write is done): ``[T, H_rank, D]``."""
        from pagedkv.attention.torch_ref import paged_attention_ref

        md = plan.metadata
        if self.check_steps and layer_idx == 0:
            self.check_step(md, kv_cache.shape[2])
        q_all = torch.cat(list(self.all_gather(q)), dim=1)
        lse = torch.full(q_all.shape[:2], float("-inf"), dtype=torch.float32, device=q.device)
        out = paged_attention_ref(q_all, kv_cache, md, scale, sliding_window=sliding_window,
                                  logits_soft_cap=logits_soft_cap, lse=lse, k_scale=k_scale,
                                  v_scale=v_scale, cp=self.cp)
        return self.merge(out, lse)

    def check_step(self, md, block_size: int) -> None:
        """The step's slot mapping (its real tokens) and DCP local lengths against the seeds'
        rule, recomputed by brute force: position ``p`` of request row ``r`` is this rank's
        iff ``((p % (B * cp)) // I) % cp == rank``, then at ``table[r, p // (B * cp)] * B +
        (p % (B * cp)) // (cp * I) * I + p % I``, else -1; the local length counts the
        positions below ``seq_len`` that are this rank's."""
        from pagedkv.errors import InvariantError

        cp, rank, inter = self.cp
        n = int(md.num_reqs)
        qsl = [int(x) for x in md.query_start_loc_cpu[:n + 1]]
        seq = [int(x) for x in md.seq_lens_cpu[:n]]
        table = md.block_table_tensor.cpu()
        slots = md.slot_mapping.cpu()
        vbs = block_size * cp

        def own(p):
            return ((p % vbs) // inter) % cp == rank

        for r in range(n):
            q_len = qsl[r + 1] - qsl[r]
            for i in range(q_len):
                p = seq[r] - q_len + i
                voff = p % vbs
                want = (int(table[r, p // vbs]) * block_size + voff // (cp * inter) * inter
                        + voff % inter) if own(p) else -1
                got = int(slots[qsl[r] + i])
                if got != want:
                    raise InvariantError("dcp-slot-mapping", "a slot differs from the CP rule",
                                         request_row=r, position=p, slot=got, expected=want)
        local = getattr(md, "dcp_local_seq_lens_cpu", None)
        if local is None:
            raise InvariantError("dcp-local-lens", "a DCP step carries no local lengths")
        for r in range(n):
            want = sum(1 for p in range(seq[r]) if own(p))
            if int(local[r]) != want:
                raise InvariantError("dcp-local-lens", "a local length differs from the count "
                                     "of owned positions", request_row=r, local=int(local[r]),
                                     expected=want)
        self.steps_checked += 1


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


__all__ = ["DCPGroup", "TPGroup", "merge_partials"]
