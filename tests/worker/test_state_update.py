"""update_states: scripted SchedulerOutputs applied to the persistent batch (sec. 9.8)."""

import pytest

from pagedkv.core.output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedkv.core.spec import SlotMappingMode
from pagedkv.errors import InvalidRequestError, UnknownRequestError
from pagedkv.worker.input_batch import InputBatch
from pagedkv.worker.state_update import record_sampled_tokens, update_states


def make_batch():
    return InputBatch(
        max_num_reqs=4,
        max_model_len=32,
        max_num_batched_tokens=32,
        device="cpu",
        pin_memory=False,
        block_sizes=[4, 4],
        max_num_blocks_per_req=[8, 8],
        slot_mapping_modes=[SlotMappingMode.TOKEN_TO_KV_SLOT] * 2,
    )


def new(rid, prompt, blocks, computed=0):
    return NewRequestData(rid, list(prompt), None, blocks, computed)


def sched_out(new_reqs=(), cached=(), num_sched=None, finished=(), resumed=(), zero=None, cow=()):
    cd = CachedRequestData()
    for rid, computed, blocks in cached:
        cd.req_ids.append(rid)
        cd.num_computed_tokens.append(computed)
        cd.new_block_ids.append(blocks)
    cd.resumed_req_ids = set(resumed)
    num_sched = dict(num_sched or {})
    return SchedulerOutput(
        scheduled_new_reqs=list(new_reqs),
        scheduled_cached_reqs=cd,
        num_scheduled_tokens=num_sched,
        total_num_scheduled_tokens=sum(num_sched.values()),
        finished_req_ids=set(finished),
        new_block_ids_to_zero=zero,
        kv_cache_block_copies=list(cow),
    )


def table(b, rid, g=0):
    row = b.req_id_to_index[rid]
    n = b.block_table.num_blocks_per_row[g, row]
    return b.block_table[g].block_table.np[row, :n].tolist()


def test_scripted_steps():
    b, reqs = make_batch(), {}
    # step 1: two new requests
    s1 = sched_out(
        new_reqs=[new("A", range(6), ([1, 2], [11, 12])), new("B", [7, 8, 9], ([3], [13]))],
        num_sched={"A": 6, "B": 3},
        zero=[12, 13],
        cow=[(5, 6)],
    )
    up = update_states(reqs, b, s1)
    assert up.block_ids_to_zero == [12, 13] and up.block_copies == [(5, 6)]
    assert b.req_ids == ["A", "B"] and up.added == ["A", "B"]
    assert table(b, "A") == [1, 2] and table(b, "A", 1) == [11, 12]
    assert table(b, "B") == [3] and b.num_computed_tokens_cpu[:2].tolist() == [0, 0]
    record_sampled_tokens(reqs, b, [[50], [60]])
    assert reqs["A"].output_token_ids == [50] and b.num_tokens[:2].tolist() == [7, 4]
    assert b.token_ids_cpu[1, :4].tolist() == [7, 8, 9, 60]

    # step 2: decode A (no new blocks), B gets a block, new C
    s2 = sched_out(
        new_reqs=[new("C", [1, 2], ([5], [15]))],
        cached=[("A", 6, None), ("B", 3, ([4], [14]))],
        num_sched={"A": 1, "B": 1, "C": 2},
    )
    update_states(reqs, b, s2)
    assert b.req_ids == ["A", "B", "C"]
    assert table(b, "B") == [3, 4] and table(b, "B", 1) == [13, 14]
    assert reqs["B"].block_ids == ([3, 4], [13, 14])
    assert b.num_computed_tokens_cpu[:3].tolist() == [6, 3, 0]
    record_sampled_tokens(reqs, b, [[51], [61], [70]])

    # step 3: A finished, B not scheduled (leaves the batch, state kept), C decodes
    s3 = sched_out(cached=[("C", 2, None)], num_sched={"C": 1}, finished=["A"])
    up = update_states(reqs, b, s3)
    assert up.finished == ["A"] and up.removed_unscheduled == ["B"]
    assert "A" not in reqs and "B" in reqs
    assert b.req_ids == ["C"] and table(b, "C") == [5]  # condensed from row 2 to row 0
    assert not b.block_table.block_table.np[1:].any()  # B's row cleared, C's source zeroed
    record_sampled_tokens(reqs, b, [[71]])

    # step 4: new D, B resumed with a full replacement table, C gets a block
    s4 = sched_out(
        new_reqs=[new("D", [3, 3, 3], ([20], [21]))],
        cached=[("C", 3, ([9], [19])), ("B", 0, ([7, 8], [17, 18]))],
        num_sched={"D": 3, "C": 1, "B": 5},
        resumed=["B"],
    )
    up = update_states(reqs, b, s4)
    assert up.added == ["D", "B"]  # new first, then the queued re-add
    assert b.req_ids == ["C", "D", "B"]
    assert reqs["B"].block_ids == ([7, 8], [17, 18])
    assert table(b, "B") == [7, 8] and table(b, "B", 1) == [17, 18]
    assert table(b, "C") == [5, 9] and table(b, "D") == [20]
    # B keeps its outputs: prompt + 2 sampled tokens
    assert b.token_ids_cpu[2, :5].tolist() == [7, 8, 9, 60, 61]
    assert b.num_computed_tokens_cpu[:3].tolist() == [3, 0, 0]


