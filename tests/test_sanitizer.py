"""The sanitizer catches each broken rule, naming the rule and the request/row/slot involved.

Each test runs a small workload to a mid-run state, breaks exactly one invariant by hand, and
checks that the sanitizer raises InvariantError with that rule.
"""

import pytest

from pagedkv.config import SchedulerConfig
from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from pagedkv.tools.index_driver import IndexLayerDriver
from pagedkv.errors import InvariantError
from pagedkv.sanitizer import check_pool, check_step


def _driver():
    kv = KVCacheConfig(num_blocks=32, kv_cache_groups=[
        KVCacheGroupSpec(("l",), FullAttentionSpec(block_size=4))])
    sc = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    d = IndexLayerDriver(kv, sc, next_token=lambda t, p: (7 * p + t) % 97, vocab_size=97,
                         sanitize=True)
    d.add_request("a", list(range(10)), max_tokens=8)
    d.add_request("b", list(range(100, 107)), max_tokens=8)
    d.step()
    d.step()
    return d


def _prepare(d):
    """Schedule one more step and prepare its inputs without running the fake model."""
    from pagedkv.worker.state_update import update_states

    so = d.scheduler.schedule()
    update_states(d.states, d.batch, so)
    return d.preparer.prepare(d.batch, so.num_scheduled_tokens)


def _expect(rule, fn, *args):
    with pytest.raises(InvariantError) as ei:
        fn(*args)
    assert ei.value.rule == rule, str(ei.value)
    return ei.value


def test_clean_state_passes():
    d = _driver()
    step = _prepare(d)
    check_pool(d.scheduler.kv_cache_manager)
    check_step(d.scheduler.kv_cache_manager, d.batch, step)


def test_ref_count_drift_is_caught():
    d = _driver()
    mgr = d.scheduler.kv_cache_manager
    blk = mgr.coordinator.single_type_managers[0].req_to_blocks["a"][0]
    blk.ref_cnt += 1
    err = _expect("ref=holders", check_pool, mgr)
    assert err.details["block"] == blk.block_id


def test_free_queue_corruption_is_caught():
    d = _driver()
    mgr = d.scheduler.kv_cache_manager
    mgr.block_pool.free_block_queue.num_free_blocks += 1
    _expect("free-queue", check_pool, mgr)


def test_device_row_drift_is_caught():
    d = _driver()
    step = _prepare(d)
    d.batch.block_table.block_table.gpu[0, 0] += 1
    err = _expect("device=committed", check_step, d.scheduler.kv_cache_manager, d.batch, step)
    assert err.details["row"] == 0


def test_row_count_mismatch_is_caught():
    d = _driver()
    step = _prepare(d)
    d.batch.block_table.num_blocks_per_row[0, 1] += 1
    err = _expect("table=held", check_step, d.scheduler.kv_cache_manager, d.batch, step)
    assert err.details["row"] == 1


def test_slot_in_null_block_is_caught():
    d = _driver()
    step = _prepare(d)
    step.slot_mappings[0, 0] = 1  # block 0, offset 1
    # The formula check fires first (the slot no longer matches the table); make the table
    # agree so that only the null-write rule is broken.
    pos = int(step.positions[0])
    row = int(step.req_indices[0])
    view = d.batch.block_table[0].block_table
    view.np[row, pos // 4] = 0
    view.gpu[row, pos // 4] = 0
    d.scheduler.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks[
        d.batch.req_ids[row]][pos // 4] = d.scheduler.kv_cache_manager.block_pool.null_block
    step.slot_mappings[0, 0] = pos % 4
    _expect("null-write", check_step, d.scheduler.kv_cache_manager, d.batch, step)


def test_padding_slot_is_caught():
    d = _driver()
    step = _prepare(d)
    d.batch.block_table.slot_mappings[0, step.num_tokens] = 5
    err = _expect("padding", check_step, d.scheduler.kv_cache_manager, d.batch, step)
    assert err.details["token"] == step.num_tokens


def test_wrong_slot_is_caught():
    d = _driver()
    step = _prepare(d)
    step.slot_mappings[0, 1] += 1
    _expect("slot=formula", check_step, d.scheduler.kv_cache_manager, d.batch, step)
