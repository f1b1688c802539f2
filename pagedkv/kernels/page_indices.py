"""FlashInfer-style paged-KV CSR: ``indptr``, ``indices``, ``last_page_len`` (sec. 15 and 13).

For request ``r < num_reqs``: ``pages = ceil(seq_lens[r] / page_size)``,
``indptr[r + 1] = indptr[r] + pages`` (``indptr[0] = 0``),
``indices[indptr[r] : indptr[r + 1]] = block_table[r, :pages]`` and
``last_page_len = seq % page_size``, or ``page_size`` when that is 0 and ``seq > 0``, or 0 when
``seq == 0``. Padded requests ``r in [num_reqs, num_reqs_padded)`` get 0 pages, last_page_len 0,
and ``indptr`` repeats its last value (CUDA-graph padding, sec. 13).

One launch, grid ``(cdiv(max(num_reqs_padded, 1), ROWS),)`` with ``ROWS = 1`` for batches up to
128 requests and 16 above: program ``i`` handles request rows ``[ROWS i, ROWS i + ROWS)``; it
computes its own offset ``indptr[ROWS i]`` on the device by summing the page counts of the rows
before it in vectorized chunks, takes a cumsum inside its tile, then copies its rows' pages as
one 2-D tile. No host sync, no cumsum launch; the grid depends only
on host integers.

``build_page_indices_groups`` builds the CSR of every KV-cache group in one launch (grid
``(cdiv(max(num_reqs_padded, 1), ROWS), G)``) from the multi-group block-table buffer (group ``g`` in
columns ``[group_col_start[g], + group_width[g])``, page size ``group_page_size[g]``) into
stacked outputs ``[G, ...]``; all groups share ``seq_lens``. Per group it equals
``build_page_indices`` on that group's column view.

Deliberate, documented choices (only visible for out-of-contract input):
  * Negative ``seq_lens`` count as 0.
  * A page column past the block table's width is written as -1 (never a neighbour row's block).
  * ``page_size`` is a compile-time constant of the kernel (static per group).
  * ``build_page_indices`` rejects an ``indices_out`` smaller than the table can need
    (``num_reqs * width`` pages, a host-side check); pages past it, which only seq_lens longer
    than the table give, are dropped (``indptr`` still tells the full count).
  * Zero-size tensors (an empty batch, a width-0 table, arrays made from empty numpy arrays)
    are accepted; such calls run the torch twin (the data pointer of an empty device tensor is
    null, which a Triton launch rejects).
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


@triton.jit
def _csr_tile(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    col_limit,
    seq_lens_ptr,
    indptr_ptr,
    indices_ptr,
    last_ptr,
    tile,
    num_reqs,
    num_reqs_padded,
    max_pages,
    page_size,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """CSR entries of request rows ``[tile * ROWS, (tile + 1) * ROWS)``: ``indptr[r + 1]`` (and
    ``indptr[0]`` for tile 0), ``last_page_len[r]`` and the rows' pages. The offset of the
    tile is recomputed here from the page counts of the real rows before it (vectorized
    chunks), so no cross-program sync is needed; inside the tile a cumsum gives each row's
    start, and the pages of all ROWS rows are copied as one 2-D tile per BLOCK_P columns."""
    r0 = tile * ROWS
    n_prev = tl.minimum(r0, num_reqs)
    offset = tl.full([], 0, tl.int32)
    c0 = tl.full([], 0, tl.int32)
    while c0 < n_prev:
        k = c0 + tl.arange(0, BLOCK_R)
        sl = tl.load(seq_lens_ptr + k, mask=k < n_prev, other=0)
        sl = tl.maximum(sl, 0).to(tl.int32)
        offset += tl.sum((sl + page_size - 1) // page_size, axis=0)
        c0 += BLOCK_R
    rows = r0 + tl.arange(0, ROWS)
    in_batch = rows < num_reqs_padded
    seq = tl.load(seq_lens_ptr + rows, mask=rows < num_reqs, other=0)
    seq = tl.maximum(seq, 0).to(tl.int32)
    pages = (seq + page_size - 1) // page_size
    ends = offset + tl.cumsum(pages, axis=0)
    starts = ends - pages
    last = tl.where(seq > 0, seq - (pages - 1) * page_size, 0)
    tl.store(indptr_ptr + rows + 1, ends.to(indptr_ptr.dtype.element_ty), mask=in_batch)
    tl.store(last_ptr + rows, last.to(last_ptr.dtype.element_ty), mask=in_batch)
    tl.store(indptr_ptr + r0, tl.zeros([], indptr_ptr.dtype.element_ty), mask=r0 == 0)
    row_ptr = bt_ptr + rows.to(tl.int64)[:, None] * bt_stride_r
    dst = indices_ptr + starts.to(tl.int64)[:, None]
    npages = pages[:, None]
    most = tl.max(pages, axis=0)
    p0 = tl.full([], 0, tl.int32)
    while p0 < most:
        p = p0 + tl.arange(0, BLOCK_P)[None, :]
        keep = (p < npages) & (starts[:, None] + p < max_pages)
        blk = tl.load(row_ptr + p.to(tl.int64) * bt_stride_c, mask=keep & (p < col_limit),
                      other=-1)
        tl.store(dst + p, blk.to(indices_ptr.dtype.element_ty), mask=keep)
        p0 += BLOCK_P


@triton.jit(do_not_specialize=["num_reqs", "num_reqs_padded"])
def _page_indices_kernel(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    bt_width,
    seq_lens_ptr,
    indptr_ptr,
    indices_ptr,
    last_ptr,
    num_reqs,
    num_reqs_padded,
    max_pages,
    PAGE_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One group; grid ``(cdiv(max(num_reqs_padded, 1), ROWS),)``."""
    _csr_tile(bt_ptr, bt_stride_r, bt_stride_c, bt_width, seq_lens_ptr, indptr_ptr,
              indices_ptr, last_ptr, tl.program_id(0), num_reqs, num_reqs_padded, max_pages,
              PAGE_SIZE, ROWS, BLOCK_R, BLOCK_P)


