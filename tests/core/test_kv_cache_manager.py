"""KVCacheManager (sec 6): the verified single-group trace, admission rules, stats, errors."""

from __future__ import annotations

import pytest

from pagedkv.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
from pagedkv.core.request import Request, RequestStatus
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from pagedkv.errors import ConfigError, InvalidRequestError


def make(block_size=16, num_blocks=100, max_model_len=4096, **kw) -> KVCacheManager:
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec(("l0",), FullAttentionSpec(block_size=block_size))],
    )
    return KVCacheManager(cfg, max_model_len=max_model_len, **kw)


def req(mgr, rid, tokens, **kw):
    return Request(rid, list(tokens), block_hasher=mgr.block_hasher, **kw)


def queue(mgr):
    return [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]


def refs(mgr, ids):
    return [mgr.block_pool.blocks[i].ref_cnt for i in ids]


def decode(mgr, r, tok):
    """One decode step the way the scheduler does it: allocate 1 slot, then the token."""
    got = mgr.allocate_slots(r, 1)
    r.num_computed_tokens += 1
    r.append_output_token_ids(tok)
    return got


def test_verified_single_group_trace():
    """Sec 6.4 (B=16, 100 blocks)."""
    mgr = make()
    prefix = list(range(1000, 1048))
    r0 = req(mgr, "r0", prefix + list(range(7)))  # 55 tokens
    assert mgr.allocate_slots(r0, 55).get_block_ids() == ([1, 2, 3, 4],)
    assert [mgr.block_pool.blocks[i].block_hash is not None for i in (1, 2, 3, 4)] == [
        True, True, True, False
    ]
    r0.num_computed_tokens = 55
    r0.append_output_token_ids(7)

    r1 = req(mgr, "r1", prefix + [9, 9, 9, 9, 9])  # 53 tokens, same 48-token prefix
    hits, n = mgr.get_computed_blocks(r1)
    assert n == 48 and hits.get_block_ids() == ([1, 2, 3],)
    assert mgr.allocate_slots(r1, 5, n, hits).get_block_ids() == ([5],)
    assert refs(mgr, [1, 2, 3, 4, 5]) == [2, 2, 2, 1, 1]

    # Decode r0 from 55 to 64 tokens: nothing allocated; 64 to 65: block 6.
    for tok in range(8, 16):
        assert decode(mgr, r0, tok) is mgr.empty_kv_cache_blocks
    assert r0.num_tokens == 64 and r0.num_computed_tokens == 63
    assert decode(mgr, r0, 16) is mgr.empty_kv_cache_blocks  # slot 64 still in block 4
    assert decode(mgr, r0, 17).get_block_ids() == ([6],)
    assert mgr.get_block_ids("r0") == ([1, 2, 3, 4, 6],)


def test_lookahead_slots():
    """With lookahead 3: allocate_slots(10 tokens, B=4) returns 4 blocks (13 slots)."""
    mgr = make(block_size=4, num_blocks=10)
    r = req(mgr, "r", range(10))
    assert mgr.allocate_slots(r, 10, num_lookahead_tokens=3).get_block_ids() == ([1, 2, 3, 4],)


def test_identical_prompt_hits_one_block_less():
    """An identical 48-token prompt with B=16 hits 32 tokens, not 48."""
    mgr = make()
    prompt = list(range(48))
    mgr.allocate_slots(req(mgr, "a", prompt), 48)
    hits, n = mgr.get_computed_blocks(req(mgr, "b", prompt))
    assert n == 32 and hits.get_block_ids() == ([1, 2],)


def test_get_computed_blocks_has_no_side_effects():
    mgr = make(num_blocks=10)
    a = req(mgr, "a", range(40))
    mgr.allocate_slots(a, 40)
    mgr.free(a)
    before_q, before_refs = queue(mgr), refs(mgr, range(10))
    hits, n = mgr.get_computed_blocks(req(mgr, "b", range(40)))
    assert n == 32
    assert queue(mgr) == before_q and refs(mgr, range(10)) == before_refs


