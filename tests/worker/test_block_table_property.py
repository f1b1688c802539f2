"""Property tests: random row-op / commit sequences against a plain-Python model of sec. 10.3,
and random persistent-batch schedules checking the data-plane invariants."""

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedkv.core.spec import SlotMappingMode
from pagedkv.errors import BlockTableError
from pagedkv.worker.block_table import MultiGroupBlockTable
from pagedkv.worker.input_batch import CachedRequestState, InputBatch
from pagedkv.worker.inputs import InputPreparer

ROWS = 4
SIZES = (16, 4, 8)
MAX_BLOCKS = (3, 5, 2)
MODES = (SlotMappingMode.TOKEN_TO_KV_SLOT, SlotMappingMode.TOKEN_TO_KV_SLOT, SlotMappingMode.NONE)
WIDTHS = (8, 32, 2)  # aligned widths of the groups above

row_st = st.integers(0, ROWS - 1)
ids_st = st.lists(st.integers(0, 999), max_size=6)
op_st = st.one_of(
    st.tuples(st.just("add"), st.tuples(ids_st, ids_st, ids_st), row_st),
    st.tuples(st.just("append"), st.tuples(ids_st, ids_st, ids_st), row_st),
    st.tuples(st.just("clear"), row_st),
    st.tuples(st.just("move"), row_st, row_st),
    st.tuples(st.just("swap"), row_st, row_st),
    st.tuples(st.just("gswap"), st.integers(0, 2), row_st, row_st),
    st.tuples(st.just("commit"), st.integers(0, ROWS)),
    st.tuples(st.just("pad"), st.integers(0, ROWS), st.integers(0, ROWS)),
)


class Model:
    """Reference semantics of sec. 10.3, one Python list per (group, row)."""

    def __init__(self):
        self.cpu = [[[0] * w for _ in range(ROWS)] for w in WIDTHS]
        self.n = [[0] * ROWS for _ in WIDTHS]
        self.dev = [[[0] * w for _ in range(ROWS)] for w in WIDTHS]

    def fits(self, ids, row, reset):
        return all((0 if reset else self.n[g][row]) + len(ids[g]) <= WIDTHS[g] for g in range(3))

    def write(self, ids, row, reset):
        for g in range(3):
            start = 0 if reset else self.n[g][row]
            self.cpu[g][row][start : start + len(ids[g])] = ids[g]
            self.n[g][row] = start + len(ids[g])

    def clear(self, row):
        for g in range(3):
            self.cpu[g][row][: self.n[g][row]] = [0] * self.n[g][row]
            self.n[g][row] = 0

    def move(self, s, t):
        if s == t:
            return
        for g in range(3):
            k = self.n[g][s]
            self.cpu[g][t][:k] = self.cpu[g][s][:k]
            self.cpu[g][s][:k] = [0] * k
            self.n[g][t], self.n[g][s] = k, 0

    def swap(self, a, b, groups=(0, 1, 2)):
        for g in groups:
            self.cpu[g][a], self.cpu[g][b] = self.cpu[g][b], self.cpu[g][a]
            self.n[g][a], self.n[g][b] = self.n[g][b], self.n[g][a]

    def commit(self, k):
        for g in range(3):
            for r in range(k):
                self.dev[g][r] = list(self.cpu[g][r])

    def pad(self, a, b):
        for g in range(3):
            for r in range(a, b):
                self.dev[g][r] = [0] * WIDTHS[g]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(op_st, max_size=30))
def test_row_ops_match_model(ops):
    t = MultiGroupBlockTable(ROWS, 8, "cpu", False, SIZES, MAX_BLOCKS, MODES)
    assert t.widths == WIDTHS
    m = Model()
    for op in ops:
        kind = op[0]
        if kind in ("add", "append"):
            ids, row = op[1], op[2]
            reset = kind == "add"
            if m.fits(ids, row, reset):
                getattr(t, f"{kind}_row")(ids, row)
                m.write(ids, row, reset)
            else:
                with pytest.raises(BlockTableError):
                    getattr(t, f"{kind}_row")(ids, row)
        elif kind == "clear":
            t.clear_row(op[1])
            m.clear(op[1])
        elif kind == "move":
            t.move_row(op[1], op[2])
            m.move(op[1], op[2])
        elif kind == "swap":
            t.swap_row(op[1], op[2])
            m.swap(op[1], op[2])
        elif kind == "gswap":
            t[op[1]].swap_row(op[2], op[3])
            if op[2] != op[3]:
                m.swap(op[2], op[3], groups=(op[1],))
        elif kind == "commit":
            t.commit_block_table(op[1])
            m.commit(op[1])
        elif kind == "pad":
            a, b = sorted((op[1], op[2]))
            t.fill_padding_rows(a, b)
            m.pad(a, b)
        for g in range(3):
            assert t[g].block_table.np.tolist() == m.cpu[g]
            assert t[g].num_blocks_per_row.tolist() == m.n[g]
            # device rows equal the committed CPU rows (and nothing else moved them)
            assert t[g].block_table.gpu.tolist() == m.dev[g]


