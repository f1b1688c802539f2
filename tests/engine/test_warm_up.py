"""``LLMEngine.warm_up``: throw-away requests through every kind of step (fresh prefill, a mixed
decode + chunked-extend step, decodes; greedy and sampled), then nothing of them is left."""

import pytest
from engine_helpers import log_scheduled_steps, make_llm, pool_is_idle

from pagedkv import SamplingParams
from pagedkv.errors import InvariantError


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
    else:  # max_model_len below the budget: the long prompt (44 tokens) fits one mixed step
        assert sorted(log[2].values()) == [1, 44]
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
