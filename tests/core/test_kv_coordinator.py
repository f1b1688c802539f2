"""Coordinators (sec 5): choice, block sizes, hybrid fixed-point hits, two-phase adoption."""

from __future__ import annotations

import pytest

from pagedkv.core.coordinator import (
    HybridKVCacheCoordinator,
    KVCacheCoordinatorNoPrefixCache,
    UnitaryKVCacheCoordinator,
    resolve_block_sizes,
)
from pagedkv.core.kv_cache_manager import KVCacheManager
from pagedkv.core.request import Request
from pagedkv.core.spec import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from pagedkv.errors import ConfigError


def config(*specs, num_blocks=64):
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_groups=[KVCacheGroupSpec((f"l{i}",), s) for i, s in enumerate(specs)],
    )


FULL4 = FullAttentionSpec(block_size=4)
SWA8 = SlidingWindowSpec(block_size=4, sliding_window=8)  # needs cdiv(7, 4) = 2 blocks
SWA6 = SlidingWindowSpec(block_size=4, sliding_window=6)  # needs 2 blocks, other spec


def test_coordinator_choice():
    assert isinstance(KVCacheManager(config(FULL4), 64).coordinator, UnitaryKVCacheCoordinator)
    assert isinstance(KVCacheManager(config(FULL4, SWA8), 64).coordinator, HybridKVCacheCoordinator)
    off = KVCacheManager(config(FULL4, SWA8), 64, enable_caching=False)
    assert isinstance(off.coordinator, KVCacheCoordinatorNoPrefixCache)
    assert off.block_hasher is None


def test_block_size_resolution():
    assert resolve_block_sizes(config(FULL4), True) == (4, 4)
    f16, s32 = FullAttentionSpec(block_size=16), SlidingWindowSpec(block_size=32, sliding_window=64)
    assert resolve_block_sizes(config(f16, s32), True) == (32, 16)
    assert resolve_block_sizes(config(f16, s32), False) == (32, 32)
    mamba_none = MambaSpec(block_size=64)
    assert resolve_block_sizes(config(f16, mamba_none), True) == (64, 64)
    with pytest.raises(ConfigError):
        resolve_block_sizes(KVCacheConfig(num_blocks=4), True)
    with pytest.raises(ConfigError):
        KVCacheManager(config(FULL4), 64, hash_block_size=2)  # unitary needs equal sizes


