"""One tile of the decode kernels' online softmax (shared by ``triton_decode.py`` and
``triton_decode_streamk.py``)."""

import triton
import triton.language as tl


@triton.jit
def _decode_tile(acc, l_i, m_i, q, t, seq_len, k_ptr, v_ptr, bt_row, bt_width, c_sb, c_st,
                 head_off, d, scale_log2, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
                 BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Positions ``[t * TILE_N, (t + 1) * TILE_N)`` of the online softmax."""
    n = t * TILE_N + tl.arange(0, TILE_N)
    col = n // BLOCK_SIZE
    valid = (n < seq_len) & (col < bt_width)
    blk = tl.load(bt_row + col, mask=valid, other=0).to(tl.int64)
    tok = blk * c_sb + (n % BLOCK_SIZE).to(tl.int64) * c_st + head_off
    if HEAD_DIM == D_PAD:
        kv_mask = valid[:, None]
    else:
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + tok[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + tok[:, None] + d[None, :], mask=kv_mask, other=0.0)
    scores = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * scale_log2
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new
