"""Request handling through the engine: validation before scheduling, abort, stop strings and
stop token ids, seeded sampling, logprobs, metrics."""

import math

import pytest
import torch
from engine_helpers import TEXTS, make_llm, pool_is_idle

from pagedkv import LLM, SamplingParams
from pagedkv.errors import InvalidRequestError, UnknownRequestError


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return make_llm(tiny_dir("qwen3"), max_model_len=64)


def _untouched(llm, free_before):
    sched = llm.scheduler
    return (sched.kv_cache_manager.num_free_blocks == free_before and not sched.requests
            and not sched.has_requests())


@pytest.mark.parametrize("prompt, params, match", [
    ("", None, "empty"),
    ([[]], None, "empty"),
    (list(range(64)), None, "max_model_len"),
    (list(range(100)), None, "max_model_len"),
    ([1, 2, 512], None, "outside the vocabulary"),
    ([1, -3], None, "outside the vocabulary"),
    ([1, 2.5], None, "ints"),
    ([2, True], None, "ints"),
    ("Hello", {"temperature": 0}, "SamplingParams"),
    ("Hello", "greedy", "SamplingParams"),
    ([5, 6], SamplingParams(stop_token_ids=[600]), "outside the vocabulary"),
])
def test_invalid_requests_rejected_before_scheduling(llm, prompt, params, match):
    free = llm.scheduler.kv_cache_manager.num_free_blocks
    with pytest.raises(InvalidRequestError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert _untouched(llm, free)
    # one bad prompt in a batch: nothing of the batch is queued
    with pytest.raises(InvalidRequestError):
        llm.generate(["Hello", prompt], params, use_tqdm=False)
    assert _untouched(llm, free)


def test_bad_sampling_params_are_typed_errors():
    for kw in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(min_p=1.5),
               dict(max_tokens=0), dict(n=2), dict(logprobs=99), dict(stop=[""])):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kw)


def test_params_list_length_must_match(llm):
    with pytest.raises(InvalidRequestError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams(), SamplingParams(), SamplingParams()], use_tqdm=False)
    assert not llm.scheduler.has_requests()


def test_longest_valid_prompt_and_length_cap(llm):
    p = [5] * 63  # max_model_len - 1
    out = llm.generate([p], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert pool_is_idle(llm)


def test_abort_frees_blocks(llm):
    sched = llm.scheduler
    mgr = sched.kv_cache_manager
    free0 = mgr.num_free_blocks
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    a = llm.add_request(TEXTS[2], params)
    b = llm.add_request(TEXTS[1], params)
    for _ in range(3):
        llm.step()
    held_by_a = len(mgr.get_block_ids(a)[0])
    assert held_by_a > 0
    free_mid = mgr.num_free_blocks
    assert llm.abort(a) is True
    assert mgr.num_free_blocks == free_mid + held_by_a
    assert llm.abort(a) is False  # already finished
    outs = {o.request_id: o for o in llm.step()}
    assert outs[a].finished and outs[a].outputs[0].finish_reason == "abort"
    assert 0 < len(outs[a].outputs[0].token_ids) < 30
    last = None
    while llm.has_unfinished_requests():
        for o in llm.step():
            assert o.request_id == b
            last = o
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert mgr.num_free_blocks == free0 and pool_is_idle(llm)
    # finished requests are forgotten once reported; aborting them (or unknown ids) is a no-op
    assert llm.abort(b) is False and llm.abort("no-such-request") is False
    with pytest.raises(UnknownRequestError):
        llm.engine.get_request(b)
    assert not llm.engine._requests


def test_abort_waiting_request(llm):
    rid = llm.add_request([3, 4, 5], SamplingParams(max_tokens=5))
    assert llm.abort(rid)
    out = llm.step()
    assert [o.request_id for o in out] == [rid] and out[0].outputs[0].finish_reason == "abort"
    assert pool_is_idle(llm)


def test_stop_strings(tiny_dir):
    llm = make_llm(tiny_dir("mistral"), max_model_len=64)  # its tiny model's text varies most
    base = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ref = llm.generate(TEXTS[:3], base, use_tqdm=False)
    stops, expected = [], []
    for o in ref:
        text = o.outputs[0].text
        # a 2-character stop string whose first occurrence is well inside the text
        s = next(text[i:i + 2] for i in range(3, len(text) - 2)
                 if "\ufffd" not in text[i:i + 2] and text.find(text[i:i + 2]) >= 3)
        stops.append(s)
        expected.append(text[: text.find(s)])
    outs = llm.generate(TEXTS[:3], [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[s])
                                     for s in stops], use_tqdm=False)
    for o, r, s, want in zip(outs, ref, stops, expected):
        c = o.outputs[0]
        assert c.text == want
        assert c.finish_reason == "stop" and c.stop_reason == s
        assert len(c.token_ids) < 24
        assert c.token_ids == r.outputs[0].token_ids[: len(c.token_ids)]
    assert pool_is_idle(llm)
    # include_stop_str_in_output keeps it
    o = llm.generate(TEXTS[0], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stops[0],
                                              include_stop_str_in_output=True), use_tqdm=False)[0]
    assert o.outputs[0].text == expected[0] + stops[0]


