"""Replay every kind-"sched" trace through pagedkv's Scheduler and compare every field of
every log line with vLLM 0.33.0's recorded answers (tests/vectors/vllm-logs).

The driver follows tests/vectors/FORMAT.txt's engine loop exactly: step while a request has
not arrived yet or the scheduler has requests; an idle engine jumps to the next arrival (no
schedule() call, no line); a step adds its arrivals (arrival order, ties in trace order),
then applies its aborts (``finish_requests(id, FINISHED_ABORTED)``, one call per id, in
``(abort_step, trace position)`` order), then schedules. The fake model samples
``traces.next_token(rid, pos, vocab)`` at ``pos = num_tokens`` for every scheduled request
that completed its prefill; partial-prefill chunks sample nothing.

Field meanings (checked against the logs):
* ``num_free_blocks_after_schedule``: free blocks right after schedule();
* ``num_free_blocks`` / ``num_running`` / ``num_waiting`` / ``free_queue``: after
  update_from_output() (finished requests already freed); ``free_queue`` only when the
  trace's ``log_free_queue`` is ``"step"``;
* ``prefix_cache``: the manager's prefix-cache counters for this step's lookups;
* ``finished``: ids finished by this step's update_from_output (sorted);
* ``aborted``: ids this step's abort calls finished (traces with ``abort_step`` only);
* summary: totals over the run; ``max_running`` measured right after each schedule().
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os

import pytest

from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.output import ModelRunnerOutput
from pagedkv.core.request import RequestStatus
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec

VECTORS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vectors")


def _load_traces_module():
    spec = importlib.util.spec_from_file_location("pagedkv_vector_traces",
                                                  os.path.join(VECTORS, "traces.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


traces = _load_traces_module()

SCHED_TRACES = sorted(
    p for p in glob.glob(os.path.join(VECTORS, "traces", "*.json"))
    if json.load(open(p)).get("kind") == "sched"
)


def _group_spec(g: dict, block_size: int):
    if g["type"] == "full":
        return FullAttentionSpec(block_size=block_size)
    if g["type"] == "sliding_window":
        return SlidingWindowSpec(block_size=block_size, sliding_window=g["sliding_window"])
    raise ValueError(f"unknown group type {g['type']!r} in trace")


# Engine keys a trace may omit, and their documented defaults (FORMAT.txt).
ENGINE_DEFAULTS = {
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "groups": [{"type": "full"}],
}


def engine_config(trace: dict) -> dict:
    return {**ENGINE_DEFAULTS, **trace["engine"]}


def build_scheduler(engine: dict) -> Scheduler:
    engine = {**ENGINE_DEFAULTS, **engine}
    bs = engine["block_size"]
    groups = [
        KVCacheGroupSpec((f"layer.{i}",), _group_spec(g, bs)) for i, g in enumerate(engine["groups"])
    ]
    kv_cfg = KVCacheConfig(num_blocks=engine["num_blocks"], kv_cache_groups=groups)
    sched_cfg = SchedulerConfig(
        max_num_seqs=engine["max_num_seqs"],
        max_num_batched_tokens=engine["max_num_batched_tokens"],
        max_model_len=engine["max_model_len"],
        enable_chunked_prefill=engine["enable_chunked_prefill"],
        long_prefill_token_threshold=engine["long_prefill_token_threshold"],
    )
    cache_cfg = CacheConfig(block_size=bs, enable_prefix_caching=engine["enable_prefix_caching"])
    return Scheduler(sched_cfg, kv_cfg, cache_cfg, log_stats=True)


def _block_pool(manager):
    pool = getattr(manager, "block_pool", None)
    if pool is None:
        pool = manager.coordinator.block_pool
    return pool


def free_queue_ids(manager) -> list[int]:
    return [b.block_id for b in _block_pool(manager).free_block_queue.get_all_free_blocks()]


def _stats_dict(stats) -> dict:
    keys = ("requests", "queries", "hits", "preempted_requests", "preempted_queries",
            "preempted_hits")
    return {k: int(getattr(stats, k)) for k in keys}


def _block_ids(ids) -> list | None:
    return None if ids is None else [list(g) for g in ids]


def fake_model(sched: Scheduler, out, vocab: int) -> ModelRunnerOutput:
    sampled = {}
    for rid in out.num_scheduled_tokens:
        req = sched.requests[rid]
        sampled[rid] = [] if req.is_prefill_chunk else [traces.next_token(rid, req.num_tokens, vocab)]
    return ModelRunnerOutput.from_sampled(sampled)


def replay(trace: dict):
    """Yield one dict per log line (header excluded) in the log's format, following
    FORMAT.txt's engine loop: idle jumps, aborts before schedule(), max_running right after
    schedule(), free_queue on step lines only with ``log_free_queue == "step"``."""
    sched = build_scheduler(trace["engine"])
    manager = sched.kv_cache_manager
    vocab = trace["vocab"]
    log_queue = trace.get("log_free_queue") == "step"
    requests = trace["requests"]
    # Arrival order, ties in trace order (sorted() is stable).
    arrivals = sorted(requests, key=lambda r: r["arrival_step"])
    has_aborts = any("abort_step" in r for r in requests)
    aborts = sorted(
        ((r["abort_step"], i, r["id"]) for i, r in enumerate(requests) if "abort_step" in r)
    )
    totals = dict.fromkeys(("requests", "queries", "hits", "preempted_requests",
                            "preempted_queries", "preempted_hits"), 0)
    step = 0
    lines = 0
    last_step = -1
    max_running = 0
    preemptions = 0
    num_aborted = 0
    next_arrival = 0
    next_abort = 0
    while next_arrival < len(arrivals) or sched.has_requests():
        if not sched.has_requests():
            step = max(step, arrivals[next_arrival]["arrival_step"])
        while next_arrival < len(arrivals) and arrivals[next_arrival]["arrival_step"] <= step:
            r = arrivals[next_arrival]
            sched.add_request(
                sched.make_request(r["id"], r["prompt"], max_tokens=r["max_tokens"],
                                   ignore_eos=True, arrival_time=float(r["arrival_step"]))
            )
            next_arrival += 1
        aborted: list[str] = []
        while next_abort < len(aborts) and aborts[next_abort][0] <= step:
            aborted += sched.finish_requests(aborts[next_abort][2], RequestStatus.FINISHED_ABORTED)
            next_abort += 1
        num_aborted += len(aborted)
        out = sched.schedule()
        free_after_schedule = manager.num_free_blocks
        max_running = max(max_running, len(sched.running))
        result = sched.update_from_output(out, fake_model(sched, out, vocab))
        stats = result.scheduler_stats
        pc = _stats_dict(stats.prefix_cache_stats)
        for k in totals:
            totals[k] += pc[k]
        cached = out.scheduled_cached_reqs
        line = {
            "kind": "step",
            "step": step,
            "new": [
                {"id": n.req_id, "block_ids": _block_ids(n.block_ids),
                 "num_computed_tokens": n.num_computed_tokens}
                for n in out.scheduled_new_reqs
            ],
            "cached": {
                "req_ids": list(cached.req_ids),
                "new_block_ids": [_block_ids(b) for b in cached.new_block_ids],
                "num_computed_tokens": list(cached.num_computed_tokens),
                "resumed_req_ids": sorted(cached.resumed_req_ids),
            },
            "num_scheduled_tokens": [[k, v] for k, v in out.num_scheduled_tokens.items()],
            "finished_req_ids": sorted(out.finished_req_ids),
            "preempted_req_ids": sorted(out.preempted_req_ids),
            "finished": sorted(result.finished_req_ids),
            "num_free_blocks_after_schedule": free_after_schedule,
            "num_free_blocks": manager.num_free_blocks,
            "num_running": stats.num_running_reqs,
            "num_waiting": stats.num_waiting_reqs,
            "prefix_cache": pc,
        }
        if log_queue:
            line["free_queue"] = free_queue_ids(manager)
        if has_aborts:
            line["aborted"] = sorted(aborted)
        preemptions += stats.num_preempted_reqs
        yield line
        lines += 1
        last_step = step
        step += 1
    assert preemptions == sched.num_preemptions
    summary = {
        "kind": "summary",
        "steps": lines,
        "last_step": last_step,
        "max_running": max_running,
        "num_free_blocks": manager.num_free_blocks,
        "preemptions": sched.num_preemptions,
        "free_queue": free_queue_ids(manager),
        **totals,
    }
    if has_aborts:
        summary["aborted"] = num_aborted
    yield summary


def _first_diff(expected, got, path=""):
    """Path and values of the first difference between two JSON values."""
    if isinstance(expected, dict) and isinstance(got, dict):
        for k in sorted(set(expected) | set(got)):
            if k not in got:
                return f"{path}.{k}", expected[k], "<missing>"
            if k not in expected:
                return f"{path}.{k}", "<absent in log>", got[k]
            d = _first_diff(expected[k], got[k], f"{path}.{k}")
            if d:
                return d
        return None
    if isinstance(expected, list) and isinstance(got, list):
        for i, (e, g) in enumerate(zip(expected, got)):
            d = _first_diff(e, g, f"{path}[{i}]")
            if d:
                return d
        if len(expected) != len(got):
            return f"{path} (length {len(expected)} vs {len(got)})", expected, got
        return None
    if expected != got or type(expected) is not type(got):
        return path, expected, got
    return None


def compare_trace(trace_path: str) -> list[str]:
    trace = json.load(open(trace_path))
    name = os.path.basename(trace_path)[: -len(".json")]
    log_path = os.path.join(VECTORS, "vllm-logs", f"{name}.jsonl")
    expected = [json.loads(line) for line in open(log_path)]
    assert expected[0]["kind"] == "header"
    assert expected[0]["v2_model_runner"] is False  # resumed requests in the cached list
    expected = expected[1:]
    got_lines = replay(trace)
    for i, exp in enumerate(expected):
        try:
            got = next(got_lines)
        except StopIteration:
            return [f"{name}: replay ended after {i} lines, log has {len(expected)}"]
        d = _first_diff(exp, got)
        if d:
            where = f"step {exp.get('step', 'summary')}"
            return [f"{name}: {where} field {d[0]}: expected {d[1]!r}, got {d[2]!r}"]
    extra = next(got_lines, None)
    if extra is not None:
        return [f"{name}: replay has more lines than the log, first extra: {extra}"]
    return []


@pytest.mark.parametrize("trace_path", SCHED_TRACES, ids=lambda p: os.path.basename(p)[:-5])
def test_sched_trace_matches_vllm(trace_path):
    problems = compare_trace(trace_path)
    assert not problems, problems[0]


def test_all_sched_presets_present():
    names = {os.path.basename(p).split("-")[0] for p in SCHED_TRACES}
    assert {"small", "chunked", "prefix", "hybrid", "swa", "tri", "sparse", "abort"} <= names
    assert len(SCHED_TRACES) >= 9
