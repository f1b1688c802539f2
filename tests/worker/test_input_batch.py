"""InputBatch: add into the smallest hole, remove, condense (verified example), swap, reorder."""

import numpy as np
import pytest

from pagedkv.core.spec import SlotMappingMode
from pagedkv.errors import BlockTableError, InvalidRequestError, UnknownRequestError
from pagedkv.worker.input_batch import (
    DECODE,
    LONG_EXTEND,
    PREFILL,
    SHORT_EXTEND,
    CachedRequestState,
    InputBatch,
)


def make_batch(reqs=6, model_len=64, groups=1):
    return InputBatch(
        max_num_reqs=reqs,
        max_model_len=model_len,
        max_num_batched_tokens=32,
        device="cpu",
        pin_memory=False,
        block_sizes=[16] * groups,
        max_num_blocks_per_req=[4] * groups,
        slot_mapping_modes=[SlotMappingMode.TOKEN_TO_KV_SLOT] * groups,
    )


def state(rid, prompt_len=3, computed=0, blocks=None, out=(), groups=1):
    k = int(rid[1:]) if rid[1:].isdigit() else 0
    blocks = blocks if blocks is not None else tuple([100 + k] for _ in range(groups))
    return CachedRequestState(
        req_id=rid,
        prompt_token_ids=[1000 * k + i for i in range(prompt_len)],
        sampling_params=None,
        block_ids=blocks,
        num_computed_tokens=computed,
        output_token_ids=list(out),
    )


def rows(b):
    return {rid: b.req_id_to_index[rid] for rid in b.req_id_to_index}


def check_consistent(b):
    """Row-level invariants: id map, token rows, table rows match the states' block ids."""
    for rid, row in b.req_id_to_index.items():
        assert b.req_ids[row] == rid
        k = int(rid[1:])
        n_p = b.num_prompt_tokens[row]
        assert b.token_ids_cpu[row, :n_p].tolist() == [1000 * k + i for i in range(n_p)]
        n = b.block_table.num_blocks_per_row[0, row]
        assert b.block_table[0].block_table.np[row, :n].tolist() == [100 + k]
        assert not b.block_table[0].block_table.np[row, n:].any()


def test_verified_condense_example():
    """Sec. 9.5 (verified): rows {r0, r5 (reused hole 1), r2, r4}; remove r0, r2 -> r4@0, r5@1."""
    b = make_batch()
    for rid in ("r0", "r1", "r2", "r4"):
        b.add_request(state(rid))
    b.remove_request("r1")
    assert b.add_request(state("r5")) == 1  # reuses the smallest hole
    assert b.req_ids == ["r0", "r5", "r2", "r4"]
    assert b.remove_request("r0") == 0 and b.remove_request("r2") == 2
    assert b.remove_request("nope") is None
    b.condense()
    assert b.req_ids == ["r4", "r5"]
    assert rows(b) == {"r4": 0, "r5": 1}
    check_consistent(b)
    # moved rows are zeroed at the source
    assert not b.block_table.block_table.np[2:].any()
    assert b.block_table.num_blocks_per_row[0, 2:].tolist() == [0] * 4


def test_add_request_smallest_hole_first():
    b = make_batch()
    for i in range(5):
        b.add_request(state(f"r{i}"))
    b.remove_request("r3")
    b.remove_request("r1")
    assert b.add_request(state("r7")) == 1
    assert b.add_request(state("r8")) == 3
    assert b.add_request(state("r9")) == 5
    check_consistent(b)


def test_condense_holes_at_end_and_all_removed():
    b = make_batch()
    for i in range(4):
        b.add_request(state(f"r{i}"))
    b.remove_request("r3")
    b.remove_request("r2")
    b.condense()
    assert b.req_ids == ["r0", "r1"]
    b.remove_request("r0")
    b.remove_request("r1")
    b.condense()
    assert b.req_ids == [] and b.num_reqs == 0
    assert not b.block_table.block_table.np.any()