def test_failed_allocation_changes_nothing():
    mgr = make(block_size=4, num_blocks=6)  # 5 usable
    a = req(mgr, "a", range(12))
    mgr.allocate_slots(a, 12)
    mgr.free(a)  # blocks 1..3 cached and free
    q, r = queue(mgr), refs(mgr, range(6))
    b = req(mgr, "b", list(range(12)) + list(range(50, 60)))  # 22 tokens -> 6 blocks
    hits, n = mgr.get_computed_blocks(b)
    assert n == 12
    assert mgr.allocate_slots(b, 10, n, hits) is None
    assert queue(mgr) == q and refs(mgr, range(6)) == r
    assert mgr.get_block_ids("b") == ([],)


def test_full_sequence_must_fit_counts_evictable_hits():
    """Sec 7.6 steps 11-15: 49 tokens need 4 blocks, 3 of them evictable hits; 3 free -> None."""
    mgr = make(block_size=16, num_blocks=5)  # 4 usable
    prompt = list(range(48))
    a = req(mgr, "a", prompt + [1])
    mgr.allocate_slots(a, 49)
    mgr.free(a)  # 1..3 hashed, 4 unhashed: all free
    hog = req(mgr, "hog", [7])
    mgr.allocate_slots(hog, 1)  # takes block 4 (head, LIFO) -> 3 free, all evictable hits
    assert queue(mgr) == [3, 2, 1]
    b = req(mgr, "b", prompt + [2])
    hits, n = mgr.get_computed_blocks(b)
    assert n == 48
    assert mgr.allocate_slots(b, 1, n, hits, full_sequence_must_fit=True) is None
    # Without the full-sequence gate the chunk itself does not fit either (1 new + 3 hits).
    assert mgr.allocate_slots(b, 1, n, hits) is None
    mgr.free(hog)
    assert mgr.allocate_slots(b, 1, n, hits, full_sequence_must_fit=True).get_block_ids() == ([4],)


def test_full_sequence_must_fit_uses_whole_sequence():
    mgr = make(block_size=4, num_blocks=5)  # 4 usable
    r = req(mgr, "r", range(20))  # 5 blocks in total
    assert mgr.allocate_slots(r, 8, full_sequence_must_fit=True) is None
    assert mgr.allocate_slots(r, 8).get_block_ids() == ([1, 2],)


def test_watermark_applies_to_waiting_when_others_scheduled():
    mgr = make(block_size=4, num_blocks=10, watermark=0.3)  # 3 watermark blocks, 9 free
    assert mgr.watermark_blocks == 3
    r = req(mgr, "r", range(28))  # 7 blocks
    assert mgr.allocate_slots(r, 28) is None
    assert mgr.allocate_slots(r, 28, has_scheduled_reqs=False).get_block_ids() == (
        [1, 2, 3, 4, 5, 6, 7],
    )
    r.status = RequestStatus.RUNNING
    r.num_computed_tokens = 28
    r.append_output_token_ids(1)
    assert mgr.allocate_slots(r, 1).get_block_ids() == ([8],)  # running: no watermark


def test_stats_recorded_and_reset():
    mgr = make(block_size=4, num_blocks=20)
    a = req(mgr, "a", range(12))
    mgr.get_computed_blocks(a)
    mgr.allocate_slots(a, 12)
    b = req(mgr, "b", range(13))
    mgr.get_computed_blocks(b)
    p = req(mgr, "p", range(9))
    p.num_preemptions = 1
    mgr.get_computed_blocks(p)
    s = req(mgr, "s", range(9), skip_reading_prefix_cache=True)
    assert mgr.get_computed_blocks(s) == (mgr.empty_kv_cache_blocks, 0)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (2, 25, 12)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (1, 9, 8)
    assert stats.reset is False
    fresh = mgr.make_prefix_cache_stats()
    assert (fresh.requests, fresh.queries, fresh.preempted_requests) == (0, 0, 0)
    assert make(log_stats=False).make_prefix_cache_stats() is None


