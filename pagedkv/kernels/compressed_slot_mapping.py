"""Compressed (DeepSeek-V4 style) slot mapping (reference sec. 17.1).

A compressed layer keeps one state per ``C = compress_ratio`` tokens; a manager block of
``B = S * C`` tokens stores ``S = storage_block_size`` states. Only the token that closes a group,
``(pos + 1) % C == 0``, writes, and only if its own (uncompressed) slot is not PAD. For such a
token, with decode context parallelism ``cp`` and interleave ``I``::

    local = pos // (I * cp) * I + pos % I        # == pos without DCP
    c     = local // C
    slot  = block_table[req, c // S] * S + c % S

Every other entry of the output is -1: the output is "pre-filled with -1 in full". Here that is
done by the launch itself (grid ``(num_reqs + P, S)`` as in ``slot_mapping.py``: request
programs write -1 for non-writing tokens, the ``P`` extra programs write -1 from
``min(query_start_loc[num_reqs], num_tokens)`` to the end of the buffer), so no separate
``fill_`` launch is needed and the result is the same for well-formed input.

``pos = seq_lens[r] - query_len(r) + i`` for the request's i-th token.

Deliberate, documented choices:
  * ``own_slot_mapping=None`` with ``cp_world_size > 1``: ownership is derived the way the
    regular slot mapping decides it (``((pos % (B * cp)) // I) % cp == cp_rank`` with
    ``B = S * C``), so a rank writes only the states it owns. With ``own_slot_mapping`` given,
    ownership is ``own_slot_mapping[t] >= 0`` alone (vLLM 0.33.0 behaviour).
  * Block-table entries are clamped to >= 0 (the vLLM builders clamp the table before the
    call); columns past the table width and positions outside ``[0, 2**31)`` give -1.
  * ``storage_block_size``, ``compress_ratio`` and the CP parameters are compile-time
    constants of the kernel (static per layer): one compiled variant per configuration.
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

@triton.jit(do_not_specialize=["num_reqs", "num_tokens"])
def _compressed_slot_mapping_kernel(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    bt_width,
    qsl_ptr,
    seq_lens_ptr,
    own_ptr,
    out_ptr,
    num_reqs,
    num_tokens,
    out_len,
    STORAGE_BLOCK: tl.constexpr,
    COMPRESS_RATIO: tl.constexpr,
    CP_WORLD: tl.constexpr,
    CP_RANK: tl.constexpr,
    CP_INTER: tl.constexpr,
    HAS_OWN: tl.constexpr,
    BLOCK: tl.constexpr,
    PAD: tl.constexpr,
):
    """Grid ``(num_reqs + P, S)``; position math in int32 (positions < 2**31), slots int64."""
    r = tl.program_id(0)
    s = tl.program_id(1)
    num_splits = tl.num_programs(1)
    if r >= num_reqs:
        fill_pad_tail(out_ptr, qsl_ptr, num_reqs, num_tokens, out_len, r, s,
                      tl.num_programs(0), num_splits, PAD)
    else:
        q_start = tl.load(qsl_ptr + r)
        q_end = tl.load(qsl_ptr + r + 1)
        first_pos = tl.load(seq_lens_ptr + r).to(tl.int64) - (q_end - q_start)
        end = tl.minimum(q_end, num_tokens)
        row_ptr = bt_ptr + r.to(tl.int64) * bt_stride_r
        t0 = q_start + s * BLOCK
        while t0 < end:
            t = t0 + tl.arange(0, BLOCK)
            in_req = t < end
            pos64 = first_pos + (t - q_start)
            ok = in_req & (pos64 >= 0) & (pos64 <= 2147483647)
            pos = tl.where(ok, pos64, 0).to(tl.int32)
            ok = ok & ((pos % COMPRESS_RATIO) == COMPRESS_RATIO - 1)  # (pos + 1) % C == 0
            if HAS_OWN:
                own = tl.load(own_ptr + t, mask=ok, other=-1)
                ok = ok & (own >= 0)
            elif CP_WORLD > 1:
                voff = pos % (STORAGE_BLOCK * COMPRESS_RATIO * CP_WORLD)
                ok = ok & (((voff // CP_INTER) % CP_WORLD) == CP_RANK)
            local = pos // (CP_INTER * CP_WORLD) * CP_INTER + pos % CP_INTER
            c = local // COMPRESS_RATIO
            col = c // STORAGE_BLOCK
            ok = ok & (col < bt_width)
            blk = tl.load(row_ptr + col.to(tl.int64) * bt_stride_c, mask=ok, other=0)
            slot = tl.maximum(blk, 0).to(tl.int64) * STORAGE_BLOCK + c % STORAGE_BLOCK
            tl.store(out_ptr + t, tl.where(ok, slot, -1), mask=in_req)
            t0 += num_splits * BLOCK


def _check(fn, block_table, query_start_loc, seq_lens, slot_mapping_out, num_reqs, num_tokens,
           storage_block_size, compress_ratio, own_slot_mapping, cp_world_size, cp_rank,
           cp_interleave):
    check_tensor(fn, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor(fn, "query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1,
                 contiguous_last=True)
    check_tensor(fn, "seq_lens", seq_lens, dtypes=INDEX_DTYPES, ndim=1, contiguous_last=True)
    check_tensor(fn, "slot_mapping_out", slot_mapping_out, dtypes=(torch.int64,), ndim=1,
                 contiguous_last=True)
    num_reqs = check_int(fn, "num_reqs", num_reqs, lo=0, hi=block_table.shape[0])
    num_tokens = check_int(fn, "num_tokens", num_tokens, lo=0, hi=slot_mapping_out.shape[0])
    S = check_int(fn, "storage_block_size", storage_block_size, lo=1)
    C = check_int(fn, "compress_ratio", compress_ratio, lo=1)
    if not (query_start_loc.numel() >= num_reqs + 1):
        raise ConfigError(
            f"{fn}: query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries, "
            f"has {query_start_loc.numel()}"
        )
    if not (seq_lens.numel() >= num_reqs):
        raise ConfigError(
            f"{fn}: seq_lens needs num_reqs = {num_reqs} entries, has {seq_lens.numel()}"
        )
    if own_slot_mapping is not None:
        check_tensor(fn, "own_slot_mapping", own_slot_mapping, dtypes=INDEX_DTYPES, ndim=1,
                     contiguous_last=True)
        if not (own_slot_mapping.numel() >= num_tokens):
            raise ConfigError(
                f"{fn}: own_slot_mapping needs num_tokens = {num_tokens} entries, "
                f"has {own_slot_mapping.numel()}"
            )
    cp = check_cp(fn, cp_world_size, cp_rank, cp_interleave)
    check_same_device(fn, block_table=block_table, query_start_loc=query_start_loc,
                      seq_lens=seq_lens, slot_mapping_out=slot_mapping_out,
                      own_slot_mapping=own_slot_mapping)
    return num_reqs, num_tokens, S, C, cp


def compute_compressed_slot_mapping(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping_out: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    storage_block_size: int,
    compress_ratio: int,
    own_slot_mapping: torch.Tensor | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    max_query_len: int | None = None,
) -> None:
    """Fill ``slot_mapping_out`` (int64 ``[>= num_tokens]``, whole buffer written) with the
    compressed-state slots of the tokens that close a ``compress_ratio`` group, -1 elsewhere.

    Args:
        block_table: int32 ``[max_num_reqs, width]`` (manager blocks of the compressed group).
        query_start_loc: int32 ``[>= num_reqs + 1]``; seq_lens: int32 ``[>= num_reqs]``
            (sequence length after this step).
        storage_block_size: states per block (``block_size // compress_ratio``).
        own_slot_mapping: optional int64 ``[>= num_tokens]``, the tokens' own (uncompressed)
            slots; a token whose own slot is < 0 (DCP non-owned, replayed) never writes.
        max_query_len: optional host hint (longest request this step); sizes the launch only.
    """
    fn = "compute_compressed_slot_mapping"
    num_reqs, num_tokens, S, C, (cp, rank, inter) = _check(
        fn, block_table, query_start_loc, seq_lens, slot_mapping_out, num_reqs, num_tokens,
        storage_block_size, compress_ratio, own_slot_mapping, cp_world_size, cp_rank,
        cp_interleave)
    if not use_triton(_compressed_slot_mapping_kernel, block_table):
        _compressed_torch(block_table, query_start_loc, seq_lens, slot_mapping_out, num_reqs,
                          num_tokens, S, C, own_slot_mapping, cp, rank, inter)
        return
    block, warps, splits, pads = token_launch_geometry(num_reqs, num_tokens,
                                                       slot_mapping_out.shape[0], max_query_len)
    has_own = own_slot_mapping is not None
    _compressed_slot_mapping_kernel[(num_reqs + pads, splits)](
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        query_start_loc, seq_lens, own_slot_mapping if has_own else slot_mapping_out,
        slot_mapping_out, num_reqs, num_tokens, slot_mapping_out.shape[0],
        STORAGE_BLOCK=S, COMPRESS_RATIO=C, CP_WORLD=cp, CP_RANK=rank, CP_INTER=inter,
        HAS_OWN=has_own, BLOCK=block, PAD=PAD_BLOCK, num_warps=warps,
    )


def compute_compressed_slot_mapping_ref(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping_out: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    storage_block_size: int,
    compress_ratio: int,
    own_slot_mapping: torch.Tensor | None = None,
    cp_world_size: int = 1,
    cp_rank: int = 0,
    cp_interleave: int = 1,
    max_query_len: int | None = None,
) -> None:
    """Plain torch twin of :func:`compute_compressed_slot_mapping`."""
    fn = "compute_compressed_slot_mapping_ref"
    num_reqs, num_tokens, S, C, (cp, rank, inter) = _check(
        fn, block_table, query_start_loc, seq_lens, slot_mapping_out, num_reqs, num_tokens,
        storage_block_size, compress_ratio, own_slot_mapping, cp_world_size, cp_rank,
        cp_interleave)
    _compressed_torch(block_table, query_start_loc, seq_lens, slot_mapping_out, num_reqs,
                      num_tokens, S, C, own_slot_mapping, cp, rank, inter)


def _compressed_torch(block_table, query_start_loc, seq_lens, out, num_reqs, num_tokens, S, C,
                      own, cp, rank, inter):
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    pad_start = min(int(qsl[num_reqs]), num_tokens)
    out[pad_start:] = PAD_SLOT_ID
    first, last = int(qsl[0]), pad_start
    if num_reqs == 0 or last <= first:
        return
    tok = torch.arange(first, last, device=out.device)
    req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True)
    q_start = qsl[req]
    q_len = qsl[req + 1] - q_start
    pos = seq_lens[:num_reqs].to(torch.int64)[req] - q_len + (tok - q_start)
    ok = (pos >= 0) & (pos <= 2**31 - 1) & (pos % C == C - 1)
    safe = torch.where(ok, pos, 0)
    if own is not None:
        ok &= own[first:last] >= 0
    else:
        voff = safe % (S * C * cp)
        ok &= ((voff // inter) % cp) == rank
    local = safe // (inter * cp) * inter + safe % inter
    c = local // C
    col = c // S
    ok &= col < block_table.shape[1]
    blk = gather_table(block_table, req, col, ok).clamp(min=0)
    out[first:last] = torch.where(ok, blk * S + c % S, PAD_SLOT_ID)
