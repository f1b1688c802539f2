"""Sparse top-k index translation, DeepSeek V3.2 / V4 (reference sec. 17.2).

Each token ``t`` of request ``req_id_per_token[t]`` selected ``K`` positions of its request
(``topk_indices[t, k]``, request-local token indices, -1 = none). They become flat KV slots::

    out[t, k] = block_table[req, idx // BS] * BS + idx % BS

``idx == -1`` (any negative idx) gives -1, and so does a block index past the table width.
A request id outside ``[0, block_table.shape[0])`` gives an all -1 row (never a neighbour's
block). The slot is computed in int64 and cast to ``out``'s dtype on store.

With ``lens`` (int32 ``[>= T]``), ``lens[t]`` receives the number of valid entries of row
``t`` (slots ``>= 0``): the per-token length the DeepSeek-V4 sparse attention reads with the
translated slots. Entries ``lens[T:]`` are left as they are.

``block_size`` is a compile-time constant of the kernel; index math runs in int32 (int64 top-k
indices past ``2**31 - 1`` give -1), the slot in int64.
Launch: grid ``(T,)`` with ``T = topk_indices.shape[0]`` (host shape only); each program walks
its row in ``NUM_CHUNKS`` (a compile-time count) chunks of ``BLOCK_K`` (at most 1024) columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import (
    INDEX_DTYPES,
    cdiv,
    check_int,
    check_same_device,
    check_tensor,
    gather_table,
    next_pow2,
    use_triton,
)


@triton.jit(
    do_not_specialize=[
        "bt_rows",
        "bt_width",
        "num_k",
    ]
)
def _sparse_index_kernel(
    req_ptr,
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    bt_rows,
    bt_width,
    topk_ptr,
    topk_stride_t,
    topk_stride_k,
    out_ptr,
    out_stride_t,
    lens_ptr,
    num_k,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
    HAS_LENS: tl.constexpr,
):
    t = tl.program_id(0)
    req = tl.load(req_ptr + t)
    row_ok = (req >= 0) & (req < bt_rows)
    # A bad row admits no index: the scalar `row_ok` is folded into the upper bound, so that
    # every block mask is built from block comparisons (a scalar predicate broadcast into a
    # block mask has non-boolean data in the Triton interpreter; triton >= 3.9 rejects it).
    idx_hi = tl.where(row_ok, 2147483647, -1)
    t64 = t.to(tl.int64)
    count = tl.zeros((BLOCK_K,), dtype=tl.int32)
    for c in tl.static_range(NUM_CHUNKS):
        k = c * BLOCK_K + tl.arange(0, BLOCK_K)
        in_k = k < num_k
        idx = tl.load(topk_ptr + t64 * topk_stride_t + k.to(tl.int64) * topk_stride_k,
                      mask=in_k, other=-1)
        ok = in_k & (idx >= 0) & (idx <= idx_hi)
        idx = tl.where(ok, idx, 0).to(tl.int32)
        col = idx // BLOCK_SIZE
        ok = ok & (col < bt_width)
        blk = tl.load(bt_ptr + req.to(tl.int64) * bt_stride_r + col.to(tl.int64) * bt_stride_c,
                      mask=ok, other=0)
        slot = tl.where(ok, blk.to(tl.int64) * BLOCK_SIZE + (idx - col * BLOCK_SIZE), -1)
        tl.store(out_ptr + t64 * out_stride_t + k, slot.to(out_ptr.dtype.element_ty), mask=in_k)
        count += tl.where(slot >= 0, 1, 0)
    if HAS_LENS:
        tl.store(lens_ptr + t, tl.sum(count, axis=0))


def _check(fn, req_id_per_token, block_table, topk_indices, block_size, out, lens=None):
    check_tensor(fn, "req_id_per_token", req_id_per_token, dtypes=INDEX_DTYPES, ndim=1,
                 contiguous_last=True)
    check_tensor(fn, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor(fn, "topk_indices", topk_indices, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor(fn, "out", out, dtypes=INDEX_DTYPES, ndim=2, contiguous_last=True)
    block_size = check_int(fn, "block_size", block_size, lo=1)
    if not (tuple(out.shape) == tuple(topk_indices.shape)):
        raise ConfigError(
            f"{fn}: out must have topk_indices' shape {tuple(topk_indices.shape)}, "
            f"got {tuple(out.shape)}"
        )
    if not (req_id_per_token.numel() >= topk_indices.shape[0]):
        raise ConfigError(
            f"{fn}: req_id_per_token needs {topk_indices.shape[0]} entries (one per token), "
            f"has {req_id_per_token.numel()}"
        )
    if lens is not None:
        check_tensor(fn, "lens", lens, dtypes=(torch.int32,), ndim=1, contiguous_last=True)
        if lens.numel() < topk_indices.shape[0]:
            raise ConfigError(
                f"{fn}: lens needs {topk_indices.shape[0]} entries (one per token), "
                f"has {lens.numel()}"
            )
        check_same_device(fn, out=out, lens=lens)
    check_same_device(fn, req_id_per_token=req_id_per_token, block_table=block_table,
                      topk_indices=topk_indices, out=out)
    return block_size


def convert_req_index_to_global_index(
    req_id_per_token: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    lens: torch.Tensor | None = None,
) -> None:
    """Translate request-local top-k token indices into flat KV slots (in place into ``out``).

    Args:
        req_id_per_token: int32 ``[>= T]`` batch row of each token.
        block_table: int32 ``[max_num_reqs, width]``.
        topk_indices: int32 ``[T, K]`` (any strides), -1 = no selection.
        block_size: tokens per block of ``block_table``.
        out: int32 ``[T, K]`` (columns contiguous).
        lens: optional int32 ``[>= T]``: receives each token's number of valid slots.
    """
    fn = "convert_req_index_to_global_index"
    block_size = _check(fn, req_id_per_token, block_table, topk_indices, block_size, out, lens)
    num_t, num_k = topk_indices.shape
    if num_t == 0:
        return
    if num_k == 0:
        if lens is not None:
            lens[:num_t].zero_()
        return
    if not use_triton(_sparse_index_kernel, block_table):
        _sparse_index_torch(req_id_per_token, block_table, topk_indices, block_size, out, lens)
        return
    block_k = min(1024, next_pow2(num_k))
    _sparse_index_kernel[(num_t,)](
        req_id_per_token, block_table, block_table.stride(0), block_table.stride(1),
        block_table.shape[0], block_table.shape[1], topk_indices, topk_indices.stride(0),
        topk_indices.stride(1), out, out.stride(0), out if lens is None else lens, num_k,
        BLOCK_SIZE=block_size, BLOCK_K=block_k, NUM_CHUNKS=cdiv(num_k, block_k),
        HAS_LENS=lens is not None,
        num_warps=4 if block_k >= 512 else 1,
    )


def convert_req_index_to_global_index_ref(
    req_id_per_token: torch.Tensor,
    block_table: torch.Tensor,
    topk_indices: torch.Tensor,
    block_size: int,
    out: torch.Tensor,
    lens: torch.Tensor | None = None,
) -> None:
    """Plain torch twin of :func:`convert_req_index_to_global_index`."""
    fn = "convert_req_index_to_global_index_ref"
    block_size = _check(fn, req_id_per_token, block_table, topk_indices, block_size, out, lens)
    if topk_indices.shape[0] == 0:
        return
    _sparse_index_torch(req_id_per_token, block_table, topk_indices, block_size, out, lens)


def _sparse_index_torch(req_id_per_token, block_table, topk_indices, block_size, out, lens=None):
    num_t = topk_indices.shape[0]
    rows, width = block_table.shape
    req = req_id_per_token[:num_t].to(torch.int64)
    row_ok = (req >= 0) & (req < rows)
    idx = topk_indices.to(torch.int64)
    col = torch.div(idx, block_size, rounding_mode="floor")
    ok = row_ok[:, None] & (idx >= 0) & (idx <= 2**31 - 1) & (col < width)
    blk = gather_table(block_table, req[:, None], col, ok)
    slots = torch.where(ok, blk * block_size + idx % block_size, -1)
    out.copy_(slots.to(out.dtype))
    if lens is not None:
        lens[:num_t] = (slots >= 0).sum(dim=1).to(lens.dtype)
