"""Per-step input preparation: seed worked examples, vectorised indices, CUDA-graph padding."""

import numpy as np
import pytest
import torch

from pagedkv.errors import InvalidRequestError, InvariantError
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.inputs import InputPreparer, dcp_local_seq_lens


def setup(reqs=4, model_len=64, tokens=16, block_sizes=(16,), max_blocks=(4,), modes=None, **kw):
    b = InputBatch(reqs, model_len, tokens, "cpu", False, list(block_sizes), list(max_blocks), modes, **kw)
    return b, InputPreparer.for_batch(b)


def add(b, rid, prompt, blocks, computed=0, out=()):
    return b.add_request(CachedRequestState(rid, list(prompt), None, blocks, computed, list(out)))


def test_seed_example_position_17():
    """Seed sec. 7: B=16, blocks [10, 25]; the token at position 17 goes to slot 25*16+1=401."""
    b, prep = setup()
    add(b, "A", range(18), ([10, 25],), computed=17)
    step = prep.prepare(b, {"A": 1})
    assert step.positions.tolist() == [17]
    assert step.slot_mappings[0].tolist() == [401]
    assert step.query_start_loc.tolist() == [0, 1] and step.seq_lens.tolist() == [18]
    assert step.input_ids.tolist() == [17]


def test_seed_chunked_prefill_crossing_partial_block():
    """Seed: 1000 tokens computed = 62 full blocks + 8 slots of logical block 62 (63 blocks).
    The next 500 tokens: 1000..1007 fill block_table[62] offsets 8..15, 1008.. the next block."""
    B = 16
    table = [1000 + 3 * i for i in range(94)]  # 94 blocks cover 1500 tokens
    b, prep = setup(reqs=1, model_len=1536, tokens=512, max_blocks=(96,))
    add(b, "A", [i % 50000 for i in range(1500)], (table[:63],), computed=1000)
    b.block_table.append_row((table[63:],), 0)  # the scheduler's new blocks for this chunk
    step = prep.prepare(b, {"A": 500})
    slots = step.slot_mappings[0].numpy()
    pos = np.arange(1000, 1500)
    np.testing.assert_array_equal(step.positions.numpy(), pos)
    assert slots[:8].tolist() == [table[62] * B + o for o in range(8, 16)]
    assert slots[8] == table[63] * B + 0
    np.testing.assert_array_equal(slots, np.array(table)[pos // B] * B + pos % B)
    assert b.block_table.slot_mappings[0, 500:].tolist() == [-1] * 12
    assert step.seq_lens.tolist() == [1500] and step.max_query_len == 500
    assert step.logits_indices.tolist() == [499]


def test_vectorised_indices_two_groups():
    b, prep = setup(block_sizes=(16, 4), max_blocks=(4, 16))
    add(b, "A", range(5), ([7], [1, 2]), computed=0)
    add(b, "B", range(20), ([3, 9], [4, 5, 6, 8, 11]), computed=17, out=[])
    add(b, "C", [5, 6, 7], ([2], [12]), computed=1)
    step = prep.prepare(b, {"A": 5, "B": 3, "C": 2})
    assert step.query_start_loc.tolist() == [0, 5, 8, 10]
    assert step.positions.tolist() == [0, 1, 2, 3, 4, 17, 18, 19, 1, 2]
    assert step.req_indices.tolist() == [0] * 5 + [1] * 3 + [2] * 2
    assert step.input_ids.tolist() == [0, 1, 2, 3, 4, 17, 18, 19, 6, 7]
    assert step.seq_lens.tolist() == [5, 20, 3]
    assert step.logits_indices.tolist() == [4, 7, 9]
    assert step.is_prefilling.tolist() == [True, True, True]
    assert step.max_query_len == 5 and step.max_seq_len == 20
    g0 = [7 * 16 + p for p in range(5)] + [9 * 16 + 1, 9 * 16 + 2, 9 * 16 + 3, 2 * 16 + 1, 2 * 16 + 2]
    g1 = [4, 5, 6, 7, 8 + 0] + [11 * 4 + 1, 11 * 4 + 2, 11 * 4 + 3, 12 * 4 + 1, 12 * 4 + 2]
    assert step.slot_mappings[0].tolist() == g0
    assert step.slot_mappings[1].tolist() == g1


def test_cuda_graph_padding_rows_rewritten_every_step():
    b, prep = setup(reqs=4, tokens=12)
    for i in range(3):
        add(b, f"r{i}", range(10), ([i + 1, i + 5],), computed=4)
    prep.prepare(b, {f"r{i}": 2 for i in range(3)})
    assert b.block_table.block_table.gpu[:3, 0].tolist() == [1, 2, 3]
    # poison every persistent device buffer, then run a smaller batch padded to 4 rows
    b.remove_request("r1")
    b.remove_request("r2")
    b.condense()
    b.block_table.block_table.gpu[3].fill_(77)
    b.block_table.slot_mappings.fill_(55)
    prep.seq_lens.gpu.fill_(33)
    prep.query_start_loc.gpu.fill_(44)
    prep.is_prefilling.gpu.fill_(True)
    step = prep.prepare(b, {"r0": 3}, num_reqs_padded=4, num_tokens_padded=8)
    dev = b.block_table.block_table.gpu
    assert dev[0, :2].tolist() == [1, 5]
    assert (dev[1:4] == 0).all()  # padded rows -> null block, including stale rows 1, 2
    assert step.query_start_loc.tolist() == [0, 3, 3, 3, 3]
    assert step.seq_lens.tolist() == [7, 0, 0, 0]
    assert step.is_prefilling.tolist() == [True, False, False, False]
    assert step.slot_mappings.shape == (1, 8)
    assert step.slot_mappings[0].tolist() == [20, 21, 22, -1, -1, -1, -1, -1]
    assert b.block_table.slot_mappings[0, 8:].tolist() == [-1] * 4
    assert step.positions.tolist() == [4, 5, 6, 0, 0, 0, 0, 0]
    assert step.num_reqs == 1 and step.num_reqs_padded == 4 and step.num_tokens_padded == 8
    cap = prep.prepare(b, {"r0": 3}, num_reqs_padded=2, for_cudagraph_capture=True)
    assert cap.max_seq_len == b.max_model_len


def test_commit_is_issued_first(monkeypatch):
    b, prep = setup()
    add(b, "A", range(4), ([1],))
    calls = []
    bt = b.block_table
    orig_commit, orig_copy = bt.commit_block_table, prep._area.copy_to_gpu
    monkeypatch.setattr(bt, "commit_block_table", lambda n: (calls.append("commit"), orig_commit(n)))
    monkeypatch.setattr(prep._area, "copy_to_gpu", lambda used: (calls.append(("inputs", dict(used))), orig_copy(used))[1])
    monkeypatch.setattr(b, "scheduled_tokens_per_row", lambda d: (calls.append("host"), np.array([4], np.int32))[1])
    prep.prepare(b, {"A": 4})
    # commit first, then the host math, then the step's inputs in ONE copy
    assert calls == ["commit", "host", ("inputs", {
        "query_start_loc": 2, "seq_lens": 1, "logits_indices": 1, "is_prefilling": 1,
        "positions": 4, "input_ids": 4})]
    # with the decode order on, the same one copy also carries it (all max_num_reqs rows)
    prep.decode_order_enabled = True
    calls.clear()
    prep.prepare(b, {"A": 4})
    assert calls[2][1]["decode_order"] == 4


def test_decode_order_longest_first_and_padding():
    """decode_order: the padded requests by decreasing seq_len (ties in row order, padding
    rows' 0 last), then the rows past the padding in place: a permutation of every grid size
    up to max_num_reqs; rewritten every step (a smaller batch leaves no stale entry)."""
    b, prep = setup(reqs=6, tokens=16, max_blocks=(4,))
    add(b, "A", range(10), ([1],), computed=9)   # seq 10
    assert prep.prepare(b, {"A": 1}).decode_order is None  # off unless a backend reads it
    prep.decode_order_enabled = True
    add(b, "B", range(30), ([2, 3],), computed=29)  # seq 30
    add(b, "C", range(10), ([4],), computed=9)   # seq 10
    add(b, "D", range(20), ([5, 6],), computed=19)  # seq 20
    step = prep.prepare(b, {"A": 1, "B": 1, "C": 1, "D": 1}, num_reqs_padded=5)
    assert step.seq_lens.tolist() == [10, 30, 10, 20, 0]
    assert step.decode_order.dtype == torch.int32
    assert step.decode_order.tolist() == [1, 3, 0, 2, 4, 5]
    b.remove_request("B")
    b.condense()
    step = prep.prepare(b, {"A": 1, "C": 1, "D": 1})
    assert step.seq_lens.tolist() == [10, 20, 10]
    assert step.decode_order.tolist() == [1, 0, 2, 3, 4, 5]


def test_staging_area_one_copy():
    """Fields at 64-byte boundaries; one copy moves the used rows of every field (and what
    lies between them); rows past the copied bytes keep their device values."""
    from pagedkv.errors import ConfigError
    from pagedkv.worker.buffers import StagingArea

    area = StagingArea([("a", 5, torch.int32), ("b", 3, torch.int64), ("c", 4, torch.bool)],
                       device="cpu")
    assert area.nbytes == 128 + 4  # a at 0, b at 64, c at 128
    area["a"].np[:] = [1, 2, 3, 4, 5]
    area["b"].np[:] = [7, 8, 9]
    area["c"].np[:] = [True, False, True, True]
    area.copy_to_gpu({"a": 2, "b": 2})  # bytes [0, 64 + 16)
    assert area["a"].gpu.tolist() == [1, 2, 3, 4, 5]  # the whole of a lies below b's rows
    assert area["b"].gpu.tolist() == [7, 8, 0]
    assert area["c"].gpu.tolist() == [False] * 4
    area.copy_to_gpu({"c": 3})
    assert area["c"].gpu.tolist() == [True, False, True, False]
    assert area["b"].gpu.tolist() == [7, 8, 9]
    area["b"].wait_for_copy()  # a field waits for the area's copy (a no-op on CPU)
    with pytest.raises(ConfigError):
        area.copy_to_gpu({"b": 4})
    with pytest.raises(ConfigError):
        StagingArea([("a", 1, torch.int32), ("a", 1, torch.int32)], device="cpu")


def test_prepare_validation():
    b, prep = setup()
    add(b, "A", range(4), ([1],))
    add(b, "B", range(4), ([2],))
    with pytest.raises(InvalidRequestError):
        prep.prepare(b, {"A": 5, "B": 1})  # more than the request's known tokens
    with pytest.raises(InvalidRequestError):
        prep.prepare(b, {"A": 0, "B": 1})
    with pytest.raises(InvalidRequestError):
        prep.prepare(b, {"A": 1, "B": 1}, num_reqs_padded=1)
    with pytest.raises(InvalidRequestError):
        prep.prepare(b, {"A": 1, "B": 1}, num_tokens_padded=17)
    b.remove_request("A")
    with pytest.raises(InvariantError):
        prep.prepare(b, {"B": 1})


def test_dcp_local_seq_lens_and_cp_slots():
    seq = np.array([0, 1, 5, 8, 9, 17])
    # cp=2, I=1: rank 0 holds even positions
    assert dcp_local_seq_lens(seq, 2, 0, 1).tolist() == [0, 1, 3, 4, 5, 9]
    assert dcp_local_seq_lens(seq, 2, 1, 1).tolist() == [0, 0, 2, 4, 4, 8]
    assert dcp_local_seq_lens(seq, 2, 1, 4).tolist() == [0, 0, 1, 4, 4, 8]
    b, prep = setup(cp_world_size=2, cp_rank=1, cp_interleave=1)
    add(b, "A", range(4), ([6],))
    step = prep.prepare(b, {"A": 4})
    assert step.slot_mappings[0].tolist() == [-1, 96, -1, 97]
    assert step.dcp_local_seq_lens.tolist() == [2]


def test_step_views_reused_per_shape():
    """Steps of the same shape get the same view objects (made once), holding the new step's
    values; another shape gets its own views."""
    b, prep = setup()
    add(b, "A", range(18), ([10, 25],), computed=16)
    add(b, "B", range(5), ([3],), computed=3)
    s1 = prep.prepare(b, {"A": 1, "B": 1})
    assert s1.positions.tolist() == [16, 3] and s1.seq_lens.tolist() == [17, 4]
    b.num_computed_tokens_cpu[:2] = [17, 4]
    s2 = prep.prepare(b, {"A": 1, "B": 1})
    assert s2.positions is s1.positions and s2.query_start_loc is s1.query_start_loc
    assert s2.positions.tolist() == [17, 4] and s2.seq_lens.tolist() == [18, 5]
    assert s2.slot_mappings[0].tolist() == [25 * 16 + 1, 3 * 16 + 4]
    s3 = prep.prepare(b, {"A": 1, "B": 1}, num_reqs_padded=3, num_tokens_padded=4)
    assert s3.positions is not s1.positions
    assert s3.positions.tolist() == [17, 4, 0, 0] and s3.query_start_loc.tolist() == [0, 1, 2, 2]
