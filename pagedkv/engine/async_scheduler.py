"""AsyncScheduler: the scheduler for async scheduling (one step in flight while the next one is
scheduled), vLLM V1's ``AsyncScheduler`` semantics on top of ``pagedkv.core.scheduler``.

The engine loop (``LLMEngine`` with ``async_scheduling=True``) is::

    so_k = schedule()                 # step k-1 is still running on the device
    runner.execute_model_async(so_k)  # enqueue step k; its input ids of the decode rows are the
                                      # tokens step k-1 samples, written on the device
    mro = runner.get_output(step k-1) # wait for step k-1 only now
    update_from_output(so_{k-1}, mro) # tokens, stops, frees

So ``schedule()`` runs before the previous step's tokens are known. A request scheduled in a step
that samples gets an *output placeholder* (``Request.num_output_placeholders += 1``): the core
scheduler counts placeholders as known tokens (``num_tokens + placeholders - computed`` tokens to
schedule), so a decoding request is scheduled for the token its in-flight step is producing. The
output of that step replaces the placeholder (``num_output_placeholders -= len(new tokens)``).

Differences from the synchronous scheduler, all as vLLM's async scheduler does:

* a request whose in-flight tokens bring it to ``max_tokens`` is not scheduled again (it
  finishes when that output arrives); it stays in ``running`` (it keeps its blocks, counts
  against ``max_num_seqs`` and may be preempted). A request that stops on EOS / a stop token / a stop string runs one
  step more than needed; that step's token is dropped (the request is gone by then);
* a preempted request drops its placeholders; the token its in-flight step samples is dropped
  (``update_from_output`` skips requests that are no longer running) and recomputed after it
  resumes;
* a full block is registered in the prefix cache by the first ``schedule()`` that knows all of
  its tokens, one step later than without async scheduling; the blocks completed by a
  request's last token(s) are not registered before the request is freed.

Speculative decoding is not supported with async scheduling.
"""

from __future__ import annotations

from pagedkv.core.output import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from pagedkv.core.request import Request, RequestStatus
from pagedkv.core.scheduler import Scheduler
from pagedkv.errors import ConfigError

_RUNNING = RequestStatus.RUNNING


class AsyncScheduler(Scheduler):
    """See the module docstring."""

    concurrent_batches = 2  # the step being scheduled and the one in flight

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self._num_lookahead_tokens:
            raise ConfigError("async scheduling does not support lookahead (speculative) tokens")
        # Requests whose in-flight tokens finish them (max_tokens): skipped by the next schedule.
        self._draining: list[Request] = []

    # ----- schedule ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        drain = [r for r in self._draining if r.status == _RUNNING and r.num_output_placeholders > 0]
        self._draining = []
        # A draining request stays in ``running`` (its seat, its blocks, a preemption candidate)
        # but must get no tokens: without its last placeholder the core sees nothing to compute.
        for r in drain:
            r.num_output_placeholders -= 1
        try:
            out = super().schedule()
        finally:
            for r in drain:
                if r.status == _RUNNING:
                    r.num_output_placeholders += 1
        self._add_placeholders(out)
        return out

    def _add_placeholders(self, output: SchedulerOutput) -> None:
        """After a schedule: one placeholder per scheduled request that samples in this step
        (the core marks the others ``is_prefill_chunk``, counting the placeholders it had);
        preempted requests lose theirs."""
        requests = self.requests
        for rid in output.preempted_req_ids:
            req = requests.get(rid)
            if req is not None:
                req.num_output_placeholders = 0
        max_model_len = self.max_model_len
        draining = self._draining
        for rid in output.num_scheduled_tokens:
            req = requests[rid]
            if req.is_prefill_chunk:
                continue  # samples nothing this step
            p = req.num_output_placeholders + 1
            req.num_output_placeholders = p
            if (len(req._output_token_ids) + p >= req.stop.max_tokens
                    or len(req._all_token_ids) + p >= max_model_len):
                draining.append(req)

    # ----- update --------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """The core update, after the arriving tokens replaced their placeholders (of requests
        still running; a preempted request's token is dropped by the core update)."""
        sampled = model_runner_output.sampled_token_ids
        if sampled:
            requests = self.requests
            for rid, toks in zip(model_runner_output.req_ids, sampled):
                if toks:
                    req = requests.get(rid)
                    if req is not None and req.status == _RUNNING:
                        p = req.num_output_placeholders - len(toks)
                        req.num_output_placeholders = p if p > 0 else 0
        return super().update_from_output(scheduler_output, model_runner_output)


__all__ = ["AsyncScheduler"]
