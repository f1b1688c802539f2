"""KVCacheBlock, FreeKVCacheBlockQueue, BlockHashToBlockMap and BlockPool (sec 2)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedkv.core.block_pool import BlockHashToBlockMap, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagedkv.errors import BlockStateError, ConfigError, NoFreeBlocksError


def ids(blocks):
    return [b.block_id for b in blocks]


def queue_ids(pool: BlockPool):
    return ids(pool.free_block_queue.get_all_free_blocks())


def fake_request(hashes, rid="r"):
    return SimpleNamespace(request_id=rid, block_hashes=list(hashes))


H = [bytes([i]) * 32 for i in range(16)]  # fake 32-byte block hashes


# ----- free queue ----------------------------------------------------------------------------
def test_queue_ops_keep_order():
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = FreeKVCacheBlockQueue(blocks)
    assert q.num_free_blocks == 8 and ids(q.get_all_free_blocks()) == list(range(8))
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 2]
    q.remove(blocks[5])
    assert ids(q.get_all_free_blocks()) == [3, 4, 6, 7]
    q.append(blocks[0])
    q.append_n([blocks[1], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [3, 4, 6, 7, 0, 1, 2]
    q.remove(blocks[3])
    q.remove(blocks[2])
    q.prepend_n([blocks[5], blocks[3], blocks[2]])
    assert ids(q.get_all_free_blocks()) == [5, 3, 2, 4, 6, 7, 0, 1]
    assert q.num_free_blocks == 8
    # popped blocks have no links
    b = q.popleft()
    assert b.prev_free_block is None and b.next_free_block is None


def test_queue_errors():
    blocks = [KVCacheBlock(i) for i in range(2)]
    q = FreeKVCacheBlockQueue(blocks)
    q.popleft_n(2)
    with pytest.raises(NoFreeBlocksError):
        q.popleft()
    with pytest.raises(ValueError):  # vLLM raises ValueError here
        q.popleft_n(1)
    with pytest.raises(BlockStateError):
        q.remove(blocks[0])  # not linked
    q.append(blocks[0])
    with pytest.raises(BlockStateError):
        q.append(blocks[0])
    with pytest.raises(BlockStateError):
        q.prepend_n([blocks[0]])
    assert q.popleft_n(0) == []


# ----- pool construction ---------------------------------------------------------------------
def test_pool_pops_null_block():
    pool = BlockPool(10)
    assert pool.null_block.block_id == 0 and pool.null_block.is_null
    assert queue_ids(pool) == list(range(1, 10))
    assert pool.get_num_free_blocks() == 9 and pool.get_usage() == 0.0
    pool.get_new_blocks(3)
    assert pool.get_usage() == pytest.approx(1 - 6 / 9)
    assert BlockPool(1).get_usage() == 0.0
    with pytest.raises(ConfigError):
        BlockPool(0)


def test_get_new_blocks_from_head_and_too_many():
    pool = BlockPool(6)
    got = pool.get_new_blocks(2)
    assert ids(got) == [1, 2] and [b.ref_cnt for b in got] == [1, 1]
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(4)
    assert queue_ids(pool) == [3, 4, 5]  # the failed call changed nothing


# ----- free order ----------------------------------------------------------------------------
def test_verified_free_order_example():
    """Sec 2.3: r0 = [1,2,3,4(partial)], r1 shares 1..3 plus [5(partial)].
    Free r0, then r1 -> [5, 4, 6..N-1, 3, 2, 1]."""
    n = 12
    pool = BlockPool(n)
    r0 = pool.get_new_blocks(4)
    pool.cache_full_blocks(fake_request(H[:3]), r0, 0, 3, 16, 0)
    hit = pool.get_cached_block(H[0], [0]) + pool.get_cached_block(H[1], [0]) + pool.get_cached_block(H[2], [0])
    assert ids(hit) == [1, 2, 3]
    pool.touch(hit)
    r1 = hit + pool.get_new_blocks(1)
    assert ids(r1) == [1, 2, 3, 5]
    assert [b.ref_cnt for b in pool.blocks[1:6]] == [2, 2, 2, 1, 1]
    pool.free_blocks(reversed(r0))
    pool.free_blocks(reversed(r1))
    assert queue_ids(pool) == [5, 4] + list(range(6, n)) + [3, 2, 1]


def test_unhashed_lifo_hashed_lru():
    pool = BlockPool(8)
    a = pool.get_new_blocks(3)  # 1, 2, 3
    pool.free_blocks(a)  # unhashed: prepended in order, first becomes head
    assert queue_ids(pool) == [1, 2, 3, 4, 5, 6, 7]
    b = pool.get_new_blocks(2)  # 1, 2
    pool.cache_full_blocks(fake_request(H[:2]), b, 0, 2, 16, 0)
    pool.free_blocks(b)  # hashed: appended in order
    assert queue_ids(pool) == [3, 4, 5, 6, 7, 1, 2]


def test_caching_off_everything_prepended():
    pool = BlockPool(6, enable_caching=False)
    b = pool.get_new_blocks(2)
    pool.free_blocks(reversed(b))
    assert queue_ids(pool) == [2, 1, 3, 4, 5]


# ----- errors ----------------------------------------------------------------------------------
def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(6)
    b = pool.get_new_blocks(2)
    pool.free_blocks(b)
    before = queue_ids(pool)
    with pytest.raises(BlockStateError):
        pool.free_blocks(b)
    assert queue_ids(pool) == before
    assert [x.ref_cnt for x in pool.blocks] == [0] * 6


def test_duplicate_in_one_free_call_rolls_back():
    pool = BlockPool(6)
    b = pool.get_new_blocks(2)
    c = pool.get_new_blocks(1)
    with pytest.raises(BlockStateError):
        pool.free_blocks([c[0], b[0], b[0]])
    assert [x.ref_cnt for x in pool.blocks[1:4]] == [1, 1, 1]
    assert queue_ids(pool) == [4, 5]


def test_null_block_is_skipped_by_free_and_touch():
    pool = BlockPool(4)
    pool.free_blocks([pool.null_block])
    pool.touch([pool.null_block])
    assert pool.null_block.ref_cnt == 0
    assert 0 not in queue_ids(pool)


def test_touch_of_block_in_use_but_zero_ref_raises():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    b.ref_cnt = 0  # corrupt on purpose: not in the queue, yet ref 0
    with pytest.raises(BlockStateError):
        pool.touch([b])


def test_set_block_hash_twice_raises():
    b = KVCacheBlock(3)
    b.set_block_hash(b"k", 4)
    with pytest.raises(BlockStateError):
        b.set_block_hash(b"k2")
    b.reset_hash()
    assert b.block_hash is None and b.block_hash_num_tokens == 0


# ----- prefix cache ----------------------------------------------------------------------------
def test_hash_map_without_dedup():
    m = BlockHashToBlockMap()
    b1, b2, b3 = KVCacheBlock(1), KVCacheBlock(2), KVCacheBlock(3)
    m.insert(b"k", b1)
    m.insert(b"k", b2)
    m.insert(b"k", b3)
    assert m.get_one_block(b"k") is b1
    assert m.pop(b"k", 1) is b1
    assert m.get_one_block(b"k") is b2
    assert m.pop(b"k", 7) is None and m.get_one_block(b"k") is b2
    assert m.pop(b"k", 2) is b2 and m.pop(b"k", 3) is b3
    assert b"k" not in m and m.get_one_block(b"k") is None
    m.insert(b"x", b1)
    assert m.pop(b"x", 2) is None and m.get_one_block(b"x") is b1


def test_cache_full_blocks_keys_and_tokens():
    pool = BlockPool(8, hash_block_size=4)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(fake_request(H[:3]), blocks, 1, 3, 4, 2)
    assert blocks[0].block_hash is None
    assert blocks[1].block_hash == H[1] + (2).to_bytes(4, "big")
    assert blocks[2].block_hash_num_tokens == 12
    assert pool.get_cached_block(H[2], [2]) == [blocks[2]]
    assert pool.get_cached_block(H[2], [0]) is None


def test_cache_full_blocks_coarse_group_uses_last_fine_hash():
    pool = BlockPool(8, hash_block_size=4)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(fake_request(H[:5]), blocks, 0, 2, 8, 1)
    assert blocks[0].block_hash == H[1] + (1).to_bytes(4, "big")
    assert blocks[1].block_hash == H[3] + (1).to_bytes(4, "big")


def test_get_cached_block_needs_every_group():
    pool = BlockPool(8)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(fake_request(H[:1]), a, 0, 1, 16, 0)
    assert pool.get_cached_block(H[0], [0, 1]) is None
    pool.cache_full_blocks(fake_request(H[:1]), b, 0, 1, 16, 1)
    assert pool.get_cached_block(H[0], [0, 1]) == [a[0], b[0]]


def test_same_hash_two_blocks_and_eviction_on_reuse():
    pool = BlockPool(4)
    a = pool.get_new_blocks(1)
    b = pool.get_new_blocks(1)
    pool.cache_full_blocks(fake_request(H[:1]), a, 0, 1, 16, 0)
    pool.cache_full_blocks(fake_request(H[:1]), b, 0, 1, 16, 0)
    assert pool.get_cached_block(H[0], [0]) == a
    pool.free_blocks(a + b)  # hashed: appended [1, 2]
    assert queue_ids(pool) == [3, 1, 2]
    got = pool.get_new_blocks(2)  # 3, then 1 (evicts 1's entry)
    assert ids(got) == [3, 1]
    assert a[0].block_hash is None
    assert pool.get_cached_block(H[0], [0]) == b  # the other holder stays


def test_touch_takes_cached_free_block_out_of_queue():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(fake_request(H[:2]), a, 0, 2, 16, 0)
    pool.free_blocks(reversed(a))
    assert queue_ids(pool) == [3, 4, 2, 1]
    pool.touch([a[0]])
    assert a[0].ref_cnt == 1 and queue_ids(pool) == [3, 4, 2]


def test_evict_blocks_and_reset():
    pool = BlockPool(5)
    a = pool.get_new_blocks(2)
    pool.cache_full_blocks(fake_request(H[:2]), a, 0, 2, 16, 0)
    pool.evict_blocks({a[0].block_id})
    assert a[0].block_hash is None and a[0].ref_cnt == 1
    assert pool.get_cached_block(H[0], [0]) is None
    with pytest.raises(BlockStateError):
        pool.evict_blocks([99])
    assert pool.reset_prefix_cache() is False  # blocks in use
    pool.free_blocks(a)
    assert pool.reset_prefix_cache() is True
    assert a[1].block_hash is None and pool.get_cached_block(H[1], [0]) is None
