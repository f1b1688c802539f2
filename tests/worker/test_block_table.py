"""BlockTable / MultiGroupBlockTable: widths, row ops (reference sec. 10.3), commit, slot mapping."""

import numpy as np
import pytest
import torch

from pagedkv.core.spec import SlotMappingMode
from pagedkv.errors import BlockTableError, ConfigError
from pagedkv.worker.block_table import (
    BlockTable,
    MultiGroupBlockTable,
    get_block_table_width,
)
from pagedkv.worker.buffers import CpuGpuBuffer

NONE = SlotMappingMode.NONE
TOK = SlotMappingMode.TOKEN_TO_KV_SLOT


def multi(block_sizes=(16, 16), max_blocks=(4, 3), modes=None, reqs=4, tokens=16, **kw):
    return MultiGroupBlockTable(reqs, tokens, "cpu", False, block_sizes, max_blocks, modes, **kw)


# ----------------------------------------------------------------------------- buffers
def test_cpu_gpu_buffer_views_and_partial_copy():
    b = CpuGpuBuffer(3, 2, dtype=torch.int32, device="cpu", pin_memory=True)
    assert b.gpu.data_ptr() != b.cpu.data_ptr()  # a real second copy even on CPU
    assert not b.cpu.is_pinned()  # no pinning without CUDA
    b.np[:] = [[1, 2], [3, 4], [5, 6]]
    assert b.cpu.tolist() == [[1, 2], [3, 4], [5, 6]]  # .np is a view of .cpu
    out = b.copy_to_gpu(2)
    assert out.tolist() == [[1, 2], [3, 4]]
    assert b.gpu.tolist() == [[1, 2], [3, 4], [0, 0]]
    b.copy_to_gpu()
    assert b.gpu.tolist() == [[1, 2], [3, 4], [5, 6]]
    with pytest.raises(ConfigError):
        b.copy_to_gpu(4)


# ------------------------------------------------------------------------------ widths
def test_width_examples():
    assert get_block_table_width(4, 16) == 8  # 128 tokens = 8 blocks of 16
    assert get_block_table_width(3, 16, slot_mapping_mode=NONE) == 3  # Mamba: no alignment
    assert get_block_table_width(9, 16) == 16
    assert get_block_table_width(1, 256) == 1
    assert get_block_table_width(3, 48) == 8  # 128/gcd(128,48)=8
    t = multi((16, 16), (4, 3), (TOK, NONE))
    assert t.widths == (8, 3) and t.col_starts == (0, 8) and t.total_width == 11
    assert t.block_table.cpu.shape == (4, 11) and t.block_table.cpu.dtype == torch.int32
    assert t[0].width == 8 and t[1].width == 3
    assert t.slot_mappings.shape == (2, 16) and t.slot_mappings.dtype == torch.int64


# ------------------------------------------------------------------------------ row ops
def test_append_add_clear_hand_computed():
    t = multi()
    g0, g1 = t[0], t[1]
    t.add_row(([10, 25], [7]), 1)
    t.append_row(([31], []), 1)  # empty list: no-op for group 1
    assert g0.block_table.np[1].tolist() == [10, 25, 31, 0, 0, 0, 0, 0]
    assert g1.block_table.np[1].tolist() == [7, 0, 0, 0, 0, 0, 0, 0]
    assert t.num_blocks_per_row[:, 1].tolist() == [3, 1]
    assert t.block_table.np[1].tolist() == [10, 25, 31, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0]
    # add_row resets the count and does NOT zero the stale tail.
    t.add_row(([5], [6, 8]), 1)
    assert g0.block_table.np[1, :4].tolist() == [5, 25, 31, 0]
    assert g1.block_table.np[1, :3].tolist() == [6, 8, 0]
    assert t.num_blocks_per_row[:, 1].tolist() == [1, 2]
    # clear_row zeroes [:n] only.
    t.clear_row(1)
    assert g0.block_table.np[1, :4].tolist() == [0, 25, 31, 0]
    assert g1.block_table.np[1, :3].tolist() == [0, 0, 0]
    assert t.num_blocks_per_row[:, 1].tolist() == [0, 0]


def test_move_row_zeroes_source_prefix():
    t = multi()
    t.add_row(([1, 2, 3], [4]), 3)
    t.add_row(([9, 9, 9, 9, 9], [9, 9]), 0)
    t.clear_row(0)  # row 0 now zero in [:n], n=0
    t.move_row(3, 0)
    assert t[0].block_table.np[0, :4].tolist() == [1, 2, 3, 0]
    assert t[1].block_table.np[0, :2].tolist() == [4, 0]
    assert t.num_blocks_per_row[:, 0].tolist() == [3, 1]
    assert t.block_table.np[3].tolist() == [0] * 16
    assert t.num_blocks_per_row[:, 3].tolist() == [0, 0]
    t.move_row(0, 0)  # deliberate: a no-op, not a wipe
    assert t.num_blocks_per_row[:, 0].tolist() == [3, 1]


