"""Single-type managers (sec 4): skipped blocks, cache-hit rules, Mamba allocation traces."""

from __future__ import annotations

import pytest

from pagedkv.core.block_pool import BlockPool
from pagedkv.core.hashing import get_request_block_hasher, sha256
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.managers import (
    ChunkedLocalAttentionManager,
    FullAttentionManager,
    MambaManager,
    SlidingWindowManager,
    get_manager_class,
)
from pagedkv.core.request import Request
from pagedkv.core.spec import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)
from pagedkv.errors import ConfigError

H = [bytes([i]) * 32 for i in range(64)]


def ids(blocks):
    return [b.block_id for b in blocks]


def register(pool: BlockPool, positions, group_id=0):
    """Put a fresh block in the prefix cache under H[i] for each position i."""
    out = {}
    for i in positions:
        (b,) = pool.get_new_blocks(1)
        key = H[i] + group_id.to_bytes(4, "big")
        b._block_hash = key
        pool.cached_block_hash_to_block.insert(key, b)
        out[i] = b
    return out


def config(*specs, num_blocks=64):
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)],
    )


def test_registry_walks_mro():
    assert get_manager_class(FullAttentionSpec(block_size=16)) is FullAttentionManager
    assert get_manager_class(MLAAttentionSpec(block_size=16, compress_ratio=4)) is FullAttentionManager
    assert get_manager_class(SlidingWindowMLASpec(block_size=16, sliding_window=8)) is SlidingWindowManager
    assert get_manager_class(ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=32)) is (
        ChunkedLocalAttentionManager
    )
    assert get_manager_class(MambaSpec(block_size=16)) is MambaManager
    with pytest.raises(ConfigError):
        get_manager_class(KVCacheSpec(block_size=16))


# ----- sliding window --------------------------------------------------------------------------
def _swa_manager(window=4, block_size=2, num_blocks=32):
    pool = BlockPool(num_blocks, hash_block_size=block_size)
    spec = SlidingWindowSpec(block_size=block_size, sliding_window=window)
    return SlidingWindowManager(spec, pool, 0, hash_block_size=block_size), pool


def test_swa_remove_skipped_blocks_verified_example():
    """W=4, B=2: n=4 frees nothing, 5 frees block 0, 6 nothing new, 7 frees block 1,
    11 frees blocks 2 and 3 given to free_blocks as [3, 2]."""
    mgr, pool = _swa_manager()
    mgr.allocate_new_blocks("r", 12, 12)
    table = list(mgr.req_to_blocks["r"])
    calls = []
    real_free = pool.free_blocks
    pool.free_blocks = lambda blocks: (calls.append([table.index(b) for b in blocks]), real_free(blocks))
    expected = {4: [], 5: [[0]], 6: [], 7: [[1]], 11: [[3, 2]]}
    for n, want in expected.items():
        calls.clear()
        mgr.remove_skipped_blocks("r", n)
        assert calls == want, n
    got = mgr.req_to_blocks["r"]
    assert [b.is_null for b in got] == [True] * 4 + [False] * 2
    assert all(table[i].ref_cnt == 0 for i in range(4))


def test_swa_skipped_tokens_with_extra_retained():
    pool = BlockPool(8, hash_block_size=2)
    spec = SlidingWindowSpec(block_size=2, sliding_window=4, extra_retained_tokens=2)
    mgr = SlidingWindowManager(spec, pool, 0)
    assert mgr.get_num_skipped_tokens(5) == 0 and mgr.get_num_skipped_tokens(9) == 4


def test_swa_hit_pattern_verified_example():
    """W=4, B=2, cached pattern T T F T F F T T F T T T: hit = 12 blocks, last two real."""
    pool = BlockPool(32, hash_block_size=2)
    spec = SlidingWindowSpec(block_size=2, sliding_window=4)
    pattern = "TTFTFFTTFTTT"
    cached = register(pool, [i for i, c in enumerate(pattern) if c == "T"])
    (hit,) = SlidingWindowManager.find_longest_cache_hit(H[:12], 24, [0], pool, spec, False, 2)
    assert len(hit) == 12
    assert all(b.is_null for b in hit[:10])
    assert hit[10:] == [cached[10], cached[11]]


