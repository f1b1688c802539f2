"""Prometheus metrics of a serving engine, named close to vLLM's (``pagedkv:`` prefix instead
of ``vllm:``) so dashboards port.

Updated on the engine thread after every step (``ServingMetrics.on_step``) from the engine's
own counters and the requests' ``RequestMetrics``; exported by ``GET /metrics``. One registry
per server (not the process-global default), so several servers or tests do not collide.
"""

from __future__ import annotations

import bisect
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class ServingMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        r, labels = self.registry, ["model_name"]
        self.model_name = model_name
        self.running = Gauge("pagedkv:num_requests_running", "Requests in the running batch",
                             labels, registry=r)
        self.waiting = Gauge("pagedkv:num_requests_waiting", "Requests waiting to be scheduled",
                             labels, registry=r)
        self.kv_usage = Gauge("pagedkv:kv_cache_usage_perc",
                              "Fraction of KV-cache blocks in use (1 = full)", labels, registry=r)
        self.kv_group_usage = Gauge(
            "pagedkv:kv_cache_group_usage_perc",
            "Fraction of the KV pool held by each KV-cache group", labels + ["group"], registry=r)
        self.prefix_queries = Counter("pagedkv:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache", labels, registry=r)
        self.prefix_hits = Counter("pagedkv:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", labels, registry=r)
        self.preemptions = Counter("pagedkv:num_preemptions", "Preempted requests", labels, registry=r)
        self.prompt_tokens = Counter("pagedkv:prompt_tokens", "Prompt tokens of finished requests",
                                     labels, registry=r)
        self.generation_tokens = Counter("pagedkv:generation_tokens", "Generated tokens",
                                         labels, registry=r)
        self.success = Counter("pagedkv:request_success", "Finished requests by finish reason",
                               labels + ["finished_reason"], registry=r)
        self.failed_steps = Counter("pagedkv:failed_steps", "Engine steps that raised", labels,
                                    registry=r)
        self.ttft = Histogram("pagedkv:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("pagedkv:inter_token_latency_seconds", "Time between two tokens",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("pagedkv:e2e_request_latency_seconds", "Arrival to finish", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        # the children of the one model_name label, looked up once (labels() takes a lock and
        # a dict lookup; on_step would pay it per output and per token)
        self._ttft, self._itl, self._e2e = (h.labels(model_name) for h in (self.ttft, self.itl,
                                                                            self.e2e))
        self._prompt_tokens = self.prompt_tokens.labels(model_name)
        self._last = dict(queries=0, hits=0, preemptions=0, tokens=0, failed=0)
        self._last_token_time: dict[str, tuple[float, int]] = {}
        self._next_group_scan = 0.0  # per-group usage walks every held block: twice a second

    def on_step(self, engine, outputs, failed_steps: int = 0) -> None:
        """After a step, on the engine thread: ``observe`` of the engine's gauges and totals
        (:func:`engine_gauges`) and the step's outputs."""
        now = time.monotonic()
        scan = now >= self._next_group_scan
        if scan:
            self._next_group_scan = now + 0.5
        self.observe(engine_gauges(engine, scan_groups=scan, failed_steps=failed_steps), outputs)

    def observe(self, gauges: dict, outputs) -> None:
        """Gauges and counters from ``gauges`` (an :func:`engine_gauges` dict: counters are
        totals, turned into increments here), latencies from the outputs' metrics (cumulative
        ``RequestOutput`` objects)."""
        self._observe_gauges(gauges)
        self._observe_requests(
            (out.request_id, len(out.outputs[0].token_ids), out.metrics.arrival_time,
             out.metrics.first_token_time, out.metrics.last_token_time,
             out.outputs[0].finish_reason if out.finished else None,
             out.metrics.finished_time, len(out.prompt_token_ids), out.finished)
            for out in outputs)

    def observe_deltas(self, gauges: dict, items) -> None:
        """:meth:`observe` from a step's deltas (the engine-process front: no snapshot per
        delta). ``items``: ``(OutputDelta, arrival_time, prompt tokens, the request's tokens
        so far)`` per delta."""
        self._observe_gauges(gauges)
        self._observe_requests((d[0], n, arrival, d[8], d[9], d[5], d[10], prompt_tokens,
                                d[5] is not None) for d, arrival, prompt_tokens, n in items)

    def _observe_gauges(self, gauges: dict) -> None:
        m, name = self, self.model_name
        m.running.labels(name).set(gauges["running"])
        m.waiting.labels(name).set(gauges["waiting"])
        m.kv_usage.labels(name).set(gauges["kv_usage"])
        for gid, usage in (gauges.get("group_usage") or {}).items():
            m.kv_group_usage.labels(name, str(gid)).set(usage)
        for key, counter in (("queries", m.prefix_queries), ("hits", m.prefix_hits),
                             ("preemptions", m.preemptions), ("tokens", m.generation_tokens),
                             ("failed", m.failed_steps)):
            value = gauges[key]
            if value > m._last[key]:
                counter.labels(name).inc(value - m._last[key])
            m._last[key] = value

    def _observe_requests(self, records) -> None:
        """Latencies of a step's requests. ``records``: ``(request id, tokens so far, arrival,
        first token time, last token time, finish reason, finished time, prompt tokens,
        finished)``. TTFT at a request's first tokens, one ITL sample per new token (the gap
        since its previous tokens, spread evenly over them; a step's equal gaps are added to
        the histogram at once), E2E and the finish reason when it finished."""
        last = self._last_token_time
        ttft, e2e, name = self._ttft, self._e2e, self.model_name
        gaps: dict[float, int] = {}
        for rid, n, arrival, t_first, t_last, reason, t_fin, prompt_tokens, finished in records:
            prev = last.get(rid)
            if prev is None:
                if t_first is not None and n:
                    ttft.observe(t_first - arrival)
            elif n > prev[1] and t_last is not None:
                k = n - prev[1]
                gap = (t_last - prev[0]) / k
                gaps[gap] = gaps.get(gap, 0) + k
            if finished:
                last.pop(rid, None)
                self.success.labels(name, reason or "abort").inc()
                self._prompt_tokens.inc(prompt_tokens)
                if t_fin is not None:
                    e2e.observe(t_fin - arrival)
            elif t_last is not None and n:
                last[rid] = (t_last, n)
        for gap, count in gaps.items():
            _observe_many(self._itl, gap, count)

    def export(self) -> bytes:
        return generate_latest(self.registry)


def _observe_many(hist, value: float, count: int) -> None:
    """``count`` observations of ``value`` in the histogram child ``hist``: its sum and the one
    bucket ``Histogram.observe`` picks (the first upper bound >= value), each updated once.
    prometheus_client has no public call for it; without the attributes this relies on, one
    ``observe`` per observation."""
    bounds, buckets, total = (getattr(hist, "_upper_bounds", None), getattr(hist, "_buckets", None),
                              getattr(hist, "_sum", None))
    if bounds is None or buckets is None or total is None or count == 1:
        for _ in range(count):
            hist.observe(value)
        return
    total.inc(value * count)
    buckets[bisect.bisect_left(bounds, value)].inc(count)


def engine_gauges(engine, *, scan_groups: bool = True, failed_steps: int = 0) -> dict:
    """The engine's state for the metrics, as plain numbers (sent across processes by the
    engine-core process): running / waiting requests, KV usage, per-group usage (a walk over
    every held block: only when ``scan_groups``), and totals of prefix-cache queries and hits,
    preemptions, generated tokens and failed steps."""
    sched = engine.scheduler
    mgr = sched.kv_cache_manager
    st = engine.stats
    out = dict(running=sched.num_running, waiting=sched.num_waiting, kv_usage=mgr.usage,
               queries=st.prefix_cache_queries, hits=st.prefix_cache_hits,
               preemptions=sched.num_preemptions, tokens=st.tokens_generated,
               failed=failed_steps, group_usage=None)
    if scan_groups:
        total = max(1, sched.kv_cache_config.num_blocks - 1)
        out["group_usage"] = {
            gid: sum(1 for blocks in smgr.req_to_blocks.values() for b in blocks
                     if not b.is_null) / total
            for gid, smgr in enumerate(mgr.coordinator.single_type_managers)}
    return out


__all__ = ["ServingMetrics", "engine_gauges"]