def test_move_row_keeps_target_tail_beyond_source_count():
    t = multi(max_blocks=(4, 4))
    t.add_row(([1, 2, 3, 4], [1]), 0)
    t.add_row(([7], [8]), 2)
    t.move_row(2, 0)  # only [:1] copied; target columns 1..3 keep their old values
    assert t[0].block_table.np[0, :4].tolist() == [7, 2, 3, 4]
    assert t.num_blocks_per_row[0, 0] == 1


def test_swap_row_whole_rows_and_counts():
    t = multi()
    t.add_row(([1, 2], [3]), 0)
    t.add_row(([4], [5, 6, 7]), 2)
    t.swap_row(0, 2)
    assert t[0].block_table.np[0, :3].tolist() == [4, 0, 0]
    assert t[1].block_table.np[0, :3].tolist() == [5, 6, 7]
    assert t[0].block_table.np[2, :3].tolist() == [1, 2, 0]
    assert t.num_blocks_per_row[:, 0].tolist() == [1, 3]
    assert t.num_blocks_per_row[:, 2].tolist() == [2, 1]
    # a group view's swap touches only its own columns
    t[1].swap_row(0, 2)
    assert t[0].block_table.np[0, :1].tolist() == [4]
    assert t[1].block_table.np[0, :1].tolist() == [3]
    assert t.num_blocks_per_row[:, 0].tolist() == [1, 1]


def test_overflow_raises_and_leaves_row_unchanged():
    t = multi(max_blocks=(4, 3), modes=(TOK, NONE))  # widths 8 and 3
    t.add_row(([1] * 7, [2, 2]), 0)
    before = t.block_table.np.copy(), t.num_blocks_per_row.copy()
    # group 1 would overflow (2 + 2 > 3): nothing is written, group 0 included
    with pytest.raises(BlockTableError, match="width 3"):
        t.append_row(([5], [3, 3]), 0)
    with pytest.raises(BlockTableError):
        t.add_row(([1] * 9, []), 0)
    with pytest.raises(BlockTableError):
        t.append_row(([-1], []), 0)
    with pytest.raises(BlockTableError):
        t.append_row(([1],), 0)  # wrong number of groups
    with pytest.raises(BlockTableError):
        t.add_row(([1], [1]), 4)  # row out of range
    with pytest.raises(BlockTableError):
        t[0].append_row([1, 1], 0)
    np.testing.assert_array_equal(t.block_table.np, before[0])
    np.testing.assert_array_equal(t.num_blocks_per_row, before[1])
    t[0].append_row([6], 0)  # exactly fills the width
    assert t.num_blocks_per_row[0, 0] == 8


# -------------------------------------------------------------------------- commit/clear
def test_commit_copies_exactly_first_rows():
    t = multi()
    t.block_table.gpu.fill_(-7)  # poison the device copy
    for r in range(4):
        t.add_row(([r + 1, r + 2], [r + 3]), r)
    t.commit_block_table(2)
    dev = t.block_table.gpu
    np.testing.assert_array_equal(dev[:2].numpy(), t.block_table.np[:2])
    assert (dev[2:] == -7).all()  # rows beyond stay as before
    assert t.get_device_tensor(2).shape == (2, 16)
    assert t[1].get_device_tensor(3).shape == (3, 8)
    assert t[1].get_device_tensor(3).stride() == (16, 1)  # strided view of the shared buffer
    t.commit_block_table(0)
    with pytest.raises(BlockTableError):
        t.commit_block_table(5)


def test_group_view_commit_and_clear():
    t = multi()
    t.add_row(([1], [2]), 0)
    t[1].commit_block_table(1)
    assert t[1].block_table.gpu[0, 0].item() == 2
    assert t[0].block_table.gpu[0, 0].item() == 0  # group 0 not committed
    t.commit_block_table(1)
    t[0].clear()
    assert t[0].block_table.np.sum() == 0 and t[0].block_table.gpu.sum() == 0
    assert t[1].block_table.gpu[0, 0].item() == 2 and t.num_blocks_per_row[1, 0] == 1
    t.clear()
    assert t.block_table.np.sum() == 0 and t.block_table.gpu.sum() == 0
    assert t.num_blocks_per_row.sum() == 0


