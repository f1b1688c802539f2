"""``LLMEngine.warm_up``: throw-away requests through every kind of step (fresh prefill, a mixed
decode + chunked-extend step, decodes; greedy and sampled), then nothing of them is left."""

import pytest
from engine_helpers import log_scheduled_steps, make_llm, pool_is_idle

from pagedkv import SamplingParams
from pagedkv.errors import InvariantError
from pagedkv.kernels._common import TOKEN_BLOCK_LEVELS


@pytest.mark.parametrize("max_model_len", [256, 48])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_covers_prefill_mixed_and_decode_steps_and_leaves_nothing(tiny_dir, async_scheduling,
                                                                         max_model_len):
    llm = make_llm(tiny_dir("qwen3"), max_num_batched_tokens=64, max_model_len=max_model_len,
                   async_scheduling=async_scheduling, warmup=False)
    engine = llm.engine
    before = engine.kv_stats()
    log = log_scheduled_steps(engine.scheduler)
    steps = engine.warm_up()
    assert steps >= 4 and len(log) >= 4
    kinds = set()
    for so in log:
        counts = list(so.values())
        if not counts:
            continue
        if all(c == 1 for c in counts):
            kinds.add("decode")
        elif any(c == 1 for c in counts):
            kinds.add("mixed")
        else:
            kinds.add("prefill")
    assert kinds == {"prefill", "mixed", "decode"}
    # the short request prefills alone, then decodes; the long one (64 + 32 tokens) joins and
    # is chunked over two steps, each mixed with the short one's decode
    assert list(log[0].values()) == [8] and list(log[1].values()) == [1]
    if max_model_len == 256:
        assert sorted(log[2].values()) == [1, 63] and sorted(log[3].values()) == [1, 33]
    else:  # max_model_len below the budget: long prompts of 44 tokens, cdiv(64 + 32, 44) = 3
        # of them in round 1, so that its mixed step fills the budget (1 + 44 + 19 = 64)
        assert sorted(log[2].values()) == [1, 19, 44]
        assert sum(log[3].values()) == 64
        ids = [rid for so in log for rid in so]
        assert {"__warmup-0-long", "__warmup-0-long-1", "__warmup-0-long-2"} <= set(ids)
        assert "__warmup-1-long-1" not in ids  # round 2: one long request
    # round 2's short request prefills 40 tokens alone (22 = 44 // 2 under max_model_len 48):
    # with round 1's 8, the slot-mapping kernel's two small token-block levels (32, 256) are
    # compiled before a user's first prompt (the budget of 64 never reaches the third)
    first = next(so for so in log if "__warmup-1-short" in so)
    assert first == {"__warmup-1-short": 40 if max_model_len == 256 else 22}
    levels = {next(b for b in TOKEN_BLOCK_LEVELS if b >= max(so.values())) for so in log if so}
    assert levels == {32, 256}
    # nothing left: no requests, every block free, no cached prefix, counters restored
    assert pool_is_idle(llm)
    assert not engine._requests
    after = engine.kv_stats()
    for key in ("steps", "tokens_generated", "preemptions", "prefix_cache_queries",
                "prefix_cache_hits", "cuda_graph_steps", "free_blocks"):
        assert after[key] == before[key], key
    assert len(engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block) == 0
    # the engine serves normally afterwards, and request ids start where they would have
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].request_id == "0"
    assert pool_is_idle(llm)


def test_warm_up_needs_an_idle_engine(tiny_dir):
    llm = make_llm(tiny_dir("qwen3"), warmup=False)
    engine = llm.engine
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2))
    with pytest.raises(InvariantError):
        engine.warm_up()


def test_warm_up_default_is_off_on_cpu_and_on_when_asked(tiny_dir):
    llm = make_llm(tiny_dir("qwen3"))
    assert llm.engine.kv_stats()["steps"] == 0
    llm2 = make_llm(tiny_dir("qwen3"), warmup=True)
    assert llm2.engine.kv_stats()["steps"] == 0 and pool_is_idle(llm2)