def test_unscheduled_then_readded_with_new_blocks():
    b, reqs = make_batch(), {}
    update_states(reqs, b, sched_out(new_reqs=[new("A", range(4), ([1], [2])), new("B", range(4), ([3], [4]))],
                                     num_sched={"A": 4, "B": 4}))
    # A skipped this step
    update_states(reqs, b, sched_out(cached=[("B", 4, None)], num_sched={"B": 1}))
    assert b.req_ids == ["B"]
    # A comes back (not resumed): its new blocks extend the kept state; it re-enters with add_row
    update_states(reqs, b, sched_out(cached=[("A", 4, ([5], [6])), ("B", 5, None)], num_sched={"A": 2, "B": 1}))
    assert b.req_ids == ["B", "A"]
    assert table(b, "A") == [1, 5] and table(b, "A", 1) == [2, 6]


def test_reorder_threshold_puts_decodes_first():
    b, reqs = make_batch(), {}
    update_states(reqs, b, sched_out(new_reqs=[new("A", range(4), ([1], [2]))], num_sched={"A": 4}))
    record_sampled_tokens(reqs, b, [[9]])
    up = update_states(
        reqs, b,
        sched_out(new_reqs=[new("P", range(5), ([3, 4], [5, 6]))], cached=[("A", 4, None)],
                  num_sched={"P": 5, "A": 1}),
        reorder_threshold=1,
    )
    assert b.req_ids == ["A", "P"] and not up.reordered
    record_sampled_tokens(reqs, b, [[10], [11]])
    # finish A; new prefill Q lands in A's hole (row 0); P is now a decode -> goes first
    up = update_states(
        reqs, b,
        sched_out(new_reqs=[new("Q", range(3), ([7], [8]))], cached=[("P", 5, None)],
                  num_sched={"Q": 3, "P": 1}, finished=["A"]),
        reorder_threshold=1,
    )
    assert up.reordered and b.req_ids == ["P", "Q"]
    assert table(b, "P") == [3, 4] and table(b, "Q") == [7]


def test_bad_scheduler_output_rejected_before_mutation():
    b, reqs = make_batch(), {}
    update_states(reqs, b, sched_out(new_reqs=[new("A", range(4), ([1], [2]))], num_sched={"A": 4}))
    with pytest.raises(UnknownRequestError):
        update_states(reqs, b, sched_out(cached=[("Z", 0, None)], num_sched={"Z": 1}))
    with pytest.raises(InvalidRequestError):
        update_states(reqs, b, sched_out(new_reqs=[new("A", range(4), ([1], [2]))], num_sched={"A": 4}))
    with pytest.raises(InvalidRequestError):
        update_states(reqs, b, sched_out(cached=[("A", 0, None)], num_sched={"A": 4}, resumed=["A"]))
    with pytest.raises(InvalidRequestError):
        update_states(reqs, b, sched_out(cached=[("A", 4, None)], num_sched={}))
    assert b.req_ids == ["A"] and table(b, "A") == [1]
    with pytest.raises(InvalidRequestError):
        record_sampled_tokens(reqs, b, [])


def test_new_request_with_known_preempted_id_replaces_state():
    b, reqs = make_batch(), {}
    update_states(reqs, b, sched_out(new_reqs=[new("A", range(4), ([1], [2])), new("B", range(4), ([3], [4]))],
                                     num_sched={"A": 4, "B": 4}))
    update_states(reqs, b, sched_out(cached=[("B", 4, None)], num_sched={"B": 1}))  # A out of the batch
    # V2-style resume: A comes back as a new request with its full table
    update_states(reqs, b, sched_out(new_reqs=[new("A", range(6), ([8, 9], [10]))], cached=[("B", 5, None)],
                                     num_sched={"A": 6, "B": 1}))
    assert b.req_ids == ["B", "A"] and table(b, "A") == [8, 9]
    assert reqs["A"].num_prompt_tokens == 6
    with pytest.raises(InvalidRequestError):  # running in the batch: not a valid new request
        update_states(reqs, b, sched_out(new_reqs=[new("B", range(4), ([1], [2]))], num_sched={"B": 4, "A": 1},
                                         cached=[("A", 6, None)]))
    with pytest.raises(InvalidRequestError):
        update_states(reqs, b, sched_out(new_reqs=[new("C", range(4), ([1], [2]))], cached=[("C", 0, None)],
                                         num_sched={"C": 4}))


def test_record_sampled_tokens_by_request_id():
    b, reqs = make_batch(), {}
    update_states(reqs, b, sched_out(new_reqs=[new("A", range(4), ([1], [2])), new("B", range(2), ([3], [4]))],
                                     num_sched={"A": 4, "B": 2}))
    record_sampled_tokens(reqs, b, {"B": [5], "A": []})
    assert reqs["B"].output_token_ids == [5] and reqs["A"].output_token_ids == []
    assert b.num_tokens[:2].tolist() == [4, 3] and b.token_ids_cpu[1, :3].tolist() == [0, 1, 5]
    with pytest.raises(UnknownRequestError):
        record_sampled_tokens(reqs, b, {"Z": [1]})
