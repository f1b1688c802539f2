"""AsyncLLM directly (no HTTP): a consumer that falls behind gets the newest cumulative output
(fewer, larger steps; nothing lost), a prompt's outputs equal LLM.generate, one loop wake-up
per engine step delivers every stream's output."""

import asyncio

import pytest

from pagedkv import LLM, SamplingParams
from pagedkv.entrypoints.async_llm import AsyncLLM

ENGINE = dict(device="cpu", dtype="float32", attention_backend="torch_ref", max_num_seqs=8,
              max_num_batched_tokens=256, max_model_len=256, kv_cache_memory_bytes=2 << 20,
              seed=0)


@pytest.fixture(scope="module")
def engines(tiny_dir):
    path = tiny_dir("llama")
    return LLM(path, **ENGINE), LLM(path, **ENGINE)


def test_slow_consumer_gets_the_newest_output(engines):
    served, ref = engines
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["Hello", "The block table maps a request row", "A slot is a block id times"]
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, p, use_tqdm=False)]
    allm = AsyncLLM(served.engine).start()
    loop_calls = []

    async def consume(prompt, lag_steps):
        """Read the stream; after each read, fall ``lag_steps`` engine steps behind (counted
        in steps, not seconds, so a loaded machine does not change what the test shows)."""
        seen = []
        async for out in allm.generate(prompt, p):
            seen.append(len(out.outputs[0].token_ids))
            target = served.engine.stats.steps + lag_steps
            while (lag_steps and served.engine.stats.steps < target
                   and served.engine.scheduler.has_unfinished_requests()):
                await asyncio.sleep(0.002)
        return out, seen

    async def main():
        loop = asyncio.get_running_loop()
        inner = loop.call_soon_threadsafe

        def counting(fn, *args, **kw):
            loop_calls.append(fn)
            return inner(fn, *args, **kw)

        loop.call_soon_threadsafe = counting
        return await asyncio.gather(consume(prompts[0], 3), consume(prompts[1], 0),
                                    consume(prompts[2], 0))

    steps0 = served.engine.stats.steps
    try:
        results = asyncio.run(main())
    finally:
        allm.shutdown()
    (slow, slow_seen), (fast, fast_seen), _ = results
    for (out, seen), w in zip(results, want):
        assert out.finished and out.outputs[0].token_ids == w
        assert seen == sorted(seen) and seen[-1] == 40  # cumulative, never going back
    # the slow reader skipped outputs (several tokens per read), the fast one saw ~every step
    assert len(slow_seen) < 0.6 * len(fast_seen), (slow_seen, fast_seen)
    # one call_soon_threadsafe per step for all three streams (plus the add futures)
    deliveries = [fn for fn in loop_calls if getattr(fn, "__name__", "") == "_put_all"]
    steps = served.engine.stats.steps - steps0
    assert 40 <= len(deliveries) <= steps, (len(deliveries), steps)
    assert len(loop_calls) <= steps + 3
