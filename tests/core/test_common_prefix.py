"""``SchedulerOutput.num_common_prefix_blocks`` (cascade attention's shared prefix): per
KV-cache group, the leading blocks that every request holding blocks shares, walked along
``running[0]``'s list (vLLM's rule: a block counts while its ``ref_cnt`` equals the number of
holders). Hand-computed cases at block size 4 (prompts of whole blocks share them through
prefix-cache hits), then a property test against a brute-force intersection of the tables."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.config import CacheConfig, SchedulerConfig
from pagedkv.core.output import ModelRunnerOutput
from pagedkv.core.scheduler import Scheduler
from pagedkv.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)

B = 4
SYS = [101, 102, 103, 104, 105, 106, 107, 108]  # two full blocks of "system prompt"


def make(groups=None, num_blocks=40, max_num_seqs=8, budget=64, caching=True) -> Scheduler:
    groups = groups or [KVCacheGroupSpec(("layer.0",), FullAttentionSpec(block_size=B))]
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                          max_model_len=256)
    return Scheduler(cfg, kv, CacheConfig(block_size=B, enable_prefix_caching=caching))


def step(sched: Scheduler):
    """schedule + update (one sampled token per completed prefill); returns the output."""
    out = sched.schedule()
    sampled = {rid: [] if sched.requests[rid].is_prefill_chunk else [900 + sched.requests[rid].num_tokens]
               for rid in out.num_scheduled_tokens}
    sched.update_from_output(out, ModelRunnerOutput.from_sampled(sampled))
    return out


def add(sched: Scheduler, rid: str, tokens, max_tokens=20):
    sched.add_request(sched.make_request(rid, list(tokens), max_tokens=max_tokens))


def test_nothing_running_is_empty():
    sched = make()
    assert sched.schedule().num_common_prefix_blocks == []


def test_one_request_shares_all_its_blocks():
    # a lone request is every holder: its 3 blocks (2 full + the partial one) all count
    sched = make()
    add(sched, "a", SYS + [1, 2])
    out = step(sched)
    assert out.num_common_prefix_blocks == [3]


def test_prefix_hits_divergence_and_finish():
    sched = make()
    add(sched, "a", SYS + [1, 2, 3, 4, 5])  # blocks: SYS0, SYS1, [1..4], [5]
    assert step(sched).num_common_prefix_blocks == [4]
    # b shares both system blocks (hit of 8 tokens) and nothing after them
    add(sched, "b", SYS + [7, 7, 7])
    out = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 8
    assert out.num_common_prefix_blocks == [2]
    # c shares only the first system block: the shared prefix shrinks to 1
    add(sched, "c", SYS[:4] + [50, 51, 52, 53, 54], max_tokens=2)
    out = step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 4
    assert out.num_common_prefix_blocks == [1]
    # c finishes (2 tokens: sampled at its prefill and at the next step) and frees its blocks:
    # a and b share two blocks again
    out = step(sched)
    assert "c" in out.num_scheduled_tokens and sched.requests.get("c") is None
    assert step(sched).num_common_prefix_blocks == [2]


def test_no_shared_block():
    sched = make()
    add(sched, "a", SYS + [1])
    add(sched, "b", [9, 9, 9, 9, 9])
    out = step(sched)
    assert out.num_common_prefix_blocks == [0]


def test_caching_off_shares_nothing_between_requests():
    sched = make(caching=False)
    add(sched, "a", SYS + [1])
    step(sched)
    add(sched, "b", SYS + [2])
    assert step(sched).num_common_prefix_blocks == [0]


def test_hybrid_groups_only_full_attention_counts():
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=B)),
              KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=B, sliding_window=8)),
              KVCacheGroupSpec(("local",), ChunkedLocalAttentionSpec(block_size=B,
                                                                     attention_chunk_size=8))]
    sched = make(groups=groups, num_blocks=80)
    add(sched, "a", SYS + [1, 2, 3, 4, 5])
    assert step(sched).num_common_prefix_blocks == [4, 0, 0]
    add(sched, "b", SYS + [6, 6])
    out = step(sched)
    # b hits both system blocks in every group (the local group's hit is null blocks); only
    # the full-attention group reports them: its lists [1, 2, 3, 4] and [1, 2, 13] share 2
    new = out.scheduled_new_reqs[0]
    assert new.num_computed_tokens == 8 and new.block_ids[0] == [1, 2, 13]
    assert out.num_common_prefix_blocks == [2, 0, 0]


def _shared_by_all(sched: Scheduler, gid: int) -> int:
    """Brute force: the longest common prefix of the block-id lists of every holder."""
    m = sched.kv_cache_manager.coordinator.single_type_managers[gid]
    lists = [[b.block_id for b in blocks] for blocks in m.req_to_blocks.values()]
    if not lists:
        return 0
    n = 0
    while all(len(x) > n for x in lists) and len({x[n] for x in lists}) == 1:
        n += 1
    return n


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000))
def test_matches_brute_force_over_random_workloads(seed):
    """Requests on one of two system prompts (or none) arrive over time, finish, and may be
    preempted by a small pool; each step's count equals the brute-force common prefix of all
    holders' tables (full attention: a shared block id means shared content)."""
    rng = random.Random(seed)
    sched = make(num_blocks=rng.choice([12, 20, 40]), budget=rng.choice([8, 16, 64]))
    prompts = [SYS, SYS[:4] + [300, 301, 302, 303], []]
    k = 0
    for _ in range(30):
        if rng.random() < 0.5:
            base = rng.choice(prompts)
            add(sched, f"r{k}", base + [rng.randrange(1, 99) for _ in range(rng.randrange(1, 7))],
                max_tokens=rng.randrange(1, 6))
            k += 1
        if not sched.has_requests():
            continue
        out = sched.schedule()
        if sched.running:
            assert out.num_common_prefix_blocks == [_shared_by_all(sched, 0)]
        else:
            assert out.num_common_prefix_blocks == []
        sampled = {rid: [] if sched.requests[rid].is_prefill_chunk else [7]
                   for rid in out.num_scheduled_tokens}
        sched.update_from_output(out, ModelRunnerOutput.from_sampled(sampled))