@triton.jit
def _csr_group_program(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    bt_width,
    col_start_ptr,
    width_ptr,
    page_size_ptr,
    seq_lens_ptr,
    indptr_ptr,
    indptr_stride_g,
    indices_ptr,
    indices_stride_g,
    last_ptr,
    last_stride_g,
    num_reqs,
    num_reqs_padded,
    max_pages,
    tile,
    g,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """CSR row tile ``tile`` of group ``g`` (multi-group buffer, stacked outputs)."""
    g = g.to(tl.int64)
    col_start = tl.load(col_start_ptr + g)
    col_limit = tl.minimum(tl.load(width_ptr + g), bt_width - col_start)
    _csr_tile(bt_ptr + col_start.to(tl.int64) * bt_stride_c, bt_stride_r, bt_stride_c,
              col_limit, seq_lens_ptr, indptr_ptr + g * indptr_stride_g,
              indices_ptr + g * indices_stride_g, last_ptr + g * last_stride_g, tile, num_reqs,
              num_reqs_padded, max_pages, tl.load(page_size_ptr + g), ROWS, BLOCK_R, BLOCK_P)


@triton.jit(do_not_specialize=["num_reqs", "num_reqs_padded"])
def _page_indices_groups_kernel(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    bt_width,
    col_start_ptr,
    width_ptr,
    page_size_ptr,
    seq_lens_ptr,
    indptr_ptr,
    indptr_stride_g,
    indices_ptr,
    indices_stride_g,
    last_ptr,
    last_stride_g,
    num_reqs,
    num_reqs_padded,
    max_pages,
    ROWS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """All groups; grid ``(cdiv(max(num_reqs_padded, 1), ROWS), G)``."""
    _csr_group_program(bt_ptr, bt_stride_r, bt_stride_c, bt_width, col_start_ptr, width_ptr,
                       page_size_ptr, seq_lens_ptr, indptr_ptr, indptr_stride_g, indices_ptr,
                       indices_stride_g, last_ptr, last_stride_g, num_reqs, num_reqs_padded,
                       max_pages, tl.program_id(0), tl.program_id(1), ROWS, BLOCK_R, BLOCK_P)


def _csr_rows(num_reqs_padded: int) -> int:
    """Request rows per CSR program: 1 for small batches (lowest latency), 16 for large ones
    (the prefix sum over earlier rows is then done once per 16 rows)."""
    return 1 if num_reqs_padded <= 128 else 16


def csr_tiles(num_reqs_padded: int) -> int:
    """Programs per group (at least one, which also writes indptr[0])."""
    return cdiv(max(num_reqs_padded, 1), _csr_rows(num_reqs_padded))


def csr_meta(num_reqs: int, num_reqs_padded: int) -> dict:
    """Compile-time tile sizes and warps of the CSR programs (host integers only)."""
    rows = _csr_rows(num_reqs_padded)
    return dict(ROWS=rows, BLOCK_R=min(1024, next_pow2(max(num_reqs, 16))),
                BLOCK_P=256 if rows == 1 else 128, num_warps=4)


def _check(fn, block_table, seq_lens, page_size, num_reqs, num_reqs_padded, indptr_out,
           indices_out, last_page_len_out):
    check_tensor(fn, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    for name, t in (("seq_lens", seq_lens), ("indptr_out", indptr_out),
                    ("indices_out", indices_out), ("last_page_len_out", last_page_len_out)):
        check_tensor(fn, name, t, dtypes=INDEX_DTYPES, ndim=1, contiguous_last=True)
    page_size = check_int(fn, "page_size", page_size, lo=1)
    num_reqs = check_int(fn, "num_reqs", num_reqs, lo=0, hi=block_table.shape[0])
    num_reqs_padded = check_int(fn, "num_reqs_padded", num_reqs_padded, lo=num_reqs)
    if not (seq_lens.numel() >= num_reqs):
        raise ConfigError(
            f"{fn}: seq_lens needs num_reqs = {num_reqs} entries, has {seq_lens.numel()}"
        )
    if not (indptr_out.numel() >= num_reqs_padded + 1):
        raise ConfigError(
            f"{fn}: indptr_out needs num_reqs_padded + 1 = {num_reqs_padded + 1} entries, "
            f"has {indptr_out.numel()}"
        )
    if not (last_page_len_out.numel() >= num_reqs_padded):
        raise ConfigError(
            f"{fn}: last_page_len_out needs num_reqs_padded = {num_reqs_padded} entries, "
            f"has {last_page_len_out.numel()}"
        )
    need = num_reqs * block_table.shape[1]
    if indices_out.numel() < need:
        raise ConfigError(
            f"{fn}: indices_out has {indices_out.numel()} entries, the table can need "
            f"num_reqs x width = {num_reqs} x {block_table.shape[1]} = {need}; size it for "
            "max_num_reqs x max pages per request"
        )
    check_same_device(fn, block_table=block_table, seq_lens=seq_lens, indptr_out=indptr_out,
                      indices_out=indices_out, last_page_len_out=last_page_len_out)
    return page_size, num_reqs, num_reqs_padded


def build_page_indices(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_reqs: int,
    num_reqs_padded: int,
    indptr_out: torch.Tensor,
    indices_out: torch.Tensor,
    last_page_len_out: torch.Tensor,
) -> None:
    """Build the CSR page index in one launch.

    Args:
        block_table: int32 ``[max_num_reqs, width]`` (pages = manager or kernel blocks).
        seq_lens: int32 ``[>= num_reqs]`` (DCP-local lengths under DCP).
        page_size: tokens per page.
        num_reqs, num_reqs_padded: real and CUDA-graph-padded request counts (host ints).
        indptr_out: int32 ``[>= num_reqs_padded + 1]``; indices_out: int32 ``[max_pages]``;
        last_page_len_out: int32 ``[>= num_reqs_padded]``. Entries past those ranges (and
        ``indices_out`` past ``indptr[num_reqs]``) are left untouched.
    """
    fn = "build_page_indices"
    page_size, num_reqs, num_reqs_padded = _check(
        fn, block_table, seq_lens, page_size, num_reqs, num_reqs_padded, indptr_out,
        indices_out, last_page_len_out)
    if (not use_triton(_page_indices_kernel, block_table) or block_table.numel() == 0
            or indices_out.numel() == 0 or seq_lens.numel() == 0):
        _page_indices_torch(block_table, seq_lens, page_size, num_reqs, num_reqs_padded,
                            indptr_out, indices_out, last_page_len_out)
        return
    _page_indices_kernel[(csr_tiles(num_reqs_padded),)](
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        seq_lens, indptr_out, indices_out, last_page_len_out, num_reqs,
        num_reqs_padded, indices_out.numel(), PAGE_SIZE=page_size,
        **csr_meta(num_reqs, num_reqs_padded),
    )


def build_page_indices_ref(
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    page_size: int,
    num_reqs: int,
    num_reqs_padded: int,
    indptr_out: torch.Tensor,
    indices_out: torch.Tensor,
    last_page_len_out: torch.Tensor,
) -> None:
    """Plain torch twin of :func:`build_page_indices`."""
    fn = "build_page_indices_ref"
    page_size, num_reqs, num_reqs_padded = _check(
        fn, block_table, seq_lens, page_size, num_reqs, num_reqs_padded, indptr_out,
        indices_out, last_page_len_out)
    _page_indices_torch(block_table, seq_lens, page_size, num_reqs, num_reqs_padded,
                        indptr_out, indices_out, last_page_len_out)


def _page_indices_torch(block_table, seq_lens, page_size, num_reqs, num_reqs_padded,
                        indptr_out, indices_out, last_page_len_out):
    dev = indptr_out.device
    seq = torch.zeros(num_reqs_padded, dtype=torch.int64, device=dev)
    seq[:num_reqs] = seq_lens[:num_reqs].to(torch.int64).clamp(min=0)
    pages = (seq + page_size - 1) // page_size
    indptr = torch.zeros(num_reqs_padded + 1, dtype=torch.int64, device=dev)
    indptr[1:] = torch.cumsum(pages, 0)
    indptr_out[: num_reqs_padded + 1] = indptr.to(indptr_out.dtype)
    last = torch.where(seq > 0, seq - (pages - 1) * page_size, 0)
    last_page_len_out[:num_reqs_padded] = last.to(last_page_len_out.dtype)
    total = int(indptr[num_reqs])
    if total == 0:
        return
    req = torch.repeat_interleave(torch.arange(num_reqs, device=dev), pages[:num_reqs])
    col = torch.arange(total, device=dev) - indptr[req]
    ok = col < block_table.shape[1]
    blk = torch.where(ok, gather_table(block_table, req, col, ok), -1)
    n = min(total, indices_out.numel())
    indices_out[:n] = blk[:n].to(indices_out.dtype)


def _check_groups(fn, block_table, group_col_start, group_width, group_page_size, seq_lens,
                  num_reqs, num_reqs_padded, indptr_out, indices_out, last_page_len_out):
    check_tensor(fn, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    for name, t in (("group_col_start", group_col_start), ("group_width", group_width),
                    ("group_page_size", group_page_size), ("seq_lens", seq_lens)):
        check_tensor(fn, name, t, dtypes=INDEX_DTYPES, ndim=1, contiguous_last=True)
    for name, t in (("indptr_out", indptr_out), ("indices_out", indices_out),
                    ("last_page_len_out", last_page_len_out)):
        check_tensor(fn, name, t, dtypes=INDEX_DTYPES, ndim=2, contiguous_last=True)
    num_groups = group_col_start.numel()
    for name, t in (("group_width", group_width), ("group_page_size", group_page_size),
                    ("indptr_out", indptr_out), ("indices_out", indices_out),
                    ("last_page_len_out", last_page_len_out)):
        if t.shape[0] != num_groups:
            raise ConfigError(f"{fn}: {name} needs {num_groups} groups (first dimension), "
                              f"has shape {tuple(t.shape)}")
    if num_groups < 1:
        raise ConfigError(f"{fn}: at least one KV-cache group is needed")
    num_reqs = check_int(fn, "num_reqs", num_reqs, lo=0, hi=block_table.shape[0])
    num_reqs_padded = check_int(fn, "num_reqs_padded", num_reqs_padded, lo=num_reqs)
    if seq_lens.numel() < num_reqs:
        raise ConfigError(
            f"{fn}: seq_lens needs num_reqs = {num_reqs} entries, has {seq_lens.numel()}")
    if indptr_out.shape[1] < num_reqs_padded + 1:
        raise ConfigError(f"{fn}: indptr_out needs num_reqs_padded + 1 = {num_reqs_padded + 1} "
                          f"columns, has {indptr_out.shape[1]}")
    if last_page_len_out.shape[1] < num_reqs_padded:
        raise ConfigError(f"{fn}: last_page_len_out needs num_reqs_padded = {num_reqs_padded} "
                          f"columns, has {last_page_len_out.shape[1]}")
    check_same_device(fn, block_table=block_table, group_col_start=group_col_start,
                      group_width=group_width, group_page_size=group_page_size,
                      seq_lens=seq_lens, indptr_out=indptr_out, indices_out=indices_out,
                      last_page_len_out=last_page_len_out)
    return num_groups, num_reqs, num_reqs_padded


def build_page_indices_groups(
    block_table: torch.Tensor,
    group_col_start: torch.Tensor,
    group_width: torch.Tensor,
    group_page_size: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    num_reqs_padded: int,
    indptr_out: torch.Tensor,
    indices_out: torch.Tensor,
    last_page_len_out: torch.Tensor,
) -> None:
    """The CSR of every KV-cache group in one launch.

    Args:
        block_table: int32 ``[max_num_reqs, total_width]`` (all groups side by side).
        group_col_start, group_width, group_page_size: int32 ``[G]`` on the table's device
            (page sizes >= 1; not checked on the device).
        seq_lens: int32 ``[>= num_reqs]``, shared by all groups.
        indptr_out: int32 ``[G, >= num_reqs_padded + 1]``; indices_out: int32
            ``[G, max_pages]``; last_page_len_out: int32 ``[G, >= num_reqs_padded]``
            (row strides free, columns contiguous).
    """
    fn = "build_page_indices_groups"
    num_groups, num_reqs, num_reqs_padded = _check_groups(
        fn, block_table, group_col_start, group_width, group_page_size, seq_lens, num_reqs,
        num_reqs_padded, indptr_out, indices_out, last_page_len_out)
    if (not use_triton(_page_indices_groups_kernel, block_table) or block_table.numel() == 0
            or indices_out.numel() == 0 or seq_lens.numel() == 0):
        _page_indices_groups_torch(block_table, group_col_start, group_width, group_page_size,
                                   seq_lens, num_reqs, num_reqs_padded, indptr_out,
                                   indices_out, last_page_len_out)
        return
    _page_indices_groups_kernel[(csr_tiles(num_reqs_padded), num_groups)](
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[1],
        group_col_start, group_width, group_page_size, seq_lens,
        indptr_out, indptr_out.stride(0), indices_out, indices_out.stride(0),
        last_page_len_out, last_page_len_out.stride(0), num_reqs, num_reqs_padded,
        indices_out.shape[1], **csr_meta(num_reqs, num_reqs_padded),
    )


def build_page_indices_groups_ref(
    block_table: torch.Tensor,
    group_col_start: torch.Tensor,
    group_width: torch.Tensor,
    group_page_size: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    num_reqs_padded: int,
    indptr_out: torch.Tensor,
    indices_out: torch.Tensor,
    last_page_len_out: torch.Tensor,
) -> None:
    """Plain torch twin of :func:`build_page_indices_groups`."""
    _, num_reqs, num_reqs_padded = _check_groups(
        "build_page_indices_groups_ref", block_table, group_col_start, group_width,
        group_page_size, seq_lens, num_reqs, num_reqs_padded, indptr_out, indices_out,
        last_page_len_out)
    _page_indices_groups_torch(block_table, group_col_start, group_width, group_page_size,
                               seq_lens, num_reqs, num_reqs_padded, indptr_out, indices_out,
                               last_page_len_out)


def _page_indices_groups_torch(block_table, group_col_start, group_width, group_page_size,
                               seq_lens, num_reqs, num_reqs_padded, indptr_out, indices_out,
                               last_page_len_out):
    total_width = block_table.shape[1]
    for g, (start, width, page) in enumerate(zip(group_col_start.tolist(),
                                                 group_width.tolist(),
                                                 group_page_size.tolist())):
        cols = block_table[:, start: start + max(0, min(width, total_width - start))]
        _page_indices_torch(cols, seq_lens, page, num_reqs, num_reqs_padded, indptr_out[g],
                            indices_out[g], last_page_len_out[g])
