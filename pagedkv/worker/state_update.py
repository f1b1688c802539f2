"""Apply a SchedulerOutput to the worker's request states and persistent batch.

Mirrors the V1 runner's ``_update_states`` (reference sec. 9.8), in order:

1. finished ids: drop their state and their row;
2. ``new_block_ids_to_zero`` and the copy-on-write pairs are handed back to the caller (the
   runner owns the KV tensors and applies them before the forward pass);
3. requests in the batch that are not scheduled this step, and resumed ones, leave the batch;
   their :class:`CachedRequestState` is kept;
4. states are created for the new requests;
5. cached requests: ``num_computed_tokens`` is set; not resumed -> block ids extended,
   resumed -> block ids replaced by the full table; if still in the batch the new blocks are
   appended to its row, else it is queued for re-adding;
6. queued requests are added, new ones first, in list order;
7. ``condense()``, reorder (when a threshold is given), ``refresh_metadata()``.

The runner (later) records the tokens it sampled with :func:`record_sampled_tokens`.

Deliberate differences from vLLM: the SchedulerOutput is validated before anything changes
(unknown cached/scheduled ids -> ``UnknownRequestError``; a new request already running in the
batch, a resumed request without its full table, an id both new and cached, or a scheduled
request without a ``num_scheduled_tokens`` entry -> ``InvalidRequestError``). A new request
whose id is known but out of the batch (a V2-style resume) replaces the kept state.
Finished ids are removed in sorted order (the resulting rows do not depend on the order).
All state is passed explicitly: ``requests`` is the runner's ``req_id -> state`` dict.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import repeat
from typing import Mapping, Sequence

from pagedkv.core.output import CachedRequestData, SchedulerOutput
from pagedkv.errors import InvalidRequestError, UnknownRequestError
from pagedkv.worker.input_batch import CachedRequestState, InputBatch


@dataclass
class StateUpdate:
    """What the runner must still do after the batch update."""

    block_ids_to_zero: list[int] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst), after zeroing
    finished: list[str] = field(default_factory=list)
    removed_unscheduled: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    reordered: bool = False
    batch_changed: bool = False


def update_states(
    requests: dict[str, CachedRequestState],
    batch: InputBatch,
    sched: SchedulerOutput,
    reorder_threshold: int | None = None,
) -> StateUpdate:
    """Apply ``sched`` to ``requests`` and ``batch`` (see the module docstring).

    ``reorder_threshold``: the smallest ``reorder_batch_threshold`` of the attention backends,
    or None for no reordering. Bad input (unknown request, duplicate new request, resumed
    request without blocks) raises before the batch is touched.
    """
    cached = sched.scheduled_cached_reqs
    _validate(requests, batch, sched)
    out = StateUpdate(
        block_ids_to_zero=list(sched.new_block_ids_to_zero or ()),
        block_copies=[(int(s), int(d)) for s, d in sched.kv_cache_block_copies],
    )

    # 1. finished
    for req_id in sorted(sched.finished_req_ids):
        requests.pop(req_id, None)
        batch.remove_request(req_id)
        out.finished.append(req_id)

    # 3. unscheduled and resumed requests leave the batch (state kept). Usually every row is
    # scheduled and nothing resumes: one set comparison instead of a per-row loop.
    scheduled = sched.num_scheduled_tokens
    resumed = cached.resumed_req_ids
    index = batch.req_id_to_index
    if resumed or not index.keys() <= scheduled.keys():
        for req_id in list(index):
            if req_id not in scheduled or req_id in resumed:
                batch.remove_request(req_id)
                out.removed_unscheduled.append(req_id)

    # 4. new requests
    to_add: list[CachedRequestState] = []
    for new in sched.scheduled_new_reqs:
        state = CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            sampling_params=new.sampling_params,
            block_ids=new.block_ids,
            num_computed_tokens=new.num_computed_tokens,
            lora_request=new.lora_request,
            mm_features=list(new.mm_features),
        )
        requests[new.req_id] = state
        to_add.append(state)

    # 5. cached requests
    if cached.req_ids:
        if cached.new_token_ids or resumed or len(cached.num_output_tokens) != len(cached.req_ids):
            _update_cached_requests(requests, batch, cached, to_add)
        else:
            _update_running_requests(requests, batch, cached, to_add)

    # 6. (re-)add, new requests first
    for state in to_add:
        batch.add_request(state)
        out.added.append(state.req_id)

    # 7. condense, reorder, refresh
    batch.condense()
    if reorder_threshold is not None:
        out.reordered = batch.reorder_batch_to_split_decodes_and_prefills(scheduled, reorder_threshold)
    out.batch_changed = batch.refresh_metadata()
    return out


def _update_cached_requests(
    requests: dict[str, CachedRequestState],
    batch: InputBatch,
    cached: CachedRequestData,
    to_add: list[CachedRequestState],
) -> None:
    """Step 5, general form (pipelined tokens, resumed requests, partial lists)."""
    resumed = cached.resumed_req_ids
    for i, req_id in enumerate(cached.req_ids):
        state = requests[req_id]
        num_computed = cached.num_computed_tokens[i]
        new_ids = cached.new_block_ids[i] if i < len(cached.new_block_ids) else None
        row = batch.req_id_to_index.get(req_id)
        state.num_computed_tokens = num_computed

        if i < len(cached.new_token_ids) and cached.new_token_ids[i]:
            # Pipeline parallel: tokens sampled elsewhere arrive here.
            new_toks = cached.new_token_ids[i]
            k = num_computed + len(new_toks) - state.num_tokens
            if k > 0:
                state.output_token_ids.extend(new_toks[-k:])
                if row is not None:
                    batch.append_token_ids(row, new_toks[-k:])
        elif i < len(cached.num_output_tokens):
            n_out = cached.num_output_tokens[i]
            if n_out < len(state.output_token_ids):
                # Outputs the scheduler discarded: align our copy.
                del state.output_token_ids[n_out:]
                if row is not None:
                    batch.truncate_tokens(row, state.num_tokens)

        if req_id in resumed:
            state.block_ids = tuple(list(ids) for ids in new_ids)  # type: ignore[union-attr]
            if req_id in cached.all_token_ids:
                all_toks = cached.all_token_ids[req_id]
                state.output_token_ids = list(all_toks[state.num_prompt_tokens :])
        elif new_ids is not None:
            for ids, extra in zip(state.block_ids, new_ids):
                ids.extend(extra)

        if row is None:
            to_add.append(state)
            continue
        batch.num_computed_tokens_cpu[row] = num_computed
        if new_ids is not None:
            batch.block_table.append_row(new_ids, row)


def _update_running_requests(
    requests: dict[str, CachedRequestState],
    batch: InputBatch,
    cached: CachedRequestData,
    to_add: list[CachedRequestState],
) -> None:
    """Step 5 for the scheduler's usual lists (no pipelined tokens, nothing resumed, one
    ``num_output_tokens`` entry per request): the same effects as
    :func:`_update_cached_requests`, in one tight loop (every step of every request)."""
    index_get = batch.req_id_to_index.get
    num_computed_cpu = batch.num_computed_tokens_cpu
    append_row = batch.block_table.append_row
    block_ids = cached.new_block_ids or repeat(None)  # validated: one entry each, or none
    for req_id, num_computed, new_ids, n_out in zip(
        cached.req_ids, cached.num_computed_tokens, block_ids, cached.num_output_tokens
    ):
        state = requests[req_id]
        row = index_get(req_id)
        state.num_computed_tokens = num_computed
        if n_out < len(state.output_token_ids):
            # Outputs the scheduler discarded: align our copy.
            del state.output_token_ids[n_out:]
            if row is not None:
                batch.truncate_tokens(row, state.num_tokens)
        if new_ids is not None:
            for ids, extra in zip(state.block_ids, new_ids):
                ids.extend(extra)
        if row is None:
            to_add.append(state)
            continue
        num_computed_cpu[row] = num_computed
        if new_ids is not None:
            append_row(new_ids, row)


def _validate(requests: dict[str, CachedRequestState], batch: InputBatch, sched: SchedulerOutput) -> None:
    cached = sched.scheduled_cached_reqs
    finished = sched.finished_req_ids
    cached_ids = set(cached.req_ids)
    for new in sched.scheduled_new_reqs:
        # A known id that is out of the batch (preempted) is replaced by the new state.
        if new.req_id in batch.req_id_to_index and new.req_id not in finished:
            raise InvalidRequestError(
                f"new request {new.req_id!r} is already running in the batch; finish it first"
            )
        if new.req_id in cached_ids:
            raise InvalidRequestError(f"request {new.req_id!r} is both new and cached")
    n = len(cached.req_ids)
    if len(cached.num_computed_tokens) != n or (cached.new_block_ids and len(cached.new_block_ids) != n):
        raise InvalidRequestError(
            f"CachedRequestData lists disagree: {n} req_ids, {len(cached.num_computed_tokens)} "
            f"num_computed_tokens, {len(cached.new_block_ids)} new_block_ids"
        )
    # The per-id walks below run only when a set-level check (C loops) finds something to
    # report or a resumed request to check, so errors name the same first offending id.
    if (
        cached.resumed_req_ids
        or not requests.keys() >= cached_ids
        or not cached_ids.isdisjoint(finished)
    ):
        _validate_cached_ids(requests, cached, finished)
    new_ids = {r.req_id for r in sched.scheduled_new_reqs}
    scheduled = sched.num_scheduled_tokens.keys()
    # Scheduled = cached + new exactly (disjoint, checked above): nothing more to check.
    if not (
        len(scheduled) == len(cached_ids) + len(new_ids)
        and scheduled >= cached_ids
        and scheduled >= new_ids
    ):
        _validate_scheduled_ids(requests, sched, new_ids)


def _validate_cached_ids(requests, cached, finished) -> None:
    for i, req_id in enumerate(cached.req_ids):
        if req_id not in requests or req_id in finished:
            raise UnknownRequestError(
                f"cached request {req_id!r} is not known to the worker (never added, or finished)"
            )
        if req_id in cached.resumed_req_ids and (
            i >= len(cached.new_block_ids) or cached.new_block_ids[i] is None
        ):
            raise InvalidRequestError(
                f"resumed request {req_id!r} must carry its full block table in new_block_ids"
            )


def _validate_scheduled_ids(requests, sched, new_ids) -> None:
    finished = sched.finished_req_ids
    cached = sched.scheduled_cached_reqs
    for req_id in sched.num_scheduled_tokens:
        if req_id not in new_ids and (req_id not in requests or req_id in finished):
            raise UnknownRequestError(f"scheduled request {req_id!r} is not known to the worker")
    for req_id in [*new_ids, *cached.req_ids]:
        if req_id not in sched.num_scheduled_tokens:
            raise InvalidRequestError(
                f"request {req_id!r} is in the scheduler output but has no num_scheduled_tokens entry"
            )


def record_sampled_tokens(
    requests: dict[str, CachedRequestState],
    batch: InputBatch,
    sampled_token_ids: Sequence[Sequence[int]] | Mapping[str, Sequence[int]],
) -> None:
    """Append sampled tokens to the request states and the batch's token table.

    ``sampled_token_ids``: one list per row in row order (``len == batch.num_reqs``), or a
    ``req_id -> tokens`` mapping (e.g. built from a ``ModelRunnerOutput``). Rows still
    prefilling pass an empty list.
    """
    if isinstance(sampled_token_ids, Mapping):
        items = []
        for req_id, toks in sampled_token_ids.items():
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                raise UnknownRequestError(f"sampled tokens for {req_id!r}, which is not in the batch")
            items.append((row, toks))
    else:
        if len(sampled_token_ids) != batch.num_reqs:
            raise InvalidRequestError(
                f"got sampled tokens for {len(sampled_token_ids)} rows, the batch has {batch.num_reqs}"
            )
        items = list(enumerate(sampled_token_ids))
    for row, toks in items:
        if not toks:
            continue
        req_id = batch.req_ids[row]
        batch.append_token_ids(row, toks)
        requests[req_id].output_token_ids.extend(int(t) for t in toks)