def test_reset_prefix_cache():
    mgr = make(block_size=4, num_blocks=8)
    a = req(mgr, "a", range(8))
    mgr.allocate_slots(a, 8)
    assert mgr.reset_prefix_cache() is False
    mgr.free(a)
    assert mgr.reset_prefix_cache() is True
    assert mgr.make_prefix_cache_stats().reset is True
    assert mgr.get_computed_blocks(req(mgr, "b", range(8)))[1] == 0


def test_caching_off():
    mgr = make(block_size=4, num_blocks=8, enable_caching=False)
    a = Request("a", list(range(8)))
    assert a.block_hashes == []
    mgr.allocate_slots(a, 8)
    mgr.free(a)
    assert queue(mgr) == [2, 1, 3, 4, 5, 6, 7]  # unhashed: tail block reused first
    assert mgr.get_computed_blocks(Request("b", list(range(8)))) == (mgr.empty_kv_cache_blocks, 0)


def test_input_errors():
    mgr = make(block_size=4, num_blocks=8)
    r = req(mgr, "r", range(4))
    with pytest.raises(InvalidRequestError):
        mgr.allocate_slots(r, 0)
    with pytest.raises(ValueError):
        mgr.allocate_slots(r, -1)
    with pytest.raises(InvalidRequestError):
        mgr.allocate_slots(r, 1, new_computed_blocks=KVCacheBlocks(([], [])))
    with pytest.raises(ConfigError):
        make(watermark=1.5)
    with pytest.raises(ConfigError):
        make(max_model_len=0)
    with pytest.raises(ConfigError):
        make(hash_algo="nope")


def test_unknown_request_views_and_free():
    mgr = make(block_size=4, num_blocks=8)
    assert mgr.get_block_ids("ghost") == ([],)
    assert mgr.get_blocks("ghost") is mgr.empty_kv_cache_blocks
    mgr.free(Request("ghost", [1]))  # no-op, like vLLM
    assert mgr.num_free_blocks == 7


def test_max_model_len_caps_slots():
    mgr = make(block_size=4, num_blocks=10, max_model_len=10)
    r = req(mgr, "r", range(9))
    assert mgr.allocate_slots(r, 9, num_lookahead_tokens=8).get_block_ids() == ([1, 2, 3],)


def test_kv_cache_blocks_helpers():
    mgr = make(block_size=4, num_blocks=8)
    a = req(mgr, "a", range(8))
    x = mgr.allocate_slots(a, 8)
    assert mgr.empty_kv_cache_blocks.get_block_ids(allow_none=True) is None
    assert mgr.empty_kv_cache_blocks.get_block_ids() == ([],)
    assert (x + mgr.get_blocks("a")).get_block_ids() == ([1, 2, 1, 2],)
    assert x.get_unhashed_block_ids() == []
    assert x.new_empty().get_block_ids() == ([],)
    assert mgr.usage == pytest.approx(2 / 7)


def test_swa_request_table_gets_nulls_and_stays_bounded():
    cfg = KVCacheConfig(
        num_blocks=16,
        kv_cache_groups=[KVCacheGroupSpec(("l0",), SlidingWindowSpec(block_size=4, sliding_window=8))],
    )
    mgr = KVCacheManager(cfg, max_model_len=1024)
    r = Request("r", list(range(8)), block_hasher=mgr.block_hasher)
    mgr.allocate_slots(r, 8)
    r.num_computed_tokens = 8
    for tok in range(40):
        r.append_output_token_ids(tok)
        assert mgr.allocate_slots(r, 1) is not None
        r.num_computed_tokens += 1
        held = [b for b in mgr.get_blocks("r").blocks[0] if not b.is_null]
        assert len(held) <= 4
    table = mgr.get_block_ids("r")[0]
    # processed 47 tokens: 47 - 8 + 1 = 40 skipped -> blocks 0..9 released
    assert len(table) == 12 and table[:10] == [0] * 10 and 0 not in table[10:]
    mgr.free(r)
    assert mgr.num_free_blocks == 15
