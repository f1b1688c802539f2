"""The serving front's per-token pieces, against what they replace: the preformatted SSE chunk
(``ChunkFormat.text``) equals ``json.dumps`` of the chunk dict over random text (any unicode,
lone surrogates, control characters, quotes, backslashes), ids and model names; the engine-
process front's streams fold any grouping of step deltas into the snapshot a delta-by-delta
fold gives, skip to the newest output and raise errors; the metrics from deltas equal the
metrics from snapshots, and a step's equal ITL gaps added at once equal one observe each."""

import asyncio
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi")
prometheus_client = pytest.importorskip("prometheus_client")

from pagedkv.engine.outputs import CompletionOutput, OutputDelta, RequestOutput  # noqa: E402
from pagedkv.entrypoints.engine_core import (  # noqa: E402
    EngineCoreClient,
    EngineSpec,
    _DeltaRequestStream,
    _DeltaStream,
)
from pagedkv.entrypoints.metrics import ServingMetrics, _observe_many  # noqa: E402
from pagedkv.entrypoints.openai_server import ChunkFormat  # noqa: E402
from pagedkv.errors import PagedKVError  # noqa: E402

ANY_TEXT = st.text(st.characters(codec=None, categories=None), max_size=40)  # surrogates too
TRICKY = st.sampled_from(['"', "\\", "\n", "\r\n", "\t", "\x00", "\x1f", "\x7f", "\u2028",
                          "\ud800", "\udfff", "\U0001f600", "é", "中", "</script>",
                          "data: x\n\n"])
TEXT = st.one_of(ANY_TEXT, st.lists(st.one_of(TRICKY, ANY_TEXT), max_size=6).map("".join))


def _reference(rid, object_, created, model, choice) -> str:
    """The chunk as the server wrote it before ChunkFormat: json.dumps of the whole dict."""
    return "data: " + json.dumps({"id": rid, "object": object_, "created": created,
                                  "model": model, "choices": [choice]}) + "\n\n"


@settings(max_examples=300, deadline=None)
@given(rid=TEXT, model=TEXT, created=st.integers(0, 2**40), index=st.integers(0, 10**6),
       delta=TEXT.filter(bool), chat=st.booleans())
def test_text_chunk_equals_json_dumps(rid, model, created, index, delta, chat):
    object_ = "chat.completion.chunk" if chat else "text_completion"
    fmt = ChunkFormat(rid, object_, created, model, chat=chat)
    if chat:
        choice = {"index": index, "delta": {"content": delta}, "logprobs": None,
                  "finish_reason": None}
    else:
        choice = {"index": index, "text": delta, "logprobs": None, "finish_reason": None}
    want = _reference(rid, object_, created, model, choice)
    assert fmt.text(index, delta) == want
    assert fmt.text(index, delta) == want  # the cached per-index head
    assert fmt.chunk(choice) == want
    usage = {"prompt_tokens": 3, "completion_tokens": index, "total_tokens": index + 3}
    assert fmt.usage(usage) == "data: " + json.dumps({
        "id": rid, "object": object_, "created": created, "model": model, "choices": [],
        "usage": usage}) + "\n\n"
    assert fmt.text(index, delta).isascii()


# --------------------------------------------------------------------------------------------
# the engine-process front's streams


def _delta(rid, k, toks, text, lps=None, reason=None):
    return OutputDelta((rid, toks, text, lps, -0.5 * k, reason, None, 1.0, 1.1, 1.0 + k,
                        2.0 if reason else None, 3, 0))


@st.composite
def delta_runs(draw):
    """A request's step deltas (the last finishes it) and a grouping of them into reads."""
    steps = draw(st.integers(1, 12))
    with_lps = draw(st.booleans())
    deltas = []
    for k in range(steps):
        toks = draw(st.lists(st.integers(0, 99), min_size=0, max_size=3))
        lps = [{t: float(t)} for t in toks] if with_lps else None
        deltas.append(_delta("r", k, toks, draw(TEXT), lps,
                             "length" if k == steps - 1 else None))
    cuts = sorted(draw(st.sets(st.integers(1, steps - 1), max_size=steps - 1))) if steps > 1 else []
    groups = [deltas[a:b] for a, b in zip([0, *cuts], [*cuts, steps])]
    return deltas, groups


def _snapshot(out: RequestOutput):
    c = out.outputs[0]
    m = out.metrics
    return (out.request_id, out.prompt, out.prompt_token_ids, out.finished, c.text, c.token_ids,
            c.logprobs, c.cumulative_logprob, c.finish_reason, c.stop_reason,
            m.first_scheduled_time, m.first_token_time, m.last_token_time, m.finished_time,
            m.num_cached_tokens, m.num_preemptions, m.num_generated_tokens)


@settings(max_examples=200, deadline=None)
@given(delta_runs())
def test_fold_of_any_grouping_equals_delta_by_delta(run):
    deltas, groups = run
    one = _DeltaStream("r", "p", [1, 2], 0.5)
    outs = [one.fold([d]) for d in deltas]
    grouped = _DeltaStream("r", "p", [1, 2], 0.5)
    gouts = [grouped.fold(g) for g in groups]
    assert _snapshot(gouts[-1]) == _snapshot(outs[-1])
    # snapshots are copies: a later fold leaves an earlier snapshot as it was
    first = outs[0].outputs[0]
    assert first.token_ids == list(deltas[0][1]) and first.text == deltas[0][2]
    want_text = "".join(d[2] for d in deltas)
    assert outs[-1].outputs[0].text == want_text
    assert outs[-1].outputs[0].token_ids == [t for d in deltas for t in d[1]]


