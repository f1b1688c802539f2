"""Property tests: random scheduler-like op sequences over KVCacheManager keep the pool's
invariants (hypothesis).

Invariants after every op:
* free + held = usable blocks (num_blocks - 1); the free queue has no duplicates;
* ref_cnt of every block == number of (request, group) tables holding it;
* a block is in the free queue iff its ref_cnt is 0; the null block is never in it;
* a block held by two requests carries a prefix-cache key (it was shared by a hit);
* every hashed block is reachable in the prefix-cache map under its key, and a hashed block
  in a request's table holds exactly the prefix its key names;
* a double free raises BlockStateError and changes nothing.
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.core.block_pool import KVCacheBlock
from pagedkv.core.hashing import resolve_block_hashes
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import Request, RequestStatus
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec, cdiv
from pagedkv.errors import BlockStateError

B = 4
PREFIXES = [list(range(1000, 1000 + 24)), list(range(2000, 2000 + 16)), list(range(1000, 1000 + 10))]

CONFIGS = {
    "full": ([FullAttentionSpec(block_size=B)], 20, True),
    "full-nocache": ([FullAttentionSpec(block_size=B)], 20, False),
    "full+swa": ([FullAttentionSpec(block_size=B), SlidingWindowSpec(block_size=B, sliding_window=8)], 28, True),
}

op_strategy = st.one_of(
    st.tuples(st.just("admit"), st.integers(0, len(PREFIXES)), st.integers(0, 24),
              st.integers(1, 9), st.booleans(), st.booleans()),
    st.tuples(st.just("step"), st.integers(0, 7)),
    st.tuples(st.just("step"), st.integers(0, 7)),
    st.tuples(st.just("free"), st.integers(0, 7)),
    st.tuples(st.just("double_free"), st.integers(0, 7)),
)


def check_invariants(mgr: KVCacheManager, running: dict[str, Request]) -> None:
    pool = mgr.block_pool
    holders: Counter = Counter()
    owners: dict[int, set] = defaultdict(set)
    for manager in mgr.coordinator.single_type_managers:
        assert set(manager.req_to_blocks) <= set(running)
    for rid in running:
        for blocks in mgr.coordinator.get_blocks(rid):
            for b in blocks:
                if b.is_null:
                    continue
                holders[b.block_id] += 1
                owners[b.block_id].add(rid)
    free_ids = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    free_set = set(free_ids)
    assert len(free_ids) == len(free_set) == pool.get_num_free_blocks()
    assert 0 not in free_set and pool.null_block.ref_cnt == 0
    for b in pool.blocks[1:]:
        assert b.ref_cnt == holders[b.block_id], b
        assert (b.ref_cnt == 0) == (b.block_id in free_set), b
    assert pool.get_num_free_blocks() + len(holders) == pool.num_gpu_blocks - 1
    for bid, rids in owners.items():
        if len(rids) > 1:
            assert pool.blocks[bid].block_hash is not None, (bid, rids)
    cache = pool.cached_block_hash_to_block._cache
    for b in pool.blocks:
        if b.block_hash is not None:
            entry = cache[b.block_hash]
            assert entry is b if isinstance(entry, KVCacheBlock) else entry[b.block_id] is b
    for rid, r in running.items():
        slots = r.allocated_slots
        for manager, blocks in zip(mgr.coordinator.single_type_managers, mgr.coordinator.get_blocks(rid)):
            assert len(blocks) == cdiv(slots, manager.block_size)
            # A hashed block holds exactly the prefix its key names (no stale keys).
            hashes = resolve_block_hashes(r.block_hashes, mgr.hash_block_size, manager.block_size)
            gid = manager.kv_cache_group_id.to_bytes(4, "big")
            for j, b in enumerate(blocks):
                if not b.is_null and b.block_hash is not None:
                    assert j < len(hashes) and b.block_hash == hashes[j] + gid, (rid, j, b)


def run_ops(config_name: str, ops) -> None:
    specs, num_blocks, caching = CONFIGS[config_name]
    cfg = KVCacheConfig(num_blocks=num_blocks,
                        kv_cache_groups=[KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)])
    mgr = KVCacheManager(cfg, max_model_len=256, enable_caching=caching)
    running: dict[str, Request] = {}
    waiting: list[Request] = []
    freed_blocks: list[KVCacheBlock] = []
    counter = 0

    def emit(r: Request) -> None:
        r.append_output_token_ids(7 + (len(r.request_id) * 31 + r.num_tokens) % 5)

    def admit(r: Request, half: bool, must_fit: bool) -> None:
        hits, n_hit = mgr.get_computed_blocks(r)
        rest = r.num_tokens - r.num_computed_tokens - n_hit
        n = -(-rest // 2) if half else rest
        if n == 0:
            return
        got = mgr.allocate_slots(r, n, n_hit, hits, full_sequence_must_fit=must_fit)
        if got is None:
            if r not in waiting:
                waiting.append(r)
            return
        r.num_computed_tokens += n_hit + n
        r.allocated_slots = r.num_computed_tokens
        r.status = RequestStatus.RUNNING
        running[r.request_id] = r
        if r in waiting:
            waiting.remove(r)
        if r.num_computed_tokens == r.num_tokens:
            emit(r)

    def pick(i):
        keys = sorted(running)
        return running[keys[i % len(keys)]] if keys else None

    for op in ops:
        kind = op[0]
        if kind == "admit":
            _, p, plen, tail, half, must_fit = op
            if waiting and p == len(PREFIXES):  # re-admit a preempted / blocked request
                admit(waiting[0], half, must_fit)
            else:
                prefix = PREFIXES[p % len(PREFIXES)][:plen]
                counter += 1
                tokens = prefix + [counter * 10 + k for k in range(tail)]
                admit(Request(f"r{counter}", tokens, block_hasher=mgr.block_hasher), half, must_fit)
        elif kind == "step":
            r = pick(op[1])
            if r is None:
                continue
            n = r.num_tokens - r.num_computed_tokens
            if r.num_tokens + 1 > 256:
                n = 0
            if n <= 0:
                continue
            got = mgr.allocate_slots(r, n)
            if got is None:  # preempt the request itself
                mgr.free(r)
                del running[r.request_id]
                r.num_computed_tokens = 0
                r.status = RequestStatus.PREEMPTED
                r.num_preemptions += 1
                waiting.append(r)
            else:
                r.num_computed_tokens += n
                r.allocated_slots = r.num_computed_tokens
                emit(r)
        elif kind == "free":
            r = pick(op[1])
            if r is None:
                continue
            freed_blocks = [b for g in mgr.get_blocks(r.request_id).blocks for b in g if not b.is_null]
            mgr.free(r)
            del running[r.request_id]
        elif kind == "double_free":
            victims = [b for b in freed_blocks if b.ref_cnt == 0]
            if victims:
                before = [b.ref_cnt for b in mgr.block_pool.blocks]
                with pytest.raises(BlockStateError):
                    mgr.block_pool.free_blocks(victims[op[1] % len(victims):])
                assert [b.ref_cnt for b in mgr.block_pool.blocks] == before
        check_invariants(mgr, running)
    for r in list(running.values()):
        mgr.free(r)
    del running
    assert mgr.num_free_blocks == num_blocks - 1
    check_invariants(mgr, {})


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(op_strategy, min_size=10, max_size=60))
def test_random_ops_keep_invariants(config_name, ops):
    run_ops(config_name, ops)


def _seeded_ops(seed: int, n: int = 60) -> list[tuple]:
    rng = random.Random(seed)
    ops: list[tuple] = []
    for _ in range(n):
        kind = rng.choice(["admit", "admit", "step", "step", "step", "free", "double_free"])
        if kind == "admit":
            ops.append(("admit", rng.randint(0, len(PREFIXES)), rng.randint(0, 24), rng.randint(1, 9),
                        rng.random() < 0.5, rng.random() < 0.5))
        else:
            ops.append((kind, rng.randint(0, 7)))
    return ops


@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_seeded_long_schedules_keep_invariants(config_name):
    """Longer random schedules (pool pressure: eviction of cached blocks, preemption)."""
    for seed in range(60):
        run_ops(config_name, _seeded_ops(seed))