_add = st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 3))
_step = st.tuples(st.just("step"), st.integers(1, 3), st.booleans())
sched_op = st.one_of(  # adds and steps weighted up so most steps see a non-empty batch
    _add,
    _add,
    _add,
    st.tuples(st.just("remove"), st.integers(0, 20)),
    st.tuples(st.just("swap"), st.integers(0, 20), st.integers(0, 20)),
    _step,
    _step,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(sched_op, max_size=25))
def test_persistent_batch_invariants(ops):
    """Random add/remove/swap/step schedules. After every step: device rows == committed CPU
    rows, each table row == its request's blocks with a zero tail, num_blocks_per_row ==
    len(block ids), every slot lies in a block owned by its request (never the null block),
    no two tokens share a slot."""
    B = (16, 4)
    batch = InputBatch(ROWS, 64, 32, "cpu", False, list(B), [4, 16])
    prep = InputPreparer(ROWS, 32, "cpu", False)
    states: dict[str, CachedRequestState] = {}
    next_block, next_id = 1, 0
    for op in ops:
        if op[0] == "add" and batch.num_reqs + len(batch._holes) < ROWS:
            n_tok, computed = op[1], min(op[2], op[1] - 1)
            blocks = []
            for bs in B:
                k = -(-n_tok // bs)
                blocks.append(list(range(next_block, next_block + k)))
                next_block += k
            s = CachedRequestState(f"q{next_id}", list(range(n_tok)), None, tuple(blocks), computed)
            next_id += 1
            states[s.req_id] = s
            batch.add_request(s)
        elif op[0] == "remove" and batch.num_reqs:
            rid = list(batch.req_id_to_index)[op[1] % batch.num_reqs]
            batch.remove_request(rid)
            del states[rid]
        elif op[0] == "swap" and batch.num_reqs and not batch.has_holes:
            batch.swap_states(op[1] % batch.num_reqs, op[2] % batch.num_reqs)
        elif op[0] == "step":
            batch.condense()
            n = batch.num_reqs
            sched = {}
            for rid, row in batch.req_id_to_index.items():
                left = int(batch.num_tokens[row] - batch.num_computed_tokens_cpu[row])
                sched[rid] = max(1, min(op[1], left))
            if op[2]:
                batch.reorder_batch_to_split_decodes_and_prefills(sched, 1)
            step = prep.prepare(batch, sched, num_reqs_padded=min(ROWS, n + 1))
            event(f"step with {n} requests")
            bt = batch.block_table
            assert bt.block_table.gpu[:n].tolist() == bt.block_table.np[:n].tolist()
            assert not bt.block_table.gpu[n : n + 1].any()
            slots = step.slot_mappings.numpy()
            for g in range(2):
                s = slots[g, : step.num_tokens]
                assert (s > 0).all() and len(set(s.tolist())) == len(s)
                owner = s // B[g]
                for tok, row in enumerate(step.req_indices):
                    assert owner[tok] in states[batch.req_ids[row]].block_ids[g]
            # advance: the scheduled tokens are now computed
            for rid, row in batch.req_id_to_index.items():
                batch.num_computed_tokens_cpu[row] = min(
                    batch.num_tokens[row] - 1, batch.num_computed_tokens_cpu[row] + sched[rid]
                )
                states[rid].num_computed_tokens = int(batch.num_computed_tokens_cpu[row])
        # row invariants (hole rows are all zero)
        bt = batch.block_table
        for row in range(ROWS):
            rid = batch._req_ids[row] if row < len(batch._req_ids) else None
            for g in range(2):
                n = int(bt.num_blocks_per_row[g, row])
                data = bt[g].block_table.np[row]
                if rid is None:
                    assert n == 0 and not data.any()
                else:
                    assert data[:n].tolist() == states[rid].block_ids[g]
                    assert not data[n:].any()
        assert {batch._req_ids[r]: r for r in batch.req_id_to_index.values()} == batch.req_id_to_index
        assert np.all(batch.num_tokens[: batch.num_reqs] >= 1) or batch.has_holes
