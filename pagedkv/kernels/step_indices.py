"""The whole per-step index build in ONE launch: slot mapping + FlashInfer CSR, all groups.

``build_step_indices`` produces exactly what ``compute_slot_mappings`` (slot_mapping.py) and
``build_page_indices_groups`` (page_indices.py) produce, with one kernel launch instead of two:
the grid is ``(num_reqs + P + T, G, S)``; programs ``r < num_reqs + P`` run the slot-mapping
program (request or padding worker), the ``T = page_indices.csr_tiles(num_reqs_padded)`` others
build CSR row tile ``r - num_reqs - P`` of group ``g`` (split 0 only). The two parts write disjoint outputs, so no
ordering between programs is needed.

The CSR pages are the groups' manager blocks (page size = ``group_block_size[g]``) and all
groups share ``seq_lens`` (pass the DCP-local lengths under DCP). Groups whose attention uses
kernel-block subdivision or another page layout build their CSR with ``build_page_indices``
on the translated table instead.

Why: PERF.md's target is the whole index build within 2x of one minimal launch. Launch cost
dominates these tiny kernels (eagerly ~15-20 us of host time per Triton launch on the H200
host, ~1.6-2 us per kernel inside a CUDA graph), so one launch instead of two halves it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels._common import (
    PAD_BLOCK,
    check_same_device,
    token_launch_geometry,
    use_triton,
)
from pagedkv.kernels.page_indices import (
    _check_groups as _check_csr,
    _csr_group_program,
    build_page_indices_groups_ref,
    csr_meta,
    csr_tiles,
)
from pagedkv.kernels.slot_mapping import (
    _check_common as _check_slot_common,
    _check_groups as _check_slot_groups,
    _slot_mapping_program,
    compute_slot_mappings_ref,
)


@triton.jit(do_not_specialize=["num_reqs", "num_tokens", "num_reqs_padded", "num_slot_rows"])
def _step_indices_kernel(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    bt_width,
    col_start_ptr,
    width_ptr,
    block_size_ptr,
    mode_ptr,
    qsl_ptr,
    pos_ptr,
    seq_lens_ptr,
    slot_ptr,
    slot_stride_g,
    indptr_ptr,
    indptr_stride_g,
    indices_ptr,
    indices_stride_g,
    last_ptr,
    last_stride_g,
    num_reqs,
    num_tokens,
    max_num_tokens,
    num_reqs_padded,
    max_pages,
    num_slot_rows,
    CP_WORLD: tl.constexpr,
    CP_RANK: tl.constexpr,
    CP_INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    r = tl.program_id(0)
    g = tl.program_id(1)
    s = tl.program_id(2)
    if r < num_slot_rows:
        _slot_mapping_program(bt_ptr, bt_stride_r, bt_stride_c, bt_width, col_start_ptr,
                              width_ptr, block_size_ptr, mode_ptr, qsl_ptr, pos_ptr, slot_ptr,
                              slot_stride_g, num_reqs, num_tokens, max_num_tokens, r, g, s,
                              num_slot_rows, tl.num_programs(2), CP_WORLD, CP_RANK, CP_INTER,
                              BLOCK, PAD)
    elif s == 0:
        _csr_group_program(bt_ptr, bt_stride_r, bt_stride_c, bt_width, col_start_ptr,
                           width_ptr, block_size_ptr, seq_lens_ptr, indptr_ptr,
                           indptr_stride_g, indices_ptr, indices_stride_g, last_ptr,
                           last_stride_g, num_reqs, num_reqs_padded, max_pages,
                           r - num_slot_rows, g, ROWS, BLOCK_R, BLOCK_P)


def _check(fn, block_table, group_col_start, group_width, group_block_size, group_mode,
           query_start_loc, positions, seq_lens, slot_mapping, indptr_out, indices_out,
           last_page_len_out, num_reqs, num_tokens, num_reqs_padded, cp_world_size, cp_rank,
           cp_interleave):
    num_groups = _check_slot_groups(fn, block_table, group_col_start, group_width,
                                    group_block_size, group_mode, slot_mapping)
    num_reqs, num_tokens, cp = _check_slot_common(
        fn, block_table, query_start_loc, positions, num_reqs, num_tokens,
        slot_mapping.shape[1], cp_world_size, cp_rank, cp_interleave)
    _, _, num_reqs_padded = _check_csr(
        fn, block_table, group_col_start, group_width, group_block_size, seq_lens, num_reqs,
        num_reqs_padded, indptr_out, indices_out, last_page_len_out)
    check_same_device(fn, block_table=block_table, group_mode=group_mode,
                      query_start_loc=query_start_loc, positions=positions,
                      slot_mapping=slot_mapping)
    return num_groups, num_reqs, num_tokens, num_reqs_padded, cp


def build_step_indices(
    block_table: torch.Tensor,
    group_col_start: torch.Tensor,
    group_width: torch.Tensor,
    group_block_size: torch.Tensor,
    group_mode: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    indptr_out: torch.Tensor,
    indices_out: torch.Tensor,
    last_page_len_out: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    num_reqs_padded: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    max_query_len: int | None = None,
) -> None:
    """Slot mapping of all groups + CSR of all groups, one launch.

    Equivalent to ``compute_slot_mappings(block_table, group_col_start, group_width,
    group_block_size, group_mode, query_start_loc, positions, slot_mapping, num_reqs,
    num_tokens, cp_world_size, cp_rank, cp_interleave)`` followed by
    ``build_page_indices_groups(block_table, group_col_start, group_width, group_block_size,
    seq_lens, num_reqs, num_reqs_padded, indptr_out, indices_out, last_page_len_out)``; see
    those for every argument. ``max_query_len`` only sizes the launch.
    """
    fn = "build_step_indices"
    num_groups, num_reqs, num_tokens, num_reqs_padded, (cp, rank, inter) = _check(
        fn, block_table, group_col_start, group_width, group_block_size, group_mode,
        query_start_loc, positions, seq_lens, slot_mapping, indptr_out, indices_out,
        last_page_len_out, num_reqs, num_tokens, num_reqs_padded, cp_world_size, cp_rank,
        cp_interleave)
    if not use_triton(_step_indices_kernel, block_table):
        _step_indices_torch(block_table, group_col_start, group_width, group_block_size,
                            group_mode, query_start_loc, positions, seq_lens, slot_mapping,
                            indptr_out, indices_out, last_page_len_out, num_reqs, num_tokens,
                            num_reqs_padded, cp, rank, inter)
        return
    block, _, splits, pads = token_launch_geometry(num_reqs, num_tokens,
                                                       slot_mapping.shape[1], max_query_len)
    slot_rows = num_reqs + pads
    meta = csr_meta(num_reqs, num_reqs_padded)  # 4 warps: the CSR tiles need them
    _step_indices_kernel[(slot_rows + csr_tiles(num_reqs_padded), num_groups, splits)](
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        group_col_start, group_width, group_block_size, group_mode, query_start_loc, positions,
        seq_lens, slot_mapping, slot_mapping.stride(0), indptr_out, indptr_out.stride(0),
        indices_out, indices_out.stride(0), last_page_len_out, last_page_len_out.stride(0),
        num_reqs, num_tokens, slot_mapping.shape[1], num_reqs_padded, indices_out.shape[1],
        slot_rows, CP_WORLD=cp, CP_RANK=rank, CP_INTER=inter, BLOCK=block, PAD=PAD_BLOCK,
        **meta,
    )


def build_step_indices_ref(
    block_table: torch.Tensor,
    group_col_start: torch.Tensor,
    group_width: torch.Tensor,
    group_block_size: torch.Tensor,
    group_mode: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    indptr_out: torch.Tensor,
    indices_out: torch.Tensor,
    last_page_len_out: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    num_reqs_padded: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    max_query_len: int | None = None,
) -> None:
    """Plain torch twin of :func:`build_step_indices`."""
    _, num_reqs, num_tokens, num_reqs_padded, (cp, rank, inter) = _check(
        "build_step_indices_ref", block_table, group_col_start, group_width, group_block_size,
        group_mode, query_start_loc, positions, seq_lens, slot_mapping, indptr_out,
        indices_out, last_page_len_out, num_reqs, num_tokens, num_reqs_padded, cp_world_size,
        cp_rank, cp_interleave)
    _step_indices_torch(block_table, group_col_start, group_width, group_block_size, group_mode,
                        query_start_loc, positions, seq_lens, slot_mapping, indptr_out,
                        indices_out, last_page_len_out, num_reqs, num_tokens, num_reqs_padded,
                        cp, rank, inter)


def _step_indices_torch(block_table, group_col_start, group_width, group_block_size, group_mode,
                        query_start_loc, positions, seq_lens, slot_mapping, indptr_out,
                        indices_out, last_page_len_out, num_reqs, num_tokens, num_reqs_padded,
                        cp, rank, inter):
    compute_slot_mappings_ref(block_table, group_col_start, group_width, group_block_size,
                              group_mode, query_start_loc, positions, slot_mapping, num_reqs,
                              num_tokens, cp, rank, inter)
    build_page_indices_groups_ref(block_table, group_col_start, group_width, group_block_size,
                                  seq_lens, num_reqs, num_reqs_padded, indptr_out, indices_out,
                                  last_page_len_out)
