"""LLMEngine: a model on the paged index layer, stepped one ``SchedulerOutput`` at a time.

The real-model sibling of ``IndexLayerDriver``: ``Scheduler.schedule()`` -> ``ModelRunner.
execute_model()`` -> ``Scheduler.update_from_output()`` -> output processing (incremental
detokenization, stop strings, logprobs, metrics).

With ``async_scheduling`` (an ``AsyncScheduler``, see ``pagedkv.engine.async_scheduler``) a
step schedules and enqueues step k, then collects step k-1 (which ran on the device meanwhile)
and processes its outputs: the host's scheduling, input preparation and output processing
overlap the device's forward pass; the tokens are the same. ``flush()`` collects the step still
in flight.

Detokenization of a request without stop strings is deferred until its text is read (a final
output, or ``to_output`` while streaming): the tokens are then fed to the incremental
detokenizer in one update (the same text as one update per step). Requests with stop strings are
detokenized every step (the stop check needs the text).

Requests are validated completely before anything reaches the scheduler (``InvalidRequestError``:
empty prompt, prompt that leaves no room for an output token within ``max_model_len``, token ids
outside the vocabulary, text without a tokenizer, stop strings without a tokenizer, stop token ids
outside the vocabulary, anything but ``SamplingParams``), so a rejected request allocates nothing.

Stop strings are found by the detokenizer after the step; the request is then finished through
``Scheduler.finish_requests(..., FINISHED_STOPPED)``, which frees its blocks at once. ``abort``
does the same with ``FINISHED_ABORTED``.

``build_engine`` assembles everything from a model (+ tokenizer): attention backend, KV-pool
sizing (``pagedkv.engine.memory``), KV-cache config, scheduler, runner, CUDA graphs.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from pagedkv.attention.backend import AttentionBackend
from pagedkv.config import CacheConfig, EngineConfig, SchedulerConfig
from pagedkv.core.request import FinishReason, Request, RequestStatus
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.spec import KVCacheConfig, MambaSpec, cdiv
from pagedkv.engine.async_scheduler import AsyncScheduler
from pagedkv.engine.heap import freeze_after_startup
from pagedkv.engine.memory import (
    CUDA_GRAPH_RESERVE_BYTES,
    KVCacheSizing,
    fitted_max_model_len,
    group_capacity,
    check_pool,
    kv_bytes_held_by_other_engines,
    register_engine,
    size_kv_cache,
    warn_if_others_hold_memory,
)
from pagedkv.engine.validation import PromptType, validate_request
from pagedkv.engine.outputs import OutputDelta, CompletionOutput, Logprob, RequestMetrics, RequestOutput
from pagedkv.errors import ConfigError, InvalidRequestError, InvariantError, UnknownRequestError
from pagedkv.kernels._common import TOKEN_BLOCK_LEVELS
from pagedkv.models.generation_config import GenerationDefaults
from pagedkv.sampling.detokenizer import IncrementalDetokenizer
from pagedkv.sampling.params import SamplingParams
from pagedkv.worker.model_runner import (
    ModelRunner,
    kv_cache_groups_for,
    profile_peak_memory,
)
from pagedkv.worker.kv_caches import kv_block_bytes

# "triton": the Triton backend, its prefill requests through cuDNN's paged attention where the
# frontend is installed (pip install pagedkv[cudnn]; TritonAttentionBackend's paged_prefill
# "auto"), else through its own kernel; "triton+cudnn": the same with paged_prefill="cudnn" asked
# for explicitly
ATTENTION_BACKENDS = ("auto", "torch_ref", "triton", "triton+cudnn")


def make_attention_backend(name: str | AttentionBackend, device: torch.device) -> AttentionBackend:
    """``"auto"``: the Triton backend on CUDA, the torch reference on CPU; ``"triton"`` needs
    CUDA (or ``TRITON_INTERPRET=1``) and sends its prefill requests through cuDNN's paged
    attention where the frontend is installed (``paged_prefill="auto"``), else through its own
    kernel; ``"triton+cudnn"``: the Triton backend with ``paged_prefill="cudnn"`` named
    explicitly; an ``AttentionBackend`` instance is used as is (e.g.
    ``TritonAttentionBackend(paged_prefill="triton")``: Triton kernels only)."""
    if isinstance(name, AttentionBackend):
        return name
    if name not in ATTENTION_BACKENDS:
        raise ConfigError(f"unknown attention_backend {name!r}; use one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch_ref"
    if name == "torch_ref":
        from pagedkv.attention.torch_ref import TorchRefBackend

        return TorchRefBackend()
    from pagedkv.attention.triton_backend import TritonAttentionBackend

    if name == "triton+cudnn":
        return TritonAttentionBackend(paged_prefill="cudnn")
    return TritonAttentionBackend()


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    request: Request
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer | None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Detokenization without stop strings is deferred until the text is read (``to_output``):
    # the tokens are fed to the incremental detokenizer then, in one update, which gives the
    # same text as one update per step. ``text_tokens``: output tokens fed so far.
    lazy_text: bool = False
    text_tokens: int = 0
    # what to_delta has reported so far (tokens, characters of text)
    sent_tokens: int = 0
    sent_text: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_token_ids(self) -> Sequence[int]:
        """The request's output tokens: the scheduler's list itself (a sampled token is
        appended once on this side, by the scheduler; the runner keeps its own rows)."""
        return self.request.output_token_ids

    def _sync_text(self) -> None:
        d = self.detokenizer
        if d.finished:
            return
        new = self.output_token_ids[self.text_tokens:]
        reason = self.finish_reason
        final = reason is not None and reason != FinishReason.ABORT.value
        if not new and not final:
            return
        d.update(new, stop_terminated=final and reason == FinishReason.STOP.value, finished=final)
        self.text_tokens = len(self.output_token_ids)

    def to_output(self) -> RequestOutput:
        text = ""
        if self.detokenizer is not None:
            if self.lazy_text:
                self._sync_text()
            # a running request's text stops short of a stop string that may still complete
            text = self.detokenizer.emitted_text
        comp = CompletionOutput(
            index=0,
            text=text,
            token_ids=list(self.output_token_ids),
            cumulative_logprob=self.cumulative_logprob,
            logprobs=None if self.logprobs is None else list(self.logprobs),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids), [comp],
                             self.finished, self.metrics)

    def to_delta(self) -> OutputDelta:
        """What was added since the last ``to_delta`` (no copy of what came before)."""
        text = ""
        if self.detokenizer is not None:
            if self.lazy_text:
                self._sync_text()
            full = self.detokenizer.emitted_text
            text = full[self.sent_text:]
            self.sent_text = len(full)
        k = self.sent_tokens
        toks = self.output_token_ids[k:]
        lps = None if self.logprobs is None else self.logprobs[k:]
        self.sent_tokens = len(self.output_token_ids)
        m = self.metrics
        return OutputDelta((self.request_id, toks, text, lps, self.cumulative_logprob,
                            self.finish_reason, self.stop_reason, m.first_scheduled_time,
                            m.first_token_time, m.last_token_time, m.finished_time,
                            m.num_cached_tokens, m.num_preemptions))


@dataclass
class EngineStats:
    steps: int = 0
    tokens_generated: int = 0
    prompt_tokens_scheduled: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    peak_kv_usage: float = 0.0
    cuda_graph_steps: int = 0


class LLMEngine:
    """Scheduler + ModelRunner + output processing (see the module docstring)."""

    def __init__(self, model: Any, tokenizer: Any, scheduler: Scheduler, runner: ModelRunner,
                 sizing: KVCacheSizing | None = None, *, async_scheduling: bool = False,
                 generation_defaults: GenerationDefaults | None = None,
                 sanitize: bool = False) -> None:
        if async_scheduling and not isinstance(scheduler, AsyncScheduler):
            raise ConfigError("async_scheduling needs an AsyncScheduler (build_engine makes one)")
        self.async_scheduling = async_scheduling
        self._inflight = None  # (SchedulerOutput, StepHandle) of the step on the device
        self.model = model
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.runner = runner
        self.sizing = sizing
        self.config = model.config
        self.vocab_size = model.config.vocab_size
        self.max_model_len = scheduler.max_model_len
        self.generation_defaults = generation_defaults or GenerationDefaults()
        # EOS: config.json's ids, then generation_config.json's (instruct models list their
        # end-of-turn ids there), else the tokenizer's
        eos = list(dict.fromkeys([*model.config.eos_token_ids,
                                  *self.generation_defaults.eos_token_ids]))
        if not eos and tokenizer is not None and tokenizer.eos_token_id is not None:
            eos = [tokenizer.eos_token_id]
        self.eos_token_ids = eos
        self._requests: dict[str, _RequestState] = {}
        self._pending: list[_RequestState] = []  # finished outside a step (abort)
        self._ids = itertools.count()
        self.stats = EngineStats()
        # True from the start of a step until it returns: still True after an exception or a
        # KeyboardInterrupt escaped a step (``recover`` then knows the step's state is torn).
        self._stepping = False
        self.sanitize = sanitize
        if sanitize:
            from pagedkv.sanitizer import check_pool, check_step

            mgr, batch = scheduler.kv_cache_manager, runner.input_batch

            def step_check(step) -> None:  # after input preparation, before the forward pass
                check_pool(mgr)
                check_step(mgr, batch, step)

            runner.step_check = step_check
            self._check_pool = lambda: check_pool(mgr)

    @property
    def eos_token_ids(self) -> list[int]:
        """The EOS ids requests stop on (unless ``ignore_eos``); the runner keeps them from
        being sampled before a request's ``min_tokens``."""
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:
        self._eos_token_ids = list(ids)
        self.runner.eos_token_ids = tuple(self._eos_token_ids)  # rebuilds the per-row stop ids

    # ----- requests ------------------------------------------------------------------------
    def new_request_id(self) -> str:
        rid = str(next(self._ids))
        while rid in self._requests:
            rid = str(next(self._ids))
        return rid

    def validate(self, prompt: PromptType, params: SamplingParams | None
                 ) -> tuple[str | None, list[int], SamplingParams]:
        """``(prompt text or None, prompt token ids, params)`` or ``InvalidRequestError``
        (:func:`validate_request` with this engine's tokenizer, vocabulary and context).
        ``params=None`` takes :meth:`default_sampling_params`."""
        if params is None:
            params = self.default_sampling_params()
        return validate_request(prompt, params, tokenizer=self.tokenizer,
                                vocab_size=self.vocab_size, max_model_len=self.max_model_len)

    def default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the checkpoint's ``generation_config.json`` values
        (temperature, top_p, top_k, min_p, max_new_tokens), as vLLM applies them when a request
        brings no sampling parameters."""
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        return SamplingParams(**{k: v for k, v in self.generation_defaults.sampling.items()
                                 if k in fields})

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None, *, arrival_time: float | None = None,
                    _validated: tuple | None = None) -> str:
        """Validate and queue one request; returns its id."""
        text, ids, params = _validated if _validated is not None else self.validate(prompt, params)
        rid = self.new_request_id() if request_id is None else str(request_id)
        if rid in self._requests:
            raise InvalidRequestError(f"request id {rid!r} is in use; pass a unique id")
        if self._inflight is not None and rid in self._inflight[0].num_scheduled_tokens:
            raise InvalidRequestError(
                f"request id {rid!r} belongs to a finished request whose last step is still in "
                "flight (async scheduling); use another id or call step()/flush() first"
            )
        params = params.resolved(self.eos_token_ids)  # the stop rules: pagedkv.core.stop
        stop = params.to_stop_params(self.max_model_len)
        now = time.monotonic() if arrival_time is None else arrival_time
        req = Request(
            request_id=rid,
            prompt_token_ids=ids,
            sampling_params=params,
            stop=stop,
            eos_token_id=self.eos_token_ids[0] if self.eos_token_ids else None,
            arrival_time=now,
            block_hasher=self.scheduler.block_hasher,
            prompt_ids_checked=True,  # validate_request's own list of plain ints
        )
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params, ids)
        st = _RequestState(rid, text, ids, params, req,
                           RequestMetrics(arrival_time=now, num_prompt_tokens=len(ids)), detok,
                           lazy_text=detok is not None and not params.stop)
        if params.logprobs is not None:
            st.logprobs = []
            st.cumulative_logprob = 0.0
        self.scheduler.add_request(req)
        self._requests[rid] = st
        return rid

    def abort(self, request_id: str) -> bool:
        """Finish a waiting or running request now (its blocks are freed); returns whether it
        was still unfinished (False for an id that already finished and was reported, or was
        never added: a client disconnect can race with the request finishing). Its final
        output (``finish_reason="abort"``) comes with the next ``step()``."""
        st = self._requests.get(request_id)
        if st is None or st.finished:
            return False
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        self._finish(st, FinishReason.ABORT.value, None, time.monotonic())
        self._pending.append(st)
        return True

    def has_unfinished_requests(self) -> bool:
        return any(not st.finished for st in self._requests.values())

    def get_request(self, request_id: str) -> RequestOutput:
        st = self._requests.get(request_id)
        if st is None:
            raise UnknownRequestError(f"request {request_id!r} is not known")
        return st.to_output()

    def release(self, request_id: str) -> None:
        """Forget a finished request's output state now (``step`` forgets a request itself
        once it returned its final output)."""
        st = self._requests.get(request_id)
        if st is not None and st.finished:
            del self._requests[request_id]

    def _emit(self, changed: list[_RequestState], deltas: bool = False) -> list[RequestOutput]:
        """The outputs of ``changed``; a finished request's state is dropped once its final
        output is out, so a long-running ``add_request``/``step`` loop does not grow."""
        outs = [st.to_delta() for st in changed] if deltas else [st.to_output() for st in changed]
        reqs = self._requests
        for st in changed:
            if st.finished and reqs.get(st.request_id) is st:
                del reqs[st.request_id]
        return outs

    # ----- recovery ------------------------------------------------------------------------
    def recover(self, request_ids=()) -> list[str]:
        """Leave the engine consistent after an exception or a KeyboardInterrupt escaped a
        caller's loop (``LLM.generate`` calls it for its requests). Returns the aborted ids.

        * The exception came from inside a step (``step``/``flush`` did not return): that
          step's bookkeeping is torn (scheduled but never updated, maybe half-applied to the
          worker's batch, prefix-cache blocks registered for KV that was never written). Every
          unfinished request is aborted, the runner forgets its batch and enqueued steps, and
          the prefix cache is reset (all blocks are free then).
        * Otherwise (between steps): a step still in flight (async scheduling) is collected
          normally, its outputs kept for the next ``step()``; then ``request_ids`` are aborted.

        Aborted and finished states of ``request_ids`` are dropped at once (no output is
        reported for them); blocks are freed immediately.
        """
        wanted = set(request_ids)
        sched = self.scheduler
        torn = self._stepping
        self._stepping = False
        if torn:
            self._inflight = None
            self.runner.reset_requests()
            victims = [rid for rid, st in self._requests.items() if not st.finished]
        else:
            self.settle()
            victims = [rid for rid in request_ids
                       if rid in self._requests and not self._requests[rid].finished]
        now = time.monotonic()
        for rid in victims:
            sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
            self._finish(self._requests[rid], FinishReason.ABORT.value, None, now)
        gone = wanted | set(victims)
        for rid in gone:
            st = self._requests.get(rid)
            if st is not None and st.finished:
                del self._requests[rid]
        self._pending = [st for st in self._pending if st.request_id not in gone]
        if torn:
            sched.reset_prefix_cache()
        return victims

    # ----- one step ------------------------------------------------------------------------
    def step(self, finished_only: bool = False, deltas: bool = False) -> list[RequestOutput]:
        """One engine step; returns the outputs of requests that gained tokens or finished
        (only the finished ones with ``finished_only``: no per-step copies of running
        requests' token lists). With async scheduling the outputs are those of the previous
        step (the one that ran on the device while this one was scheduled). A finished
        request is forgotten once its final output was returned. ``deltas``: return
        :class:`OutputDelta` tuples (only what each request gained) instead of cumulative
        outputs; use one form for a request's whole life."""
        self._stepping = True
        if self.async_scheduling:
            changed = self._step_async(finished_only)
        else:
            changed = self._step_sync(finished_only)
        self._stepping = False
        return self._emit(changed, deltas)

    def _step_sync(self, finished_only: bool) -> list[_RequestState]:
        changed: list[_RequestState] = self._pending
        self._pending = []
        sched = self.scheduler
        if not sched.has_requests():
            return changed
        so = self._schedule()
        mro = self.runner.execute_model(so)
        eco = sched.update_from_output(so, mro)
        self._process(mro, eco, changed, finished_only)
        return changed

    def _step_async(self, finished_only: bool) -> list[_RequestState]:
        """Schedule and enqueue step k, then collect and process step k-1 (which ran on the
        device meanwhile)."""
        changed: list[_RequestState] = self._pending
        self._pending = []
        sched = self.scheduler
        prev, self._inflight = self._inflight, None
        cur = None
        if sched.has_requests():
            so = self._schedule()
            cur = (so, self.runner.execute_model_async(so))
        if prev is not None:
            self._collect(prev, changed, finished_only)
        if cur is not None:
            if cur[0].total_num_scheduled_tokens:
                self._inflight = cur
            else:  # nothing runs: report it now (finished ids, ignored requests)
                self._collect(cur, changed, finished_only)
        return changed

    def flush(self, deltas: bool = False) -> list[RequestOutput]:
        """Async scheduling: collect the step still in flight (if any) and return its outputs;
        a no-op otherwise."""
        self._stepping = True
        changed: list[_RequestState] = self._pending
        self._pending = []
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self._collect(prev, changed, False)
        self._stepping = False
        return self._emit(changed, deltas)

    def settle(self) -> None:
        """Async scheduling: collect the step still in flight (if any) without returning its
        outputs: they come with the next ``step()``. A no-op otherwise."""
        self._stepping = True
        prev, self._inflight = self._inflight, None
        if prev is not None:
            changed: list[_RequestState] = []
            self._collect(prev, changed, False)
            self._pending.extend(changed)
        self._stepping = False

    def _collect(self, inflight, changed: list, finished_only: bool) -> None:
        so, handle = inflight
        mro = self.runner.get_output(handle)
        eco = self.scheduler.update_from_output(so, mro)
        self._process(mro, eco, changed, finished_only)

    def _schedule(self):
        so = self.scheduler.schedule()
        if so.scheduled_new_reqs:
            now = time.monotonic()
            reqs = self._requests
            for new in so.scheduled_new_reqs:
                st = reqs.get(new.req_id)
                if st is not None and st.metrics.first_scheduled_time is None:
                    st.metrics.first_scheduled_time = now
                    st.metrics.num_cached_tokens = new.num_computed_tokens
        return so

    def _process(self, mro, eco, changed: list, finished_only: bool) -> None:
        """Output processing of one step: metrics, logprobs, detokenization, stop strings."""
        sched = self.scheduler
        if self.sanitize:
            self._check_pool()
        reqs = self._requests
        now = time.monotonic()
        stats = self.stats
        stats.steps += 1
        stats.cuda_graph_steps = self.runner.num_graph_steps
        s = eco.scheduler_stats
        if s is not None:
            if s.kv_cache_usage > stats.peak_kv_usage:
                stats.peak_kv_usage = s.kv_cache_usage
            pcs = s.prefix_cache_stats
            if pcs is not None:
                stats.prefix_cache_queries += pcs.queries
                stats.prefix_cache_hits += pcs.hits
        logprobs = getattr(mro, "logprobs", None)
        n_tokens = 0
        for o in eco.outputs:
            st = reqs.get(o.req_id)
            if st is None or st.finished:
                continue
            toks = o.new_token_ids
            m = st.metrics
            if toks:
                n_tokens += len(toks)
                if m.first_token_time is None:
                    m.first_token_time = now
                m.last_token_time = now
                m.num_generated_tokens += len(toks)
                if st.logprobs is not None and logprobs:
                    self._add_logprobs(st, logprobs.get(o.req_id))
            reason = o.finish_reason
            stop_reason = o.stop_reason
            if st.detokenizer is not None and not st.lazy_text:
                d = st.detokenizer.update(toks, stop_terminated=reason == FinishReason.STOP,
                                          finished=reason is not None)
                st.text_tokens = len(st.output_token_ids)
                if d.stop_string is not None:
                    if reason is None:
                        sched.finish_requests([o.req_id], RequestStatus.FINISHED_STOPPED)
                    reason, stop_reason = FinishReason.STOP, d.stop_string
            if reason is not None:
                self._finish(st, reason.value, stop_reason, now)
                changed.append(st)
            elif not finished_only:
                changed.append(st)
        stats.tokens_generated += n_tokens

    def _add_logprobs(self, st: _RequestState, lp) -> None:
        if lp is None:
            return
        entry: dict[int, Logprob] = {}
        decode = self.tokenizer.decode if self.tokenizer is not None else None
        for i, (tid, val) in enumerate(zip(lp.token_ids, lp.logprobs)):
            if tid in entry:
                continue
            rank = lp.rank if i == 0 else i
            entry[tid] = Logprob(val, rank, decode([tid], skip_special_tokens=False) if decode else None)
        st.logprobs.append(entry)
        st.cumulative_logprob += lp.logprobs[0]

    def _finish(self, st: _RequestState, reason: str, stop_reason, now: float) -> None:
        st.finish_reason = reason
        st.stop_reason = stop_reason
        st.metrics.finished_time = now
        st.metrics.num_preemptions = st.request.num_preemptions

    # ----- warm-up ---------------------------------------------------------------------------
    def warm_up(self, seed: int = 0) -> int:
        """Run throw-away requests through every kind of step a real run can take, so that the
        kernels are compiled before the first user request: Triton and ``torch.compile`` compile
        on first use, which otherwise stalls the first mixed step of a run (1.3 s on the H200,
        measured in W1's second step).

        Per round: a short request alone (a step of fresh prefills: 8 tokens in round 1, 40
        in round 2, one per token-block level of the index kernels), its decodes (graph replays
        when captured), then a long request (``max_num_batched_tokens`` + 32 tokens, capped by
        ``max_model_len``) joins: mixed steps (the short one decodes while the long one's
        prompt prefills, chunked over cached context when it exceeds the budget) and decodes of
        both. Where ``max_model_len`` caps it below the budget, round 1 has as many long
        requests as fill the budget + 32 tokens (as the free blocks and ``max_num_seqs``
        allow), so that its mixed step is a full-budget step: a workload's first full step
        then meets no new activation size or GEMM shape (W1 / W3 at 16,384 tokens a step and
        ``max_model_len`` 4,096: the long request had 4,092 tokens). Round 1 is greedy; in
        round 2 the short request samples (temperature, top-k, top-p, min-p, a seed,
        logprobs), for the sampler.

        Then, where the runner's attention backend has cascade attention and prefix caching is
        on, a shared-prefix round (:meth:`_warm_up_cascade`): the eager cascade launches (the
        suffix prefill and the merge of a mixed step) are compiled nowhere else, and a
        shared-prefix workload's first mixed steps otherwise pay for them (W3 on the H200: its
        5 prefill-like steps took 2.05 s of a 3.21 s run).

        Afterwards nothing of it is left: the requests are gone, their blocks free, the prefix
        cache reset, and the engine's and runner's counters as before. Returns the number of
        steps run. Must be called with no requests in the engine."""
        # (finished ids the worker has not been told about yet may remain: the next step
        # tells it, the warm-up's first one included)
        if (self._requests or self._inflight is not None
                or self.scheduler.has_unfinished_requests()):
            raise InvariantError("warm-up", "warm_up needs an idle engine",
                                 requests=len(self._requests))
        import random

        sched, runner = self.scheduler, self.runner
        saved = (dataclasses.replace(self.stats), sched.num_preemptions, runner.num_steps,
                 runner.num_graph_steps, getattr(runner, "num_mixed_graph_steps", 0))
        rng = random.Random(seed)
        budget = sched.scheduler_config.max_num_batched_tokens
        long_len = max(2, min(budget + 32, self.max_model_len - 4))
        # round 1's short prompt fits the smallest token-block level of the index kernels
        # (slot mappings: compiled variants per level, kernels._common.token_launch_geometry);
        # round 2's the next one (a prompt of 33-256 tokens, a chat turn's size): a user's
        # first such prompt otherwise compiled the slot-mapping kernel in its first step
        # (H200: 310 ms in a fresh process, 18 ms from Triton's disk cache)
        short_lens = (max(1, min(8, long_len // 2)),
                      max(1, min(TOKEN_BLOCK_LEVELS[0] + 8, long_len // 2)))
        greedy = dict(temperature=0.0, ignore_eos=True)
        sampled = dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=seed, logprobs=2,
                       ignore_eos=True)
        num_long = self._warm_up_long_requests(long_len, budget)
        steps = 0

        def prompt(n: int) -> list[int]:
            return [rng.randrange(self.vocab_size) for _ in range(n)]

        def step() -> None:
            nonlocal steps
            self.step(finished_only=True)
            steps += 1

        try:
            for r, short_kw in enumerate((greedy, sampled)):
                n_long = num_long if r == 0 else 1
                # the long prompts' prefill chunks, then their decodes
                long_steps = -(-(n_long * long_len) // max(1, budget - 1)) + 3
                short = self.add_request(prompt(short_lens[r]),
                                         SamplingParams(max_tokens=long_steps + 3, **short_kw),
                                         request_id=f"__warmup-{r}-short")
                step()  # the short request's prefill
                step()  # its first decode
                longs = [self.add_request(prompt(long_len), SamplingParams(max_tokens=3, **greedy),
                                          request_id=f"__warmup-{r}-long" + (f"-{i}" if i else ""))
                         for i in range(n_long)]
                while self.has_unfinished_requests():
                    step()
                self.flush()
                for rid in [short] + longs:
                    self.release(rid)
            self._warm_up_cascade(prompt, step, greedy)
        except BaseException:  # an error or an interrupt: no warm-up request may stay behind
            self.recover([rid for rid in self._requests if rid.startswith("__warmup-")])
            raise
        finally:
            self._pending = []
            sched.reset_prefix_cache()
            (self.stats, sched.num_preemptions, runner.num_steps, runner.num_graph_steps,
             mixed) = saved
            if hasattr(runner, "num_mixed_graph_steps"):
                runner.num_mixed_graph_steps = mixed
        return steps

    def _warm_up_long_requests(self, long_len: int, budget: int) -> int:
        """How many long requests of ``long_len`` tokens :meth:`warm_up`'s first round runs:
        enough to fill ``budget`` + 32 tokens, at most ``max_num_seqs - 1`` (the short request
        runs beside them) and as many as the free blocks hold (a block of slack each, in
        every KV-cache group); 1 where the runner does not tell its groups' block sizes."""
        sched = self.scheduler
        sizes = getattr(self.runner, "_group_block_sizes", None)
        want = cdiv(budget + 32, max(1, long_len))
        if want <= 1 or not sizes:
            return 1
        per_request = (cdiv(long_len + 3, min(sizes)) + 1) * len(sizes)
        short = (cdiv(8 + 64, min(sizes)) + 1) * len(sizes)
        room = (sched.kv_cache_manager.num_free_blocks - short) // per_request
        return max(1, min(want, sched.scheduler_config.max_num_seqs - 1, room))

    def _warm_up_cascade(self, prompt, step, greedy: dict) -> None:
        """The shared-prefix round of :meth:`warm_up`: one request with a prompt of ``P``
        shared tokens (``CascadeConfig.min_prefix_tokens`` rounded up to whole blocks of every
        KV-cache group) + 8 of its own prefills; once its prefill is scheduled, ``min_reqs - 1``
        more with the same ``P`` tokens + ``J`` of their own join on prefix-cache hits: a mixed
        cascade step (the first request decodes, the others extend over the shared ``P``), then
        cascade decodes (the ``CASCADE`` graphs where captured). ``J = (budget - 1) //
        (min_reqs - 1)`` (at least 8, capped by ``max_model_len`` and by the free blocks, else
        8), so that the mixed step fills the step budget as a shared-prefix workload's
        prefill steps do: its cascade buffers (float32 partial outputs of every row) and
        activations then reach their full size here, not in a user's first step (W3 on the
        H200: the first timed run's 3 prefill-like steps took 0.22 s, a second run's 0.13 s,
        the first with one new allocator segment). For the round only, the
        backend's ``min_saved_us`` is 0 (its other thresholds are met as configured); the
        backend's config is restored however the round ends. Skipped where it cannot take
        cascade attention: no cascade backend on this process's runner (tensor-parallel ranks
        run their own), prefix caching off, ``max_num_seqs < min_reqs``, or ``P + 16`` tokens
        beyond ``max_model_len`` or the free blocks."""
        import math

        sched, runner = self.scheduler, self.runner
        backend = getattr(runner, "attn_backend", None)
        cfg = getattr(backend, "cascade", None)
        sizes = getattr(runner, "_group_block_sizes", None)
        if (not getattr(backend, "supports_cascade", False) or cfg is None or not sizes
                or not sched.kv_cache_manager.enable_caching
                or sched.scheduler_config.max_num_seqs < cfg.min_reqs):
            return
        unit = math.lcm(*sizes)
        prefix_len = cdiv(cfg.min_prefix_tokens, unit) * unit
        own, new = 8, 4
        free = sched.kv_cache_manager.num_free_blocks

        def blocks(joiner_own: int) -> int:  # in every group, a block of slack a request
            return (cdiv(prefix_len + own + new, min(sizes))
                    + cfg.min_reqs * (cdiv(joiner_own + new, min(sizes)) + 1)) * len(sizes)

        if prefix_len + own + new > self.max_model_len or blocks(own) > free:
            return
        budget = sched.scheduler_config.max_num_batched_tokens
        joiner = min((budget - 1) // max(1, cfg.min_reqs - 1),
                     self.max_model_len - prefix_len - new - 1)
        if joiner < own or blocks(joiner) > free:
            joiner = own
        shared = prompt(prefix_len)
        params = SamplingParams(max_tokens=new, **greedy)
        backend.cascade = dataclasses.replace(cfg, min_saved_us=0.0)
        try:
            first = self.add_request(shared + prompt(own), params,
                                     request_id="__warmup-cascade-0")
            for _ in range(cdiv(prefix_len + own, budget) + 2):
                if sched.requests[first].num_computed_tokens >= prefix_len + own:
                    break
                step()  # its prefill (chunked when the budget is short)
            ids = [first] + [self.add_request(shared + prompt(joiner), params,
                                              request_id=f"__warmup-cascade-{i}")
                             for i in range(1, cfg.min_reqs)]
            while self.has_unfinished_requests():
                step()
            self.flush()
            for rid in ids:
                self.release(rid)
        finally:
            backend.cascade = cfg

    # ----- introspection -------------------------------------------------------------------
    def kv_stats(self) -> dict:
        """Pool and cache statistics (blocks, usage, prefix-cache hits, preemptions)."""
        mgr = self.scheduler.kv_cache_manager
        st = self.stats
        total = self.scheduler.kv_cache_config.num_blocks
        d = {
            "num_blocks": total,
            "block_size": self.runner.block_size,
            "free_blocks": mgr.num_free_blocks,
            "usage": mgr.usage,
            "peak_usage": st.peak_kv_usage,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
            "prefix_cache_hit_rate": (st.prefix_cache_hits / st.prefix_cache_queries
                                      if st.prefix_cache_queries else 0.0),
            "preemptions": self.scheduler.num_preemptions,
            "steps": st.steps,
            "tokens_generated": st.tokens_generated,
            "cuda_graph_steps": self.runner.num_graph_steps,
            "mixed_cuda_graph_steps": getattr(self.runner, "num_mixed_graph_steps", 0),
            "cuda_graph_sizes": [] if self.runner.cuda_graphs is None
            else list(self.runner.cuda_graphs.sizes),
            "mixed_cuda_graph_sizes": [] if self.runner.cuda_graphs is None
            else list(self.runner.cuda_graphs.mixed_sizes),
            "async_scheduling": self.async_scheduling,
            "compiled_model": bool(getattr(self.model, "compiled", False)),
            "max_num_seqs": self.scheduler.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": self.scheduler.scheduler_config.max_num_batched_tokens,
        }
        if self.sizing is not None:
            d.update(token_capacity=self.sizing.token_capacity,
                     max_concurrency=self.sizing.max_concurrency,
                     kv_cache_bytes=self.sizing.kv_cache_bytes, sized_by=self.sizing.source,
                     kv_cache_dtype=self.sizing.kv_cache_dtype)
        return d


# --------------------------------------------------------------------------------------------
# Assembly


def resolve_device(device: str | torch.device | None) -> torch.device:
    """``None`` -> CUDA if available, else CPU; ``"cpu"``, ``"cuda"``, ``"cuda:N"`` or a
    ``torch.device``; anything else is a ``ConfigError`` saying what to use."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise ConfigError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA GPU is available; use device='cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ConfigError(f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA "
                          "device(s)")
    return dev


def allow_long_max_model_len_from_env() -> bool:
    return os.environ.get("PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN", "") in ("1", "true", "True")


def attention_block_size(groups, block_size: int) -> int:
    """The block size the pool is sized and scheduled by: the attention groups' (a
    state-space hybrid raises it, see ``hybrid_state_specs``), else ``block_size``."""
    sizes = {g.kv_cache_spec.block_size for g in groups
             if not isinstance(g.kv_cache_spec, MambaSpec)}
    if any(isinstance(g.kv_cache_spec, MambaSpec) for g in groups) and len(sizes) == 1:
        return sizes.pop()
    return block_size


def dcp_scheduler_groups(groups, dcp: int):
    """The KV-cache groups as the scheduler sees them under decode context parallelism: a
    block spans ``block_size * dcp`` tokens (each of the ``dcp`` ranks holds ``block_size`` of
    them; vLLM's ``scheduler_block_size = block_size * dcp``); ``groups`` itself for 1."""
    if dcp == 1:
        return groups
    from pagedkv.core.spec import KVCacheGroupSpec

    return tuple(KVCacheGroupSpec(g.layer_names, dataclasses.replace(
        g.kv_cache_spec, block_size=g.kv_cache_spec.block_size * dcp)) for g in groups)


def attention_cache_dtypes(groups) -> str:
    """The dtypes of the groups' attention caches (torch names in group order, distinct,
    joined by "+"; "" without attention groups): what the sizing reports."""
    names: list[str] = []
    for g in groups:
        for name in g.layer_names:
            spec = g.layer_spec(name)
            dtype = getattr(spec, "dtype", None)
            if dtype is not None and not isinstance(spec, MambaSpec) and dtype not in names:
                names.append(dtype)
    return "+".join(names)


def build_engine(
    model: Any,
    tokenizer: Any = None,
    config: EngineConfig | None = None,
    *,
    generation_defaults: GenerationDefaults | None = None,
    **options,
) -> LLMEngine:
    """Everything around a loaded ``model`` (its attention backend already installed), with
    the engine options of ``config`` (an :class:`~pagedkv.config.EngineConfig`) or, without
    one, ``EngineConfig.from_options(**options)``.

    ``async_scheduling``: schedule step k+1 while step k runs on the device (see
    ``pagedkv.engine.async_scheduler``); same tokens, outputs one step later.
    ``compile_model``: ``torch.compile`` the model's norm/rotary/MLP regions (CUDA only; see
    ``DecoderForCausalLM.compile_regions``), before the CUDA graphs are captured. Both default
    (``None``) to on with CUDA and off on CPU.
    ``warmup``: run :meth:`LLMEngine.warm_up` before returning (default: on a GPU), so no
    kernel compiles during the first requests.
    ``generation_defaults``: the checkpoint's ``generation_config.json`` (its EOS ids join the
    model's; its sampling values are the default ``SamplingParams``).
    ``sanitize``: check every invariant of ``pagedkv.sanitizer`` on every step (the pool after
    each update; tables, padding and slot mappings of every group after each input
    preparation, before the forward pass), raising ``InvariantError``; slow, for debugging.
    ``kv_cache_dtype``: "fp8" (or "fp8_e4m3") keeps the attention layers' paged K/V in
    ``float8_e4m3fn`` (per-layer scales 1.0, as vLLM without checkpoint scales: the writers
    quantize, the attention kernels dequantize); the pool's page bytes halve, so a byte budget
    holds twice the blocks (the sizing reports the dtype). MLA latent caches and state layers
    keep the model's dtype.
    ``max_model_len``: default the model's trained context (``max_trained_len``), fitted to the
    pool when that is smaller; a larger value than the trained context is refused unless
    ``allow_long_max_model_len`` (or ``PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN=1``).

    The objects built here are frozen out of the cyclic GC at the end
    (``pagedkv.engine.heap``)."""
    tp = config.tensor_parallel_size if config is not None else options.get(
        "tensor_parallel_size", 1)
    if tp != 1:
        raise ConfigError(
            f"tensor_parallel_size={tp} shards a checkpoint across "
            "worker processes, each loading it: use LLM(path, tensor_parallel_size=N) (or "
            "pagedkv serve PATH --tensor-parallel-size N), not a model built in this process")
    plan = plan_engine(model, config, **options)
    runner = ModelRunner(model, plan.kv, plan.sc, plan.cc, device=model.device,
                         seed=plan.ec.seed, enforce_eager=not plan.graphs,
                         cuda_graph_sizes=plan.ec.cuda_graph_sizes,
                         mixed_cuda_graphs=plan.ec.mixed_cuda_graphs)
    if plan.ec.compile_model and hasattr(model, "compile_regions"):
        model.compile_regions()
    runner.capture_cuda_graphs()
    return assemble_engine(model, tokenizer, plan, runner, generation_defaults=generation_defaults)


@dataclass(frozen=True)
class EnginePlan:
    """What :func:`plan_engine` decides for a model and the engine options: the resolved
    options (``ec``), the scheduler's config, the KV-cache groups and pool (``kv``), the cache
    config, the pool's sizing report and whether decode steps replay CUDA graphs."""

    ec: EngineConfig
    sc: SchedulerConfig
    kv: KVCacheConfig
    cc: CacheConfig
    sizing: KVCacheSizing
    graphs: bool


def plan_engine(model: Any, config: EngineConfig | None = None, **options) -> EnginePlan:
    """Validate the engine options against ``model`` and size its KV-cache pool (the groups
    of ``model.kv_cache_specs``, the block size, the sizing of ``pagedkv.engine.memory``; on a
    GPU this profiles one step of ``model``): the part of :func:`build_engine` before the
    scheduler and the runner exist. A tensor-parallel worker calls it on its shard."""
    device = model.device
    cfg = model.config
    if config is None:
        config = EngineConfig.from_options(**options)
    elif options:
        raise ConfigError(f"build_engine takes a config or options, not both (got {sorted(options)})")
    ec = config.resolved(device)
    block_size, max_num_seqs = ec.block_size, ec.max_num_seqs
    max_num_batched_tokens, max_model_len = ec.max_num_batched_tokens, ec.max_model_len
    enable_prefix_caching, gpu_memory_utilization = ec.enable_prefix_caching, ec.gpu_memory_utilization
    num_gpu_blocks_override, kv_cache_memory_bytes = ec.num_gpu_blocks_override, ec.kv_cache_memory_bytes
    enforce_eager = ec.enforce_eager
    long_prefill_token_threshold = ec.long_prefill_token_threshold
    allow_long_max_model_len = ec.allow_long_max_model_len
    kv_cache_dtype = ec.kv_cache_dtype
    trained = getattr(cfg, "max_trained_len", cfg.max_position_embeddings)
    user_max_model_len = max_model_len
    if max_model_len is None:
        max_model_len = trained
    if isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 2:
        raise ConfigError(f"max_model_len must be an int >= 2, got {max_model_len!r}")
    if (max_model_len > trained and not allow_long_max_model_len
            and not allow_long_max_model_len_from_env()):
        raise ConfigError(
            f"max_model_len={max_model_len} is longer than the model's trained context "
            f"({trained} tokens: max_position_embeddings {cfg.max_position_embeddings}"
            f"{', with RoPE scaling' if trained != cfg.max_position_embeddings else ''}); outputs "
            "past it are unreliable. Lower max_model_len, or pass allow_long_max_model_len=True "
            "(or set PAGEDKV_ALLOW_LONG_MAX_MODEL_LEN=1) to run it anyway")
    if not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool) or max_num_seqs < 1:
        raise ConfigError(f"max_num_seqs must be an int >= 1, got {max_num_seqs!r}")
    sc = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_model_len=max_model_len,
        long_prefill_token_threshold=long_prefill_token_threshold,
    )
    # Validates block_size, prefix caching and utilization before any memory work.
    CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                gpu_memory_utilization=gpu_memory_utilization, cache_dtype=kv_cache_dtype)
    # kv_cache_dtype="fp8": the attention layers' specs in float8_e4m3fn, half the page bytes
    groups = kv_cache_groups_for(model, block_size, max_model_len=max_model_len,
                                 enable_prefix_caching=enable_prefix_caching,
                                 kv_cache_dtype=kv_cache_dtype)
    # a state-space hybrid's attention blocks grow until their page holds a state page
    block_size = attention_block_size(groups, block_size)
    # a block's bytes over the shared tensor slots (one per layer with one group): the groups'
    # pages (K and V; one latent vector per token for MLA; a state block's padded page)
    per_block = kv_block_bytes(groups)
    # a max_model_len request holds blocks in every group (the pool is shared); under decode
    # context parallelism a scheduler block spans dcp ranks' blocks (dcp_scheduler_groups)
    dcp = ec.decode_context_parallel_size
    sched_block = block_size * dcp

    def blocks_needed(groups, max_model_len):
        return sum(g["blocks_per_request"] for g in group_capacity(
            dcp_scheduler_groups(groups, dcp), max_model_len, max_num_batched_tokens,
            sched_block))

    need = blocks_needed(groups, max_model_len)
    backend = model.attn_backend
    graphs = device.type == "cuda" and not enforce_eager and backend.supports_cuda_graphs
    sizing = size_kv_cache(
        bytes_per_block=per_block,
        block_size=sched_block,
        max_model_len=max_model_len,
        num_gpu_blocks_override=num_gpu_blocks_override,
        kv_cache_memory_bytes=kv_cache_memory_bytes,
        device_type=device.type,
        gpu_memory_utilization=gpu_memory_utilization,
        profile=(lambda: profile_peak_memory(model, sc, block_size, kv_cache_groups=groups))
        if device.type == "cuda" else None,
        graph_reserve_bytes=CUDA_GRAPH_RESERVE_BYTES if graphs else 0,
        check=user_max_model_len is not None,
        max_num_seqs=max_num_seqs,
        blocks_per_request=need,
    )
    if device.type == "cuda":
        warn_if_others_hold_memory(sizing, max_num_seqs * need + 1,
                                   kv_bytes_held_by_other_engines(device))
    if user_max_model_len is None and sizing.num_usable_blocks < need:
        # max_model_len was not given: fit it to the pool instead of failing
        max_model_len = fitted_max_model_len(dcp_scheduler_groups(groups, dcp),
                                             sizing.num_usable_blocks, max_num_batched_tokens,
                                             sched_block, max_model_len)
        if max_model_len >= 2:
            sc = dataclasses.replace(sc, max_model_len=max_model_len)
            sizing = dataclasses.replace(sizing, max_model_len=max_model_len)
            # mode-none state blocks cover max_model_len tokens
            groups = kv_cache_groups_for(model, block_size, max_model_len=max_model_len,
                                         enable_prefix_caching=enable_prefix_caching,
                                         kv_cache_dtype=kv_cache_dtype)
            need = blocks_needed(groups, max_model_len)
        check_pool(sizing.num_blocks, sched_block, max_model_len, sizing.source, need)
    kv = KVCacheConfig(num_blocks=sizing.num_blocks, kv_cache_groups=groups)
    sizing = dataclasses.replace(sizing, kv_cache_dtype=attention_cache_dtypes(groups))
    if len(groups) > 1:  # the pool's capacity per group (a request holds blocks in each)
        sizing = dataclasses.replace(sizing, groups=group_capacity(
            dcp_scheduler_groups(groups, dcp), max_model_len, max_num_batched_tokens,
            sched_block))
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=sizing.num_blocks,
                     enable_prefix_caching=enable_prefix_caching,
                     gpu_memory_utilization=gpu_memory_utilization, cache_dtype=kv_cache_dtype)
    return EnginePlan(ec, sc, kv, cc, sizing, graphs)


def assemble_engine(model: Any, tokenizer: Any, plan: EnginePlan, runner: Any, *,
                    generation_defaults: GenerationDefaults | None = None) -> LLMEngine:
    """The scheduler of ``plan`` and an :class:`LLMEngine` over ``runner`` (a
    :class:`ModelRunner`, or a tensor-parallel executor with its interface), registered,
    warmed up (``plan.ec.warmup``) and frozen out of the cyclic GC: the end of
    :func:`build_engine`."""
    ec, sc, kv, cc, sizing = plan.ec, plan.sc, plan.kv, plan.cc, plan.sizing
    scheduler = (AsyncScheduler if ec.async_scheduling else Scheduler)(sc, kv, cc)
    engine = LLMEngine(model, tokenizer, scheduler, runner, sizing,
                       async_scheduling=ec.async_scheduling,
                       generation_defaults=generation_defaults, sanitize=ec.sanitize)
    engine.engine_config = ec
    register_engine(engine)
    if ec.warmup:
        engine.warm_up(ec.seed)
    freeze_after_startup()
    return engine


__all__ = ["ATTENTION_BACKENDS", "EnginePlan", "EngineStats", "LLMEngine", "assemble_engine",
           "build_engine", "plan_engine", "make_attention_backend",
           "resolve_device", "validate_request"]
