"""Kernel-block subdivision of a block table (reference sec. 11).

When the attention kernel's page (``kernel_block_size``) is smaller than the manager block
``B``, each manager block ``b`` is ``ratio = B // kernel_block_size`` kernel blocks
``b * stride + j`` (``j < ratio``; ``stride = ratio`` for dense layouts, the backend's
``kernel_block_stride`` for packed ones)::

    out[r, c * ratio + j] = block_table[r, c] * stride + j      (r < num_reqs, c < width)

Only the table handed to the attention backend is translated; slot mapping stays in manager
blocks (for dense layouts ``b * B + off == (b * ratio + off // kbs) * kbs + off % kbs``).
The null block 0 maps to kernel blocks ``0 .. ratio-1``, all inside manager block 0.
Columns ``>= width * ratio`` and rows ``>= num_reqs`` of ``out`` are left untouched.
The product is computed in int64 and cast to ``out``'s dtype on store. ``ratio`` and the stride
are compile-time constants of the kernel (static per attention group).
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
    use_triton,
)

_BLOCK = 1024


@triton.jit(
    do_not_specialize=[
        "out_width",
    ]
)
def _kernel_block_table_kernel(
    bt_ptr,
    bt_stride_r,
    bt_stride_c,
    out_ptr,
    out_stride_r,
    out_width,
    RATIO: tl.constexpr,
    STRIDE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = e < out_width
    c = e // RATIO
    j = e - c * RATIO
    blk = tl.load(bt_ptr + r.to(tl.int64) * bt_stride_r + c.to(tl.int64) * bt_stride_c, mask=m,
                  other=0)
    val = blk.to(tl.int64) * STRIDE + j
    tl.store(out_ptr + r.to(tl.int64) * out_stride_r + e, val.to(out_ptr.dtype.element_ty),
             mask=m)


def _check(fn, block_table, num_reqs, ratio, out, block_stride):
    check_tensor(fn, "block_table", block_table, dtypes=INDEX_DTYPES, ndim=2)
    check_tensor(fn, "out", out, dtypes=INDEX_DTYPES, ndim=2, contiguous_last=True)
    ratio = check_int(fn, "ratio", ratio, lo=1)
    stride = ratio if block_stride is None else check_int(fn, "block_stride", block_stride, lo=1)
    num_reqs = check_int(fn, "num_reqs", num_reqs, lo=0,
                         hi=min(block_table.shape[0], out.shape[0]))
    out_width = block_table.shape[1] * ratio
    if not (out.shape[1] >= out_width):
        raise ConfigError(
            f"{fn}: out needs width * ratio = {out_width} columns, has {out.shape[1]}"
        )
    check_same_device(fn, block_table=block_table, out=out)
    return num_reqs, ratio, stride, out_width


def map_to_kernel_block_table(
    block_table: torch.Tensor,
    num_reqs: int,
    ratio: int,
    out: torch.Tensor,
    block_stride: int | None = None,
) -> None:
    """``out[r, c*ratio + j] = block_table[r, c] * stride + j`` for the first ``num_reqs`` rows.

    Args:
        block_table: int32 ``[max_num_reqs, width]`` in manager blocks (any strides).
        num_reqs: rows to translate (host int; pass the padded count under CUDA graphs).
        ratio: manager block size // kernel block size.
        out: int32 ``[>= num_reqs, >= width * ratio]``, columns contiguous.
        block_stride: kernel-block stride of one manager block (default ``ratio``).
    """
    fn = "map_to_kernel_block_table"
    num_reqs, ratio, stride, out_width = _check(fn, block_table, num_reqs, ratio, out,
                                                block_stride)
    if num_reqs == 0 or out_width == 0:
        return
    if not use_triton(_kernel_block_table_kernel, block_table):
        _kernel_block_table_torch(block_table, num_reqs, ratio, out, stride)
        return
    _kernel_block_table_kernel[(num_reqs, cdiv(out_width, _BLOCK))](
        block_table, block_table.stride(0), block_table.stride(1), out, out.stride(0),
        out_width, RATIO=ratio, STRIDE=stride, BLOCK=_BLOCK, num_warps=4,
    )


def map_to_kernel_block_table_ref(
    block_table: torch.Tensor,
    num_reqs: int,
    ratio: int,
    out: torch.Tensor,
    block_stride: int | None = None,
) -> None:
    """Plain torch twin of :func:`map_to_kernel_block_table`."""
    fn = "map_to_kernel_block_table_ref"
    num_reqs, ratio, stride, out_width = _check(fn, block_table, num_reqs, ratio, out,
                                                block_stride)
    if num_reqs == 0 or out_width == 0:
        return
    _kernel_block_table_torch(block_table, num_reqs, ratio, out, stride)


def _kernel_block_table_torch(block_table, num_reqs, ratio, out, stride):
    width = block_table.shape[1]
    j = torch.arange(ratio, device=out.device, dtype=torch.int64)
    val = block_table[:num_reqs].to(torch.int64)[:, :, None] * stride + j
    out[:num_reqs, : width * ratio] = val.reshape(num_reqs, width * ratio).to(out.dtype)
