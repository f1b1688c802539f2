"""Merging two partial attention results by their log-sum-exps (cascade attention).

Attention of a query over keys ``A u B`` (disjoint) from its results over ``A`` and over ``B``
alone: with ``o_A``, ``o_B`` the normalized outputs and ``lse_A``, ``lse_B`` the natural-log
log-sum-exps of the scores (the logs of the two softmax denominators),
``m = max(lse_A, lse_B)``, ``w_A = exp(lse_A - m)``, ``w_B = exp(lse_B - m)``:

    o = (w_A o_A + w_B o_B) / (w_A + w_B)

exact up to rounding, as the two denominators add. Cascade attention takes ``A`` = the
shared prefix (every query of the batch against the prefix blocks, one read of them) and
``B`` = each request's own blocks after it (``pagedkv.attention.triton_backend``).

The first part may come in ``S`` pieces (``out_a [S, T, H, D]``, ``lse_a [S, T, H]``: key splits
of the shared prefix, ``paged_prefill_attention(kv_splits=S)``): all ``S + 1`` parts merge the
same way, ``m`` their maximum and the weights summed.

``merge_attention_states`` (Triton), grid ``(num_rows, cdiv(H, BLOCK_H))``: one program per
row and tile of heads, fp32 arithmetic, the result cast to ``out``'s dtype. A part whose
weight is 0 (``lse = -inf``: no key) contributes nothing, even where its output holds NaN.
``end`` (optional, an int32 device scalar such as ``query_start_loc[num_reqs]``): rows in
``[end, num_rows)`` are zeroed instead (CUDA-graph padding rows: no host value is read, so the
launch can be captured). ``merge_attention_states_ref`` is the plain torch twin.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.attention._triton_common import ATTN_DTYPES
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import check_same_device, check_tensor, next_pow2, use_triton
from pagedkv.kernels.pdl import pdl_launch_args, pdl_prologue


# ``end_ptr`` is a view into ``query_start_loc`` at the step's request count: 16-byte aligned
# or not by that count, which would otherwise be two compiled variants (a W3 run compiled the
# second in its third step)
@triton.jit(do_not_specialize_on_alignment=["end_ptr"])
def _merge_kernel(
    out_ptr, o_s0, o_s1,
    a_ptr, a_split, a_s0, a_s1, a_lse_ptr, a_lse_split, a_lse_s0,
    b_ptr, b_s0, b_s1, b_lse_ptr, b_lse_s0,
    end_ptr,
    HAS_END: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    A_PARTS: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    d = tl.arange(0, D_PAD)
    h_ok = h < NUM_HEADS
    mask = h_ok[:, None] & (d < HEAD_DIM)[None, :]
    out_rows = out_ptr + t * o_s0 + h[:, None] * o_s1 + d[None, :]
    if HAS_END:
        if t >= tl.load(end_ptr):
            tl.store(out_rows, tl.zeros([BLOCK_H, D_PAD], tl.float32).to(out_ptr.dtype.element_ty),
                     mask=mask)
            return
    lse_b = tl.load(b_lse_ptr + t * b_lse_s0 + h, mask=h_ok, other=float("-inf"))
    m = lse_b
    for i in tl.static_range(A_PARTS):
        lse_i = tl.load(a_lse_ptr + i * a_lse_split + t * a_lse_s0 + h, mask=h_ok,
                        other=float("-inf"))
        m = tl.maximum(m, lse_i)
    m = tl.where(m == float("-inf"), 0.0, m)
    # a part of weight 0 adds nothing, NaN in its output included
    w_b = tl.exp(lse_b - m)
    o_b = tl.load(b_ptr + t * b_s0 + h[:, None] * b_s1 + d[None, :], mask=mask, other=0.0)
    num = tl.where(w_b[:, None] > 0, o_b.to(tl.float32) * w_b[:, None], 0.0)
    den = w_b
    for i in tl.static_range(A_PARTS):
        lse_i = tl.load(a_lse_ptr + i * a_lse_split + t * a_lse_s0 + h, mask=h_ok,
                        other=float("-inf"))
        w_i = tl.exp(lse_i - m)
        o_i = tl.load(a_ptr + i * a_split + t * a_s0 + h[:, None] * a_s1 + d[None, :],
                      mask=mask, other=0.0)
        num += tl.where(w_i[:, None] > 0, o_i.to(tl.float32) * w_i[:, None], 0.0)
        den += w_i
    o = tl.where(den[:, None] > 0, num / tl.where(den > 0, den, 1.0)[:, None], 0.0)
    tl.store(out_rows, o.to(out_ptr.dtype.element_ty), mask=mask)


def _split_view(x: torch.Tensor, ndim: int) -> torch.Tensor:
    """``x`` with a leading parts dimension (one part when it has ``ndim`` dims)."""
    return x.unsqueeze(0) if x.dim() == ndim else x


def _check(fn: str, out, out_a, lse_a, out_b, lse_b, num_rows, end) -> None:
    for name, t in (("out", out), ("out_b", out_b)):
        check_tensor(fn, name, t, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "lse_b", lse_b, dtypes=(torch.float32,), ndim=2, contiguous_last=True)
    a_nd = 4 if isinstance(out_a, torch.Tensor) and out_a.dim() == 4 else 3
    check_tensor(fn, "out_a", out_a, dtypes=ATTN_DTYPES, ndim=a_nd, contiguous_last=True)
    check_tensor(fn, "lse_a", lse_a, dtypes=(torch.float32,), ndim=a_nd - 1,
                 contiguous_last=True)
    rows, heads, _ = out.shape
    parts = out_a.shape[0] if a_nd == 4 else 1
    if tuple(out_a.shape[a_nd - 3:]) != tuple(out.shape) or tuple(out_b.shape) != tuple(out.shape):
        raise ConfigError(f"{fn}: out_a {tuple(out_a.shape)} and out_b {tuple(out_b.shape)} "
                          f"must have out's shape {tuple(out.shape)} (out_a: [S, ...] allowed)")
    if tuple(lse_a.shape) != ((parts, rows, heads) if a_nd == 4 else (rows, heads)) \
            or tuple(lse_b.shape) != (rows, heads):
        raise ConfigError(f"{fn}: lse_a {tuple(lse_a.shape)} and lse_b {tuple(lse_b.shape)} "
                          f"must be [num_rows={rows}, num_heads={heads}] (lse_a: [S, ...] as "
                          f"out_a)")
    if not 1 <= parts <= 64:
        raise ConfigError(f"{fn}: out_a has {parts} parts (1 .. 64)")
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or not 0 <= num_rows <= rows:
        raise ConfigError(f"{fn}: num_rows must be a host int in [0, {rows}], got {num_rows!r}")
    tensors = dict(out=out, out_a=out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b)
    if end is not None:
        check_tensor(fn, "end", end, dtypes=(torch.int32,), ndim=1)
        if end.numel() < 1:
            raise ConfigError(f"{fn}: end must hold one int32 value")
        tensors["end"] = end
    check_same_device(fn, **tensors)


def merge_attention_states(
    out: torch.Tensor,
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    num_rows: int,
    end: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Rows ``[0, num_rows)`` of ``out [T, H, D]`` = the merge of ``(out_a, lse_a)`` and
    ``(out_b, lse_b)`` (see the module docstring); ``out`` may be ``out_b`` itself (or
    ``out_a`` of one part). ``lse_*``: float32 ``[T, H]``, natural log; ``out_a`` / ``lse_a``
    may carry a leading dimension of S parts. ``end``: int32 device scalar (first element
    read): rows ``>= end`` are zeroed. Rows ``>= num_rows`` are left as they are. Returns
    ``out``."""
    fn = "merge_attention_states"
    if check:
        _check(fn, out, out_a, lse_a, out_b, lse_b, num_rows, end)
    if num_rows == 0:
        return out
    if not use_triton(_merge_kernel, out):
        return merge_attention_states_ref(out, out_a, lse_a, out_b, lse_b, num_rows, end,
                                          check=False)
    num_heads, head_dim = out.shape[1], out.shape[2]
    block_h = min(16, next_pow2(num_heads))
    d_pad = max(16, next_pow2(head_dim))
    a, la = _split_view(out_a, 3), _split_view(lse_a, 2)
    _merge_kernel[(num_rows, triton.cdiv(num_heads, block_h))](
        out, out.stride(0), out.stride(1),
        a, a.stride(0), a.stride(1), a.stride(2), la, la.stride(0), la.stride(1),
        out_b, out_b.stride(0), out_b.stride(1), lse_b, lse_b.stride(0),
        lse_b if end is None else end,  # never read without end
        HAS_END=end is not None, NUM_HEADS=num_heads, HEAD_DIM=head_dim, D_PAD=d_pad,
        BLOCK_H=block_h, A_PARTS=a.shape[0], num_warps=4 if block_h * d_pad >= 1024 else 1,
        **pdl_launch_args(_merge_kernel, out.device),
    )
    return out