def test_swa_hit_without_a_full_run_keeps_leading_run():
    pool = BlockPool(32, hash_block_size=2)
    spec = SlidingWindowSpec(block_size=2, sliding_window=6)  # needs 3 blocks
    cached = register(pool, [0, 1, 3, 5])
    (hit,) = SlidingWindowManager.find_longest_cache_hit(H[:6], 12, [0], pool, spec, False, 2)
    assert hit == [cached[0], cached[1]]
    (none,) = SlidingWindowManager.find_longest_cache_hit(H[10:16], 12, [0], pool, spec, False, 2)
    assert none == []


def test_swa_hit_eagle_and_alignment():
    pool = BlockPool(32, hash_block_size=2)
    spec = SlidingWindowSpec(block_size=2, sliding_window=4)  # needs 2 (3 with EAGLE)
    cached = register(pool, range(6))
    (hit,) = SlidingWindowManager.find_longest_cache_hit(H[:6], 12, [0], pool, spec, True, 2)
    # run 3..5 found, then EAGLE drops block 5
    assert len(hit) == 5 and all(b.is_null for b in hit[:3]) and hit[3:] == [cached[3], cached[4]]
    (hit,) = SlidingWindowManager.find_longest_cache_hit(H[:5], 10, [0], pool, spec, False, 4)
    assert len(hit) == 4  # 5 blocks = 10 tokens, popped to a multiple of 4 tokens


def test_swa_admission_cap():
    from pagedkv.core.coordinator import max_admission_blocks_per_request

    spec = SlidingWindowSpec(block_size=16, sliding_window=1024)
    assert max_admission_blocks_per_request(spec, 1024, 16384) == 129
    assert max_admission_blocks_per_request(FullAttentionSpec(block_size=16), 1024, 16384) is None


# ----- full attention ----------------------------------------------------------------------------
def test_full_hit_stops_at_first_miss_and_eagle_and_alignment():
    pool = BlockPool(32, hash_block_size=4)
    spec = FullAttentionSpec(block_size=4)
    cached = register(pool, [0, 1, 2, 4])
    (hit,) = FullAttentionManager.find_longest_cache_hit(H[:5], 20, [0], pool, spec, False, 4)
    assert hit == [cached[0], cached[1], cached[2]]
    (hit,) = FullAttentionManager.find_longest_cache_hit(H[:5], 11, [0], pool, spec, False, 4)
    assert hit == [cached[0], cached[1]]  # max_length 11 -> at most 2 blocks
    (hit,) = FullAttentionManager.find_longest_cache_hit(H[:5], 20, [0], pool, spec, True, 4)
    assert hit == [cached[0], cached[1]]
    (hit,) = FullAttentionManager.find_longest_cache_hit(H[:5], 20, [0], pool, spec, False, 8)
    assert hit == [cached[0], cached[1]]


# ----- chunked local ---------------------------------------------------------------------------
def test_chunked_local_skip_and_hit():
    pool = BlockPool(32, hash_block_size=2)
    spec = ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4)
    mgr = ChunkedLocalAttentionManager(spec, pool, 0)
    assert [mgr.get_num_skipped_tokens(n) for n in (3, 4, 7, 8, 9)] == [0, 4, 4, 8, 8]
    cached = register(pool, [0, 1, 4])
    # max_length 11: current chunk starts at token 8 (block 4); blocks 4.. are looked up.
    (hit,) = ChunkedLocalAttentionManager.find_longest_cache_hit(H[:6], 11, [0], pool, spec, False, 2)
    assert len(hit) == 5 and all(b.is_null for b in hit[:4]) and hit[4] is cached[4]
    with pytest.raises(ConfigError):
        ChunkedLocalAttentionManager.find_longest_cache_hit(H[:6], 11, [0], pool, spec, True, 2)


def test_chunked_local_allocation_frees_old_chunks():
    mgr = KVCacheManager(config(ChunkedLocalAttentionSpec(block_size=2, attention_chunk_size=4),
                                num_blocks=16), max_model_len=64)
    req = Request("r", list(range(9)), block_hasher=mgr.block_hasher)
    assert mgr.allocate_slots(req, 9).get_block_ids() == ([1, 2, 3, 4, 5],)
    req.num_computed_tokens = 9
    req.append_output_token_ids(9)
    mgr.allocate_slots(req, 1)  # processed 9 -> chunks [0, 8) are released
    assert mgr.get_block_ids("r") == ([0, 0, 0, 0, 5],)


