"""Slot mapping: every scheduled token's flat KV slot, for all KV-cache groups in one launch.

``slot = block_table[row, pos // B] * B + pos % B`` (reference sec. 12), with decode context
parallelism (DCP) interleaving: ``vbs = B * cp``, ``vblk = pos // vbs``, ``voff = pos % vbs``;
the token is local iff ``(voff // I) % cp == rank``; then
``slot = block_table[row, vblk] * B + (voff // (cp * I)) * I + voff % I``, else ``-1``.

Layout of the launch (one launch for all groups): grid ``(num_reqs + P, G, S)``. Program
``(r, g, s)`` with ``r < num_reqs`` maps request ``r``'s tokens for group ``g``; the extra
programs ``r >= num_reqs`` fill the group's padding with ``-1``. ``P = 1`` and ``S = 1`` for
buffers up to 4096 tokens and requests up to 2048 tokens, i.e. exactly the
``(num_reqs + 1, G)`` grid. For long requests the launcher deals every request's token range
over ``S`` programs (chunks ``s``, ``s + S``, ...) so that no program walks more than two
chunks, and for large buffers it uses ``P > 1`` padding programs so that none stores more than
~4 chunks (``_common.token_launch_geometry``). Lanes per program follow the longest request
(``max_query_len`` hint; 32 lanes and one warp for decode). The grid depends only on host
integers, never on device data, so a captured CUDA graph stays valid.

Arithmetic: CP parameters are compile-time constants (one compiled variant per DCP layout),
position math is int32 (positions must be < 2**31; larger ones give -1), slots are int64.

Deliberate, documented differences from vLLM 0.33.0 (all invisible for well-formed input):
  * The padding program fills from ``min(query_start_loc[num_reqs], num_tokens)`` to the end of
    the buffer (V2 behaviour), so tokens a caller counts in ``num_tokens`` but no request owns
    (CUDA-graph padding) become -1 as well. Request programs never write at or past
    ``num_tokens``.
  * Groups with ``group_mode == 0`` (``SlotMappingMode.NONE``) get -1 for every token (V2); V1
    leaves the buffer as it was.
  * Bounds: a column ``>= group_width[g]`` or outside the block table's width, and a position
    outside ``[0, 2**31)``, give -1 instead of reading a neighbour's block.
  * Context parallelism applies to every group with mode 1 (V2 applies it only to groups marked
    ``dcp_sharded``; pass ``cp_world_size=1`` in a separate call for unsharded groups).
Contract not checked on the device (checking would need a host sync): ``query_start_loc`` is
non-decreasing, and ``group_block_size >= 1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import (
    INDEX_DTYPES,
    PAD_BLOCK,
    PAD_SLOT_ID,
    check_cp,
    check_int,
    check_same_device,
    check_tensor,
    fill_pad_tail,
    gather_table,
    token_launch_geometry,
    use_triton,
)

_INT32_MAX = 2**31 - 1


@triton.jit
def _map_request_tokens(
    out_row,
    row_ptr,
    bt_stride_c,
    col_start,
    col_limit,
    qsl_ptr,
    pos_ptr,
    r,
    s,
    num_splits,
    num_tokens,
    block_size,
    CP_WORLD: tl.constexpr,
    CP_RANK: tl.constexpr,
    CP_INTER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Slots of request ``r``'s tokens ``[qsl[r], min(qsl[r+1], num_tokens))``, chunks
    ``s, s + num_splits, ...``; columns ``>= col_limit`` (relative to ``col_start``) give -1.
    Position math runs in int32 (positions < 2**31), the slot product in int64."""
    start = tl.load(qsl_ptr + r)
    end = tl.minimum(tl.load(qsl_ptr + r + 1), num_tokens)
    lanes = tl.arange(0, BLOCK)
    t0 = start + s * BLOCK
    while t0 < end:
        t = t0 + lanes
        in_req = t < end
        pos64 = tl.load(pos_ptr + t, mask=in_req, other=-1)
        ok = in_req & (pos64 >= 0) & (pos64 <= 2147483647)
        pos = tl.where(ok, pos64, 0).to(tl.int32)
        if CP_WORLD == 1:
            vblk = pos // block_size
            local_off = pos - vblk * block_size
        else:
            vbs = block_size * CP_WORLD
            vblk = pos // vbs
            voff = pos - vblk * vbs
            ok = ok & (((voff // CP_INTER) % CP_WORLD) == CP_RANK)
            local_off = (voff // (CP_WORLD * CP_INTER)) * CP_INTER + voff % CP_INTER
        col = col_start + vblk
        ok = ok & (vblk < col_limit) & (col >= 0)
        blk = tl.load(row_ptr + col.to(tl.int64) * bt_stride_c, mask=ok, other=0)
        slot = blk.to(tl.int64) * block_size + local_off
        tl.store(out_row + t, tl.where(ok, slot, -1), mask=in_req)
        t0 += num_splits * BLOCK


@triton.jit
def _slot_mapping_program(
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
    out_ptr,
    out_stride_g,
    num_reqs,
    num_tokens,
    max_num_tokens,
    r,
    g,
    s,
    num_row_programs,
    num_splits,
    CP_WORLD: tl.constexpr,
    CP_RANK: tl.constexpr,
    CP_INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
):
    """Program ``(r, g, s)`` of the multi-group slot mapping: request ``r < num_reqs`` of
    group ``g`` (split ``s``), or a padding worker for ``num_reqs <= r < num_row_programs``."""
    out_row = out_ptr + g.to(tl.int64) * out_stride_g
    if r >= num_reqs:
        fill_pad_tail(out_row, qsl_ptr, num_reqs, num_tokens, max_num_tokens, r, s,
                      num_row_programs, num_splits, PAD)
    else:
        col_start = tl.load(col_start_ptr + g)
        # Bound by the group's width and by the buffer's width (never a neighbour's column).
        col_limit = tl.minimum(tl.load(width_ptr + g), bt_width - col_start)
        block_size = tl.load(block_size_ptr + g)
        if tl.load(mode_ptr + g) != 0:
            _map_request_tokens(out_row, bt_ptr + r.to(tl.int64) * bt_stride_r, bt_stride_c,
                                col_start, col_limit, qsl_ptr, pos_ptr, r, s, num_splits,
                                num_tokens, block_size, CP_WORLD, CP_RANK, CP_INTER, BLOCK)
        else:
            # SlotMappingMode.NONE: the group's tokens get PAD.
            start = tl.load(qsl_ptr + r)
            end = tl.minimum(tl.load(qsl_ptr + r + 1), num_tokens)
            t0 = start + s * BLOCK
            while t0 < end:
                t = t0 + tl.arange(0, BLOCK)
                tl.store(out_row + t, tl.full([BLOCK], -1, tl.int64), mask=t < end)
                t0 += num_splits * BLOCK


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _slot_mappings_kernel(
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
    out_ptr,
    out_stride_g,
    num_reqs,
    num_tokens,
    max_num_tokens,
    CP_WORLD: tl.constexpr,
    CP_RANK: tl.constexpr,
    CP_INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
):
    """Grid ``(num_reqs + P, G, S)``: request programs, then padding programs."""
    _slot_mapping_program(bt_ptr, bt_stride_r, bt_stride_c, bt_width, col_start_ptr, width_ptr,
                          block_size_ptr, mode_ptr, qsl_ptr, pos_ptr, out_ptr, out_stride_g,
                          num_reqs, num_tokens, max_num_tokens, tl.program_id(0),
                          tl.program_id(1), tl.program_id(2), tl.num_programs(0),
                          tl.num_programs(2), CP_WORLD, CP_RANK, CP_INTER, BLOCK, PAD)


@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _slot_mapping_single_kernel(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    bt_width,
    qsl_ptr,
    pos_ptr,
    out_ptr,
    num_reqs,
    num_tokens,
    max_num_tokens,
    BLOCK_SIZE: tl.constexpr,
    CP_WORLD: tl.constexpr,
    CP_RANK: tl.constexpr,
    CP_INTER: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
):
    """One group (block size a compile-time constant); grid ``(num_reqs + P, 1, S)``."""
    r = tl.program_id(0)
    s = tl.program_id(2)
    num_splits = tl.num_programs(2)
    if r >= num_reqs:
        fill_pad_tail(out_ptr, qsl_ptr, num_reqs, num_tokens, max_num_tokens, r, s,
                      tl.num_programs(0), num_splits, PAD)
    else:
        _map_request_tokens(out_ptr, bt_ptr + r.to(tl.int64) * bt_stride_r, bt_stride_c, 0,
                            bt_width, qsl_ptr, pos_ptr, r, s, num_splits, num_tokens,
                            BLOCK_SIZE, CP_WORLD, CP_RANK, CP_INTER, BLOCK)


def _check_common(fn, block_table, query_start_loc, positions, num_reqs, num_tokens,
                  max_num_tokens, cp_world_size, cp_rank, cp_interleave):
    check_tensor(fn, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor(fn, "query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1,
                 contiguous_last=True)
    check_tensor(fn, "positions", positions, dtypes=INDEX_DTYPES, ndim=1, contiguous_last=True)
    num_reqs = check_int(fn, "num_reqs", num_reqs, lo=0, hi=block_table.shape[0])
    num_tokens = check_int(fn, "num_tokens", num_tokens, lo=0)
    if num_tokens > max_num_tokens:
        raise ConfigError(f"{fn}: num_tokens = {num_tokens} exceeds the slot_mapping buffer "
                          f"({max_num_tokens} tokens); size it for max_num_batched_tokens")
    if not (query_start_loc.numel() >= num_reqs + 1):
        raise ConfigError(
            f"{fn}: query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries, "
            f"has {query_start_loc.numel()}"
        )
    if not (positions.numel() >= num_tokens):
        raise ConfigError(
            f"{fn}: positions needs num_tokens = {num_tokens} entries, has {positions.numel()}"
        )
    cp = check_cp(fn, cp_world_size, cp_rank, cp_interleave)
    return num_reqs, num_tokens, cp


def _check_groups(fn, block_table, group_col_start, group_width, group_block_size, group_mode,
                  slot_mapping):
    for name, t in (("group_col_start", group_col_start), ("group_width", group_width),
                    ("group_block_size", group_block_size), ("group_mode", group_mode)):
        check_tensor(fn, name, t, dtypes=INDEX_DTYPES, ndim=1, contiguous_last=True)
    num_groups = group_col_start.numel()
    if not (num_groups >= 1):
        raise ConfigError(
            f"{fn}: at least one KV-cache group is needed"
        )
    for name, t in (("group_width", group_width), ("group_block_size", group_block_size),
                    ("group_mode", group_mode)):
        if not (t.numel() == num_groups):
            raise ConfigError(
                f"{fn}: {name} has {t.numel()} entries, group_col_start has {num_groups}"
            )
    check_tensor(fn, "slot_mapping", slot_mapping, dtypes=(torch.int64,), ndim=2,
                 contiguous_last=True)
    if not (slot_mapping.shape[0] == num_groups):
        raise ConfigError(
            f"{fn}: slot_mapping must be [G={num_groups}, max_num_tokens], "
            f"got {tuple(slot_mapping.shape)}"
        )
    return num_groups


def compute_slot_mappings(
    block_table: torch.Tensor,
    group_col_start: torch.Tensor,
    group_width: torch.Tensor,
    group_block_size: torch.Tensor,
    group_mode: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    max_query_len: int | None = None,
) -> None:
    """Fill ``slot_mapping[g, :]`` for every KV-cache group ``g`` in one launch.

    Args:
        block_table: int32 ``[max_num_reqs, total_width]``; group ``g`` owns the columns
            ``[group_col_start[g], group_col_start[g] + group_width[g])``. Row = batch row.
        group_col_start, group_width, group_block_size, group_mode: int32 ``[G]`` on the
            block table's device. ``group_mode[g]``: 1 = token -> KV slot, 0 = no slot
            mapping (the whole row becomes -1).
        query_start_loc: int32 ``[>= num_reqs + 1]``, non-decreasing, starting at 0.
        positions: int64 ``[>= num_tokens]``.
        slot_mapping: int64 ``[G, max_num_tokens]`` (output, row stride free, columns
            contiguous). Every entry of ``[0, max_num_tokens)`` is written for valid input.
        num_reqs, num_tokens: host ints (the batch's request and token counts).
        cp_world_size, cp_rank, cp_interleave: decode context parallelism (sec. 12).
        max_query_len: optional host hint, the longest request's token count this step
            (decode: 1). It only sizes the launch (lanes per program); results do not depend
            on it. Without it ``num_tokens`` bounds the longest request.
    """
    fn = "compute_slot_mappings"
    num_groups = _check_groups(fn, block_table, group_col_start, group_width, group_block_size,
                               group_mode, slot_mapping)
    num_reqs, num_tokens, (cp, rank, inter) = _check_common(
        fn, block_table, query_start_loc, positions, num_reqs, num_tokens,
        slot_mapping.shape[1], cp_world_size, cp_rank, cp_interleave)
    check_same_device(fn, block_table=block_table, group_col_start=group_col_start,
                      group_width=group_width, group_block_size=group_block_size,
                      group_mode=group_mode, query_start_loc=query_start_loc,
                      positions=positions, slot_mapping=slot_mapping)
    if not use_triton(_slot_mappings_kernel, block_table):
        _slot_mappings_torch(block_table, group_col_start.tolist(), group_width.tolist(),
                             group_block_size.tolist(), group_mode.tolist(), query_start_loc,
                             positions, slot_mapping, num_reqs, num_tokens, cp, rank, inter)
        return
    block, warps, splits, pads = token_launch_geometry(num_reqs, num_tokens,
                                                       slot_mapping.shape[1], max_query_len)
    _slot_mappings_kernel[(num_reqs + pads, num_groups, splits)](
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        group_col_start, group_width, group_block_size, group_mode,
        query_start_loc, positions, slot_mapping, slot_mapping.stride(0),
        num_reqs, num_tokens, slot_mapping.shape[1],
        CP_WORLD=cp, CP_RANK=rank, CP_INTER=inter, BLOCK=block, PAD=PAD_BLOCK, num_warps=warps,
    )


def compute_slot_mappings_ref(
    block_table: torch.Tensor,
    group_col_start: torch.Tensor,
    group_width: torch.Tensor,
    group_block_size: torch.Tensor,
    group_mode: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    max_query_len: int | None = None,
) -> None:
    """Plain torch twin of :func:`compute_slot_mappings` (same signature, same in-place result)."""
    fn = "compute_slot_mappings_ref"
    _check_groups(fn, block_table, group_col_start, group_width, group_block_size, group_mode,
                  slot_mapping)
    num_reqs, num_tokens, (cp, rank, inter) = _check_common(
        fn, block_table, query_start_loc, positions, num_reqs, num_tokens,
        slot_mapping.shape[1], cp_world_size, cp_rank, cp_interleave)
    _slot_mappings_torch(block_table, group_col_start.tolist(), group_width.tolist(),
                         group_block_size.tolist(), group_mode.tolist(), query_start_loc,
                         positions, slot_mapping, num_reqs, num_tokens, cp, rank, inter)


def _slot_mappings_torch(block_table, col_starts, widths, block_sizes, modes, query_start_loc,
                         positions, slot_mapping, num_reqs, num_tokens, cp, rank, inter):
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    pad_start = min(int(qsl[num_reqs]), num_tokens)
    slot_mapping[:, pad_start:] = PAD_SLOT_ID
    first, last = int(qsl[0]), pad_start
    if num_reqs == 0 or last <= first:
        return
    dev = slot_mapping.device
    tok = torch.arange(first, last, device=dev)
    # Request owning each token: the number of request ends at or before it.
    req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True)
    pos = positions[first:last].to(torch.int64)
    bt_width = block_table.shape[1]
    for g in range(len(col_starts)):
        if modes[g] == 0:
            slot_mapping[g, first:last] = PAD_SLOT_ID
            continue
        bsz, width, col_start = int(block_sizes[g]), int(widths[g]), int(col_starts[g])
        vbs = bsz * cp
        in_range = (pos >= 0) & (pos <= _INT32_MAX)
        safe = torch.where(in_range, pos, 0)
        vblk, voff = safe // vbs, safe % vbs
        local = ((voff // inter) % cp) == rank
        local_off = (voff // (cp * inter)) * inter + voff % inter
        col = col_start + vblk
        ok = local & in_range & (vblk < width) & (col >= 0) & (col < bt_width)
        blk = gather_table(block_table, req, col, ok)
        slot_mapping[g, first:last] = torch.where(ok, blk * bsz + local_off, PAD_SLOT_ID)


def compute_slot_mapping(
    block_table_2d: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping_1d: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    max_query_len: int | None = None,
) -> None:
    """Single-group convenience form of :func:`compute_slot_mappings`.

    ``block_table_2d`` may be any strided 2-D view (e.g. a column slice of the multi-group
    buffer); its width bounds the columns. ``slot_mapping_1d`` is int64 ``[max_num_tokens]``.
    The group parameters travel as scalars (the block size as a compile-time constant), so
    no small device tensors are created per call. ``max_query_len``: see
    :func:`compute_slot_mappings`.
    """
    fn = "compute_slot_mapping"
    check_tensor(fn, "slot_mapping_1d", slot_mapping_1d, dtypes=(torch.int64,), ndim=1,
                 contiguous_last=True)
    block_size = check_int(fn, "block_size", block_size, lo=1)
    num_reqs, num_tokens, (cp, rank, inter) = _check_common(
        fn, block_table_2d, query_start_loc, positions, num_reqs, num_tokens,
        slot_mapping_1d.shape[0], cp_world_size, cp_rank, cp_interleave)
    check_same_device(fn, block_table_2d=block_table_2d, query_start_loc=query_start_loc,
                      positions=positions, slot_mapping_1d=slot_mapping_1d)
    width = block_table_2d.shape[1]
    if not use_triton(_slot_mapping_single_kernel, block_table_2d):
        _slot_mappings_torch(block_table_2d, [0], [width], [block_size], [1], query_start_loc,
                             positions, slot_mapping_1d.view(1, -1), num_reqs, num_tokens,
                             cp, rank, inter)
        return
    block, warps, splits, pads = token_launch_geometry(num_reqs, num_tokens,
                                                       slot_mapping_1d.shape[0], max_query_len)
    _slot_mapping_single_kernel[(num_reqs + pads, 1, splits)](
        block_table_2d, block_table_2d.stride(0), block_table_2d.stride(1), width,
        query_start_loc, positions, slot_mapping_1d, num_reqs, num_tokens,
        slot_mapping_1d.shape[0], BLOCK_SIZE=block_size, CP_WORLD=cp, CP_RANK=rank,
        CP_INTER=inter, BLOCK=block, PAD=PAD_BLOCK, num_warps=warps,
    )


def compute_slot_mapping_ref(
    block_table_2d: torch.Tensor,
    query_start_loc: torch.Tensor,
    positions: torch.Tensor,
    slot_mapping_1d: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    block_size: int,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    max_query_len: int | None = None,
) -> None:
    """Plain torch twin of :func:`compute_slot_mapping`."""
    fn = "compute_slot_mapping_ref"
    check_tensor(fn, "slot_mapping_1d", slot_mapping_1d, dtypes=(torch.int64,), ndim=1,
                 contiguous_last=True)
    block_size = check_int(fn, "block_size", block_size, lo=1)
    num_reqs, num_tokens, (cp, rank, inter) = _check_common(
        fn, block_table_2d, query_start_loc, positions, num_reqs, num_tokens,
        slot_mapping_1d.shape[0], cp_world_size, cp_rank, cp_interleave)
    _slot_mappings_torch(block_table_2d, [0], [block_table_2d.shape[1]], [block_size], [1],
                         query_start_loc, positions, slot_mapping_1d.view(1, -1), num_reqs,
                         num_tokens, cp, rank, inter)
