"""Per-step input preparation: persistent batch -> device tensors for one forward pass.

Order of work (V1 ``_prepare_inputs``):

1. ``commit_block_table(num_reqs)`` FIRST: one non-blocking host -> device copy that overlaps
   the host work below;
2. vectorised numpy (no per-token Python loop): ``query_start_loc`` (cumulative scheduled
   tokens from 0), ``req_indices`` (token -> row), ``positions = num_computed[row] + i``,
   ``input_ids`` (gathered from the token table), ``seq_lens = num_computed + scheduled``,
   ``logits_indices`` (last token of each request), ``is_prefilling``, ``decode_order`` (the
   requests longest first: the order the decode kernel launches their programs in);
3. ONE non-blocking copy to the device (the fields share one staging area, ``StagingArea``);
4. CUDA-graph padding (reference sec. 13), rewritten every step because the buffers are
   persistent: device block-table rows ``[num_reqs, num_reqs_padded)`` -> 0 (null block),
   ``query_start_loc[num_reqs+1:]`` -> the last cumulative value, ``seq_lens[num_reqs:]`` -> 0,
   ``is_prefilling[num_reqs:]`` -> False, positions/input ids of padded tokens -> 0;
5. every group's slot mapping in ONE kernel launch; slots ``[num_tokens:]`` (which include the
   padded tokens ``[num_tokens, num_tokens_padded)``) are -1.

Deliberate differences from vLLM: positions and input ids of padded tokens are written as 0
(vLLM leaves stale values); the step is validated first (no holes in the batch, every row
scheduled >= 1 token, no row scheduled past its known tokens, padded sizes within capacity).

The returned :class:`StepInputs` holds views of persistent buffers: they stay valid until the
next ``prepare`` call overwrites them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np
import torch

from pagedkv.attention.triton_decode import longest_first_order
from pagedkv.errors import InvalidRequestError, InvariantError
from pagedkv.worker.buffers import StagingArea
from pagedkv.worker.input_batch import InputBatch


@dataclass
class StepInputs:
    num_reqs: int
    num_reqs_padded: int
    num_tokens: int  # scheduled tokens (unpadded)
    num_tokens_padded: int
    num_scheduled_tokens: np.ndarray  # int32 [num_reqs]
    req_indices: np.ndarray  # int64 [num_tokens]: token -> row
    query_start_loc: torch.Tensor  # device int32 [num_reqs_padded + 1]
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor  # device int32 [num_reqs_padded]
    seq_lens_cpu: torch.Tensor
    num_computed_tokens_cpu: torch.Tensor  # int32 [num_reqs_padded] (padded rows 0)
    positions: torch.Tensor  # device int64 [num_tokens_padded]
    input_ids: torch.Tensor  # device int32 [num_tokens_padded]
    logits_indices: torch.Tensor  # device int64 [num_reqs]
    is_prefilling: torch.Tensor  # device bool [num_reqs_padded]
    slot_mappings: torch.Tensor  # device int64 [G, num_tokens_padded]
    max_query_len: int
    max_seq_len: int
    dcp_local_seq_lens: torch.Tensor | None  # device int32 [num_reqs_padded], CP only
    dcp_local_seq_lens_cpu: torch.Tensor | None
    # device int32 [max_num_reqs]: the decode kernel's request order (longest first over the
    # padded requests, the rows past them in place; paged_decode_attention's ``order``);
    # None unless InputPreparer.decode_order_enabled (a backend that reads it)
    decode_order: torch.Tensor | None = None


def dcp_local_seq_lens(seq_lens: np.ndarray, cp_world_size: int, cp_rank: int, interleave: int) -> np.ndarray:
    """Tokens of each sequence stored on ``cp_rank`` (reference sec. 12)."""
    seq = seq_lens.astype(np.int64)
    base = seq // interleave // cp_world_size * interleave
    rem = np.clip(seq - base * cp_world_size - cp_rank * interleave, 0, interleave)
    return (base + rem).astype(np.int32)


class InputPreparer:
    """Owns the per-step staging buffers (host + device) and fills them each step."""

    def __init__(
        self,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        pin_memory: bool,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)
        # One staging area: the step's inputs go to the device in one copy. Per-request
        # fields first, per-token fields last (a decode step copies ~5 KB of request fields,
        # the positions' unused tail and its input ids).
        R, T = max_num_reqs, max_num_batched_tokens
        self._area = StagingArea(
            [("query_start_loc", R + 1, torch.int32), ("seq_lens", R, torch.int32),
             ("logits_indices", R, torch.int64), ("is_prefilling", R, torch.bool),
             ("dcp_local_seq_lens", R, torch.int32), ("decode_order", R, torch.int32),
             ("positions", T, torch.int64),
             ("input_ids", T, torch.int32)],
            device=device, pin_memory=pin_memory)
        self.query_start_loc = self._area["query_start_loc"]
        self.seq_lens = self._area["seq_lens"]
        self.num_computed = torch.zeros(max_num_reqs, dtype=torch.int32)
        self.positions = self._area["positions"]
        self.input_ids = self._area["input_ids"]
        self.logits_indices = self._area["logits_indices"]
        self.is_prefilling = self._area["is_prefilling"]
        self.dcp_local_seq_lens = self._area["dcp_local_seq_lens"]
        self.decode_order = self._area["decode_order"]
        # stage decode_order each step (the runner sets it for a backend that reads it)
        self.decode_order_enabled = False
        self._arange = np.arange(max(max_num_batched_tokens, max_num_reqs) + 1, dtype=np.int64)
        self._view_cache: dict[tuple, tuple] = {}  # shape -> (slot buffer, views)
        self._num_computed_np = self.num_computed.numpy()

    @classmethod
    def for_batch(cls, batch: InputBatch) -> "InputPreparer":
        """Buffers sized and placed like ``batch``."""
        return cls(batch.max_num_reqs, batch.max_num_batched_tokens, batch.device, batch.pin_memory)

    def prepare(
        self,
        batch: InputBatch,
        num_scheduled_tokens: Mapping[str, int] | np.ndarray,
        num_reqs_padded: int | None = None,
        num_tokens_padded: int | None = None,
        for_cudagraph_capture: bool = False,
    ) -> StepInputs:
        """Build this step's inputs from the (condensed, reordered) batch.

        ``num_scheduled_tokens``: the scheduler's ``req_id -> tokens`` dict, or an int array in
        row order. ``num_reqs_padded`` / ``num_tokens_padded``: CUDA-graph sizes (default: no
        padding). During capture ``max_seq_len`` is ``max_model_len``.
        """
        bt = batch.block_table
        if batch.has_holes:
            raise InvariantError("dense_batch", "condense() the batch before preparing inputs")
        num_reqs = batch.num_reqs
        # 1. Commit first: the copy overlaps everything below.
        bt.commit_block_table(num_reqs)

        if isinstance(num_scheduled_tokens, np.ndarray):
            nsched = np.ascontiguousarray(num_scheduled_tokens[:num_reqs], dtype=np.int32)
            if nsched.shape[0] != num_reqs:
                raise InvalidRequestError(
                    f"num_scheduled_tokens has {nsched.shape[0]} rows, the batch {num_reqs}"
                )
        else:
            nsched = batch.scheduled_tokens_per_row(num_scheduled_tokens)
        computed = batch.num_computed_tokens_cpu[:num_reqs]
        num_tokens = int(nsched.sum())
        n_reqs_pad = num_reqs if num_reqs_padded is None else num_reqs_padded
        n_tok_pad = num_tokens if num_tokens_padded is None else num_tokens_padded
        seq_lens = computed + nsched
        self._validate(batch, nsched, computed, seq_lens, num_tokens, n_reqs_pad, n_tok_pad)

        self._area.wait_for_copy()

        # 2. Host-side index math.
        qsl = self.query_start_loc.np
        pos = self.positions.np
        logits = self.logits_indices.np
        if num_tokens == num_reqs:
            # Pure decode: every row has exactly one token (each has >= 1, validated above),
            # so token i belongs to row i at position num_computed[i].
            qsl[: num_reqs + 1] = self._arange[: num_reqs + 1]
            req_indices = self._arange[:num_reqs].copy()
            pos[:num_tokens] = computed
            logits[:num_reqs] = self._arange[:num_reqs]
        else:
            qsl[0] = 0
            np.cumsum(nsched, out=qsl[1 : num_reqs + 1])
            req_indices = np.repeat(self._arange[:num_reqs], nsched)
            # positions = num_computed[row] + (token index - first token of the row)
            np.add(np.repeat(computed - qsl[:num_reqs], nsched), self._arange[:num_tokens],
                   out=pos[:num_tokens])
            np.subtract(qsl[1 : num_reqs + 1], 1, out=logits[:num_reqs])
        qsl[num_reqs + 1 :] = num_tokens  # padded requests: 0 tokens
        ids = self.input_ids.np
        ids[:num_tokens] = batch.token_ids_cpu[req_indices, pos[:num_tokens]]
        if n_tok_pad > num_tokens:
            pos[num_tokens:n_tok_pad] = 0
            ids[num_tokens:n_tok_pad] = 0
        seq = self.seq_lens.np
        seq[:num_reqs] = seq_lens
        seq[num_reqs:] = 0
        ncomp = self._num_computed_np
        ncomp[:num_reqs] = computed
        ncomp[num_reqs:] = 0
        # the decode kernel's program order: the padded requests longest first, then the
        # rows past them in place (a permutation of every grid size up to max_num_reqs, so a
        # graph captured for more requests than this step pads to reads one too)
        if self.decode_order_enabled:
            order = self.decode_order.np
            order[:n_reqs_pad] = longest_first_order(seq[:n_reqs_pad])
            order[n_reqs_pad:] = self._arange[n_reqs_pad:self.max_num_reqs]
        pre = self.is_prefilling.np
        np.less(computed, batch.num_prompt_tokens[:num_reqs], out=pre[:num_reqs])
        pre[num_reqs:] = False
        cp = bt.cp_world_size
        if cp > 1:
            dcp = self.dcp_local_seq_lens.np
            dcp[:num_reqs] = dcp_local_seq_lens(seq[:num_reqs], cp, bt.cp_rank, bt.cp_interleave)
            dcp[num_reqs:] = 0

        # 3. Host -> device: one copy.
        used = {"query_start_loc": n_reqs_pad + 1, "seq_lens": n_reqs_pad,
                "logits_indices": num_reqs, "is_prefilling": n_reqs_pad,
                "positions": n_tok_pad, "input_ids": n_tok_pad}
        if self.decode_order_enabled:
            used["decode_order"] = self.max_num_reqs
        if cp > 1:
            used["dcp_local_seq_lens"] = n_reqs_pad
        self._area.copy_to_gpu(used)

        # 4. Padding rows of the persistent device block table -> null block.
        bt.fill_padding_rows(num_reqs, n_reqs_pad)

        # 5. All groups' slot mappings, one launch; [num_tokens:] -> -1.
        if num_tokens == num_reqs:
            max_query_len = 1 if num_reqs else 0
        else:
            max_query_len = int(nsched.max())
        if bt.computes_slot_mappings_on_host:
            # CPU device: the same mapping in numpy from the host arrays built above (token
            # rows and positions), without re-deriving them from the device copies.
            slots = bt.compute_slot_mappings_host(req_indices, pos[:num_tokens])
        else:
            slots = bt.compute_slot_mappings(
                num_reqs, num_tokens, self.query_start_loc.gpu, self.positions.gpu,
                max_query_len=max_query_len or None,
            )

        if for_cudagraph_capture:
            max_seq_len = batch.max_model_len
        else:
            max_seq_len = int(seq_lens.max()) if num_reqs else 0
        return StepInputs(
            num_reqs=num_reqs,
            num_reqs_padded=n_reqs_pad,
            num_tokens=num_tokens,
            num_tokens_padded=n_tok_pad,
            num_scheduled_tokens=nsched,
            req_indices=req_indices,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            **self._views(num_reqs, n_reqs_pad, n_tok_pad, cp > 1, slots),
        )

    def _views(self, num_reqs: int, n_reqs_pad: int, n_tok_pad: int, dcp: bool,
               slots: torch.Tensor) -> dict:
        """The step's ``StepInputs`` tensor fields, views of the persistent buffers made once
        per shape and reused (a dozen tensor slices cost ~15-25 us of host time per step)."""
        key = (num_reqs, n_reqs_pad, n_tok_pad, dcp, self.decode_order_enabled)
        hit = self._view_cache.get(key)
        if hit is not None and hit[0] is slots:  # the block table's persistent slot buffer
            return hit[1]
        if len(self._view_cache) >= 4096:
            self._view_cache.clear()
        views = dict(
            query_start_loc=self.query_start_loc.gpu[: n_reqs_pad + 1],
            query_start_loc_cpu=self.query_start_loc.cpu[: n_reqs_pad + 1],
            seq_lens=self.seq_lens.gpu[:n_reqs_pad],
            seq_lens_cpu=self.seq_lens.cpu[:n_reqs_pad],
            num_computed_tokens_cpu=self.num_computed[:n_reqs_pad],
            positions=self.positions.gpu[:n_tok_pad],
            input_ids=self.input_ids.gpu[:n_tok_pad],
            logits_indices=self.logits_indices.gpu[:num_reqs],
            is_prefilling=self.is_prefilling.gpu[:n_reqs_pad],
            slot_mappings=slots[:, :n_tok_pad],
            dcp_local_seq_lens=self.dcp_local_seq_lens.gpu[:n_reqs_pad] if dcp else None,
            dcp_local_seq_lens_cpu=self.dcp_local_seq_lens.cpu[:n_reqs_pad] if dcp else None,
            decode_order=self.decode_order.gpu if self.decode_order_enabled else None,
        )
        self._view_cache[key] = (slots, views)
        return views

    def _validate(self, batch, nsched, computed, seq_lens, num_tokens, n_reqs_pad, n_tok_pad) -> None:
        num_reqs = nsched.shape[0]
        if num_reqs and nsched.min() < 1:
            row = int(np.argmin(nsched))
            raise InvalidRequestError(
                f"request {batch.req_ids[row]!r} (row {row}) is in the batch with "
                f"{int(nsched[row])} scheduled tokens; every row needs >= 1"
            )
        if num_tokens > self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"{num_tokens} scheduled tokens exceed max_num_batched_tokens "
                f"{self.max_num_batched_tokens}"
            )
        over = seq_lens > batch.num_tokens[:num_reqs]
        if over.any():
            row = int(np.flatnonzero(over)[0])
            raise InvalidRequestError(
                f"request {batch.req_ids[row]!r} (row {row}): {int(computed[row])} computed + "
                f"{int(nsched[row])} scheduled tokens exceed its {int(batch.num_tokens[row])} "
                f"known tokens"
            )
        if not num_reqs <= n_reqs_pad <= self.max_num_reqs:
            raise InvalidRequestError(
                f"num_reqs_padded {n_reqs_pad} outside [{num_reqs}, {self.max_num_reqs}]"
            )
        if not num_tokens <= n_tok_pad <= self.max_num_batched_tokens:
            raise InvalidRequestError(
                f"num_tokens_padded {n_tok_pad} outside [{num_tokens}, {self.max_num_batched_tokens}]"
            )