# ----- Mamba ---------------------------------------------------------------------------------
def test_mamba_none_mode_speculative_block():
    """Verified: 10 tokens with 1 speculative block allocates 2 blocks [1, 2]."""
    spec = MambaSpec(block_size=64, num_speculative_blocks=1)
    mgr = KVCacheManager(config(spec, num_blocks=8), max_model_len=64, enable_caching=False)
    req = Request("r", list(range(10)))
    assert mgr.allocate_slots(req, 10).get_block_ids() == ([1, 2],)
    assert sorted(mgr.take_new_block_ids()) == [1, 2]
    assert mgr.take_new_block_ids() == []


def _full_mamba_manager(num_blocks=32):
    return KVCacheManager(
        config(FullAttentionSpec(block_size=4), MambaSpec(block_size=4, mamba_cache_mode="align"),
               num_blocks=num_blocks),
        max_model_len=256,
    )


def test_mamba_align_verified_trace():
    """B=4, full + Mamba: allocate 10 -> [0,0,4]; 12->13 -> [0,0,4,6]; 13->14 -> [0,0,0,6]."""
    mgr = _full_mamba_manager()
    req = Request("r", list(range(10)), block_hasher=mgr.block_hasher)
    new = mgr.allocate_slots(req, 10)
    assert new.get_block_ids() == ([1, 2, 3], [0, 0, 4])
    req.num_computed_tokens = 10
    tables = []
    for tok in range(10, 13):  # decode 10->11, 11->12, 12->13, 13->14
        req.append_output_token_ids(tok)
        assert mgr.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        tables.append(mgr.get_block_ids("r")[1])
    req.append_output_token_ids(13)
    mgr.allocate_slots(req, 1)
    tables.append(mgr.get_block_ids("r")[1])
    assert tables == [[0, 0, 4], [0, 0, 4], [0, 0, 4, 6], [0, 0, 0, 6]]
    assert mgr.get_block_ids("r")[0] == [1, 2, 3, 5]
    assert pool_queue(mgr)[-1] == 4  # the old state block was hashed: freed to the tail
    mgr.free(req)
    assert mgr.num_free_blocks == 31


def pool_queue(mgr):
    return ids(mgr.block_pool.free_block_queue.get_all_free_blocks())


def test_mamba_same_step_hit_waits_for_next_step():
    mgr = _full_mamba_manager()
    r0 = Request("r0", list(range(8)), block_hasher=mgr.block_hasher)
    assert mgr.allocate_slots(r0, 8) is not None  # the state after 8 tokens is cached
    r1 = Request("r1", list(range(8)) + [99, 98], block_hasher=mgr.block_hasher)
    hits, n = mgr.get_computed_blocks(r1)
    assert n == 8 and hits.get_block_ids() == ([1, 2], [0, 3])
    assert mgr.allocate_slots(r1, 2, n, hits) is None  # the state is written this step
    mgr.new_step_starts()
    got = mgr.allocate_slots(r1, 2, n, hits)
    assert got is not None
    assert mgr.get_block_ids("r1")[1][:2] == hits.get_block_ids()[1]


def test_mamba_all_mode_rejected():
    with pytest.raises(ConfigError):
        KVCacheManager(config(MambaSpec(block_size=4, mamba_cache_mode="all")), max_model_len=64)


def test_mla_compressed_is_full_attention_for_allocation():
    spec = MLAAttentionSpec(block_size=16, compress_ratio=4)
    mgr = KVCacheManager(config(spec, num_blocks=8), max_model_len=128)
    req = Request("r", list(range(40)), block_hasher=mgr.block_hasher)
    assert mgr.allocate_slots(req, 40).get_block_ids() == ([1, 2, 3],)
    other = Request("o", list(range(40)), block_hasher=mgr.block_hasher)
    assert mgr.get_computed_blocks(other)[1] == 32


def test_hasher_block_size_matches_manager():
    mgr = KVCacheManager(config(FullAttentionSpec(block_size=8)), max_model_len=64)
    assert mgr.block_size == 8 and mgr.hash_block_size == 8
    req = Request("r", list(range(17)), block_hasher=mgr.make_block_hasher())
    expected = Request("e", list(range(17)), block_hasher=get_request_block_hasher(8, sha256))
    assert req.block_hashes == expected.block_hashes and len(req.block_hashes) == 2
