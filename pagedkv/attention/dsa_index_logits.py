"""The lightning indexer's scores over the paged indexer key cache (Triton), DeepSeek-V3.2.

``indexer_logits(q, weights, k_cache, block_table, req_id_per_token, positions, scale, out)``::

    q                 [T, H, D]   the indexer's query heads (RoPE applied)
    weights           [T, H]      per-head weights (float32)
    k_cache           [N, B, D]   one indexer key per token, slot ``block * B + offset``
                                  (any strides with contiguous rows)
    block_table       [R, W]      int32, the requests' blocks
    req_id_per_token  [>= T]      int32, each token's request row (-1: a padding token)
    positions         [>= T]      int32, each token's position in its request
    out               [T, S]      float32: ``out[t, j] = sum_h weights[t, h] *
                                  relu(scale * q[t, h] . k_j)``, ``k_j`` the key of position
                                  ``j`` of token t's request, for ``j <= positions[t]``;
                                  ``-inf`` elsewhere (future positions, ``j`` past the table,
                                  padding tokens, request rows outside ``[0, R)``)

``S`` (``out.shape[1]``) is the longest request of the step; the caller takes the top-k of
each row (``mla_sparse.DSABackend.index_topk``).

Kernel (``_indexer_logits_kernel``), grid ``(T, cdiv(S, TILE_S))``: one token's ``TILE_S``
positions per program, their keys gathered through the block table (entries never read past
the token's position), all query heads in ``BLOCK_H`` chunks as the rows of a ``tl.dot``
against the key tile, ReLU, the weighted sum over heads in fp32; a tile entirely past the
token's position stores ``-inf`` without loading. ``q`` is cast to the cache dtype for the
products (exact fp32 products for fp32 caches).

``indexer_logits_ref`` is the plain torch twin (same signature; tokens in chunks).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.attention._triton_common import ATTN_DTYPES, dot_precision
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import cdiv, check_same_device, check_tensor, gather_table, next_pow2, use_triton

TILE_S = 64  # positions per program (compiled); the interpreter uses 16


@triton.jit(do_not_specialize=["bt_rows", "bt_width", "num_s"])
def _indexer_logits_kernel(
    q_ptr, q_s0, q_s1,
    w_ptr, w_s0,
    k_ptr, k_sb, k_st,
    bt_ptr, bt_s0, bt_s1, bt_rows, bt_width,
    req_ptr, pos_ptr,
    out_ptr, o_s0, num_s,
    scale,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_HB: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    t = tl.program_id(0)
    js = tl.program_id(1)
    t64 = t.to(tl.int64)
    j = js * TILE + tl.arange(0, TILE)
    in_s = j < num_s
    req = tl.load(req_ptr + t)
    row_ok = (req >= 0) & (req < bt_rows)
    # the scalar row check folded into the position bound (block masks from block compares)
    hi = tl.where(row_ok, tl.load(pos_ptr + t), -1)
    out_row = out_ptr + t64 * o_s0
    if js * TILE > hi:  # the whole tile lies past the token: nothing to read
        tl.store(out_row + j, tl.full([TILE], float("-inf"), tl.float32), mask=in_s)
        return
    col = j // BLOCK_SIZE
    valid = in_s & (j <= hi) & (col < bt_width)
    req64 = tl.where(row_ok, req, 0).to(tl.int64)
    blk = tl.load(bt_ptr + req64 * bt_s0 + col.to(tl.int64) * bt_s1, mask=valid, other=0)
    krow = blk.to(tl.int64) * k_sb + (j - col * BLOCK_SIZE).to(tl.int64) * k_st
    d = tl.arange(0, D_PAD)
    keys = tl.load(k_ptr + krow[:, None] + d[None, :],
                   mask=valid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    acc = tl.zeros([TILE], tl.float32)
    for hb in tl.static_range(NUM_HB):
        h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        h_ok = h < NUM_HEADS
        q = tl.load(q_ptr + t64 * q_s0 + h.to(tl.int64)[:, None] * q_s1 + d[None, :],
                    mask=h_ok[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
        w = tl.load(w_ptr + t64 * w_s0 + h, mask=h_ok, other=0.0).to(tl.float32)
        dots = tl.dot(q.to(k_ptr.dtype.element_ty), tl.trans(keys), input_precision=DOT_PREC)
        acc += tl.sum(tl.maximum(dots * scale, 0.0) * w[:, None], axis=0)
    tl.store(out_row + j, tl.where(valid, acc, float("-inf")), mask=in_s)


def _check(fn, q, weights, k_cache, block_table, req_id_per_token, positions, out):
    check_tensor(fn, "q", q, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "weights", weights, dtypes=(torch.float32,), ndim=2, contiguous_last=True)
    check_tensor(fn, "k_cache", k_cache, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "block_table", block_table, dtypes=(torch.int32,), ndim=2)
    check_tensor(fn, "req_id_per_token", req_id_per_token, dtypes=(torch.int32,), ndim=1,
                 contiguous_last=True)
    check_tensor(fn, "positions", positions, dtypes=(torch.int32,), ndim=1, contiguous_last=True)
    check_tensor(fn, "out", out, dtypes=(torch.float32,), ndim=2, contiguous_last=True)
    t, h, d = q.shape
    if k_cache.shape[2] != d:
        raise ConfigError(f"{fn}: q [T, H, {d}] and the key cache [N, B, {k_cache.shape[2]}] "
                          "must have the same head size")
    if tuple(weights.shape) != (t, h):
        raise ConfigError(f"{fn}: weights {tuple(weights.shape)} must be [T, H] = {(t, h)}")
    if out.shape[0] != t:
        raise ConfigError(f"{fn}: out must have a row per token ({t}), got {tuple(out.shape)}")
    if req_id_per_token.shape[0] < t or positions.shape[0] < t:
        raise ConfigError(f"{fn}: req_id_per_token and positions need an entry per token ({t})")
    check_same_device(fn, q=q, weights=weights, k_cache=k_cache, block_table=block_table,
                      req_id_per_token=req_id_per_token, positions=positions, out=out)


def indexer_logits(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                   block_table: torch.Tensor, req_id_per_token: torch.Tensor,
                   positions: torch.Tensor, scale: float, out: torch.Tensor, *,
                   check: bool = True) -> torch.Tensor:
    """The indexer's score of every (token, position of its request) pair into ``out``
    (module docstring). Without CUDA and without the Triton interpreter: the torch twin."""
    fn = "indexer_logits"
    if check:
        _check(fn, q, weights, k_cache, block_table, req_id_per_token, positions, out)
    t, num_heads, head_dim = q.shape
    num_s = out.shape[1]
    if t == 0 or num_s == 0:
        return out
    if not use_triton(_indexer_logits_kernel, q):
        return indexer_logits_ref(q, weights, k_cache, block_table, req_id_per_token, positions,
                                  scale, out)
    tile = TILE_S if q.is_cuda else 16
    block_h = min(64, max(16, next_pow2(num_heads)))
    _indexer_logits_kernel[(t, cdiv(num_s, tile))](
        q, q.stride(0), q.stride(1),
        weights, weights.stride(0),
        k_cache, k_cache.stride(0), k_cache.stride(1),
        block_table, block_table.stride(0), block_table.stride(1), block_table.shape[0],
        block_table.shape[1],
        req_id_per_token, positions,
        out, out.stride(0), num_s,
        float(scale),
        NUM_HEADS=num_heads, BLOCK_H=block_h, NUM_HB=cdiv(num_heads, block_h),
        HEAD_DIM=head_dim, D_PAD=max(16, next_pow2(head_dim)), BLOCK_SIZE=k_cache.shape[1],
        TILE=tile, DOT_PREC=dot_precision(k_cache.dtype),
        num_warps=4 if q.is_cuda else 1,
    )
    return out


# gathered key / score elements per chunk of tokens in the twin (bounds its temporaries)
_REF_CHUNK_ELEMENTS = 1 << 24


def indexer_logits_ref(q: torch.Tensor, weights: torch.Tensor, k_cache: torch.Tensor,
                       block_table: torch.Tensor, req_id_per_token: torch.Tensor,
                       positions: torch.Tensor, scale: float, out: torch.Tensor, *,
                       check: bool = True) -> torch.Tensor:
    """Plain torch twin of :func:`indexer_logits` (float32): gathers each token's keys
    ``k_cache[block, offset]`` through the block table (masked entries never read)."""
    _check("indexer_logits_ref", q, weights, k_cache, block_table, req_id_per_token,
           positions, out)
    t, num_heads, head_dim = q.shape
    num_s = out.shape[1]
    if t == 0 or num_s == 0:
        return out
    block_size = k_cache.shape[1]
    rows, width = block_table.shape
    req = req_id_per_token[:t].to(torch.int64)
    pos = positions[:t].to(torch.int64)
    j = torch.arange(num_s, device=q.device)
    col = j // block_size
    chunk = max(1, _REF_CHUNK_ELEMENTS // (num_s * max(head_dim, num_heads)))
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        r = req[s:e]
        ok = (((r >= 0) & (r < rows))[:, None] & (j[None, :] <= pos[s:e, None])
              & (col < width)[None, :])
        blk = gather_table(block_table, r[:, None], col[None, :], ok)
        keys = k_cache[blk, (j % block_size)[None, :].expand_as(blk)].float()  # [C, S, D]
        keys = torch.where(ok[..., None], keys, 0.0)
        dots = torch.einsum("chd,csd->chs", q[s:e].float(), keys)
        logits = (torch.relu(dots * scale) * weights[s:e, :, None]).sum(dim=1)
        out[s:e] = torch.where(ok, logits, float("-inf"))
    return out


__all__ = ["TILE_S", "indexer_logits", "indexer_logits_ref"]
