"""DeepSeek-V4 sliding-window (SWA) index lists (reference sec. 17.3).

For the i-th query token of request ``r`` at ``pos = seq_lens[r] - query_len(r) + i``::

    start = max(pos - (W - 1) - max(left - (W - 1), 0), 0, replay_start)
    end   = pos + 1 + right
    len   = end - start
    indices[k] = block_table[r, (start + k) // B] * B + (start + k) % B   for k < len
    indices[k] = -1                                                       for len <= k < width

``left`` / ``right`` are per-token in-image visibility widths (0 for text), ``replay_start`` is a
per-request lower bound (bounded replay). Tokens whose slot is < 0 get length 0 and an all -1 row.

Launch: grid ``(T,)`` over the rows of ``indices_out`` (T = its first dimension, a host number):
rows ``>= num_tokens`` are CUDA-graph padding and become all -1 with length 0, so the whole
persistent buffer is rewritten every step. Each program finds its request by counting the
request ends ``query_start_loc[1:num_reqs+1] <= t`` in vectorized chunks.

Deliberate, documented choices (only visible for out-of-contract input):
  * ``lens_out`` is clamped to ``[0, width]`` (width = ``indices_out.shape[1]``): a row never
    claims more entries than it holds; ``replay_start > pos`` gives length 0.
  * A block index past the table width gives -1 at that entry (the length still counts it).
  * Tokens no request owns (``t >= query_start_loc[num_reqs]``) are treated as invalid, and so
    are positions outside ``[0, 2**31 - width]`` (the per-entry math is int32).
  * ``block_size`` is a compile-time constant of the kernel (static per group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import (
    INDEX_DTYPES,
    check_int,
    check_same_device,
    check_tensor,
    gather_table,
    next_pow2,
    use_triton,
)

_BLOCK_R = 1024


@triton.jit(
    do_not_specialize=[
        "bt_width",
        "width",
        "num_reqs",
        "num_tokens",
        "window",
    ]
)
def _swa_indices_kernel(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    bt_width,
    qsl_ptr,
    seq_lens_ptr,
    slot_ptr,
    out_ptr,
    out_stride_t,
    lens_ptr,
    replay_ptr,
    left_ptr,
    right_ptr,
    width,
    num_reqs,
    num_tokens,
    window,
    BLOCK_SIZE: tl.constexpr,
    HAS_REPLAY: tl.constexpr,
    HAS_LEFT: tl.constexpr,
    HAS_RIGHT: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0)
    is_tok = t < num_tokens
    # Request of token t: how many requests end at or before t.
    req = tl.full([], 0, tl.int32)
    # (while loops, not range(): the interpreter cannot iterate over a runtime scalar)
    c0 = tl.full([], 0, tl.int32)
    while c0 < num_reqs:
        k = c0 + tl.arange(0, BLOCK_R)
        ends = tl.load(qsl_ptr + 1 + k, mask=k < num_reqs, other=0)
        req += tl.sum(((k < num_reqs) & (ends <= t)).to(tl.int32), axis=0)
        c0 += BLOCK_R
    valid = is_tok & (req < num_reqs)
    req = tl.minimum(req, tl.maximum(num_reqs - 1, 0))
    slot = tl.load(slot_ptr + t, mask=valid, other=-1)
    valid = valid & (slot >= 0)
    q_start = tl.load(qsl_ptr + req, mask=valid, other=0)
    q_end = tl.load(qsl_ptr + req + 1, mask=valid, other=0)
    valid = valid & (q_start <= t)
    seq = tl.load(seq_lens_ptr + req, mask=valid, other=0).to(tl.int64)
    pos = seq - (q_end - q_start) + (t - q_start)
    valid = valid & (pos >= 0) & (pos <= 2147483647 - width)
    lo = pos - (window - 1)
    if HAS_LEFT:
        left = tl.load(left_ptr + t, mask=valid, other=0).to(tl.int64)
        lo = lo - tl.maximum(left - (window - 1), 0)
    start = tl.maximum(lo, 0)
    if HAS_REPLAY:
        start = tl.maximum(start, tl.load(replay_ptr + req, mask=valid, other=0).to(tl.int64))
    end = pos + 1
    if HAS_RIGHT:
        end = end + tl.load(right_ptr + t, mask=valid, other=0).to(tl.int64)
    length = tl.minimum(tl.maximum(end - start, 0), width)
    length = tl.where(valid, length, 0)
    tl.store(lens_ptr + t, length.to(lens_ptr.dtype.element_ty))
    row_ptr = bt_ptr + req.to(tl.int64) * bt_stride_r
    out_row = out_ptr + t.to(tl.int64) * out_stride_t
    # start <= pos < 2**31 for valid rows (length > 0), so the per-entry math runs in int32.
    start32 = tl.where(length > 0, start, 0).to(tl.int32)
    k0 = tl.full([], 0, tl.int32)
    while k0 < width:
        k = k0 + tl.arange(0, BLOCK_W)
        p = start32 + k
        col = p // BLOCK_SIZE
        ok = (k < length) & (col < bt_width)
        blk = tl.load(row_ptr + col.to(tl.int64) * bt_stride_c, mask=ok, other=0)
        idx = tl.where(ok, blk.to(tl.int64) * BLOCK_SIZE + (p - col * BLOCK_SIZE), -1)
        tl.store(out_row + k, idx.to(out_ptr.dtype.element_ty), mask=k < width)
        k0 += BLOCK_W


def _check(fn, block_table, query_start_loc, seq_lens, slot_mapping, indices_out, lens_out,
           num_reqs, num_tokens, window, block_size, replay_start, left, right):
    check_tensor(fn, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    for name, t in (("query_start_loc", query_start_loc), ("seq_lens", seq_lens),
                    ("slot_mapping", slot_mapping), ("lens_out", lens_out)):
        check_tensor(fn, name, t, dtypes=INDEX_DTYPES, ndim=1, contiguous_last=True)
    check_tensor(fn, "indices_out", indices_out, dtypes=INDEX_DTYPES, ndim=2,
                 contiguous_last=True)
    rows = indices_out.shape[0]
    num_reqs = check_int(fn, "num_reqs", num_reqs, lo=0, hi=block_table.shape[0])
    num_tokens = check_int(fn, "num_tokens", num_tokens, lo=0, hi=rows)
    window = check_int(fn, "window", window, lo=1)
    block_size = check_int(fn, "block_size", block_size, lo=1)
    if not (lens_out.numel() >= rows):
        raise ConfigError(
            f"{fn}: lens_out needs indices_out.shape[0] = {rows} entries, has {lens_out.numel()}"
        )
    if not (query_start_loc.numel() >= num_reqs + 1):
        raise ConfigError(
            f"{fn}: query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries, "
            f"has {query_start_loc.numel()}"
        )
    if not (seq_lens.numel() >= num_reqs):
        raise ConfigError(
            f"{fn}: seq_lens needs num_reqs = {num_reqs} entries, has {seq_lens.numel()}"
        )
    if not (slot_mapping.numel() >= num_tokens):
        raise ConfigError(
            f"{fn}: slot_mapping needs num_tokens = {num_tokens} entries, "
            f"has {slot_mapping.numel()}"
        )
    if replay_start is not None:
        check_tensor(fn, "replay_start", replay_start, dtypes=INDEX_DTYPES, ndim=1,
                     contiguous_last=True)
        if not (replay_start.numel() >= num_reqs):
            raise ConfigError(
                f"{fn}: replay_start is per request and needs {num_reqs} entries"
            )
    for name, t in (("left", left), ("right", right)):
        if t is not None:
            check_tensor(fn, name, t, dtypes=INDEX_DTYPES, ndim=1, contiguous_last=True)
            if not (t.numel() >= num_tokens):
                raise ConfigError(
                    f"{fn}: {name} is per token and needs {num_tokens} entries"
                )
    check_same_device(fn, block_table=block_table, query_start_loc=query_start_loc,
                      seq_lens=seq_lens, slot_mapping=slot_mapping, indices_out=indices_out,
                      lens_out=lens_out, replay_start=replay_start, left=left, right=right)
    return num_reqs, num_tokens, window, block_size


def compute_swa_indices(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    indices_out: torch.Tensor,
    lens_out: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    window: int,
    block_size: int,
    replay_start: torch.Tensor | None = None,
    left: torch.Tensor | None = None,
    right: torch.Tensor | None = None,
) -> None:
    """Write every token's SWA KV slot list into ``indices_out [T, width]`` and its length
    into ``lens_out [T]`` (rows ``>= num_tokens``: all -1, length 0).

    Args:
        block_table: int32 ``[max_num_reqs, table_width]`` of the SWA group.
        query_start_loc: int32 ``[>= num_reqs + 1]``; seq_lens: int32 ``[>= num_reqs]``.
        slot_mapping: int64 ``[>= num_tokens]``: the tokens' own slots (< 0: invalid token).
        indices_out: int32 (or int64) ``[T, width]``, ``T >= num_tokens``; lens_out int32 ``[T]``.
        window: W; block_size: B (tokens per block of the SWA group).
        replay_start: optional ``[num_reqs]`` lower bound of ``start`` per request.
        left, right: optional per-token ``[num_tokens]`` in-image visibility widths.
    """
    fn = "compute_swa_indices"
    num_reqs, num_tokens, window, block_size = _check(
        fn, block_table, query_start_loc, seq_lens, slot_mapping, indices_out, lens_out,
        num_reqs, num_tokens, window, block_size, replay_start, left, right)
    rows, width = indices_out.shape
    if rows == 0:
        return
    if not use_triton(_swa_indices_kernel, block_table):
        _swa_torch(block_table, query_start_loc, seq_lens, slot_mapping, indices_out, lens_out,
                   num_reqs, num_tokens, window, block_size, replay_start, left, right)
        return
    dummy = slot_mapping
    _swa_indices_kernel[(rows,)](
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        query_start_loc, seq_lens, slot_mapping, indices_out, indices_out.stride(0), lens_out,
        replay_start if replay_start is not None else dummy,
        left if left is not None else dummy,
        right if right is not None else dummy,
        width, num_reqs, num_tokens, window, BLOCK_SIZE=block_size,
        HAS_REPLAY=replay_start is not None, HAS_LEFT=left is not None,
        HAS_RIGHT=right is not None, BLOCK_R=min(_BLOCK_R, next_pow2(max(num_reqs, 16))),
        BLOCK_W=min(1024, next_pow2(max(width, 16))), num_warps=4 if width > 256 else 1,
    )


def compute_swa_indices_ref(
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    slot_mapping: torch.Tensor,
    indices_out: torch.Tensor,
    lens_out: torch.Tensor,
    num_reqs: int,
    num_tokens: int,
    window: int,
    block_size: int,
    replay_start: torch.Tensor | None = None,
    left: torch.Tensor | None = None,
    right: torch.Tensor | None = None,
) -> None:
    """Plain torch twin of :func:`compute_swa_indices`."""
    fn = "compute_swa_indices_ref"
    num_reqs, num_tokens, window, block_size = _check(
        fn, block_table, query_start_loc, seq_lens, slot_mapping, indices_out, lens_out,
        num_reqs, num_tokens, window, block_size, replay_start, left, right)
    _swa_torch(block_table, query_start_loc, seq_lens, slot_mapping, indices_out, lens_out,
               num_reqs, num_tokens, window, block_size, replay_start, left, right)


def _swa_torch(block_table, query_start_loc, seq_lens, slot_mapping, indices_out, lens_out,
               num_reqs, num_tokens, window, block_size, replay_start, left, right):
    rows, width = indices_out.shape
    dev = indices_out.device
    indices_out.fill_(-1)
    lens_out[:rows] = 0
    if num_reqs == 0 or num_tokens == 0:
        return
    tok = torch.arange(num_tokens, device=dev)
    qsl = query_start_loc[: num_reqs + 1].to(torch.int64)
    req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True)
    valid = req < num_reqs
    req = req.clamp(max=num_reqs - 1)
    valid &= slot_mapping[:num_tokens] >= 0
    q_start = qsl[req]
    valid &= q_start <= tok
    q_len = qsl[req + 1] - q_start
    pos = seq_lens[:num_reqs].to(torch.int64)[req] - q_len + (tok - q_start)
    valid &= (pos >= 0) & (pos <= 2**31 - 1 - width)
    lo = pos - (window - 1)
    if left is not None:
        lo = lo - (left[:num_tokens].to(torch.int64) - (window - 1)).clamp(min=0)
    start = lo.clamp(min=0)
    if replay_start is not None:
        start = torch.maximum(start, replay_start[:num_reqs].to(torch.int64)[req])
    end = pos + 1
    if right is not None:
        end = end + right[:num_tokens].to(torch.int64)
    length = torch.where(valid, (end - start).clamp(min=0, max=width), 0)
    lens_out[:num_tokens] = length.to(lens_out.dtype)
    k = torch.arange(width, device=dev)
    p = start[:, None] + k[None, :]
    col = p // block_size
    ok = (k[None, :] < length[:, None]) & (col < block_table.shape[1])
    blk = gather_table(block_table, req[:, None], col, ok)
    idx = torch.where(ok, blk * block_size + p % block_size, -1)
    indices_out[:num_tokens] = idx.to(indices_out.dtype)