def test_add_request_validation():
    b = make_batch(reqs=2, model_len=8)
    b.add_request(state("r0"))
    with pytest.raises(InvalidRequestError):
        b.add_request(state("r0"))
    with pytest.raises(InvalidRequestError):
        b.add_request(state("r1", prompt_len=9))
    with pytest.raises(BlockTableError):
        b.add_request(state("r1", blocks=([1] * 9,)))  # wider than the table (8 columns)
    assert b.num_reqs == 1 and b.req_ids == ["r0"]
    b.add_request(state("r1"))
    with pytest.raises(BlockTableError, match="full"):
        b.add_request(state("r2"))


def test_swap_states_swaps_everything():
    b = make_batch(groups=2)
    b.add_request(state("r1", prompt_len=2, computed=1, out=[7, 8], groups=2))
    b.add_request(state("r2", prompt_len=5, computed=3, groups=2))
    b.swap_states(0, 1)
    assert b.req_ids == ["r2", "r1"] and rows(b) == {"r2": 0, "r1": 1}
    assert b.token_ids_cpu[0, :5].tolist() == [2000, 2001, 2002, 2003, 2004]
    assert b.token_ids_cpu[1, :4].tolist() == [1000, 1001, 7, 8]
    assert b.num_tokens[:2].tolist() == [5, 4]
    assert b.num_prompt_tokens[:2].tolist() == [5, 2]
    assert b.num_computed_tokens_cpu[:2].tolist() == [3, 1]
    for g in range(2):
        assert b.block_table[g].block_table.np[:2, 0].tolist() == [102, 101]


def test_classify_rows():
    b = make_batch()
    b.add_request(state("r0", prompt_len=10, computed=10, out=[5]))  # decode
    b.add_request(state("r1", prompt_len=10, computed=8))  # short extend (2 <= 4, prompt not done)
    b.add_request(state("r2", prompt_len=20, computed=8))  # long extend
    b.add_request(state("r3", prompt_len=10, computed=0))  # prefill
    b.add_request(state("r4", prompt_len=2, computed=0))  # prefill even if scheduled <= threshold
    regions = b.classify_rows(np.array([1, 2, 12, 10, 2]), threshold=4)
    assert regions.tolist() == [DECODE, SHORT_EXTEND, LONG_EXTEND, PREFILL, PREFILL]


def test_reorder_hand_computed_permutation():
    b = make_batch()
    # rows: P, D, L, D, S   -> regions 3,0,2,0,1 ; target 0,0,1,2,3
    specs = [("r0", 10, 0), ("r1", 4, 4), ("r2", 30, 8), ("r3", 4, 4), ("r4", 10, 8)]
    for rid, p, c in specs:
        b.add_request(state(rid, prompt_len=p, computed=c, out=[9] if c >= p else []))
    sched = {"r0": 10, "r1": 1, "r2": 16, "r3": 1, "r4": 2}
    assert b.reorder_batch_to_split_decodes_and_prefills(sched, threshold=2)
    # misplaced rows 0,2,3,4 (row 1 is already a decode in the decode region) get, in order,
    # the stable sort of their regions: r3 (D), r4 (S), r2 (L), r0 (P)
    assert b.req_ids == ["r3", "r1", "r4", "r2", "r0"]
    check_consistent(b)
    assert not b.reorder_batch_to_split_decodes_and_prefills(sched, threshold=2)
    with pytest.raises(UnknownRequestError):
        b.reorder_batch_to_split_decodes_and_prefills({"r0": 1}, threshold=2)


def test_append_token_ids():
    b = make_batch(model_len=5)
    b.add_request(state("r0", prompt_len=3))
    assert b.append_token_ids(0, [42]) == 4
    assert b.token_ids_cpu[0, :4].tolist() == [0, 1, 2, 42]
    with pytest.raises(InvalidRequestError):
        b.append_token_ids(0, [1, 2])
    b.truncate_tokens(0, 3)
    assert b.num_tokens[0] == 3
