"""Paged decode attention, stream-K variant (Triton): every program reads an equal share of K/V.

Same contract as ``paged_decode_attention`` in ``triton_decode.py`` (layouts, single-token
requests served, other rows untouched, CUDA-graph padding rows zeroed on request); this module
holds only the launch shape that differs.

Work: the batch's K/V tiles (``TILE_N`` positions of one KV head of one single-token request)
in the order (request, KV head, tile): item ``(r, h)`` is request ``r``'s ``ceil(seq_len /
TILE_N)`` tiles of head ``h``, ``W`` tiles in all. A fixed grid of ``G`` programs (a host value:
the device's multiprocessors times ``programs_per_sm``, one wave) deals them out in contiguous
shares, program ``p`` taking tiles ``[p W // G, (p + 1) W // G)``, whatever the lengths: no
program waits on a long request while others idle, and no program slot turns over mid-launch.
Each program computes the layout itself from ``query_start_loc`` and ``seq_lens`` (one vector
load of each, a cumulative sum; requests with other than one query token hold no tiles) and
walks its share item by item (the GQA-packed online softmax of ``_decode_tile``).
An item a program covers whole is written out directly; a share's first item, when partial,
goes to partial slot ``2 p`` and its last, when partial and not the first, to ``2 p + 1``
(middle items are always whole). ``_streamk_reduce_kernel`` (grid ``(num_reqs, H)``) finds
the programs that covered each split item from the same arithmetic and merges their partials.

Host values only: ``G``, ``num_reqs`` and its power-of-two bucket (the layout's vector size).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.attention.triton_decode_tile import _decode_tile
from pagedkv.kernels._common import next_pow2


@triton.jit
def _work_layout(qsl_ptr, seq_ptr, num_reqs, NR_PAD: tl.constexpr, TILE_N: tl.constexpr,
                 HKV: tl.constexpr):
    """Per request (a ``[NR_PAD]`` vector): its tiles per KV head (0 unless exactly one query
    token), the first and one-past-last global tile of its items; and the total ``W``."""
    i = tl.arange(0, NR_PAD)
    ok = i < num_reqs
    q0 = tl.load(qsl_ptr + i, mask=ok, other=0)
    q1 = tl.load(qsl_ptr + i + 1, mask=ok, other=0)
    lens = tl.load(seq_ptr + i, mask=ok, other=0)
    tiles = tl.where(ok & (q1 - q0 == 1), (lens + TILE_N - 1) // TILE_N, 0).to(tl.int64)
    incl = tl.cumsum(tiles, 0) * HKV
    excl = incl - tiles * HKV
    return i, tiles, excl, incl, tl.sum(tiles, 0) * HKV


@triton.jit(do_not_specialize=["num_reqs", "zero_rows"])
def _streamk_decode_kernel(
    q_ptr, q_s0, q_s1,
    k_ptr, v_ptr, c_sb, c_st, c_sh,
    bt_ptr, bt_s0, bt_width,
    qsl_ptr, seq_ptr, num_reqs, zero_rows,
    out_ptr, o_s0, o_s1,
    m_ptr, l_ptr, acc_ptr,
    scale_log2,
    NR_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RANGE_LOOP: tl.constexpr,
):
    p = tl.program_id(0)
    n_progs = tl.num_programs(0)
    HKV: tl.constexpr = NUM_HEADS // GROUP
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gd_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]

    if zero_rows != 0:  # padded requests (no query rows) zero row r when no request owns it
        owned = tl.load(qsl_ptr + num_reqs)
        rr = p
        while rr < num_reqs:
            if (tl.load(qsl_ptr + rr + 1) == tl.load(qsl_ptr + rr)) & (rr >= owned):
                for kh in tl.static_range(HKV):
                    tl.store(out_ptr + rr.to(tl.int64) * o_s0 + (kh * GROUP + g)[:, None] * o_s1
                             + d[None, :], tl.zeros([GROUP_PAD, D_PAD], tl.float32)
                             .to(out_ptr.dtype.element_ty), mask=gd_mask)
            rr += n_progs

    idx, tiles, excl, incl, total = _work_layout(qsl_ptr, seq_ptr, num_reqs, NR_PAD, TILE_N, HKV)
    lens = tl.load(seq_ptr + idx, mask=idx < num_reqs, other=0)
    rows = tl.load(qsl_ptr + idx, mask=idx < num_reqs, other=0)
    start = (p.to(tl.int64) * total) // n_progs
    end = ((p + 1).to(tl.int64) * total) // n_progs
    # the walk's state at tile `start`: request r (its tiles n_t, length, query row), KV head
    # kvh, tile t of the item, the first tile of the current part and whether it is the first
    r, n_t, seq_len, q_row = _request_at(start, idx, tiles, incl, lens, rows)
    off = start - tl.sum(tl.where(idx == r, excl, 0), 0)
    kvh = (off // tl.maximum(n_t, 1)).to(tl.int32)
    t = (off - kvh * n_t).to(tl.int32)
    t_part = t
    first = 1
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    # one flat loop over the share's tiles (item boundaries inside), software-pipelined by
    # Triton across items; the interpreter cannot iterate range() over runtime scalars
    if RANGE_LOOP:
        for i in range(0, (end - start).to(tl.int32)):  # an int32 loop: Triton pipelines it
            pos = start + i
            (m_i, l_i, acc, r, n_t, seq_len, q_row, kvh, t, t_part, first) = _streamk_tile(
                pos, end, p, m_i, l_i, acc, r, n_t, seq_len, q_row, kvh, t, t_part, first,
                idx, tiles, incl, lens, rows, g, d, gd_mask,
                q_ptr, q_s0, q_s1, k_ptr, v_ptr, c_sb, c_st, c_sh, bt_ptr, bt_s0, bt_width,
                out_ptr, o_s0, o_s1, m_ptr, l_ptr, acc_ptr, scale_log2,
                GROUP, GROUP_PAD, HKV, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC)
    else:
        pos = start
        while pos < end:
            (m_i, l_i, acc, r, n_t, seq_len, q_row, kvh, t, t_part, first) = _streamk_tile(
                pos, end, p, m_i, l_i, acc, r, n_t, seq_len, q_row, kvh, t, t_part, first,
                idx, tiles, incl, lens, rows, g, d, gd_mask,
                q_ptr, q_s0, q_s1, k_ptr, v_ptr, c_sb, c_st, c_sh, bt_ptr, bt_s0, bt_width,
                out_ptr, o_s0, o_s1, m_ptr, l_ptr, acc_ptr, scale_log2,
                GROUP, GROUP_PAD, HKV, HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC)
            pos += 1


@triton.jit
def _request_at(pos, idx, tiles, incl, lens, rows):
    """The request whose items hold global tile ``pos``: index, tiles per head, length,
    query row."""
    r = tl.sum((incl <= pos).to(tl.int32), 0)
    sel = idx == r
    return (r, tl.sum(tl.where(sel, tiles, 0), 0), tl.sum(tl.where(sel, lens, 0), 0),
            tl.sum(tl.where(sel, rows, 0), 0))


@triton.jit
def _streamk_tile(pos, end, p, m_i, l_i, acc, r, n_t, seq_len, q_row, kvh, t, t_part, first,
                  idx, tiles, incl, lens, rows, g, d, gd_mask,
                  q_ptr, q_s0, q_s1, k_ptr, v_ptr, c_sb, c_st, c_sh, bt_ptr, bt_s0, bt_width,
                  out_ptr, o_s0, o_s1, m_ptr, l_ptr, acc_ptr, scale_log2,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HKV: tl.constexpr,
                  HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                  TILE_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Tile ``t`` of item (request ``r``, head ``kvh``); at the end of an item or of the share
    the part is written (output or partial slot) and the state moves to the next item."""
    head = kvh * GROUP + g
    q_row_cur = q_row
    q = tl.load(q_ptr + q_row.to(tl.int64) * q_s0 + head[:, None] * q_s1 + d[None, :],
                mask=gd_mask, other=0.0).to(k_ptr.dtype.element_ty)
    acc, l_i, m_i = _decode_tile(acc, l_i, m_i, q, t, seq_len, k_ptr, v_ptr,
                                 bt_ptr + r.to(tl.int64) * bt_s0, bt_width, c_sb, c_st,
                                 kvh.to(tl.int64) * c_sh, d, scale_log2,
                                 HEAD_DIM, D_PAD, BLOCK_SIZE, TILE_N, DOT_PREC)
    item_done = t + 1 == n_t
    part_done = item_done | (pos + 1 == end)
    whole = item_done & (t_part == 0)
    slot = 2 * p.to(tl.int64) + 1 - first
    # the next tile's state: scalars of this iteration's state only (no dependence on the
    # products above), so the pipeliner can issue the next tiles' loads ahead
    last_head = kvh + 1 == HKV
    nxt = _request_at(pos + 1, idx, tiles, incl, lens, rows)
    moved = item_done & last_head
    r = tl.where(moved, nxt[0], r)
    n_t = tl.where(moved, nxt[1], n_t)
    seq_len = tl.where(moved, nxt[2], seq_len)
    q_row = tl.where(moved, nxt[3], q_row)
    kvh = tl.where(item_done, tl.where(last_head, 0, kvh + 1), kvh)
    t = tl.where(item_done, 0, t + 1)
    t_part = tl.where(part_done, 0, t_part)
    first = tl.where(part_done, 0, first)
    if part_done:
        if whole:  # the whole item: the final output
            tl.store(out_ptr + q_row_cur.to(tl.int64) * o_s0 + head[:, None] * o_s1 + d[None, :],
                     (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=gd_mask)
        else:  # the share's first item -> slot 2p, its last -> 2p + 1
            tl.store(m_ptr + slot * GROUP + g, m_i, mask=g < GROUP)
            tl.store(l_ptr + slot * GROUP + g, l_i, mask=g < GROUP)
            tl.store(acc_ptr + (slot * GROUP + g)[:, None] * D_PAD + d[None, :], acc,
                     mask=gd_mask)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    return m_i, l_i, acc, r, n_t, seq_len, q_row, kvh, t, t_part, first


@triton.jit(do_not_specialize=["num_reqs", "n_progs"])
def _streamk_reduce_kernel(
    qsl_ptr, seq_ptr, num_reqs, n_progs,
    out_ptr, o_s0, o_s1,
    m_ptr, l_ptr, acc_ptr,
    NR_PAD: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    TILE_N: tl.constexpr,
    CHUNK: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    q_row = tl.load(qsl_ptr + r)
    if tl.load(qsl_ptr + r + 1) - q_row != 1:
        return
    HKV: tl.constexpr = NUM_HEADS // GROUP
    kvh = h // GROUP
    gi = h - kvh * GROUP
    idx, tiles, excl, incl, total = _work_layout(qsl_ptr, seq_ptr, num_reqs, NR_PAD, TILE_N, HKV)
    sel = idx == r
    n_t = tl.sum(tl.where(sel, tiles, 0), 0)
    a = tl.sum(tl.where(sel, excl, 0), 0) + kvh * n_t
    b = a + n_t
    G = n_progs.to(tl.int64)
    p0 = ((a + 1) * G - 1) // total  # the last program whose share starts at or before a
    p1 = (b * G - 1) // total  # the last program whose share starts before b
    if p0 == p1:
        return  # one program covered the item: written directly
    first_slot = 2 * p0 + ((p0 * total) // G != a).to(tl.int64)
    d = tl.arange(0, D_PAD)
    c = tl.arange(0, CHUNK)
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    pp = p0
    while pp <= p1:
        prog = pp + c
        # a program between p0 and p1 with an empty share (W < G) wrote nothing
        ok = (prog <= p1) & (((prog + 1) * total) // G > (prog * total) // G)
        slot = tl.where(prog == p0, first_slot, 2 * prog)
        row = slot * GROUP + gi
        m = tl.load(m_ptr + row, mask=ok, other=float("-inf"))
        l = tl.load(l_ptr + row, mask=ok, other=0.0)
        x = tl.load(acc_ptr + row[:, None] * D_PAD + d[None, :],
                    mask=ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, 0))
        alpha = tl.exp2(m_run - m_new)
        w = tl.exp2(m - m_new)
        l_run = l_run * alpha + tl.sum(w * l, 0)
        acc = acc * alpha + tl.sum(w[:, None] * x, 0)
        m_run = m_new
        pp += CHUNK
    tl.store(out_ptr + q_row.to(tl.int64) * o_s0 + h.to(tl.int64) * o_s1 + d,
             (acc / l_run).to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def launch_streamk(q, k_cache, v_cache, block_table, query_start_loc, seq_lens, num_reqs: int,
                   out, scale_log2: float, *, shape, num_programs: int, tile_n: int,
                   num_warps: int, num_stages: int, maxnreg: int | None, dot_prec: str,
                   range_loop: bool,
                   zero_padded_rows: bool, workspace: dict | None) -> None:
    """Both launches of the stream-K path (arguments checked by the caller,
    ``paged_decode_attention``); ``num_programs``: the grid ``G``."""
    d_pad = max(16, next_pow2(shape.head_dim))
    group_pad = max(16, next_pow2(shape.group))
    nr_pad = max(16, next_pow2(num_reqs))
    slots = 2 * num_programs * shape.group
    bufs = None if workspace is None else workspace.get("streamk_partials")
    if bufs is None or bufs[0].shape[0] < slots or bufs[2].shape[1] != d_pad \
            or bufs[0].device != q.device:
        bufs = (torch.empty(slots, dtype=torch.float32, device=q.device),
                torch.empty(slots, dtype=torch.float32, device=q.device),
                torch.empty(slots, d_pad, dtype=torch.float32, device=q.device))
        if workspace is not None:
            workspace["streamk_partials"] = bufs
    m_buf, l_buf, acc_buf = bufs
    _streamk_decode_kernel[(num_programs,)](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table, block_table.stride(0), block_table.shape[1],
        query_start_loc, seq_lens, num_reqs, int(bool(zero_padded_rows)),
        out, out.stride(0), out.stride(1),
        m_buf, l_buf, acc_buf,
        scale_log2,
        NR_PAD=nr_pad, NUM_HEADS=shape.num_heads, GROUP=shape.group, GROUP_PAD=group_pad,
        HEAD_DIM=shape.head_dim, D_PAD=d_pad, BLOCK_SIZE=shape.block_size, TILE_N=tile_n,
        DOT_PREC=dot_prec, RANGE_LOOP=range_loop, num_warps=num_warps,
        num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}),
    )
    _streamk_reduce_kernel[(num_reqs, shape.num_heads)](
        query_start_loc, seq_lens, num_reqs, num_programs,
        out, out.stride(0), out.stride(1),
        m_buf, l_buf, acc_buf,
        NR_PAD=nr_pad, NUM_HEADS=shape.num_heads, GROUP=shape.group, HEAD_DIM=shape.head_dim,
        D_PAD=d_pad, TILE_N=tile_n, CHUNK=8, num_warps=4 if d_pad >= 128 else 1,
    )


__all__ = ["launch_streamk"]
