"""Async scheduling (``async_scheduling=True``): the engine schedules and enqueues step k while
step k-1 runs, the decode rows' input ids come from step k-1's sampled tokens on the device. The
tokens must be exactly the synchronous engine's: greedy against transformers (chunked prefill,
prefix-cache hits, preemption), seeded sampling and logprobs against the synchronous engine,
stop tokens / stop strings / aborts, and the CUDA-graph path (CPU stand-in)."""

import pytest
from engine_helpers import FAMILIES, TEXTS, log_scheduled_steps, make_llm, pool_is_idle

from pagedkv import SamplingParams
from pagedkv.engine.async_scheduler import AsyncScheduler
from pagedkv.errors import InvalidRequestError

NEW = 12


def greedy(n=NEW, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def check_against_hf(ref, outs, n=NEW):
    for o in outs:
        assert o.outputs[0].token_ids == ref.greedy(o.prompt_token_ids, n), f"prompt {o.prompt!r}"
        assert o.outputs[0].finish_reason == "length" and o.finished


@pytest.mark.parametrize("family", FAMILIES)
def test_async_greedy_matches_transformers(tiny_dir, hf_ref, family):
    path = tiny_dir(family)
    llm = make_llm(path, async_scheduling=True)
    assert isinstance(llm.scheduler, AsyncScheduler) and llm.engine.async_scheduling
    outs = llm.generate(TEXTS, greedy(), use_tqdm=False)
    check_against_hf(hf_ref(path), outs)
    assert pool_is_idle(llm)
    assert outs[1].outputs[0].text == llm.tokenizer.decode(outs[1].outputs[0].token_ids)


def test_async_no_step_after_max_tokens(tiny_dir):
    """A request is never scheduled once its in-flight tokens reach max_tokens: it computes
    exactly prompt + max_tokens - 1 tokens, and the pipeline keeps one step in flight."""
    llm = make_llm(tiny_dir("llama"), async_scheduling=True)
    log = log_scheduled_steps(llm.scheduler)
    lens = [3, 7, 12, 5]
    outs = llm.generate(TEXTS, [greedy(n) for n in lens], use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == lens
    for o, n in zip(outs, lens):
        rid = o.request_id
        assert sum(s.get(rid, 0) for s in log) == len(o.prompt_token_ids) + n - 1
    assert llm.engine._inflight is None and pool_is_idle(llm)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_async_chunked_prefill_small_budget(tiny_dir, hf_ref, family):
    path = tiny_dir(family)
    llm = make_llm(path, max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=True)
    log = log_scheduled_steps(llm.scheduler)
    outs = llm.generate(TEXTS, greedy(), use_tqdm=False)
    check_against_hf(hf_ref(path), outs)
    assert all(sum(s.values()) <= 16 for s in log)
    assert any(1 in s.values() and max(s.values()) > 1 for s in log)  # decodes mixed with chunks
    assert pool_is_idle(llm)


def test_async_prefix_cache_hits_keep_tokens(tiny_dir, hf_ref):
    path = tiny_dir("qwen2")
    llm = make_llm(path, async_scheduling=True)
    tok = llm.tokenizer
    prefix = tok.encode(TEXTS[3])[:40]
    tails = [tok.encode(t)[:k] for t, k in zip(TEXTS[1:], (3, 5, 9))]
    first = llm.generate([prefix + [7, 8]], greedy(), use_tqdm=False)
    prompts = [prefix + t for t in tails] + [prefix + [7, 8]]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert llm.get_kv_stats()["prefix_cache_hits"] >= 32 * len(prompts)
    assert outs[-1].outputs[0].token_ids == first[0].outputs[0].token_ids
    check_against_hf(hf_ref(path), first + outs)
    # generated blocks were registered when their tokens arrived: a prompt made of a previous
    # prompt + its output hits (most of) it
    full = list(first[0].prompt_token_ids) + first[0].outputs[0].token_ids
    before = llm.get_kv_stats()["prefix_cache_hits"]
    llm.generate([full + [9]], greedy(2), use_tqdm=False)
    assert llm.get_kv_stats()["prefix_cache_hits"] - before >= 48
    assert pool_is_idle(llm)


def test_async_preemption_with_a_small_pool(tiny_dir, hf_ref):
    path = tiny_dir("llama")
    n = 40
    llm = make_llm(path, num_gpu_blocks_override=13, max_model_len=192, kv_cache_memory_bytes=None,
                   async_scheduling=True)
    outs = llm.generate(TEXTS, greedy(n), use_tqdm=False)
    stats = llm.get_kv_stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]
    check_against_hf(hf_ref(path), outs, n)
    assert pool_is_idle(llm)
    assert all(r.num_output_placeholders == 0 for r in llm.scheduler.requests.values())


@pytest.mark.parametrize("block_size", [1, 32])
def test_async_block_sizes(tiny_dir, hf_ref, block_size):
    path = tiny_dir("qwen3")
    llm = make_llm(path, block_size=block_size, async_scheduling=True)
    check_against_hf(hf_ref(path), llm.generate(TEXTS, greedy(), use_tqdm=False))


def _outputs(llm, prompts, params):
    outs = llm.generate(prompts, params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = None if c.logprobs is None else [
            [(t, lp.rank) for t, lp in e.items()] for e in c.logprobs]
        vals = None if c.logprobs is None else [[lp.logprob for lp in e.values()] for e in c.logprobs]
        res.append(((c.token_ids, c.text, c.finish_reason, c.stop_reason, lps), vals))
    return res


def test_async_matches_sync_sampling_logprobs_and_stops(tiny_dir):
    """Seeded random sampling, logprobs, min_p/top_k/top_p, stop tokens and stop strings: async
    gives the synchronous engine's outputs (tokens, text, finish reasons, logprob ranks; logprob
    values to float tolerance: the batches differ, so CPU matmul blocking may)."""
    path = tiny_dir("qwen3")
    prompts = TEXTS + TEXTS[:2]
    base = make_llm(path)
    probe = base.generate(prompts[4:6], [greedy(20), SamplingParams(
        temperature=0.9, seed=11, max_tokens=12, ignore_eos=True)], use_tqdm=False)
    text = probe[0].outputs[0].text
    stop_str = text[len(text) // 2: len(text) // 2 + 2]
    stop_tok = probe[1].outputs[0].token_ids[6]
    params = [
        SamplingParams(temperature=0.8, seed=7, max_tokens=14, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=1.0, seed=5, top_k=20, top_p=0.9, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=16, logprobs=2),
        SamplingParams(temperature=0.7, min_p=0.05, seed=3, max_tokens=12),
        SamplingParams(temperature=0.0, max_tokens=20, stop=[stop_str]),
        SamplingParams(temperature=0.9, seed=11, max_tokens=12, stop_token_ids=[stop_tok]),
    ]
    sync = make_llm(path, max_num_batched_tokens=24, max_num_seqs=4)
    asyn = make_llm(path, max_num_batched_tokens=24, max_num_seqs=4, async_scheduling=True)
    a, b = _outputs(sync, prompts, params), _outputs(asyn, prompts, params)
    assert [x for x, _ in a] == [x for x, _ in b]
    for (_, va), (_, vb) in zip(a, b):
        if va is not None:
            for ea, eb in zip(va, vb):
                assert ea == pytest.approx(eb, abs=1e-4)
    assert a[4][0][2:4] == ("stop", stop_str) and a[5][0][2:4] == ("stop", stop_tok)
    assert pool_is_idle(asyn)


def test_async_abort_and_streaming_steps(tiny_dir):
    path = tiny_dir("llama")
    llm = make_llm(path, async_scheduling=True)
    eng = llm.engine
    ids = [eng.add_request(t, greedy(10)) for t in TEXTS]
    seen = {rid: [] for rid in ids}
    finished = {}
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            seen[out.request_id] = out.outputs[0].token_ids
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps == 4:
            assert eng.abort(ids[2])
            with pytest.raises(InvalidRequestError, match="in flight"):
                eng.release(ids[2])
                eng.add_request(TEXTS[0], greedy(2), request_id=ids[2])
    for out in eng.flush():
        finished[out.request_id] = out
    assert finished[ids[2]].outputs[0].finish_reason == "abort"
    assert len(finished[ids[2]].outputs[0].token_ids) < 10
    sync = make_llm(path)
    ref = sync.generate([TEXTS[i] for i in (0, 1, 3)], greedy(10), use_tqdm=False)
    assert [finished[ids[i]].outputs[0].token_ids for i in (0, 1, 3)] == \
        [o.outputs[0].token_ids for o in ref]
    # the id is reusable once its step was collected
    eng.add_request(TEXTS[0], greedy(2), request_id=ids[2])
    while eng.has_unfinished_requests():
        eng.step()
    eng.flush()
    assert pool_is_idle(llm)


def test_async_graph_path_on_cpu(tiny_dir, hf_ref):
    """The decode-graph path (padded buckets, persistent buffers) with async scheduling: the
    step-k-1 tokens are written into the persistent input-id buffer the graph reads."""
    from test_model_runner import EagerReplay

    from pagedkv.worker.cuda_graphs import CudaGraphManager

    path = tiny_dir("qwen3")
    llm = make_llm(path, max_num_seqs=8, async_scheduling=True)
    runner = llm.runner
    mgr = CudaGraphManager(runner, [1, 2, 4, 8], graph_capture=EagerReplay())
    mgr.capture()
    runner.cuda_graphs = mgr
    outs = llm.generate(TEXTS + TEXTS[:1], [greedy(n) for n in (10, 4, 10, 7, 9)], use_tqdm=False)
    assert runner.num_graph_steps > 0
    ref = hf_ref(path)
    for o, n in zip(outs, (10, 4, 10, 7, 9)):
        assert o.outputs[0].token_ids == ref.greedy(o.prompt_token_ids, n)