def _cascade_llm(tiny_dir, **kw):
    """The tiny Qwen3 with the Triton backend and cascade thresholds the tiny shapes meet except
    ``min_saved_us`` (10 us of saved reads: never at this size, so no user step takes cascade)."""
    from pagedkv.attention.triton_backend import CascadeConfig, TritonAttentionBackend
    cfg = CascadeConfig(min_prefix_tokens=24, min_reqs=3)
    backend = TritonAttentionBackend(cascade=cfg)
    opts = dict(max_num_batched_tokens=64, max_model_len=128, warmup=False)
    opts.update(kw)
    llm = make_llm(tiny_dir("qwen3"), attention_backend=backend, **opts)
    calls = {"cascade": 0, "mixed": 0}
    inner = backend._forward_cascade

    def fwd(q, kv_cache, plan, *a, **k):
        calls["cascade"] += 1
        calls["mixed"] += not plan.decode_only
        return inner(q, kv_cache, plan, *a, **k)

    backend._forward_cascade = fwd
    return llm, backend, cfg, calls


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_warm_up_runs_a_shared_prefix_round_through_cascade_attention(tiny_dir, async_scheduling):
    """The cascade round: P = 24 rounded up to whole 16-token blocks = 32 shared tokens; the
    first request prefills 32 + 8 tokens alone, then 2 more with (64 - 1) // 2 = 31 tokens of
    their own join on 2 cached blocks: one mixed step that fills the 64-token budget but one
    token (1 decode + 2 extends of 31 over the shared 32) and decodes of the three, all cascade
    (min_saved_us relaxed for the round, restored after); then nothing is left, and a user
    batch sharing the same 32 tokens takes no cascade step (10 us are never saved here)."""
    llm, backend, cfg, calls = _cascade_llm(tiny_dir, async_scheduling=async_scheduling)
    engine = llm.engine
    log = log_scheduled_steps(engine.scheduler)
    engine.warm_up()
    assert backend.cascade is cfg
    layers = llm.engine.model.config.num_hidden_layers
    assert calls["mixed"] == layers  # the one mixed step, every layer
    assert calls["cascade"] >= layers * 3  # + decodes of all three
    tail = [sorted(so.values()) for so in log[-6:]]
    assert [1, 31, 31] in tail  # the mixed cascade step: two extends over 32 cached tokens
    assert pool_is_idle(llm) and not engine._requests
    assert len(engine.scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block) == 0
    calls["cascade"] = 0
    system = list(range(3, 35))
    prompts = [system + [40 + i, 41 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    out = llm.generate(prompts, params, use_tqdm=False)
    assert calls["cascade"] == 0 and pool_is_idle(llm)
    cold, _, _, _ = _cascade_llm(tiny_dir, async_scheduling=async_scheduling)
    ref = cold.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]


@pytest.mark.parametrize("max_model_len,kv_bytes,joiner", [(48, None, 11), (128, 96 << 10, 8)])
def test_warm_up_cascade_joiners_capped_by_model_len_and_free_blocks(tiny_dir, max_model_len,
                                                                     kv_bytes, joiner):
    """The joiners' own tokens: (64 - 1) // 2 = 31 wanted; with max_model_len 48 at most
    48 - 32 shared - 4 new - 1 = 11; where the pool cannot hold two joiners of 31 (the tiny
    Qwen3's 96 KiB pool: 11 free blocks; the round asks 3 + 3 x (3 + 1) = 15 with joiners of
    31 and 3 + 3 x (1 + 1) = 9 with joiners of 8) the round falls back to 8 of their own."""
    kw = {"max_model_len": max_model_len}
    if kv_bytes is not None:
        kw["kv_cache_memory_bytes"] = kv_bytes
    llm, backend, cfg, calls = _cascade_llm(tiny_dir, **kw)
    engine = llm.engine
    free = engine.scheduler.kv_cache_manager.num_free_blocks
    assert kv_bytes is None or free == 11
    log = log_scheduled_steps(engine.scheduler)
    engine.warm_up()
    tail = [sorted(so.values()) for so in log]
    assert [1, joiner, joiner] in tail, (free, tail)
    assert calls["mixed"] == engine.model.config.num_hidden_layers
    assert backend.cascade is cfg and pool_is_idle(llm) and not engine._requests


def test_warm_up_skips_the_cascade_round_without_prefix_caching(tiny_dir):
    llm, backend, cfg, calls = _cascade_llm(tiny_dir, enable_prefix_caching=False)
    llm.engine.warm_up()
    assert calls["cascade"] == 0 and backend.cascade is cfg and pool_is_idle(llm)


@pytest.mark.parametrize("where,torn", [("plain", False), ("cascade", True)])
def test_warm_up_interrupted_leaves_nothing_behind(tiny_dir, where, torn):
    """A KeyboardInterrupt at a step of a plain round or of the cascade round, raised inside
    the step (``torn``: as a device error would be) or between steps, leaves no warm-up
    request, no used block, the counters and the backend's cascade config as before, and the
    engine serves normally afterwards."""
    llm, backend, cfg, calls = _cascade_llm(tiny_dir)
    engine = llm.engine
    before = engine.kv_stats()
    total = engine.warm_up()  # a clean run first: how many steps the rounds take
    fail_at = 2 if where == "plain" else total - 2
    inner, n = engine.step, [0]

    def step(*a, **k):
        n[0] += 1
        if n[0] == fail_at:
            engine._stepping = torn
            raise KeyboardInterrupt
        return inner(*a, **k)

    engine.step = step
    with pytest.raises(KeyboardInterrupt):
        engine.warm_up()
    del engine.step
    assert backend.cascade is cfg and pool_is_idle(llm) and not engine._requests
    after = engine.kv_stats()
    for key in ("steps", "tokens_generated", "prefix_cache_queries", "free_blocks"):
        assert after[key] == before[key], key
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3,
                                                      ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and pool_is_idle(llm)


@pytest.mark.gpu
def test_no_triton_kernel_compiles_after_warm_up_gpu():
    """Qwen3-0.6B's shape (random weights, bf16) with ``LLM``'s defaults (warm-up, CUDA
    graphs, cascade attention): after start-up, chat-sized prompts (4 x 40 + 200 tokens), a
    shared-prefix batch (a W3 variant: 40
    requests on a 512-token system prompt + 20-300 own tokens) and a W1-like batch (48
    prompts of 10-1,200 tokens, 1-40 output tokens, chunked by a 2,048-token budget) compile
    no Triton kernel: every variant they launch (tile levels, alignments, split counts,
    cascade pieces) was compiled by the warm-up or the graph capture. (A compile mid-run is
    0.1-0.4 s of stall: W3 lost 0.38 s to two in its third step before this was fixed.)"""
    import random

    import torch
    from triton import knobs

    from pagedkv import LLM

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    llm = LLM.from_shape("qwen3-0.6b", dtype="bfloat16", max_model_len=2048, max_num_seqs=64,
                         max_num_batched_tokens=2048)
    compiled = []

    def on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        compiled.append(f"{fn.name} {' '.join(repr.split())[:200]}")
        return False

    rng = random.Random(0)
    system = [rng.randrange(10, 10000) for _ in range(512)]
    w3 = [system + [rng.randrange(10, 10000) for _ in range(rng.randint(20, 300))]
          for _ in range(40)]
    w1 = [[rng.randrange(10, 10000) for _ in range(rng.randint(10, 1200))] for _ in range(48)]
    w1_params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 40), ignore_eos=True)
                 for _ in w1]
    prev = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = on_compile
    try:
        # first, chat-sized prompts alone (33-256 tokens a step: the slot-mapping kernel's
        # middle token-block level, which the warm-up's own prompts once missed: 310 ms)
        chat = llm.generate([[1 + i] * 40 for i in range(4)] + [[7] * 200],
                            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 8 for o in chat)
        out3 = llm.generate(w3, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            use_tqdm=False)
        out1 = llm.generate(w1, w1_params, use_tqdm=False)
    finally:
        knobs.runtime.jit_cache_hook = prev
    assert all(len(o.outputs[0].token_ids) == 16 for o in out3)
    assert [len(o.outputs[0].token_ids) for o in out1] == [p.max_tokens for p in w1_params]
    assert compiled == [], compiled
    llm.shutdown()
