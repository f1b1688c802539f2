"""Penalties through the engine: greedy repetition_penalty equals transformers' ``generate``
(its RepetitionPenaltyLogitsProcessor over prompt + output); frequency / presence equal a plain
loop over transformers' logits with the penalty twin; sync and async scheduling, chunked
prefill, preemption with a small pool, mixed with plain greedy and seeded random requests."""

import pytest
import torch
from engine_helpers import TEXTS, make_llm, pool_is_idle

from pagedkv.sampling.params import SamplingParams
from pagedkv.sampling.penalties import penalize_reference

transformers = pytest.importorskip("transformers")


@torch.no_grad()
def hf_repetition(model, prompt, n, r):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         do_sample=False, eos_token_id=None, pad_token_id=0,
                         repetition_penalty=r)
    return out[0, len(prompt):].tolist()


@torch.no_grad()
def reference_loop(model, prompt, n, rep=1.0, freq=0.0, pres=0.0):
    """Greedy decoding with the plain penalty twin over transformers' full-sequence logits."""
    out: list[int] = []
    for _ in range(n):
        logits = model(torch.tensor([list(prompt) + out])).logits[0, -1].float().tolist()
        pen = penalize_reference(logits, prompt, out, rep, freq, pres)
        out.append(max(range(len(pen)), key=pen.__getitem__))
    return out


@pytest.fixture(scope="module")
def qwen3(tiny_dir, hf_ref):
    path = tiny_dir("qwen3")
    return path, hf_ref(path).model


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_repetition_penalty_matches_transformers(qwen3, async_scheduling):
    path, model = qwen3
    llm = make_llm(path, async_scheduling=async_scheduling, max_num_batched_tokens=32)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    n = 24
    for r in (1.3, 0.8):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                           repetition_penalty=r), use_tqdm=False)
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == hf_repetition(model, p, n, r), r
    # the penalty changes what greedy picks on this model (the test can fail)
    plain = llm.generate({"prompt_token_ids": prompts[0]},
                         SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0].token_ids
    assert plain != hf_repetition(model, prompts[0], n, 1.3)
    assert pool_is_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_frequency_and_presence_match_the_twin_loop(qwen3, async_scheduling):
    path, model = qwen3
    llm = make_llm(path, async_scheduling=async_scheduling, max_num_batched_tokens=24)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    n = 16
    cases = [dict(frequency_penalty=0.7), dict(presence_penalty=1.5),
             dict(frequency_penalty=-0.3, presence_penalty=0.4, repetition_penalty=1.2), {}]
    # one batch: each prompt with its own penalties (row isolation), plus a plain greedy one
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw) for kw in cases]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for p, kw, o in zip(prompts, cases, outs):
        want = reference_loop(model, p, n, kw.get("repetition_penalty", 1.0),
                              kw.get("frequency_penalty", 0.0), kw.get("presence_penalty", 0.0))
        assert o.outputs[0].token_ids == want, kw
    assert pool_is_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_penalties_survive_preemption(tiny_dir, hf_ref, async_scheduling):
    path = tiny_dir("llama")
    model = hf_ref(path).model
    n = 40
    llm = make_llm(path, num_gpu_blocks_override=13, max_model_len=192,
                   kv_cache_memory_bytes=None, async_scheduling=async_scheduling)
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    p = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, frequency_penalty=0.5,
                       repetition_penalty=1.1)
    outs = llm.generate([{"prompt_token_ids": q} for q in prompts], p, use_tqdm=False)
    assert llm.get_kv_stats()["preemptions"] > 0
    for q, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference_loop(model, q, n, 1.1, 0.5, 0.0)
    assert pool_is_idle(llm)


def test_seeded_sampling_with_penalties_is_batch_independent(tiny_dir):
    """A seeded penalized request gives the same tokens alone and beside others (sync and
    async), so the counts follow the request, not the row."""
    path = tiny_dir("qwen3")
    p = SamplingParams(temperature=0.9, seed=7, max_tokens=20, ignore_eos=True,
                       presence_penalty=0.8, frequency_penalty=0.3)
    other = SamplingParams(temperature=0.7, seed=3, max_tokens=9, ignore_eos=True,
                           repetition_penalty=1.5)
    results = []
    for async_scheduling in (False, True):
        llm = make_llm(path, async_scheduling=async_scheduling)
        alone = llm.generate(TEXTS[2], p, use_tqdm=False)[0].outputs[0].token_ids
        four = llm.generate([TEXTS[0], TEXTS[2], TEXTS[3], TEXTS[1]],
                            [other, p, other, SamplingParams(temperature=0, max_tokens=5)],
                            use_tqdm=False)
        assert four[1].outputs[0].token_ids == alone
        two = llm.generate([TEXTS[0], TEXTS[2]], [other, p], use_tqdm=False)[1]
        assert two.outputs[0].token_ids == alone
        results.append(alone)
        assert pool_is_idle(llm)
    assert results[0] == results[1]


def test_generation_config_repetition_penalty_is_the_default(tiny_dir, tmp_path, hf_ref):
    """A checkpoint whose generation_config.json sets repetition_penalty applies it when the
    caller passes no SamplingParams (vLLM's default sampling params)."""
    import json
    import shutil

    src = tiny_dir("qwen3")
    dst = tmp_path / "ck"
    shutil.copytree(src, dst)
    cfg_path = dst / "generation_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
    cfg.update(repetition_penalty=1.3, temperature=0.0, max_new_tokens=24)
    cfg_path.write_text(json.dumps(cfg))
    llm = make_llm(str(dst))
    assert llm.engine.default_sampling_params().repetition_penalty == 1.3
    prompt = llm.tokenizer.encode(TEXTS[0])
    out = llm.generate({"prompt_token_ids": prompt}, use_tqdm=False)[0].outputs[0].token_ids
    model = hf_ref(src).model
    want = hf_repetition(model, prompt, 24, 1.3)
    assert out[: len(want)] == want[: len(out)] and len(out) > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_decode_steps_advance_the_counts_on_the_device(tiny_dir, async_scheduling):
    """While the batch does not change, the penalty counts are built once and advanced by each
    sampled token (no rebuild from the host lists), and they equal the outputs' counts."""
    llm = make_llm(tiny_dir("qwen3"), async_scheduling=async_scheduling)
    eng = llm.engine
    p = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, frequency_penalty=0.4)
    ids = [eng.add_request(t, p) for t in TEXTS[:2]]
    state = eng.runner.sampling
    runner = eng.runner
    seen = []
    checked = 0
    while eng.has_unfinished_requests():
        eng.step()
        pc = state.penalties
        if pc is None:
            continue
        seen.append(pc)
        if not async_scheduling and len(state.key) == 2:
            # sync: the host lists hold every sampled token; the device counts equal them
            for j, rid in enumerate(state.key):
                toks = runner.requests[rid].output_token_ids
                want = torch.bincount(torch.tensor(toks, dtype=torch.long),
                                      minlength=pc.vocab_size)
                assert torch.equal(pc.counts[j].long(), want)
                checked += 1
    decode = seen[2:-2]  # after both prompts are in, before the last steps
    assert len(decode) > 20 and all(pc is decode[0] for pc in decode)
    assert async_scheduling or checked > 40
