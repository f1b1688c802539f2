"""The persistent batch: one row per running request, kept across steps (V1 ``InputBatch``).

A request's *row* is its local execution slot: the first index of every per-row array and of
every group's block table. Rows stay dense: a removed request leaves a hole, the next added
request takes the smallest hole, and ``condense()`` moves the last rows down into the
remaining holes (reference sec. 9.3-9.5). ``req_id`` is the stable identity, the row is not.

Per-row host arrays (numpy): ``token_ids_cpu [max_num_reqs, max_model_len] int32``,
``num_tokens`` (prompt + output tokens written so far; vLLM's ``num_tokens_no_spec``),
``num_prompt_tokens``, ``num_computed_tokens_cpu``. ``block_table`` is a
:class:`MultiGroupBlockTable`.

Deliberate differences from vLLM:

* Holes are tracked by a plain min-heap. ``condense()`` consumes them; removing more rows
  after a condense is allowed (vLLM raises, because its logits-processor bookkeeping has
  already been read). Input preparation refuses a batch that still has holes.
* ``swap_states`` swaps the token rows only up to the longer of the two requests (stale
  tails beyond ``num_tokens`` are never read); vLLM swaps whole rows.
* Sampling parameters are not kept here (the sampler keeps its own per-row state).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from pagedkv.core.spec import SlotMappingMode
from pagedkv.errors import BlockTableError, ConfigError, InvalidRequestError, UnknownRequestError
from pagedkv.worker.block_table import MultiGroupBlockTable

# Reorder regions, in target order.
DECODE, SHORT_EXTEND, LONG_EXTEND, PREFILL = 0, 1, 2, 3


@dataclass(eq=False)
class CachedRequestState:
    """What the worker remembers about one request (kept while it is preempted too)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    block_ids: tuple[list[int], ...]  # per group, the full table (grows by extend)
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    generator: Any = None
    lora_request: Any = None
    mm_features: list = field(default_factory=list)

    def __post_init__(self) -> None:
        self.block_ids = tuple(list(ids) for ids in self.block_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def get_token_id(self, idx: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[idx] if idx < n else self.output_token_ids[idx - n]


class InputBatch:
    """Rows of running requests, their tokens, progress and block tables."""

    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_num_batched_tokens: int,
        device: torch.device | str,
        pin_memory: bool,
        block_sizes: Sequence[int],
        max_num_blocks_per_req: Sequence[int],
        slot_mapping_modes: Sequence[SlotMappingMode] | None = None,
        cp_world_size: int = 1,
        cp_rank: int = 0,
        cp_interleave: int = 1,
    ) -> None:
        if not isinstance(max_model_len, int) or max_model_len < 1:
            raise ConfigError(f"max_model_len must be a positive int, got {max_model_len!r}")
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.device = torch.device(device)
        self.pin_memory = pin_memory
        self.block_table = MultiGroupBlockTable(
            max_num_reqs,
            max_num_batched_tokens,
            device,
            pin_memory,
            block_sizes,
            max_num_blocks_per_req,
            slot_mapping_modes,
            cp_world_size=cp_world_size,
            cp_rank=cp_rank,
            cp_interleave=cp_interleave,
        )
        self._req_ids: list[str | None] = []
        self.req_id_to_index: dict[str, int] = {}
        self.token_ids_cpu_tensor = torch.zeros((max_num_reqs, max_model_len), dtype=torch.int32)
        self.token_ids_cpu: np.ndarray = self.token_ids_cpu_tensor.numpy()
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens_cpu = np.zeros(max_num_reqs, dtype=np.int32)
        self._holes: list[int] = []  # min-heap of rows removed since the last condense
        self._batch_changed = False

    # ------------------------------------------------------------------ views
    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_index)

    @property
    def req_ids(self) -> list[str]:
        """Row -> request id. Only hole-free after ``condense()``."""
        return self._req_ids  # type: ignore[return-value]

    @property
    def has_holes(self) -> bool:
        return bool(self._holes)

    # ------------------------------------------------------------- add/remove
    def add_request(self, state: CachedRequestState) -> int:
        """Put ``state`` in the smallest hole left this step, else append. Returns the row."""
        if state.req_id in self.req_id_to_index:
            raise InvalidRequestError(f"request {state.req_id!r} is already in the batch")
        n_prompt, n_tok = state.num_prompt_tokens, state.num_tokens
        if n_tok > self.max_model_len:
            raise InvalidRequestError(
                f"request {state.req_id!r} has {n_tok} tokens, more than max_model_len "
                f"{self.max_model_len}"
            )
        if not 0 <= state.num_computed_tokens <= n_tok:
            raise InvalidRequestError(
                f"request {state.req_id!r}: num_computed_tokens {state.num_computed_tokens} "
                f"outside [0, {n_tok}]"
            )
        row = self._holes[0] if self._holes else len(self._req_ids)
        if row >= self.max_num_reqs:
            raise BlockTableError(f"the batch is full ({self.max_num_reqs} rows); raise max_num_reqs")
        # Validates every group before writing anything: raises with the batch unchanged.
        self.block_table.add_row(state.block_ids, row)
        if self._holes:
            heapq.heappop(self._holes)
            self._req_ids[row] = state.req_id
        else:
            self._req_ids.append(state.req_id)
        self.req_id_to_index[state.req_id] = row
        toks = self.token_ids_cpu
        toks[row, :n_prompt] = state.prompt_token_ids
        if n_tok > n_prompt:
            toks[row, n_prompt:n_tok] = state.output_token_ids
        self.num_tokens[row] = n_tok
        self.num_prompt_tokens[row] = n_prompt
        self.num_computed_tokens_cpu[row] = state.num_computed_tokens
        self._batch_changed = True
        return row

    def remove_request(self, req_id: str) -> int | None:
        """Drop ``req_id`` (its row becomes a hole, its table row is cleared).

        Returns the freed row, or None when the request is not in the batch.
        """
        row = self.req_id_to_index.pop(req_id, None)
        if row is None:
            return None
        heapq.heappush(self._holes, row)
        self._req_ids[row] = None
        self.block_table.clear_row(row)
        self._batch_changed = True
        return row

    # ---------------------------------------------------------- row movement
    def _move(self, src: int, dst: int) -> None:
        req_id = self._req_ids[src]
        self._req_ids[dst] = req_id
        self._req_ids[src] = None
        self.req_id_to_index[req_id] = dst  # type: ignore[index]
        self.block_table.move_row(src, dst)
        n = int(self.num_tokens[src])
        self.token_ids_cpu[dst, :n] = self.token_ids_cpu[src, :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu):
            arr[dst] = arr[src]

    def condense(self) -> None:
        """Fill the holes by moving the last rows down (sec. 9.5); rows become ``[0, num_reqs)``.

        Verified example: rows {r0, r5, r2, r4}; remove r0 and r2; condense -> r4@0, r5@1.
        """
        holes = sorted(self._holes)
        self._holes = []
        num_reqs = self.num_reqs
        if not holes:
            return
        remaining = set(holes)
        last = num_reqs + len(holes) - 1
        for h in holes:
            while last in remaining:
                last -= 1
            if h >= last:
                break
            remaining.discard(h)
            self._move(last, h)
            last -= 1
        del self._req_ids[num_reqs:]
        self._batch_changed = True

    def swap_states(self, i: int, j: int) -> None:
        """Swap everything of rows ``i`` and ``j``, block tables included."""
        if i == j:
            return
        ids = self._req_ids
        ids[i], ids[j] = ids[j], ids[i]
        if ids[i] is not None:
            self.req_id_to_index[ids[i]] = i
        if ids[j] is not None:
            self.req_id_to_index[ids[j]] = j
        n = int(max(self.num_tokens[i], self.num_tokens[j]))
        toks = self.token_ids_cpu
        toks[[i, j], :n] = toks[[j, i], :n]
        for arr in (self.num_tokens, self.num_prompt_tokens, self.num_computed_tokens_cpu):
            arr[[i, j]] = arr[[j, i]]
        self.block_table.swap_row(i, j)
        self._batch_changed = True

    # ------------------------------------------------------------- reordering
    def scheduled_tokens_per_row(self, num_scheduled_tokens: Mapping[str, int]) -> np.ndarray:
        """``int32 [num_reqs]``: tokens scheduled for each row (one dict lookup per request)."""
        n = self.num_reqs
        try:
            return np.fromiter(
                map(num_scheduled_tokens.__getitem__, self._req_ids[:n]), dtype=np.int32, count=n
            )
        except KeyError as e:
            raise UnknownRequestError(
                f"request {e.args[0]!r} is in the batch but not in num_scheduled_tokens"
            ) from None

    def classify_rows(self, num_scheduled: np.ndarray, threshold: int) -> np.ndarray:
        """Region of each row: DECODE, SHORT_EXTEND, LONG_EXTEND or PREFILL (sec. 9.7).

        prefill: nothing computed yet; long extend: has context, scheduled > threshold;
        short extend: has context, scheduled <= threshold, prompt not done;
        decode: has context, scheduled <= threshold, prompt done.
        """
        n = self.num_reqs
        computed = self.num_computed_tokens_cpu[:n]
        has_context = computed > 0
        small = num_scheduled <= threshold
        prompt_done = computed >= self.num_prompt_tokens[:n]
        regions = np.full(n, DECODE, dtype=np.int32)
        regions[has_context & small & ~prompt_done] = SHORT_EXTEND
        regions[has_context & ~small] = LONG_EXTEND
        regions[~has_context] = PREFILL
        return regions

    def reorder_batch_to_split_decodes_and_prefills(
        self, num_scheduled_tokens: Mapping[str, int] | np.ndarray, threshold: int
    ) -> bool:
        """Permute rows into decode -> short extend -> long extend -> prefill.

        Rows already in their target region stay put; the misplaced rows, taken in row
        order, are stably sorted by region and dealt into the misplaced positions in row
        order (the permutation vLLM produces). Applied with ``swap_states`` along cycles.
        Returns whether anything moved.
        """
        if self._holes:
            raise BlockTableError("condense() the batch before reordering it")
        n = self.num_reqs
        if isinstance(num_scheduled_tokens, np.ndarray):
            sched = num_scheduled_tokens[:n]
        else:
            sched = self.scheduled_tokens_per_row(num_scheduled_tokens)
        regions = self.classify_rows(sched, threshold)
        target = np.repeat(np.arange(4, dtype=np.int32), np.bincount(regions, minlength=4))
        misplaced = np.flatnonzero(regions != target)
        if misplaced.size == 0:
            return False
        sources = misplaced[np.argsort(regions[misplaced], kind="stable")]
        dest = {int(s): int(d) for s, d in zip(sources, misplaced)}
        for p in list(dest):
            while dest[p] != p:
                q = dest[p]
                self.swap_states(p, q)
                dest[p], dest[q] = dest[q], q
        return True

    # ------------------------------------------------------------ bookkeeping
    def append_token_ids(self, row: int, token_ids: Sequence[int]) -> int:
        """Write ``token_ids`` after the row's tokens; returns the new token count."""
        k = len(token_ids)
        start = int(self.num_tokens[row])
        if start + k > self.max_model_len:
            raise InvalidRequestError(
                f"row {row} would hold {start + k} tokens, more than max_model_len "
                f"{self.max_model_len}"
            )
        if k:
            self.token_ids_cpu[row, start : start + k] = token_ids
            self.num_tokens[row] = start + k
        return start + k

    def truncate_tokens(self, row: int, num_tokens: int) -> None:
        """Forget tokens beyond ``num_tokens`` (discarded outputs)."""
        self.num_tokens[row] = min(int(self.num_tokens[row]), num_tokens)

    def refresh_metadata(self) -> bool:
        """End of the batch update. Returns whether rows changed since the last refresh."""
        changed, self._batch_changed = self._batch_changed, False
        return changed