@pytest.mark.parametrize("second", [SWA8, SWA6], ids=["identical-swa", "two-swa-types"])
def test_hybrid_full_swa_swa_verified_hit(second):
    """Verified with full + SWA(2 blocks) + SWA: hit ids ([1,2,3],[0,6,7],[0,10,11])."""
    mgr = KVCacheManager(config(FULL4, SWA8, second), max_model_len=256)
    prompt = list(range(100, 113))  # 13 tokens -> 4 blocks per group, 3 hashed
    r0 = Request("r0", prompt, block_hasher=mgr.block_hasher)
    assert mgr.allocate_slots(r0, 13).get_block_ids() == (
        [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    )
    r1 = Request("r1", prompt, block_hasher=mgr.block_hasher)
    hits, n = mgr.get_computed_blocks(r1)
    assert n == 12
    assert hits.get_block_ids() == ([1, 2, 3], [0, 6, 7], [0, 10, 11])
    # Adoption touches only real blocks; new blocks for the 13th token in every group.
    new = mgr.allocate_slots(r1, 1, n, hits)
    assert new.get_block_ids() == ([13], [14], [15])
    assert mgr.get_block_ids("r1") == ([1, 2, 3, 13], [0, 6, 7, 14], [0, 10, 11, 15])
    pool = mgr.block_pool
    assert [pool.blocks[i].ref_cnt for i in (1, 5, 6, 7, 10)] == [2, 1, 2, 2, 2]


def test_hybrid_fixed_point_shortens_full_attention():
    """An SWA miss in the middle leaves only the leading run: full attention is trimmed."""
    mgr = KVCacheManager(config(FULL4, SWA8), max_model_len=256)
    prompt = list(range(100, 113))
    r0 = Request("r0", prompt, block_hasher=mgr.block_hasher)
    mgr.allocate_slots(r0, 13)
    mgr.block_pool.evict_blocks([6])  # SWA block of positions [4, 8)
    r1 = Request("r1", prompt, block_hasher=mgr.block_hasher)
    hits, n = mgr.get_computed_blocks(r1)
    assert n == 4
    assert hits.get_block_ids() == ([1], [5])


def test_hybrid_no_swa_hit_means_no_hit():
    mgr = KVCacheManager(config(FULL4, SWA8), max_model_len=256)
    prompt = list(range(100, 113))
    r0 = Request("r0", prompt, block_hasher=mgr.block_hasher)
    mgr.allocate_slots(r0, 13)
    mgr.block_pool.evict_blocks([5, 6, 7])
    hits, n = mgr.get_computed_blocks(Request("r1", prompt, block_hasher=mgr.block_hasher))
    assert n == 0 and hits is mgr.empty_kv_cache_blocks


def test_hybrid_caches_only_scheduler_block_multiples():
    f4, s8 = FullAttentionSpec(block_size=4), SlidingWindowSpec(block_size=8, sliding_window=8)
    mgr = KVCacheManager(config(f4, s8), max_model_len=256)
    assert (mgr.block_size, mgr.hash_block_size) == (8, 4)
    req = Request("r", list(range(13)), block_hasher=mgr.block_hasher)
    mgr.allocate_slots(req, 13)
    # 13 tokens -> cacheable 8: two 4-blocks of the full group, one 8-block of the SWA group.
    full, swa = mgr.get_blocks("r").blocks
    assert [b.block_hash is not None for b in full] == [True, True, False, False]
    assert [b.block_hash is not None for b in swa] == [True, False]
    # The SWA group's key is the last fine hash inside its block.
    assert swa[0].block_hash[:-4] == req.block_hashes[1]


def test_two_phase_adoption_with_external_tokens():
    """Hits of every group are touched before any group allocates for external tokens."""
    mgr = KVCacheManager(config(FULL4, SWA8, num_blocks=12), max_model_len=256)
    prompt = list(range(100, 109))  # 9 tokens, 2 hashed blocks
    r0 = Request("r0", prompt, block_hasher=mgr.block_hasher)
    mgr.allocate_slots(r0, 9)
    mgr.free(r0)
    r1 = Request("r1", prompt + [1, 2, 3, 4, 5, 6, 7], block_hasher=mgr.block_hasher)
    hits, n = mgr.get_computed_blocks(r1)
    assert n == 8 and hits.get_block_ids() == ([1, 2], [4, 5])
    got = mgr.allocate_slots(r1, 4, n, hits, num_external_computed_tokens=4)
    assert got is not None
    # r0's free left the queue [6, 3, 7..11, 2, 1, 5, 4]. SWA: 12 computed tokens skip
    # block 0 (hit 4 stays free), hit 5 is touched; external blocks come after all touches.
    assert mgr.get_block_ids("r1") == ([1, 2, 6, 7], [0, 5, 3, 8])
    assert [mgr.block_pool.blocks[i].ref_cnt for i in (1, 2, 4, 5)] == [1, 1, 0, 1]


def test_groups_free_in_group_order():
    """Each group frees with its own free_blocks call, in group order: the prepends of group
    k land in front of those of group k-1."""
    mgr = KVCacheManager(config(FULL4, SWA8, num_blocks=10), max_model_len=64)
    r = Request("r", list(range(6)), block_hasher=mgr.block_hasher)
    assert mgr.allocate_slots(r, 6).get_block_ids() == ([1, 2], [3, 4])
    mgr.free(r)
    queue = [b.block_id for b in mgr.block_pool.free_block_queue.get_all_free_blocks()]
    # full: 2 (unhashed) prepended, 1 (hashed) appended; then SWA: 4 prepended, 3 appended.
    assert queue == [4, 2, 5, 6, 7, 8, 9, 1, 3]