def test_fill_padding_rows():
    t = multi()
    t.block_table.gpu.fill_(5)
    t.fill_padding_rows(1, 3)
    assert (t.block_table.gpu[0] == 5).all() and (t.block_table.gpu[1:3] == 0).all()
    assert (t.block_table.gpu[3] == 5).all()


def test_standalone_block_table():
    bt = BlockTable(16, 2, 4, 8, False, "cpu")
    assert bt.width == 8 and bt.block_table.np.shape == (2, 8)
    bt.add_row([10, 25], 0)
    bt.append_row([31], 0)
    bt.commit_block_table(1)
    assert bt.get_device_tensor(1).tolist() == [[10, 25, 31, 0, 0, 0, 0, 0]]
    qsl = torch.tensor([0, 3], dtype=torch.int32)
    pos = torch.tensor([0, 17, 40], dtype=torch.int64)
    bt.compute_slot_mapping(1, qsl, pos)
    assert bt.slot_mapping.tolist() == [160, 401, 31 * 16 + 8, -1, -1, -1, -1, -1]


def test_config_errors():
    with pytest.raises(ConfigError):
        multi(block_sizes=(16,), max_blocks=(4, 4))
    with pytest.raises(ConfigError):
        multi(block_sizes=(), max_blocks=())
    with pytest.raises(ConfigError):
        multi(cp_world_size=2, cp_rank=2)
    with pytest.raises(ConfigError):
        multi(block_sizes=(16, 16), cp_world_size=2, cp_interleave=3)


# ------------------------------------------------------------------------- slot mapping
def _qsl_pos(qsl, pos):
    return torch.tensor(qsl, dtype=torch.int32), torch.tensor(pos, dtype=torch.int64)


@pytest.mark.parametrize(
    "cp,rank,inter,expected",
    [
        (1, 0, 1, [96, 97, 98, 32, 33, -1, -1, -1]),
        (2, 0, 1, [96, -1, 97, 24, -1, -1, -1, -1]),
        (2, 1, 1, [-1, 96, -1, -1, 24, -1, -1, -1]),
        (2, 0, 4, [96, 97, 98, 24, 25, -1, -1, -1]),
    ],
)
def test_slot_mapping_verified_table(cp, rank, inter, expected):
    """Reference sec. 12 (verified on vLLM): rows [6,7] and [1,2,3,4], B=16."""
    t = multi((16,), (8,), reqs=2, tokens=8, cp_world_size=cp, cp_rank=rank, cp_interleave=inter)
    t.add_row(([6, 7],), 0)
    t.add_row(([1, 2, 3, 4],), 1)
    t.commit_block_table(2)
    qsl, pos = _qsl_pos([0, 3, 5], [0, 1, 2, 16, 17])
    out = t.compute_slot_mappings(2, 5, qsl, pos)
    assert out[0].tolist() == expected


def test_slot_mapping_all_groups_one_call_and_mamba_minus_one():
    t = multi((16, 4, 16), (4, 8, 2), (TOK, TOK, NONE), reqs=2, tokens=6)
    t.slot_mappings.fill_(123)
    t.add_row(([10, 25], [3, 4, 5, 6, 7], [9]), 0)
    t.add_row(([2], [8], [1]), 1)
    t.commit_block_table(2)
    qsl, pos = _qsl_pos([0, 2, 3], [16, 17, 3])
    out = t.compute_slot_mappings(2, 3, qsl, pos)
    assert out[0].tolist() == [400, 401, 35, -1, -1, -1]
    assert out[1].tolist() == [7 * 4 + 0, 7 * 4 + 1, 8 * 4 + 3, -1, -1, -1]
    assert out[2].tolist() == [-1] * 6  # SlotMappingMode.NONE
    assert t.slot_mapping(1).data_ptr() == t[1].slot_mapping.data_ptr()


def test_seed_example_position_17_slot_401():
    """Seed sec. 7: B=16, blocks [10, 25], position 17 -> block 25, offset 1 -> 401."""
    t = multi((16,), (2,), reqs=1, tokens=4)
    t.add_row(([10, 25],), 0)
    t.commit_block_table(1)
    qsl, pos = _qsl_pos([0, 1], [17])
    assert t.compute_slot_mappings(1, 1, qsl, pos)[0].tolist() == [401, -1, -1, -1]


def test_slot_mapping_bad_step_sizes():
    t = multi((16,), (2,), reqs=1, tokens=4)
    qsl, pos = _qsl_pos([0, 1], [17])
    with pytest.raises(BlockTableError):
        t.compute_slot_mappings(1, 5, qsl, pos)
    with pytest.raises(BlockTableError):
        t.compute_slot_mappings(1, 2, qsl, pos)
