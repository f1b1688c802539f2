"""Paged MLA decode (Triton): absorbed queries over the latent cache, one query token per request.

``mla_decode_attention(q, kv_cache, block_table, query_start_loc, seq_lens, num_reqs, scale,
out, kv_lora_rank=L)``::

    q        [T, H, L + R]   absorbed queries: per head [W_UK^T q_nope | q_pe]
    kv_cache [N, B, L + R]   one latent row [c | k_pe] per token (``mla.py``)
    out      [T, H, L]       per head sum_t softmax_t(scale q . row_t) c_t  (the latent output;
                             the caller applies W_UV)

Request ``r``'s query row is ``query_start_loc[r]``; it attends to its ``seq_lens[r]``
positions, position ``n`` at slot ``block_table[r, n // B] * B + n % B``. Only requests with
exactly one query token are served; every other row of ``out`` is left untouched (a mixed
batch hands its longer requests to another path). A decode request needs ``seq_lens[r] >= 1``.

Kernel (``_mla_decode_kernel``), grid ``(num_reqs, cdiv(H, BLOCK_H), num_splits)``:
  * every query head reads the same one latent "KV head", so a program packs ``BLOCK_H`` query
    heads (16 by default; heads past ``H`` masked) as the rows of its ``tl.dot`` tiles, GQA
    style: each latent tile loaded from the cache serves ``BLOCK_H`` heads, as keys (scores
    ``q_c c^T + q_r k_pe^T``, the two parts padded to powers of two separately: 512 + 64 at
    DeepSeek-V3's size, no padding to 1024) and, its first ``L`` columns, as values
    (``acc += P c``);
  * tiles of ``TILE_N`` positions, the block-table entry gathered per position (any block size;
    positions ``>= seq_len`` or columns past the table width are masked and never read);
    online softmax in base 2, fp32 accumulation, ``q`` cast to the cache dtype for the
    products (exact fp32 products for fp32 caches);
  * split-KV as the paged decode kernel (``triton_decode``): the same split policy
    (``choose_split`` over ``num_reqs x head tiles`` programs), the same ranges
    (``_split_range``), and the same partials layout, so its reduce kernel
    (``_decode_reduce_kernel``) merges the ranges of a split request; a request that fits one
    range writes its normalized output directly.

CUDA graphs: the grid and the buffers depend on host ints only (no host syncs); ``num_reqs``
and the split arguments are not specialized.

``mla_decode_attention_ref`` is the plain torch twin (same signature; reads lengths on the host).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from pagedkv.attention._triton_common import ATTN_DTYPES, LOG2E, dot_precision, interpreted, num_sms
from pagedkv.attention.triton_decode import (
    MAX_SPLITS,
    DecodeConfig,
    _decode_reduce_kernel,
    _split_range,
    choose_split,
)
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import cdiv, check_same_device, check_tensor, next_pow2, use_triton


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters: ``block_h`` query heads per program (power of two >= 16),
    ``tile_n`` positions per iteration (power of two >= 16), Triton's ``num_warps`` /
    ``num_stages``; ``split``: the split-KV policy (``DecodeConfig``'s split fields; its tile
    and warp fields are not used here). A first choice for the H200 (bf16, 16 heads x
    (512 + 64)), not tuned: the latent tile is ``tile_n x 576`` (36 KB in bf16 at 32) and the
    accumulator ``block_h x 512`` fp32 (64 registers per thread at 16 heads and 4 warps)."""

    block_h: int = 16
    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    split: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self):
        for name in ("block_h", "tile_n"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 16 or v & (v - 1):
                raise ConfigError(f"MLADecodeConfig.{name} must be a power of two >= 16, got {v!r}")
        if self.num_warps < 1 or self.num_stages < 1:
            raise ConfigError("MLADecodeConfig: num_warps and num_stages must be positive")


INTERPRET_MLA_DECODE_CONFIG = MLADecodeConfig(
    block_h=16, tile_n=16, num_warps=1, num_stages=1,
    split=DecodeConfig(tile_n=16, num_warps=1, num_stages=1, min_split_tokens=16))


def default_mla_decode_config(device: torch.device) -> MLADecodeConfig:
    return MLADecodeConfig() if device.type == "cuda" else INTERPRET_MLA_DECODE_CONFIG


@triton.jit
def _latent_tile(acc, l_i, m_i, q_c, q_r, tok, valid, c_ptr, dl, dr, scale_log2,
                 RANK: tl.constexpr, ROPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """One tile of the online softmax over latent rows: the rows at element offsets ``tok``
    (``valid`` ones only; others are never read), scores ``q_c c^T + q_r k_pe^T`` (base 2),
    ``acc += P c``. Heads that have seen no valid row yet keep ``m = -inf`` and zero sums (the
    sparse MLA kernel's tiles may hold none). Also the tile of ``mla_sparse_attention``."""
    c = tl.load(c_ptr + tok[:, None] + dl[None, :], mask=valid[:, None] & (dl < RANK)[None, :],
                other=0.0)
    kr = tl.load(c_ptr + tok[:, None] + RANK + dr[None, :],
                 mask=valid[:, None] & (dr < ROPE)[None, :], other=0.0)
    scores = tl.dot(q_c, tl.trans(c), input_precision=DOT_PREC)
    scores = tl.dot(q_r, tl.trans(kr), scores, input_precision=DOT_PREC)
    scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # shift an all -inf row by 0
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(scores - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(c.dtype), c, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


@triton.jit
def _mla_decode_tile(acc, l_i, m_i, q_c, q_r, t, seq_len, c_ptr, bt_row, bt_width, c_sb, c_st,
                     dl, dr, scale_log2, RANK: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PREC: tl.constexpr):
    """Positions ``[t * TILE_N, (t + 1) * TILE_N)`` of the online softmax over latent rows."""
    n = t * TILE_N + tl.arange(0, TILE_N)
    col = n // BLOCK_SIZE
    valid = (n < seq_len) & (col < bt_width)
    blk = tl.load(bt_row + col, mask=valid, other=0).to(tl.int64)
    tok = blk * c_sb + (n % BLOCK_SIZE).to(tl.int64) * c_st
    return _latent_tile(acc, l_i, m_i, q_c, q_r, tok, valid, c_ptr, dl, dr, scale_log2, RANK,
                        ROPE, DOT_PREC)


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "min_split_tiles", "zero_rows"])
def _mla_decode_kernel(
    q_ptr, q_s0, q_s1,
    c_ptr, c_sb, c_st,
    bt_ptr, bt_s0, bt_width,
    qsl_ptr, seq_ptr, num_reqs, num_splits, min_split_tiles, zero_rows,
    out_ptr, o_s0, o_s1,
    m_ptr, l_ptr, acc_ptr,
    scale_log2,
    NUM_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    L_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RANGE_LOOP: tl.constexpr,
):
    r = tl.program_id(0)
    ht = tl.program_id(1)
    s = tl.program_id(2)
    head = ht * BLOCK_H + tl.arange(0, BLOCK_H)
    head64 = head.to(tl.int64)
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    h_ok = head < NUM_HEADS
    out_mask = h_ok[:, None] & (dl < RANK)[None, :]
    q_row = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_row
    if q_len != 1:
        if (zero_rows != 0) & (q_len == 0) & (s == 0):
            # a padded request (no query rows) zeroes row r when no request owns it
            if r >= tl.load(qsl_ptr + num_reqs):
                tl.store(out_ptr + r.to(tl.int64) * o_s0 + head64[:, None] * o_s1 + dl[None, :],
                         tl.zeros([BLOCK_H, L_PAD], tl.float32).to(out_ptr.dtype.element_ty),
                         mask=out_mask)
        return
    seq_len = tl.load(seq_ptr + r)
    t0, t1, per, n_tiles = _split_range(seq_len, 0, s, num_splits, min_split_tiles, TILE_N)
    if t0 >= t1:
        return
    q_base = q_ptr + q_row.to(tl.int64) * q_s0 + head64[:, None] * q_s1
    q_c = tl.load(q_base + dl[None, :], mask=out_mask, other=0.0).to(c_ptr.dtype.element_ty)
    q_r = tl.load(q_base + RANK + dr[None, :], mask=h_ok[:, None] & (dr < ROPE)[None, :],
                  other=0.0).to(c_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], tl.float32)
    bt_row = bt_ptr + r.to(tl.int64) * bt_s0
    if RANGE_LOOP:  # compiled: a for-range loop, software-pipelined by Triton
        for t in range(t0, t1):
            acc, l_i, m_i = _mla_decode_tile(acc, l_i, m_i, q_c, q_r, t, seq_len, c_ptr, bt_row,
                                             bt_width, c_sb, c_st, dl, dr, scale_log2, RANK,
                                             ROPE, BLOCK_SIZE, TILE_N, DOT_PREC)
    else:  # the interpreter cannot iterate range() over runtime scalars
        t = t0
        while t < t1:
            acc, l_i, m_i = _mla_decode_tile(acc, l_i, m_i, q_c, q_r, t, seq_len, c_ptr, bt_row,
                                             bt_width, c_sb, c_st, dl, dr, scale_log2, RANK,
                                             ROPE, BLOCK_SIZE, TILE_N, DOT_PREC)
            t += 1

    if per >= n_tiles:
        # this request fits in one split: write the final output directly
        tl.store(out_ptr + q_row.to(tl.int64) * o_s0 + head64[:, None] * o_s1 + dl[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # the partials layout of triton_decode's reduce kernel
        part = (r.to(tl.int64) * NUM_HEADS + head64) * num_splits + s
        tl.store(m_ptr + part, m_i, mask=h_ok)
        tl.store(l_ptr + part, l_i, mask=h_ok)
        tl.store(acc_ptr + part[:, None] * L_PAD + dl[None, :], acc, mask=out_mask)


def _check(fn, q, kv_cache, block_table, query_start_loc, seq_lens, out, num_reqs, rank):
    check_tensor(fn, "q", q, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "out", out, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "kv_cache", kv_cache, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "block_table", block_table, dtypes=(torch.int32,), ndim=2, contiguous_last=True)
    check_tensor(fn, "query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1,
                 contiguous_last=True)
    check_tensor(fn, "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1, contiguous_last=True)
    width = kv_cache.shape[2]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < width:
        raise ConfigError(f"{fn}: kv_lora_rank must be an int in (0, {width}) (the cache's "
                          f"latent width), got {rank!r}")
    if q.shape[2] != width:
        raise ConfigError(f"{fn}: q [T, H, {q.shape[2]}] must have the cache's latent width {width}")
    if tuple(out.shape) != (q.shape[0], q.shape[1], rank):
        raise ConfigError(f"{fn}: out {tuple(out.shape)} must be [T, H, kv_lora_rank] = "
                          f"{(q.shape[0], q.shape[1], rank)}")
    if not isinstance(num_reqs, int) or isinstance(num_reqs, bool) or num_reqs < 0:
        raise ConfigError(f"{fn}: num_reqs must be a host int >= 0, got {num_reqs!r}")
    if query_start_loc.shape[0] < num_reqs + 1 or seq_lens.shape[0] < num_reqs \
            or block_table.shape[0] < num_reqs:
        raise ConfigError(f"{fn}: query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries, "
                          f"seq_lens and block_table num_reqs rows")
    check_same_device(fn, q=q, kv_cache=kv_cache, block_table=block_table,
                      query_start_loc=query_start_loc, seq_lens=seq_lens, out=out)


def mla_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    scale: float,
    out: torch.Tensor,
    *,
    kv_lora_rank: int,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
    zero_padded_rows: bool = False,
    check: bool = True,
    workspace: dict | None = None,
) -> torch.Tensor:
    """Latent attention of each single-token request's absorbed query row (module docstring).

    Args:
        q: ``[T, H, L + R]``; out: ``[T, H, L]`` (rows of other requests left as they are);
            kv_cache: ``[num_blocks, block_size, L + R]`` (bf16 / fp16 / fp32).
        block_table: int32 ``[>= num_reqs, width]``; query_start_loc: int32
            ``[>= num_reqs + 1]``; seq_lens: int32 ``[>= num_reqs]`` (on ``q``'s device).
        num_reqs: host int; scale: softmax scale; kv_lora_rank: ``L``.
        max_seq_len: host bound of ``seq_lens`` (caps splitting); num_splits: force the split
            count (1 .. 64); config: launch parameters (default per device).
        zero_padded_rows: a request ``r < num_reqs`` with no query rows zeroes row ``r`` of
            ``out`` when ``r >= query_start_loc[num_reqs]`` (CUDA-graph padding).
        check: validate the arguments; workspace: keeps the split partials between the calls
            of one step.
    Returns ``out``.
    """
    fn = "mla_decode_attention"
    if check:
        _check(fn, q, kv_cache, block_table, query_start_loc, seq_lens, out, num_reqs,
               kv_lora_rank)
        if num_splits is not None and (isinstance(num_splits, bool)
                                       or not isinstance(num_splits, int)
                                       or not 1 <= num_splits <= MAX_SPLITS):
            raise ConfigError(f"{fn}: num_splits must be an int in [1, {MAX_SPLITS}], got "
                              f"{num_splits!r}")
    if num_reqs == 0:
        return out
    if not use_triton(_mla_decode_kernel, q):
        return mla_decode_attention_ref(q, kv_cache, block_table, query_start_loc, seq_lens,
                                        num_reqs, scale, out, kv_lora_rank=kv_lora_rank,
                                        zero_padded_rows=zero_padded_rows)
    cfg = config or default_mla_decode_config(q.device)
    num_heads, rank = q.shape[1], kv_lora_rank
    rope = kv_cache.shape[2] - rank
    block_h = min(cfg.block_h, max(16, next_pow2(num_heads)))
    head_tiles = cdiv(num_heads, block_h)
    auto_splits, min_split_tokens = choose_split(num_reqs, head_tiles, max_seq_len,
                                                 num_sms(q.device), cfg.split)
    if num_splits is None:
        num_splits = auto_splits
    l_pad, r_pad = max(16, next_pow2(rank)), max(16, next_pow2(rope))
    min_split_tiles = max(1, cdiv(min_split_tokens, cfg.tile_n))
    if num_splits > 1:
        parts = num_reqs * num_heads * num_splits
        bufs = None if workspace is None else workspace.get("mla_decode_partials")
        if bufs is None or bufs[0].shape[0] < parts or bufs[2].shape[1] != l_pad \
                or bufs[0].device != q.device:
            bufs = (torch.empty(parts, dtype=torch.float32, device=q.device),
                    torch.empty(parts, dtype=torch.float32, device=q.device),
                    torch.empty(parts, l_pad, dtype=torch.float32, device=q.device))
            if workspace is not None:
                workspace["mla_decode_partials"] = bufs
        m_buf, l_buf, acc_buf = bufs
    else:
        m_buf = l_buf = acc_buf = out  # never touched: every request fits its one split
    _mla_decode_kernel[(num_reqs, head_tiles, num_splits)](
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        block_table, block_table.stride(0), block_table.shape[1],
        query_start_loc, seq_lens, num_reqs, num_splits, min_split_tiles,
        int(bool(zero_padded_rows)),
        out, out.stride(0), out.stride(1),
        m_buf, l_buf, acc_buf,
        float(scale) * LOG2E,
        NUM_HEADS=num_heads, BLOCK_H=block_h, RANK=rank, ROPE=rope, L_PAD=l_pad, R_PAD=r_pad,
        BLOCK_SIZE=kv_cache.shape[1], TILE_N=cfg.tile_n, DOT_PREC=dot_precision(kv_cache.dtype),
        RANGE_LOOP=not interpreted(_mla_decode_kernel),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        _decode_reduce_kernel[(num_reqs, num_heads)](
            query_start_loc, seq_lens, num_reqs, num_splits, min_split_tiles, 0,
            out, out.stride(0), out.stride(1),
            m_buf, l_buf, acc_buf, q,  # no attention sinks (q is never read as one)
            NUM_HEADS=num_heads, HEAD_DIM=rank, D_PAD=l_pad, TILE_N=cfg.tile_n, SPLIT_CHUNK=8,
            HAS_SINKS=False,
            num_warps=4 if l_pad >= 128 else 1,
        )
    return out


def mla_decode_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    scale: float,
    out: torch.Tensor,
    *,
    kv_lora_rank: int,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    config: MLADecodeConfig | None = None,
    zero_padded_rows: bool = False,
    check: bool = True,
    workspace: dict | None = None,
) -> torch.Tensor:
    """Plain torch twin of :func:`mla_decode_attention` (float32, one request at a time,
    lengths read on the host). The launch hints are ignored."""
    _check("mla_decode_attention_ref", q, kv_cache, block_table, query_start_loc, seq_lens, out,
           num_reqs, kv_lora_rank)
    if num_reqs == 0:
        return out
    qsl = [int(x) for x in query_start_loc[: num_reqs + 1].tolist()]
    lens = [int(x) for x in seq_lens[:num_reqs].tolist()]
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    for r in range(num_reqs):
        q_len = qsl[r + 1] - qsl[r]
        if q_len == 0 and zero_padded_rows and qsl[num_reqs] <= r < out.shape[0]:
            out[r] = 0
        if q_len != 1:
            continue
        n = lens[r]
        blocks = block_table[r, : -(-n // block_size)].to(torch.int64)
        lat = kv_cache[blocks].reshape(-1, width)[:n].float()  # [n, L + R]
        p = torch.softmax(q[qsl[r]].float() @ lat.T * scale, dim=-1)  # [H, n]
        out[qsl[r]] = (p @ lat[:, :kv_lora_rank]).to(out.dtype)
    return out


__all__ = ["INTERPRET_MLA_DECODE_CONFIG", "MLADecodeConfig", "default_mla_decode_config",
           "mla_decode_attention", "mla_decode_attention_ref"]
