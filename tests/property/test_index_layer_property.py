"""Random schedules through scheduler + worker tables + kernels with the sanitizer on.

Each example draws a workload (arrivals, shared prefixes, prompt/output lengths), an engine
shape (tiny pools force preemption, small budgets force chunked prefill, optional sliding-window
or chunked-local group) and abort events; the driver runs it to completion with every invariant
of DESIGN.md checked at every step (pagedkv.sanitizer). At the end every block is back in the
pool and every request finished.
"""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)
from pagedkv.tools.index_driver import IndexLayerDriver
from pagedkv.tools.workload import WorkloadSpec, make_workload


@st.composite
def engines(draw):
    block_size = draw(st.sampled_from([1, 4, 16]))
    extra = draw(st.sampled_from(["none", "swa", "local"]))
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=block_size))]
    if extra == "swa":
        w = draw(st.integers(2, 48))
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=block_size, sliding_window=w)))
    elif extra == "local":
        c = block_size * draw(st.integers(1, 4))
        groups.append(KVCacheGroupSpec(("local",), ChunkedLocalAttentionSpec(
            block_size=block_size, attention_chunk_size=c)))
    max_model_len = draw(st.sampled_from([64, 128, 256]))
    # Pool between "barely one max-length request" and "roomy".
    min_blocks = len(groups) * (-(-max_model_len // block_size)) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks * 3))
    max_num_seqs = draw(st.integers(1, 6))
    budget = draw(st.integers(max(max_num_seqs, 8), 96))
    caching = draw(st.booleans())
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         max_model_len=max_model_len,
                         long_prefill_token_threshold=draw(st.sampled_from([0, 0, 16])))
    cc = CacheConfig(block_size=block_size, num_gpu_blocks=num_blocks, enable_prefix_caching=caching)
    return kv, sc, cc


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(engine=engines(), seed=st.integers(0, 10_000), n=st.integers(1, 10),
       share=st.sampled_from([0.0, 0.5, 0.9]), abort_p=st.sampled_from([0.0, 0.05]))
def test_random_schedules_keep_every_invariant(engine, seed, n, share, abort_p):
    kv, sc, cc = engine
    cap = min(sc.max_model_len, (kv.num_blocks - 1) * cc.block_size // len(kv.kv_cache_groups))
    spec = WorkloadSpec(num_requests=n, shared_prefix_ratio=share, prefix_len=min(40, cap // 2),
                        tail_len=(1, max(1, cap // 2)), max_tokens=(1, 24), arrival_rate=1.5,
                        vocab_size=500, seed=seed)
    workload = make_workload(spec, max_len=cap)
    driver = IndexLayerDriver(kv, sc, cc, vocab_size=500,
                              sanitize=True)
    rng = random.Random(seed)
    aborted = set()

    def maybe_abort(rec):
        if abort_p and rec.row_req_ids and rng.random() < abort_p:
            rid = rng.choice(rec.row_req_ids)
            aborted.add(rid)
            driver.abort(rid)

    driver.run(workload, max_steps=5000, on_step=maybe_abort)
    mgr = driver.scheduler.kv_cache_manager
    assert mgr.num_free_blocks == kv.num_blocks - 1, "blocks leaked at the end"
    assert not driver.scheduler.has_unfinished_requests()
    assert driver.batch.num_reqs == 0 and not driver.states


def test_sanitized_trace_with_preemption_and_prefix_hits():
    """A deterministic run that is known to preempt and to hit the prefix cache."""
    kv = KVCacheConfig(num_blocks=14, kv_cache_groups=[
        KVCacheGroupSpec(("l",), FullAttentionSpec(block_size=16))])
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=192)
    spec = WorkloadSpec(num_requests=6, shared_prefix_ratio=1.0, num_prefixes=1, prefix_len=40,
                        tail_len=(4, 24), max_tokens=(30, 60), arrival_rate=0.0, seed=3)
    driver = IndexLayerDriver(kv, sc, vocab_size=1000,
                              sanitize=True)
    driver.run(make_workload(spec, max_len=160))
    s = driver.summary()
    assert s["preemptions"] > 0
    assert s["prefix_hits"] > 0
    assert s["free_blocks_at_end"] == 13