def merge_attention_states_ref(
    out: torch.Tensor,
    out_a: torch.Tensor,
    lse_a: torch.Tensor,
    out_b: torch.Tensor,
    lse_b: torch.Tensor,
    num_rows: int,
    end: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Plain torch twin of :func:`merge_attention_states` (reads ``end`` back to the host)."""
    if check:
        _check("merge_attention_states_ref", out, out_a, lse_a, out_b, lse_b, num_rows, end)
    stop = num_rows if end is None else max(0, min(num_rows, int(end[0])))
    a, la = _split_view(out_a, 3)[:, :stop].float(), _split_view(lse_a, 2)[:, :stop].float()
    parts_o = torch.cat((a, out_b[None, :stop].float()))  # [S + 1, rows, H, D]
    parts_l = torch.cat((la, lse_b[None, :stop].float()))  # [S + 1, rows, H]
    m = parts_l.max(dim=0).values
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    w = torch.exp(parts_l - m)[..., None]
    zero = torch.zeros((), dtype=torch.float32, device=out.device)
    num = torch.where(w > 0, parts_o * w, zero).sum(dim=0)
    den = w.sum(dim=0)
    merged = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), zero)
    out[:stop] = merged.to(out.dtype)
    out[stop:num_rows] = 0
    return out


__all__ = ["merge_attention_states", "merge_attention_states_ref"]
