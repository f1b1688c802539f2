"""Sparse MLA attention (Triton): each token attends to its own list of latent rows (DSA).

``sparse_mla_attention(q, kv_cache, slots, lens, scale, out, kv_lora_rank=L)``::

    q        [T, H, L + R]   absorbed queries: per head [W_UK^T q_nope | q_pe]
    kv_cache [N, B, L + R]   the latent cache, one row [c | k_pe] per token (``mla.py``;
                             any strides with contiguous rows)
    slots    [T, K] int32    flat slots ``block * B + offset`` of the rows token t attends to
    lens     [T] int32       token t reads ``slots[t, :lens[t]]`` (entries < 0 are skipped)
    out      [T, H, L]       per head sum_k softmax_k(scale q . row_k) c_k (the latent output;
                             the caller applies W_UV); a token with no valid slot gets zeros

This is the attention of DeepSeek sparse attention (``mla_sparse.py``): the indexer's top-k
positions of a token, translated to slots (``kernels.sparse_index``), are its whole context,
so prefill and decode tokens are served alike, one token per program row.

Kernel (``_sparse_mla_kernel``), grid ``(T, cdiv(H, BLOCK_H), num_splits)``: ``BLOCK_H`` query
heads per program share every latent tile (one latent "KV head", as ``mla_triton_decode``): tiles of
``TILE_K`` selected rows, each row's slot loaded from ``slots`` and split into block and
offset (any block size), then the MLA decode kernel's latent tile (``_latent_tile``: scores
``q_c c^T + q_r k_pe^T``, the two parts padded to powers of two separately, online softmax in
base 2 with fp32 accumulation; a tile without a valid row changes nothing), ``q`` cast to the cache dtype for the products (exact fp32 products for fp32
caches). Split-K as the paged decode kernels: each token is a one-query "request" of
``lens[t]`` rows, split by the decode split policy (``choose_split`` over ``T x head tiles``
programs, the ranges of ``_split_range``); a token whose rows fit one range writes its output
directly, the others write partials in the decode layout that ``triton_decode``'s reduce
kernel merges (``query_start_loc = 0 .. T``, ``seq_lens = lens``). A decode step of a small
batch thus spreads each token's ``index_topk`` rows (2048 at V3.2's size) over several
programs.

``sparse_mla_attention_ref`` is the plain torch twin (same signature, float32, tokens in
chunks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import triton
import triton.language as tl

from pagedkv.attention._triton_common import ATTN_DTYPES, LOG2E, dot_precision, interpreted, num_sms
from pagedkv.attention.mla_triton_decode import _latent_tile
from pagedkv.attention.triton_decode import (
    MAX_SPLITS,
    DecodeConfig,
    _decode_reduce_kernel,
    _split_range,
    choose_split,
)
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import (INDEX_DTYPES, cdiv, check_launch_config, check_same_device,
                                     check_tensor, next_pow2, use_triton)


@dataclass(frozen=True)
class SparseMLAConfig:
    """Launch parameters: ``block_h`` query heads per program and ``tile_k`` selected rows per
    iteration (powers of two >= 16), Triton's ``num_warps`` / ``num_stages``; ``split``: the
    split-K policy (``DecodeConfig``'s split fields; its tile and warp fields unused). A first
    choice (not tuned): at V3.2's size a ``tile_k x 576`` latent tile and a ``block_h x 512``
    fp32 accumulator, as the MLA decode kernel."""

    block_h: int = 16
    tile_k: int = 32
    num_warps: int = 4
    num_stages: int = 2
    split: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self):
        check_launch_config(self, ("block_h", "tile_k"))


INTERPRET_SPARSE_MLA_CONFIG = SparseMLAConfig(
    block_h=16, tile_k=16, num_warps=1, num_stages=1,
    split=DecodeConfig(tile_n=16, num_warps=1, num_stages=1, min_split_tokens=16))


@triton.jit
def _sparse_mla_tile(acc, l_i, m_i, q_c, q_r, kt, n, slot_row, c_ptr, c_sb, c_st, dl, dr,
                     scale_log2, RANK: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """Selected rows ``[kt * TILE_K, (kt + 1) * TILE_K)`` of the online softmax."""
    k = kt * TILE_K + tl.arange(0, TILE_K)
    in_k = k < n
    slot = tl.load(slot_row + k, mask=in_k, other=-1).to(tl.int64)
    valid = in_k & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    blk = slot // BLOCK_SIZE
    row = blk * c_sb + (slot - blk * BLOCK_SIZE) * c_st
    return _latent_tile(acc, l_i, m_i, q_c, q_r, row, valid, c_ptr, dl, dr, scale_log2, RANK,
                        ROPE, DOT_PREC)


@triton.jit(do_not_specialize=["num_k", "num_splits", "min_split_tiles"])
def _sparse_mla_kernel(
    q_ptr, q_s0, q_s1,
    c_ptr, c_sb, c_st,
    slots_ptr, slots_s0, lens_ptr, num_k, num_splits, min_split_tiles,
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
    TILE_K: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RANGE_LOOP: tl.constexpr,
):
    t = tl.program_id(0)
    ht = tl.program_id(1)
    s = tl.program_id(2)
    t64 = t.to(tl.int64)
    head = ht * BLOCK_H + tl.arange(0, BLOCK_H)
    head64 = head.to(tl.int64)
    dl = tl.arange(0, L_PAD)
    dr = tl.arange(0, R_PAD)
    h_ok = head < NUM_HEADS
    out_mask = h_ok[:, None] & (dl < RANK)[None, :]
    n = tl.minimum(tl.load(lens_ptr + t), num_k)
    t0, t1, per, n_tiles = _split_range(n, 0, s, num_splits, min_split_tiles, TILE_K)
    if (t0 >= t1) & (s > 0):
        return  # split 0 of a token without rows writes its zeros
    q_base = q_ptr + t64 * q_s0 + head64[:, None] * q_s1
    q_c = tl.load(q_base + dl[None, :], mask=out_mask, other=0.0).to(c_ptr.dtype.element_ty)
    q_r = tl.load(q_base + RANK + dr[None, :], mask=h_ok[:, None] & (dr < ROPE)[None, :],
                  other=0.0).to(c_ptr.dtype.element_ty)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD], tl.float32)
    slot_row = slots_ptr + t64 * slots_s0
    if RANGE_LOOP:  # compiled: a for-range loop, software-pipelined by Triton
        for kt in range(t0, t1):
            acc, l_i, m_i = _sparse_mla_tile(acc, l_i, m_i, q_c, q_r, kt, n, slot_row, c_ptr,
                                             c_sb, c_st, dl, dr, scale_log2, RANK, ROPE,
                                             BLOCK_SIZE, TILE_K, DOT_PREC)
    else:  # the interpreter cannot iterate range() over runtime scalars
        kt = t0
        while kt < t1:
            acc, l_i, m_i = _sparse_mla_tile(acc, l_i, m_i, q_c, q_r, kt, n, slot_row, c_ptr,
                                             c_sb, c_st, dl, dr, scale_log2, RANK, ROPE,
                                             BLOCK_SIZE, TILE_K, DOT_PREC)
            kt += 1
    if per >= n_tiles:  # the token's rows fit one range: the final output directly
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + t64 * o_s0 + head64[:, None] * o_s1 + dl[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # the partials layout of triton_decode's reduce kernel
        part = (t64 * NUM_HEADS + head64) * num_splits + s
        tl.store(m_ptr + part, m_i, mask=h_ok)
        tl.store(l_ptr + part, l_i, mask=h_ok)
        tl.store(acc_ptr + part[:, None] * L_PAD + dl[None, :], acc, mask=out_mask)


def _check(fn, q, kv_cache, slots, lens, out, rank):
    check_tensor(fn, "q", q, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "out", out, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "kv_cache", kv_cache, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "slots", slots, dtypes=INDEX_DTYPES, ndim=2, contiguous_last=True)
    check_tensor(fn, "lens", lens, dtypes=(torch.int32,), ndim=1, contiguous_last=True)
    width = kv_cache.shape[2]
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 < rank < width:
        raise ConfigError(f"{fn}: kv_lora_rank must be an int in (0, {width}) (the cache's "
                          f"latent width), got {rank!r}")
    t = q.shape[0]
    if q.shape[2] != width:
        raise ConfigError(f"{fn}: q [T, H, {q.shape[2]}] must have the cache's latent width {width}")
    if tuple(out.shape) != (t, q.shape[1], rank):
        raise ConfigError(f"{fn}: out {tuple(out.shape)} must be [T, H, kv_lora_rank] = "
                          f"{(t, q.shape[1], rank)}")
    if slots.shape[0] < t or lens.shape[0] < t:
        raise ConfigError(f"{fn}: slots [{slots.shape[0]}, K] and lens [{lens.shape[0]}] need "
                          f"a row per query token ({t})")
    check_same_device(fn, q=q, kv_cache=kv_cache, slots=slots, lens=lens, out=out)


def sparse_mla_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    kv_lora_rank: int,
    config: SparseMLAConfig | None = None,
    num_splits: int | None = None,
    check: bool = True,
    workspace: dict | None = None,
) -> torch.Tensor:
    """Latent attention of every query token over its selected rows (module docstring).

    Args:
        q: ``[T, H, L + R]``; out: ``[T, H, L]`` (every row written);
            kv_cache: ``[num_blocks, block_size, L + R]`` (bf16 / fp16 / fp32).
        slots: int32/int64 ``[>= T, K]``; lens: int32 ``[>= T]`` (on ``q``'s device).
        scale: softmax scale; kv_lora_rank: ``L``; config: launch parameters (default per
            device); num_splits: force the split count (1 .. 64); check: validate the
            arguments; workspace: keeps the split partials between the calls of one step.
    Returns ``out``. Without CUDA and without the Triton interpreter: the torch twin.
    """
    fn = "sparse_mla_attention"
    if check:
        _check(fn, q, kv_cache, slots, lens, out, kv_lora_rank)
        if num_splits is not None and (isinstance(num_splits, bool)
                                       or not isinstance(num_splits, int)
                                       or not 1 <= num_splits <= MAX_SPLITS):
            raise ConfigError(f"{fn}: num_splits must be an int in [1, {MAX_SPLITS}], got "
                              f"{num_splits!r}")
    t, num_heads = q.shape[0], q.shape[1]
    if t == 0:
        return out
    if slots.shape[1] == 0:
        return out.zero_()
    if not use_triton(_sparse_mla_kernel, q):
        return sparse_mla_attention_ref(q, kv_cache, slots, lens, scale, out,
                                        kv_lora_rank=kv_lora_rank)
    cfg = config or (SparseMLAConfig() if q.is_cuda else INTERPRET_SPARSE_MLA_CONFIG)
    rank = kv_lora_rank
    rope = kv_cache.shape[2] - rank
    block_h = min(cfg.block_h, max(16, next_pow2(num_heads)))
    head_tiles = cdiv(num_heads, block_h)
    num_k = slots.shape[1]
    auto_splits, min_split_tokens = choose_split(t, head_tiles, num_k, num_sms(q.device),
                                                 cfg.split)
    if num_splits is None:
        num_splits = auto_splits
    l_pad = max(16, next_pow2(rank))
    min_split_tiles = max(1, cdiv(min_split_tokens, cfg.tile_k))
    if num_splits > 1:
        parts = t * num_heads * num_splits
        bufs = None if workspace is None else workspace.get("sparse_mla_partials")
        if bufs is None or bufs[0].shape[0] < parts or bufs[2].shape[1] != l_pad \
                or bufs[0].device != q.device:
            bufs = (torch.empty(parts, dtype=torch.float32, device=q.device),
                    torch.empty(parts, dtype=torch.float32, device=q.device),
                    torch.empty(parts, l_pad, dtype=torch.float32, device=q.device))
            if workspace is not None:
                workspace["sparse_mla_partials"] = bufs
        m_buf, l_buf, acc_buf = bufs
    else:
        m_buf = l_buf = acc_buf = out  # never touched: every token fits its one split
    _sparse_mla_kernel[(t, head_tiles, num_splits)](
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        slots, slots.stride(0), lens, num_k, num_splits, min_split_tiles,
        out, out.stride(0), out.stride(1),
        m_buf, l_buf, acc_buf,
        float(scale) * LOG2E,
        NUM_HEADS=num_heads, BLOCK_H=block_h, RANK=rank, ROPE=rope,
        L_PAD=l_pad, R_PAD=max(16, next_pow2(rope)),
        BLOCK_SIZE=kv_cache.shape[1], TILE_K=cfg.tile_k, DOT_PREC=dot_precision(kv_cache.dtype),
        RANGE_LOOP=not interpreted(_sparse_mla_kernel),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        # each token is a one-query request of lens[t] rows (min(lens, K) as the kernel reads)
        qsl = torch.arange(t + 1, dtype=torch.int32, device=q.device)
        n = torch.clamp(lens[:t], max=num_k)
        _decode_reduce_kernel[(t, num_heads)](
            qsl, n, t, num_splits, min_split_tiles, 0,
            out, out.stride(0), out.stride(1),
            m_buf, l_buf, acc_buf, q,  # no attention sinks (q is never read as one)
            NUM_HEADS=num_heads, HEAD_DIM=rank, D_PAD=l_pad, TILE_N=cfg.tile_k, SPLIT_CHUNK=8,
            HAS_SINKS=False,
            num_warps=4 if l_pad >= 128 else 1,
        )
    return out


# gathered latent elements per chunk of tokens in the twin (bounds its temporaries)
_REF_CHUNK_ELEMENTS = 1 << 24


def sparse_mla_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slots: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    *,
    kv_lora_rank: int,
    config: SparseMLAConfig | None = None,
    num_splits: int | None = None,
    check: bool = True,
    workspace: dict | None = None,
) -> torch.Tensor:
    """Plain torch twin of :func:`sparse_mla_attention` (float32; the launch hints are
    ignored): gathers each token's rows ``kv_cache[slot // B, slot % B]`` (never a copy of the
    cache), masks entries past ``lens`` or below 0, softmax, the latent sum."""
    _check("sparse_mla_attention_ref", q, kv_cache, slots, lens, out, kv_lora_rank)
    t = q.shape[0]
    if t == 0:
        return out
    num_k = slots.shape[1]
    if num_k == 0:
        return out.zero_()
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    chunk = max(1, _REF_CHUNK_ELEMENTS // (num_k * width))
    cols = torch.arange(num_k, device=q.device)
    for s in range(0, t, chunk):
        e = min(t, s + chunk)
        sl = slots[s:e].to(torch.int64)
        valid = (cols[None, :] < lens[s:e, None].to(torch.int64)) & (sl >= 0)
        sl = torch.where(valid, sl, 0)
        rows = kv_cache[sl // block_size, sl % block_size].float()  # [C, K, L + R]
        rows = torch.where(valid[..., None], rows, 0.0)  # masked entries are never read
        scores = torch.einsum("chd,ckd->chk", q[s:e].float(), rows) * scale
        scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        probs = torch.where(valid.any(dim=1)[:, None, None], probs, 0.0)  # no valid row: zeros
        out[s:e] = torch.einsum("chk,ckl->chl", probs, rows[..., :kv_lora_rank]).to(out.dtype)
    return out


__all__ = ["INTERPRET_SPARSE_MLA_CONFIG", "SparseMLAConfig", "sparse_mla_attention",
           "sparse_mla_attention_ref"]