def test_stop_token_ids(llm):
    base = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = llm.generate(TEXTS[2], base, use_tqdm=False)[0].outputs[0].token_ids
    # a token whose first occurrence is not at position 0
    k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    stop_tok = ref[k]
    out = llm.generate(TEXTS[2], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    c = out.outputs[0]
    assert c.token_ids == ref[: k + 1]
    assert c.finish_reason == "stop" and c.stop_reason == stop_tok
    assert pool_is_idle(llm)


def test_eos_stops_unless_ignored(llm):
    ref = llm.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0].token_ids
    k = next(i for i in range(1, len(ref)) if ref[i] not in ref[:i])
    llm.engine.eos_token_ids = [ref[k]]  # pretend that token is EOS
    try:
        c = llm.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0].outputs[0]
        assert c.token_ids == ref[: k + 1] and c.finish_reason == "stop" and c.stop_reason is None
        c = llm.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
        assert c.token_ids == ref
    finally:
        llm.engine.eos_token_ids = list(llm.engine.config.eos_token_ids)


def test_seeded_sampling_is_reproducible(tiny_dir):
    path = tiny_dir("qwen3")
    llm = make_llm(path, max_model_len=64)
    p = SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate(TEXTS[1], p, use_tqdm=False)[0].outputs[0].token_ids
    # in a batch with other (unseeded, differently sized) requests, at another row
    mixed = llm.generate([TEXTS[0], TEXTS[2], TEXTS[1]],
                         [SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True),
                          SamplingParams(temperature=0, max_tokens=20, ignore_eos=True), p],
                         use_tqdm=False)[2].outputs[0].token_ids
    assert alone == mixed
    other = llm.generate(TEXTS[1], SamplingParams(temperature=1.0, top_p=0.95, top_k=50, seed=99,
                                                  max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert other[0].outputs[0].token_ids != alone
    # unseeded requests follow the engine seed
    q = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = make_llm(path, max_model_len=64, seed=5).generate(TEXTS[:2], q, use_tqdm=False)
    b = make_llm(path, max_model_len=64, seed=5).generate(TEXTS[:2], q, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_sampling_with_preemption_keeps_seeded_stream(tiny_dir):
    path = tiny_dir("llama")
    p = [SamplingParams(temperature=1.0, seed=s, max_tokens=30, ignore_eos=True) for s in range(4)]
    roomy = make_llm(path, max_model_len=128).generate(TEXTS, p, use_tqdm=False)
    tight = make_llm(path, max_model_len=128, num_gpu_blocks_override=10, kv_cache_memory_bytes=None)
    outs = tight.generate(TEXTS, p, use_tqdm=False)
    assert tight.get_kv_stats()["preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in roomy]


def test_logprobs(llm, hf_ref, tiny_dir):
    ref = hf_ref(tiny_dir("qwen3"))
    out = llm.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 6
    full = out.prompt_token_ids + c.token_ids
    hf_lp = torch.log_softmax(ref.logits(full), dim=-1)
    total = 0.0
    for i, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
        assert tok in entry and entry[tok].rank == 1  # greedy picks the most likely
        assert 3 <= len(entry) <= 4
        want = float(hf_lp[len(out.prompt_token_ids) + i - 1, tok])
        assert math.isclose(entry[tok].logprob, want, abs_tol=1e-4)
        total += entry[tok].logprob
    assert math.isclose(c.cumulative_logprob, total, rel_tol=1e-6)
    plain = llm.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None and plain.token_ids == c.token_ids


def test_metrics_and_outputs(llm):
    outs = llm.generate([TEXTS[0], [7, 8, 9]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                        use_tqdm=False)
    for o in outs:
        m = o.metrics
        assert o.finished and m.num_generated_tokens == 4 == len(o.outputs[0].token_ids)
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.time_to_first_token >= 0 and m.e2e_latency >= m.time_to_first_token
        assert m.num_prompt_tokens == len(o.prompt_token_ids)
    assert outs[1].prompt is None and outs[1].prompt_token_ids == [7, 8, 9]
    assert outs[0].prompt == TEXTS[0]


def test_model_without_tokenizer_takes_token_ids(tiny_dir):
    llm = LLM(tiny_dir("qwen3"), dtype="float32", device="cpu", tokenizer=False, max_model_len=64,
              kv_cache_memory_bytes=1 << 20)
    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    out = llm.generate([[1, 2, 3]], p, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].outputs[0].text == ""
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate("text", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]), use_tqdm=False)


def test_prompt_forms(llm):
    import numpy as np

    p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    ids = llm.tokenizer.encode(TEXTS[1])
    want = llm.generate(ids, p, use_tqdm=False)[0].outputs[0].token_ids
    forms = [TEXTS[1], {"prompt": TEXTS[1]}, {"prompt_token_ids": ids}, tuple(ids), np.array(ids),
             [np.int64(t) for t in ids]]
    for form in forms:
        outs = llm.generate(form, p, use_tqdm=False)
        assert len(outs) == 1 and outs[0].outputs[0].token_ids == want, form
    outs = llm.generate(forms, p, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want] * len(forms)
    with pytest.raises(InvalidRequestError, match="one key"):
        llm.generate({"prompt": "a", "x": 1}, p, use_tqdm=False)


def test_queued_prompt_ids_are_plain_ints_and_not_shared(llm):
    """The scheduler's request takes validate_request's list as it is (``prompt_ids_checked``,
    no second conversion): plain ints from any prompt form (numpy ints converted once), never
    the caller's list, and never the list a RequestOutput hands out."""
    import numpy as np

    from pagedkv.core.request import Request

    engine = llm.engine
    ids = llm.tokenizer.encode(TEXTS[1])
    p = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for form in (ids, np.array(ids), [np.int64(t) for t in ids], tuple(ids)):
        rid = engine.add_request(form, p)
        req = engine.scheduler.requests[rid]
        assert req.prompt_token_ids == ids and req.prompt_token_ids is not form
        assert {type(t) for t in req.prompt_token_ids} == {int}
        assert req.all_token_ids == ids and req.all_token_ids is not req.prompt_token_ids
        out = engine.get_request(rid)
        assert out.prompt_token_ids == ids and out.prompt_token_ids is not req.prompt_token_ids
        engine.abort(rid)
        engine.release(rid)
    # without the flag a Request converts (numpy ints hash to other bytes)
    r = Request("x", [np.int64(5), np.int64(7)])
    assert r.prompt_token_ids == [5, 7] and {type(t) for t in r.prompt_token_ids} == {int}
    own = [5, 7]
    assert Request("y", own, prompt_ids_checked=True).prompt_token_ids is own


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_min_tokens_keeps_stop_tokens_out_until_reached(tiny_dir, async_scheduling):
    """min_tokens (vLLM semantics): before a request has min_tokens outputs its stop tokens
    (stop_token_ids, and EOS unless ignore_eos) cannot be sampled; greedy then takes the best
    other token; from min_tokens on they stop the request as usual."""
    llm = make_llm(tiny_dir("qwen3"), max_model_len=64, async_scheduling=async_scheduling)
    free = llm.scheduler.kv_cache_manager.num_free_blocks
    base = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    ref = llm.generate(TEXTS[1], base, use_tqdm=False)[0].outputs[0]
    stop_tok = ref.token_ids[0]  # greedy's first token
    runner_up = next(t for t in ref.logprobs[0] if t != stop_tok)  # best other first token
    # without min_tokens the request stops at once
    c = llm.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                              stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [stop_tok] and c.finish_reason == "stop"
    # with min_tokens=3 the first three outputs avoid it; the first is the runner-up
    for kw in (dict(stop_token_ids=[stop_tok], ignore_eos=True), dict()):
        if not kw:  # the same token as EOS (not ignored) instead of a stop token id
            llm.engine.eos_token_ids = [stop_tok]
        try:
            out = llm.generate(TEXTS[1], SamplingParams(temperature=0, max_tokens=12, min_tokens=3,
                                                        logprobs=1, **kw), use_tqdm=False)[0]
        finally:
            llm.engine.eos_token_ids = list(llm.engine.config.eos_token_ids)
        toks = out.outputs[0].token_ids
        assert len(toks) >= 3 and stop_tok not in toks[:3], (kw, toks)
        assert toks[0] == runner_up
        # raw logprobs are the model's: the banned token keeps its finite logprob
        assert math.isfinite(out.outputs[0].logprobs[0][toks[0]].logprob)
        if out.outputs[0].finish_reason == "stop":
            assert toks[-1] == stop_tok and stop_tok not in toks[3:-1]
        else:
            assert len(toks) == 12 and stop_tok not in toks
    assert llm.scheduler.kv_cache_manager.num_free_blocks == free


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_deltas_add_up_to_the_outputs(tiny_dir, async_scheduling):
    """step(deltas=True): each OutputDelta holds only what the step added; concatenated they
    equal generate's tokens, text (stop strings included) and logprobs."""
    from pagedkv.engine.outputs import OutputDelta

    llm = make_llm(tiny_dir("qwen3"), async_scheduling=async_scheduling)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.7, seed=3, max_tokens=15, ignore_eos=True)]
    want = llm.generate(TEXTS[:2], params, use_tqdm=False)
    stop = want[0].outputs[0].text[4:7]
    params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    want.append(llm.generate(TEXTS[0], params[2], use_tqdm=False)[0])
    eng = llm.engine
    ids = [eng.add_request(t, p) for t, p in zip([TEXTS[0], TEXTS[1], TEXTS[0]], params)]
    acc = {i: dict(toks=[], text="", lps=[], reason=None) for i in ids}
    while eng.has_unfinished_requests():
        outs = eng.step(deltas=True)
        if not eng.has_unfinished_requests():
            outs += eng.flush(deltas=True)
        for d in outs:
            assert isinstance(d, OutputDelta)
            a = acc[d.request_id]
            assert a["reason"] is None  # nothing after the final delta
            a["toks"] += d.token_ids
            a["text"] += d.text
            a["lps"] += d.logprobs or []
            a["reason"] = d.finish_reason
    for i, w in zip(ids, want):
        c = w.outputs[0]
        a = acc[i]
        assert a["toks"] == c.token_ids and a["text"] == c.text and a["reason"] == c.finish_reason
        if c.logprobs:  # the same entries (values up to the batch's float order)
            assert [sorted(e) for e in a["lps"]] == [sorted(e) for e in c.logprobs]
            assert all(abs(x[t].logprob - y[t].logprob) < 1e-4
                       for x, y in zip(a["lps"], c.logprobs) for t in x)
    assert pool_is_idle(llm)