def test_request_stream_skips_to_the_newest_and_raises_errors():
    client = EngineCoreClient(EngineSpec(shape="unused"))  # not started: nothing is sent

    async def main():
        st_ = _DeltaStream("r", None, [1], 0.0)
        stream = _DeltaRequestStream(client, st_, None)
        it = stream.__aiter__()
        st_.push(_delta("r", 0, [5], "a"))
        st_.push(_delta("r", 1, [6], "b"))
        first = await it.__anext__()  # both pending deltas in one snapshot
        assert first.outputs[0].text == "ab" and first.outputs[0].token_ids == [5, 6]
        task = asyncio.ensure_future(it.__anext__())  # waits on the future
        await asyncio.sleep(0)
        assert not task.done()
        st_.push(_delta("r", 2, [7], "c", reason="length"))
        last = await task
        assert last.finished and last.outputs[0].text == "abc"
        with pytest.raises(StopAsyncIteration):
            await it.__anext__()
        assert st_.finished

        st2 = _DeltaStream("q", None, [1], 0.0)
        it2 = _DeltaRequestStream(client, st2, None).__aiter__()
        st2.push(_delta("q", 0, [5], "a"))
        st2.push(PagedKVError("boom"))
        with pytest.raises(PagedKVError, match="boom"):
            await it2.__anext__()

    asyncio.run(main())


# --------------------------------------------------------------------------------------------
# metrics


def _hist(metrics: ServingMetrics, name: str) -> dict:
    """The histogram's samples (bucket counts, count; the sum rounded)."""
    out = {}
    for fam in metrics.registry.collect():
        if fam.name != name:
            continue
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            out[(s.name, tuple(sorted(s.labels.items())))] = (
                round(s.value, 9) if s.name.endswith("_sum") else s.value)
    return out


@settings(max_examples=100, deadline=None)
@given(value=st.floats(0, 200, allow_nan=False), count=st.integers(1, 50))
def test_observe_many_equals_one_observe_each(value, count):
    a, b = ServingMetrics("m"), ServingMetrics("m")
    for _ in range(count):
        a._itl.observe(value)
    _observe_many(b._itl, value, count)
    name = "pagedkv:inter_token_latency_seconds"
    ka, kb = _hist(a, name), _hist(b, name)
    assert {k: v for k, v in ka.items() if not k[0].endswith("_sum")} == \
        {k: v for k, v in kb.items() if not k[0].endswith("_sum")}
    sa = [v for k, v in ka.items() if k[0].endswith("_sum")]
    sb = [v for k, v in kb.items() if k[0].endswith("_sum")]
    assert sa == pytest.approx(sb, rel=1e-9, abs=1e-9)


@settings(max_examples=60, deadline=None)
@given(st.lists(delta_runs(), min_size=1, max_size=4), st.randoms(use_true_random=False))
def test_metrics_from_deltas_equal_metrics_from_snapshots(runs, rnd):
    """Requests interleaved over steps: observe_deltas (the process front) and observe (the
    in-thread server, cumulative snapshots) give the same histograms and counters."""
    by_delta, by_snapshot = ServingMetrics("m"), ServingMetrics("m")
    streams = {f"r{i}": _DeltaStream(f"r{i}", None, [1, 2, 3], 0.25) for i in range(len(runs))}
    pending = {f"r{i}": [OutputDelta((f"r{i}", *d[1:])) for d in run[0]]
               for i, run in enumerate(runs)}
    tokens = {rid: 0 for rid in pending}
    total = 0
    while any(pending.values()):
        step = [rid for rid in pending if pending[rid] and rnd.random() < 0.7]
        deltas = [pending[rid].pop(0) for rid in step]
        total += sum(len(d[1]) for d in deltas)
        gauges = dict(running=len(step), waiting=0, kv_usage=0.1, queries=0, hits=0,
                      preemptions=0, tokens=total, failed=0, group_usage=None)
        items = []
        for d in deltas:
            tokens[d[0]] += len(d[1])
            items.append((d, 0.25, 3, tokens[d[0]]))
        by_delta.observe_deltas(gauges, items)
        by_snapshot.observe(gauges, [streams[d[0]].fold([d]) for d in deltas])
    for name in ("pagedkv:inter_token_latency_seconds", "pagedkv:time_to_first_token_seconds",
                 "pagedkv:e2e_request_latency_seconds", "pagedkv:request_success",
                 "pagedkv:prompt_tokens", "pagedkv:generation_tokens"):
        assert _hist(by_delta, name) == _hist(by_snapshot, name), name


def test_snapshot_types():
    out = _DeltaStream("r", None, [1], 0.0).fold([_delta("r", 0, [1], "x")])
    assert isinstance(out, RequestOutput) and isinstance(out.outputs[0], CompletionOutput)


def test_tune_gc_for_serving_in_a_fresh_process():
    """Process-wide, so checked in a child: startup objects frozen, gen0 threshold raised (never
    lowered), a bad threshold a ValueError."""
    import subprocess
    import sys

    code = (
        "import gc\n"
        "from pagedkv.entrypoints.openai_server import tune_gc_for_serving, "
        "SERVING_GC_GEN0_THRESHOLD\n"
        "g1, g2 = gc.get_threshold()[1:]\n"
        "tune_gc_for_serving()\n"
        "assert gc.get_freeze_count() > 0\n"
        "assert gc.get_threshold() == (SERVING_GC_GEN0_THRESHOLD, g1, g2), gc.get_threshold()\n"
        "gc.set_threshold(50000, g1, g2)\n"
        "tune_gc_for_serving()\n"
        "assert gc.get_threshold()[0] == 50000\n"
        "for bad in (0, -5, 1.5, '10'):\n"
        "    try:\n"
        "        tune_gc_for_serving(bad)\n"
        "    except ValueError:\n"
        "        pass\n"
        "    else:\n"
        "        raise AssertionError(bad)\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
