"""Scheduler: decides, every step, which requests run how many tokens, and owns their KV
blocks through the ``KVCacheManager`` (vLLM 0.33.0 v1 semantics, V1 runner flavour).

One step is ``schedule()`` -> (the worker runs the model) -> ``update_from_output()``.

``schedule()``
  1. Running requests first, in ``running`` order, while tokens remain in the budget.
     Each gets ``min(remaining tokens, long-prefill cap, budget, max_model_len - 1 -
     computed)`` tokens. When ``allocate_slots`` fails, a victim is preempted (FCFS: the
     last running request; priority: the max ``(priority, arrival_time)``, whose tokens
     and blocks are given back if it was already scheduled this step) until the request
     fits or is itself the victim, which ends the running phase.
  2. Waiting requests, only if nothing was preempted in this step, while the budget and
     ``max_num_seqs`` allow: prefix-cache lookup, then ``allocate_slots`` with
     ``full_sequence_must_fit`` (``scheduler_reserve_full_isl``). The first request that
     does not fit stops the phase (head-of-line blocking).
  3. The ``SchedulerOutput`` (new requests with their full tables; running and resumed
     requests in ``scheduled_cached_reqs``, resumed ones with the full table and their id
     in ``resumed_req_ids``), then ``num_computed_tokens`` is advanced optimistically.

``update_from_output()`` appends the sampled tokens, checks stop conditions and frees
finished requests' blocks.

Deliberate differences from vLLM (documented, tested):
  * ``finish_requests`` frees in the order the ids are given (vLLM iterates a set).
  * A waiting request that cannot be admitted while nothing runs can never be admitted
    (the whole pool is free or evictable); it is finished as ``FINISHED_IGNORED`` instead
    of blocking the queue forever.
  * Priority preemption of a request already skipped this step (0 tokens) keeps the loop
    index right (vLLM only adjusts it for requests it scheduled).

Pure Python (control plane).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.output import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    SchedulerStats,
)
from pagedkv.core.planning import generate_scheduler_kv_cache_config, resolve_kv_cache_block_sizes
from pagedkv.core.request import Request, RequestStatus, StopParams
from pagedkv.core.stop import check_stop  # noqa: F401 - re-exported: tests import it from here
from pagedkv.core.request_queue import make_request_queue
from pagedkv.core.spec import KVCacheConfig, MambaCacheMode, MambaSpec
from pagedkv.errors import ConfigError, InvalidRequestError, ModelOutputError

_RUNNING = RequestStatus.RUNNING
_WAITING = RequestStatus.WAITING
_PREEMPTED = RequestStatus.PREEMPTED


class Scheduler:
    """See the module docstring.

    ``kv_cache_config`` may hold ``UniformTypeKVCacheSpecs`` groups (the scheduler uses a
    member spec). ``cache_config`` defaults to ``CacheConfig(block_size=<first group's block
    size>, num_gpu_blocks=kv_cache_config.num_blocks)``.

    ``concurrent_batches``: steps that can be scheduled but not yet settled at once (1 here,
    2 for the ``AsyncScheduler``). As in vLLM, the KV-cache manager is built with
    ``max_in_flight_tokens = concurrent_batches * max_num_batched_tokens``, which caps the
    full-sequence admission reservation of block-recycling groups (sliding window: at most
    ``cdiv(min(W - 1 + in_flight, max_model_len), block_size) + 1`` blocks).
    """

    concurrent_batches = 1

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        kv_cache_config: KVCacheConfig,
        cache_config: CacheConfig | None = None,
        *,
        log_stats: bool = True,
        dcp: int = 1,
    ) -> None:
        if not isinstance(scheduler_config, SchedulerConfig):
            raise ConfigError(
                f"scheduler_config must be a SchedulerConfig, got {type(scheduler_config).__name__}"
            )
        if not isinstance(kv_cache_config, KVCacheConfig):
            raise ConfigError(
                f"kv_cache_config must be a KVCacheConfig, got {type(kv_cache_config).__name__}"
            )
        if not kv_cache_config.kv_cache_groups:
            raise ConfigError(
                "kv_cache_config has no KV-cache groups; an attention-free model needs no "
                "KV-cache scheduler"
            )
        if kv_cache_config.num_blocks < 2:
            raise ConfigError(
                f"kv_cache_config.num_blocks must be >= 2 (block 0 is the null block), "
                f"got {kv_cache_config.num_blocks}"
            )
        config = generate_scheduler_kv_cache_config(kv_cache_config)
        groups = config.kv_cache_groups
        if cache_config is None:
            cache_config = CacheConfig(
                block_size=groups[0].kv_cache_spec.block_size, num_gpu_blocks=config.num_blocks
            )
        elif not isinstance(cache_config, CacheConfig):
            raise ConfigError(f"cache_config must be a CacheConfig, got {type(cache_config).__name__}")
        if cache_config.num_gpu_blocks is not None and cache_config.num_gpu_blocks != config.num_blocks:
            raise ConfigError(
                f"cache_config.num_gpu_blocks ({cache_config.num_gpu_blocks}) differs from "
                f"kv_cache_config.num_blocks ({config.num_blocks}); pass the same pool size "
                "or leave num_gpu_blocks as None"
            )
        if len(groups) == 1 and groups[0].kv_cache_spec.block_size != cache_config.block_size:
            raise ConfigError(
                f"cache_config.block_size ({cache_config.block_size}) differs from the KV-cache "
                f"group's block size ({groups[0].kv_cache_spec.block_size}); use the same value"
            )
        self.scheduler_config = scheduler_config
        self.cache_config = cache_config
        self.kv_cache_config = config
        self.log_stats = log_stats
        self.max_model_len = scheduler_config.max_model_len
        self.max_num_running_reqs = scheduler_config.max_num_seqs
        self.max_num_scheduled_tokens = scheduler_config.token_budget
        self.enable_caching = cache_config.enable_prefix_caching
        self.block_size, self.hash_block_size = resolve_kv_cache_block_sizes(
            groups,
            cache_config.block_size,
            cache_config.enable_prefix_caching,
            dcp=dcp,
            prefix_match_unit=cache_config.prefix_match_unit,
        )
        self.kv_cache_manager = KVCacheManager(
            config,
            max_model_len=self.max_model_len,
            hash_block_size=self.hash_block_size,
            scheduler_block_size=self.block_size,
            enable_caching=self.enable_caching,
            hash_algo=cache_config.prefix_caching_hash_algo,
            log_stats=log_stats,
            watermark=scheduler_config.watermark,
            max_in_flight_tokens=self.concurrent_batches * scheduler_config.max_num_batched_tokens,
        )
        self.block_hasher = (
            self.kv_cache_manager.make_block_hasher() if self.enable_caching else None
        )
        self.policy = scheduler_config.policy
        self._priority = scheduler_config.policy == "priority"
        self._chunked_prefill = scheduler_config.enable_chunked_prefill
        self._long_prefill_threshold = scheduler_config.long_prefill_token_threshold
        self._num_lookahead_tokens = scheduler_config.num_lookahead_tokens
        self._reserve_full_isl = scheduler_config.scheduler_reserve_full_isl
        # Mamba "align" (prefix caching with a state group): prefill chunks end at block
        # boundaries so each block's state checkpoint is the state at its end
        # (_mamba_aligned_chunk); 0 when no state group caches its states
        self._mamba_align_block = next(
            (g.kv_cache_spec.block_size for g in groups
             if isinstance(g.kv_cache_spec, MambaSpec)
             and g.kv_cache_spec.mamba_cache_mode == MambaCacheMode.ALIGN), 0)
        # a step smaller than a block: chunks inside a block run on the block's own state
        # until they reach its end (see _mamba_aligned_chunk)
        self._mamba_small_budget = 0 < scheduler_config.token_budget < self._mamba_align_block

        self.requests: dict[str, Request] = {}
        self.waiting = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []
        # Finished since the last schedule(); reported in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self._prev_step_scheduled_req_ids: set[str] = set()
        # Requests finished without ever running (FINISHED_IGNORED); reported as outputs
        # by the next update_from_output.
        self._ignored: list[Request] = []
        self.num_preemptions = 0
        self._step_preempted = 0
        self.step_counter = 0

    def _mamba_aligned_chunk(self, request: Request, computed: int, n: int) -> int:
        """vLLM's Mamba-align split of a prefill chunk (prompt, or the replay of a resumed
        request), so that every cached state block holds the state at its end: a chunk ending
        before the last block boundary of the known tokens is cut to whole blocks (0: the
        request waits for a step with room for a block); one crossing that boundary ends on
        it; the tail after it runs as it is. Decode steps are left alone.

        When a whole step holds less than a block (``max_num_batched_tokens`` below the
        block size, which vLLM would never schedule), a chunk smaller than a block runs
        instead, and the next ones end no later than that block's end: the block's state is
        updated in place until it reaches the boundary, so it is still the state at its end
        when the block is cached."""
        num_tokens = len(request._all_token_ids)
        if computed >= max(request.num_prompt_tokens, num_tokens - 1):
            return n
        B = self._mamba_align_block
        last = num_tokens - num_tokens % B
        end = computed + n
        into = computed % B
        if end < last:
            if into:  # only after a chunk smaller than a block: finish that block first
                return min(n, B - into)
            whole = n // B * B
            return whole if whole or not self._mamba_small_budget else n
        if computed < last < end:
            return (min(last, computed - into + B) if into else last) - computed
        return n

    # ----- requests ------------------------------------------------------------------------
    def make_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        max_tokens: int = 16,
        min_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        sampling_params: Any = None,
        **kwargs: Any,
    ) -> Request:
        """A ``Request`` wired to this scheduler's block hasher (hashes computed now)."""
        extra = dict(kwargs)
        if arrival_time is not None:
            extra["arrival_time"] = arrival_time
        return Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=sampling_params,
            stop=StopParams(
                max_tokens=max_tokens,
                ignore_eos=ignore_eos,
                stop_token_ids=tuple(stop_token_ids),
                min_tokens=min_tokens,
            ),
            eos_token_id=eos_token_id,
            priority=priority,
            block_hasher=self.block_hasher,
            **extra,
        )

    def add_request(self, request: Request) -> None:
        """Queue a new request. A request built without a block hasher gets this
        scheduler's hasher attached (when prefix caching is on)."""
        if not isinstance(request, Request):
            raise InvalidRequestError(
                f"add_request takes a Request, got {type(request).__name__}; build one with "
                "Scheduler.make_request"
            )
        rid = request.request_id
        if rid in self.requests:
            raise InvalidRequestError(
                f"request id {rid!r} is already in the scheduler; use a unique id per request"
            )
        if request.status != _WAITING or request.num_computed_tokens:
            raise InvalidRequestError(
                f"request {rid!r} is {request.status.name} with {request.num_computed_tokens} "
                "computed tokens; only fresh WAITING requests can be added"
            )
        if request.num_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"request {rid!r} has {request.num_tokens} tokens, more than max_model_len "
                f"({self.max_model_len}); shorten the prompt or raise max_model_len"
            )
        if self.block_hasher is not None and request.block_hasher is None:
            request.block_hasher = self.block_hasher
            request.defer_block_hashes()
        self.requests[rid] = request
        self.waiting.add(request)

    def finish_requests(
        self, request_ids: str | Iterable[str], finished_status: RequestStatus
    ) -> list[str]:
        """Finish (typically abort) requests from outside, e.g. a client disconnect.

        Unknown or already finished ids are ignored, as in vLLM. Running requests leave
        ``running``, waiting/preempted ones leave the queue; each request's blocks are
        freed exactly once (a waiting or preempted request holds none). Returns the ids that
        were actually finished; they appear in the next ``SchedulerOutput.finished_req_ids``.
        """
        if not isinstance(finished_status, RequestStatus) or not RequestStatus.is_finished(
            finished_status
        ):
            raise InvalidRequestError(
                f"finished_status must be a finished RequestStatus (e.g. FINISHED_ABORTED), "
                f"got {finished_status!r}"
            )
        ids = (request_ids,) if isinstance(request_ids, str) else tuple(dict.fromkeys(request_ids))
        valid: list[Request] = []
        for rid in ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished():
                continue
            valid.append(req)
        if not valid:
            return []
        running = [r for r in valid if r.status == _RUNNING]
        if running:
            drop = {id(r) for r in running}
            self.running = [r for r in self.running if id(r) not in drop]
        waiting = [r for r in valid if r.status != _RUNNING]
        if waiting:
            self.waiting.remove_requests(waiting)
        for req in valid:
            req.status = finished_status
            self._free_request(req)
        return [r.request_id for r in valid]

    def _free_request(self, request: Request) -> None:
        rid = request.request_id
        self.finished_req_ids.add(rid)
        self.kv_cache_manager.free(request)
        del self.requests[rid]

    # ----- queries -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or bool(self.waiting)

    def has_finished_requests(self) -> bool:
        return bool(self.finished_req_ids) or bool(self._ignored)

    def has_requests(self) -> bool:
        """Unfinished requests, or finished ones the worker has not been told about yet."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def update_draft_token_ids(self, draft_token_ids: dict[str, list[int]]) -> None:
        """Set speculative draft tokens for running requests (scheduled next step)."""
        for rid, drafts in draft_token_ids.items():
            req = self.requests.get(rid)
            if req is None or req.status != _RUNNING:
                continue
            req.spec_token_ids = [int(t) for t in drafts]

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    # ----- schedule ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One scheduling decision (see the module docstring).

        The ``SchedulerOutput`` lists are built in the same pass that schedules a request,
        and each request's progress (``num_computed_tokens``, in-flight tokens, whether it
        is a partial prefill chunk) is advanced right after its entry was recorded: the
        entries hold the values from before this step, as the worker expects.
        """
        self.step_counter += 1
        manager = self.kv_cache_manager
        manager.new_step_starts()
        allocate_slots = manager.allocate_slots
        allocate_running = manager.allocate_running_slots
        empty_blocks = manager.empty_kv_cache_blocks
        lookahead = self._num_lookahead_tokens
        running = self.running
        waiting = self.waiting
        token_budget = self.max_num_scheduled_tokens
        # The long-prefill cap applies only when another request competes for the step.
        threshold = self._long_prefill_threshold
        if threshold and len(running) + len(waiting) <= 1:
            threshold = 0
        max_len_1 = self.max_model_len - 1
        prev_scheduled = self._prev_step_scheduled_req_ids

        num_scheduled_tokens: dict[str, int] = {}
        spec_decode_tokens: dict[str, list[int]] = {}
        preempted: list[Request] = []
        # CachedRequestData, one entry per scheduled running (then resumed) request.
        cached_ids: list[str] = []
        cached_block_ids: list = []
        cached_computed: list[int] = []
        cached_num_output: list[int] = []
        cached_all_tokens: dict[str, list[int]] = {}
        resumed_ids: set[str] = set()
        new_reqs_data: list[NewRequestData] = []

        # 1. Running requests.
        req_index = 0
        while req_index < len(running) and token_budget > 0:
            request = running[req_index]
            computed = request.num_computed_tokens
            spec = request.spec_token_ids
            # Tokens known so far (prompt, outputs, async placeholders).
            num_known = len(request._all_token_ids) + request.num_output_placeholders
            n = num_known + len(spec) - computed
            if 0 < threshold < n:
                n = threshold
            if n > token_budget:
                n = token_budget
            if n > max_len_1 - computed:
                n = max_len_1 - computed
            if self._mamba_align_block and n > 0:
                n = self._mamba_aligned_chunk(request, computed, n)
            if n <= 0:
                req_index += 1
                continue
            new_blocks = allocate_running(request, n, lookahead)
            while new_blocks is None:
                if self._priority:
                    victim = max(running, key=_priority_key)
                    victim_index = running.index(victim)
                    del running[victim_index]
                    if victim_index < req_index:
                        req_index -= 1
                    vid = victim.request_id
                    if vid in num_scheduled_tokens:
                        # Already scheduled in this step: take its entry and tokens back
                        # (_preempt_request resets the progress advanced below).
                        token_budget += num_scheduled_tokens.pop(vid)
                        i = cached_ids.index(vid)
                        del cached_ids[i], cached_block_ids[i]
                        del cached_computed[i], cached_num_output[i]
                        cached_all_tokens.pop(vid, None)
                        spec_decode_tokens.pop(vid, None)
                else:
                    victim = running.pop()
                self._preempt_request(victim)
                preempted.append(victim)
                if victim is request:
                    break
                new_blocks = allocate_running(request, n, lookahead)
            if new_blocks is None:
                break
            rid = request.request_id
            num_scheduled_tokens[rid] = n
            token_budget -= n
            req_index += 1
            cached_ids.append(rid)
            cached_block_ids.append(
                None if new_blocks is empty_blocks else new_blocks.get_block_ids(allow_none=True)
            )
            cached_computed.append(computed)
            cached_num_output.append(len(request._output_token_ids))
            if rid not in prev_scheduled:
                cached_all_tokens[rid] = list(request._all_token_ids)
            if spec:
                n_spec = n + computed - num_known
                if n_spec > 0:
                    spec_decode_tokens[rid] = spec[:n_spec]
                request.spec_token_ids = []
            computed += n
            request.num_computed_tokens = computed
            request.num_in_flight_tokens += n
            request.is_prefill_chunk = computed < num_known

        # 2. Waiting requests (not if anything was preempted in this step).
        if not preempted:
            max_running = self.max_num_running_reqs
            chunked = self._chunked_prefill
            must_fit = self._reserve_full_isl
            while waiting and token_budget > 0 and len(running) < max_running:
                request = waiting.peek()
                looked_up = request.num_computed_tokens == 0
                if looked_up:
                    hit_blocks, n_local = manager.get_computed_blocks(request, record_stats=False)
                    num_computed = n_local
                else:
                    hit_blocks, n_local = empty_blocks, 0
                    num_computed = request.num_computed_tokens
                n = request.num_tokens - num_computed
                if 0 < threshold < n:
                    n = threshold
                if not chunked and n > token_budget:
                    break
                if n > token_budget:
                    n = token_budget
                if self._mamba_align_block:
                    n = self._mamba_aligned_chunk(request, num_computed, n)
                    if n == 0:
                        break
                new_blocks = allocate_slots(
                    request,
                    n,
                    n_local,
                    hit_blocks,
                    num_lookahead_tokens=lookahead,
                    full_sequence_must_fit=must_fit,
                    has_scheduled_reqs=bool(running),
                )
                if new_blocks is None:
                    if running:
                        break  # head-of-line blocking
                    # Nothing runs: the whole pool is free or evictable, so this request
                    # can never be admitted. Finish it instead of stalling the queue.
                    waiting.pop()
                    request.status = RequestStatus.FINISHED_IGNORED
                    self._ignored.append(request)
                    self._free_request(request)
                    continue
                waiting.pop()
                if looked_up:
                    manager.record_prefix_cache_lookup(request, n_local)
                running.append(request)
                rid = request.request_id
                # The whole table (no block is allocated for it later in this step).
                block_ids = manager.get_blocks(rid)
                if request.status == _WAITING:
                    new_reqs_data.append(NewRequestData(
                        req_id=rid,
                        prompt_token_ids=request.prompt_token_ids,
                        sampling_params=request.sampling_params,
                        block_ids=block_ids.get_block_ids(),
                        num_computed_tokens=num_computed,
                        lora_request=request.lora_request,
                        mm_features=request.mm_features,
                    ))
                else:
                    # Resumed: the full table replaces the worker's stale copy.
                    cached_ids.append(rid)
                    resumed_ids.add(rid)
                    cached_block_ids.append(block_ids.get_block_ids(allow_none=True))
                    cached_computed.append(num_computed)
                    cached_num_output.append(len(request._output_token_ids))
                    cached_all_tokens[rid] = list(request._all_token_ids)
                num_scheduled_tokens[rid] = n
                token_budget -= n
                request.status = _RUNNING
                computed = num_computed + n
                request.num_computed_tokens = computed
                request.num_in_flight_tokens += n
                request.is_prefill_chunk = (
                    computed < len(request._all_token_ids) + request.num_output_placeholders
                )

        # 3. Output.
        output = SchedulerOutput(
            scheduled_new_reqs=new_reqs_data,
            scheduled_cached_reqs=CachedRequestData(
                req_ids=cached_ids,
                resumed_req_ids=resumed_ids,
                all_token_ids=cached_all_tokens,
                new_block_ids=cached_block_ids,
                num_computed_tokens=cached_computed,
                num_output_tokens=cached_num_output,
            ),
            num_scheduled_tokens=num_scheduled_tokens,
            total_num_scheduled_tokens=self.max_num_scheduled_tokens - token_budget,
            scheduled_spec_decode_tokens=spec_decode_tokens,
            finished_req_ids=self.finished_req_ids,
            preempted_req_ids={r.request_id for r in preempted},
        )
        new_ids_to_zero = manager.take_new_block_ids()
        if new_ids_to_zero:
            output.new_block_ids_to_zero = new_ids_to_zero
        if running:
            # the blocks every request holding blocks shares, walked along any running one
            output.num_common_prefix_blocks = manager.get_num_common_prefix_blocks(
                running[0].request_id)
        self._step_preempted = len(preempted)
        self._prev_step_scheduled_req_ids = set(num_scheduled_tokens)
        # The output keeps its own reference to the old set.
        self.finished_req_ids = set()
        return output

    def _preempt_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = _PREEMPTED
        request.num_computed_tokens = 0
        request.num_in_flight_tokens = 0
        request.is_prefill_chunk = False
        if request.spec_token_ids:
            request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # ----- update --------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Apply one step's model output: append sampled tokens, check stops, free the
        blocks of finished requests. Returns the per-request outputs and stats."""
        sampled = model_runner_output.sampled_token_ids
        index = model_runner_output.req_id_to_index
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        requests = self.requests
        max_model_len = self.max_model_len
        outputs: list[EngineCoreOutput] = []
        finished: list[str] = []
        stopped: list[Request] = []
        if self._ignored:
            for req in self._ignored:
                outputs.append(EngineCoreOutput(req.request_id, [], req.get_finished_reason()))
                finished.append(req.request_id)
            self._ignored = []

        # Fast append of one sampled int token (every non-speculative step): the same
        # effects as req.append_output_token_ids(tok), with the block hasher called only
        # when the token completes a hash block (the hasher returns [] otherwise). Requests
        # built with another hasher take the generic method.
        hasher = self.block_hasher
        hash_block_size = self.kv_cache_manager.hash_block_size
        running_status = _RUNNING
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            req = requests.get(rid)
            if req is None:
                continue  # finished (aborted) after it was scheduled
            req.num_in_flight_tokens -= n
            if sampled:
                i = index.get(rid)
                if i is None:
                    raise ModelOutputError(
                        f"model output has no entry for scheduled request {rid!r}; the runner "
                        "must report every request of the SchedulerOutput"
                    )
                new_ids = sampled[i]
            else:
                new_ids = ()
            if not new_ids:
                continue
            if req.status != running_status:
                continue  # preempted meanwhile; its work is recomputed
            drafts = spec_tokens.get(rid) if spec_tokens else None
            if drafts:
                rejected = len(drafts) + 1 - len(new_ids)
                if rejected > 0:
                    req.num_computed_tokens -= rejected
            elif req.is_prefill_chunk:
                raise ModelOutputError(
                    f"request {rid!r} sampled {list(new_ids)} during a partial-prefill chunk; "
                    "partial chunks must report no sampled token ([])"
                )
            if len(new_ids) == 1:
                tok = new_ids[0]
                if type(tok) is int and req.block_hasher is hasher:
                    out_ids = req._output_token_ids
                    out_ids.append(tok)
                    all_ids = req._all_token_ids
                    all_ids.append(tok)
                    num_all = len(all_ids)
                    if (hasher is not None
                            and num_all >= (len(req.block_hashes) + 1) * hash_block_size):
                        req.block_hashes.extend(hasher(req))
                    stop = req.stop
                    if (len(out_ids) < stop.max_tokens and num_all < max_model_len
                            and (tok != req.eos_token_id or stop.ignore_eos)
                            and not (stop.stop_token_ids and tok in stop.stop_token_ids)):
                        # No length cap, no EOS, no stop token: check_stop would say no.
                        outputs.append(EngineCoreOutput(rid, [tok]))
                        continue
                else:
                    req.append_output_token_ids(tok)
                if check_stop(req, max_model_len):
                    stopped.append(req)
                    outputs.append(EngineCoreOutput(rid, [tok], req.get_finished_reason(),
                                                    req.stop_reason))
                else:
                    outputs.append(EngineCoreOutput(rid, [tok]))
                continue
            kept: list[int] = []
            done = False
            for tok in new_ids:
                req.append_output_token_ids(tok)
                kept.append(tok)
                if check_stop(req, max_model_len):
                    done = True
                    break
            if done:
                stopped.append(req)
                outputs.append(EngineCoreOutput(rid, kept, req.get_finished_reason(),
                                                req.stop_reason))
            else:
                outputs.append(EngineCoreOutput(rid, kept))

        if stopped:
            drop = set()
            for req in stopped:
                drop.add(id(req))
                finished.append(req.request_id)
                self._free_request(req)
            self.running = [r for r in self.running if id(r) not in drop]

        stats = self.make_stats() if self.log_stats else None
        return EngineCoreOutputs(outputs, finished, stats)

    def make_stats(self) -> SchedulerStats:
        """Stats now; the prefix-cache counters cover the lookups since the last call."""
        manager = self.kv_cache_manager
        return SchedulerStats(
            step=self.step_counter,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=manager.usage,
            num_free_blocks=manager.num_free_blocks,
            num_preempted_reqs=self._step_preempted,
            num_preemptions_total=self.num_preemptions,
            prefix_cache_stats=manager.make_prefix_cache_stats(),
        )


def _priority_key(request: Request) -> tuple:
    return (request.priority, request.arrival_time)
