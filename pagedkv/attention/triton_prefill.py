"""Paged prefill / extend attention (Triton), and the varlen flash path for fresh prefills.

Layout (``backend.py`` conventions): ``q``/``out [T, H, D]``; ``kv_cache [2, num_blocks,
block_size, Hkv, D]`` already holding every position of every request (the step's new K/V
included: the backend writes them first); query ``i`` of request ``r`` is row
``query_start_loc[r] + i`` at position ``ctx + i`` with ``ctx = seq_lens[r] - query_len``, and
attends causally to positions ``<= ctx + i``, all read through ``block_table[r]``. Serves
chunked prefill and prefix-cache hits (``ctx > 0``) and fresh prefill (``ctx == 0``) alike.

Kernel (``_prefill_kernel``), grid ``(num_tokens // BLOCK_M + num_reqs, H / P)``,
flash-attention style: program ``(p, h)`` takes one tile of ``BLOCK_M`` query tokens of one
request for the ``P`` query heads ``[h P, (h + 1) P)`` (``PrefillConfig.pack_heads``: ``P``
heads of one K/V head packed into ``BLOCK_M x P`` rows, so each K/V tile loaded serves all of
them; ``P = 1``: one head) and streams that request's K/V in ``BLOCK_N`` tiles with ``tl.dot``
and an online softmax (base 2, fp32 accumulation). Tile ``p`` belongs to the request ``r``
with the largest ``query_start_loc[r] // BLOCK_M + r <= p`` (a binary search on the device;
request ``r``'s tiles fit between its bound and the next request's, so the grid depends on
host ints only).
Within a request the tiles run last-first (the longest rows start first). Key tiles wholly
visible to all rows of the query tile run without masks; only the tiles on the causal diagonal
and the sequence end are masked. Positions past ``seq_lens[r]`` and block-table columns past
the table width are never read (rule 4: they map to the null block, masked).
``skip_decode`` leaves single-token requests' rows untouched (the decode kernel serves them).
Non-causal mode (``causal=False``, cascade attention's shared prefix): every row of a request
sees all ``seq_len`` keys (only the tile at the sequence end is masked), so the whole batch's
query rows can attend to the shared prefix blocks as one request in one pass over them; with
``lse`` each row's natural-log log-sum-exp is written too (``triton_decode._lse``).

FP8 caches (``float8_e4m3fn``, ``KV_FP8``), as in the decode kernel: the loaded K / V codes are
cast to the query dtype (exact; a bf16 query is cast to fp16, ``Q_FP16``), ``k_scale`` joins
the softmax scale on the host, ``v_scale`` multiplies the accumulated output (every key split's).

``varlen_prefill_attention``: torch's ``torch.nn.attention.varlen.varlen_attn`` (flash
attention over packed sequences, CUDA only) on the contiguous new-token K/V, for batches whose
requests have no cached context; K/V heads are repeated to the query heads when that torch has
no ``enable_gqa`` flag.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from pagedkv.attention._triton_common import (
    LOG2E,
    attn_shape,
    check_attention_inputs,
    dot_precision,
    interpreted,
)
from pagedkv.attention.torch_ref import paged_attention_ref
from pagedkv.attention.triton_decode import (
    _check_softcap,
    _check_window,
    _lse,
    _sink_denominator,
    _soft_cap,
    _tile_blocks,
    check_lse,
    check_sinks,
)
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import check_launch_config, check_tensor, next_pow2, use_triton
from pagedkv.kernels.fp8_kv import check_kv_scale, dequantize_ref, is_fp8_kv
from pagedkv.kernels.pdl import pdl_launch_args, pdl_prologue


@dataclass(frozen=True)
class PrefillConfig:
    """Launch parameters of the prefill kernel (``block_m``/``block_n`` powers of two >= 16).

    ``pack_heads``: up to this many query heads of one K/V head share a program (see
    :meth:`heads_per_program`); ``block_m`` counts query tokens, so a program holds ``block_m x
    heads`` rows.

    Defaults from the H200 (bf16, 16 query / 8 K/V heads, head_dim 128): 64 x 64 tiles, 4
    warps, 3 stages, one head a program. With the block table read a tile ahead
    (:func:`_tile_blocks`), 3 stages keep two K/V tiles in flight in 112 KB of shared memory:
    two programs a multiprocessor. ``bench/bench_attention_gpu.py --sweep`` (8 x 2048 causal,
    871c3d3, us): 487 (282 TFLOP/s; 512 with the table inside the tile); 4 stages 752 (147 KB:
    one program an SM); 64 x 32 x 3 stages 465; 128 x 64 x 8 warps 469; 128 x 128 x 8 warps
    469; two heads a program x 8 warps 452 (304 TFLOP/s), x 4 warps 1369 (131 KB, 255
    registers). Through ``LLM.generate`` 128 x 64 x 8 warps (which the cascade prefix launch
    then takes too: 18.9 us alone against 19.4) lost W3, 42,639 against 46,593 output tok/s in
    one lease: not explained (BENCHMARKS.md, ninth session). In the eighth session two heads a
    program lost W3 by 5%: that A/B gave the prefix launch the packed tiles too (alone, at 4
    stages, 32.5 us against 20.7).
    """

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    pack_heads: int = 1

    def __post_init__(self):
        check_launch_config(self, ("block_m", "block_n"))
        p = self.pack_heads
        if isinstance(p, bool) or not isinstance(p, int) or p < 1 or p & (p - 1):
            raise ConfigError(f"PrefillConfig.pack_heads must be a power of two >= 1, got {p!r}")

    def heads_per_program(self, group: int) -> int:
        """Query heads one program serves: the largest power of two that divides the GQA
        group (query heads per K/V head) and is at most ``pack_heads``."""
        return min(self.pack_heads, group & -group)


INTERPRET_PREFILL_CONFIG = PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1)


def default_prefill_config(device: torch.device) -> PrefillConfig:
    return PrefillConfig() if device.type == "cuda" else INTERPRET_PREFILL_CONFIG


@triton.jit
def _attend_tile(
    acc, l_i, m_i, q, q_pos,
    k_ptr, v_ptr, blk, bt_width, c_sb, c_st, head_off,
    start, seq_len, kv_lo, window, d, scale_log2,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    CAUSAL: tl.constexpr,
    OFF32: tl.constexpr,
):
    """One key tile ``[start, start + BLOCK_N)`` of the online softmax. ``MASKED``: apply the
    causal mask (``CAUSAL``) and the sequence end (otherwise every key is visible to every
    row). With ``HAS_WINDOW`` (always masked) keys before ``kv_lo`` (the tile's first key in
    any row's window) are not read, and row ``i`` sees keys ``> q_pos[i] - window``. ``blk``:
    the tile's block-table entries (:func:`_tile_blocks`). K / V are cast to ``q``'s dtype
    after the load (a no-op unless the cache is FP8)."""
    n = start + tl.arange(0, BLOCK_N)
    if MASKED:
        valid = (n < seq_len) & (n // BLOCK_SIZE < bt_width)
        if HAS_WINDOW:
            valid = valid & (n >= kv_lo)
    if OFF32:  # every element offset of a cache half fits an int32 (the host checked)
        tok = blk * c_sb + (n % BLOCK_SIZE) * c_st + head_off
    else:
        tok = blk.to(tl.int64) * c_sb + (n % BLOCK_SIZE).to(tl.int64) * c_st + head_off
    if MASKED:
        kt = tl.load(k_ptr + tok[None, :] + d[:, None],
                     mask=valid[None, :] & (d < HEAD_DIM)[:, None], other=0.0)
        v = tl.load(v_ptr + tok[:, None] + d[None, :],
                    mask=valid[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM == D_PAD:
        kt = tl.load(k_ptr + tok[None, :] + d[:, None])
        v = tl.load(v_ptr + tok[:, None] + d[None, :])
    else:
        kt = tl.load(k_ptr + tok[None, :] + d[:, None], mask=(d < HEAD_DIM)[:, None], other=0.0)
        v = tl.load(v_ptr + tok[:, None] + d[None, :], mask=(d < HEAD_DIM)[None, :], other=0.0)
    kt = kt.to(q.dtype)
    v = v.to(q.dtype)
    qk = _soft_cap(tl.dot(q, kt, input_precision=DOT_PREC) * scale_log2, SOFTCAP)
    if MASKED:
        if CAUSAL:
            seen = (n[None, :] <= q_pos[:, None]) & valid[None, :]
        else:
            seen = valid[None, :]  # every row sees every key of the sequence
        if HAS_WINDOW:
            seen = seen & (n[None, :] > q_pos[:, None] - window)
        qk = tl.where(seen, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    if HAS_WINDOW:
        # a row may see no key of this tile yet (its window starts later): keep its running
        # max at -inf without computing -inf - -inf
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new  # every row sees key 0 in its first tile
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(qk - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, l_i, m_new


# keys per split of the non-causal mode come in multiples of this many (any tile size); a
# constexpr so the compiled kernel may read it (the interpreter also reads plain globals)
KV_SPLIT_GRANULE_TOKENS = 16
KV_SPLIT_GRANULE = tl.constexpr(KV_SPLIT_GRANULE_TOKENS)


@triton.jit(do_not_specialize=["num_reqs", "skip_decode", "window", "kv_splits"])
def _prefill_kernel(
    q_ptr, q_s0, q_s1,
    k_ptr, v_ptr, c_sb, c_st, c_sh,
    bt_ptr, bt_s0, bt_width,
    qsl_ptr, seq_ptr, num_reqs, skip_decode, window,
    out_ptr, o_s0, o_s1,
    sinks_ptr,
    scale_log2,
    HAS_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RANGE_LOOP: tl.constexpr,
    lse_ptr=None,
    lse_s0=0,
    CAUSAL: tl.constexpr = True,
    WRITE_LSE: tl.constexpr = False,
    v_scale=1.0,
    KV_FP8: tl.constexpr = False,
    kv_splits=1,
    Q_FP16: tl.constexpr = False,
    o_split=0,
    lse_split=0,
    PACK: tl.constexpr = 1,
    OFF32: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    p = tl.program_id(0)
    h = tl.program_id(1)  # query heads [h PACK, (h + 1) PACK), all of one K/V head
    s = tl.program_id(2)  # the key split (non-causal mode; 0 otherwise)
    # request of tile p: the largest r with query_start_loc[r] // BLOCK_M + r <= p
    lo = tl.full([], 0, tl.int32)
    hi = tl.full([], 0, tl.int32) + num_reqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        take = tl.load(qsl_ptr + mid) // BLOCK_M + mid <= p
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    r = lo
    q_start = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_start
    j = p - (q_start // BLOCK_M + r)
    n_qt = tl.cdiv(q_len, BLOCK_M)
    if j >= n_qt:
        return
    if (skip_decode != 0) & (q_len == 1):
        return
    j = n_qt - 1 - j  # last tile (most keys) first
    seq_len = tl.load(seq_ptr + r)
    ctx = seq_len - q_len

    # tile rows: BLOCK_M query tokens x PACK heads, token-major (row i: token i // PACK,
    # head h PACK + i % PACK)
    i = tl.arange(0, BLOCK_M * PACK)
    m_idx = j * BLOCK_M + i // PACK
    hq = h * PACK + i % PACK
    m_ok = m_idx < q_len
    d = tl.arange(0, D_PAD)
    rows = (q_start + m_idx).to(tl.int64)
    md_mask = m_ok[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + rows[:, None] * q_s0 + hq[:, None] * q_s1 + d[None, :], mask=md_mask,
                other=0.0)
    if not KV_FP8:  # an FP8 cache's K / V are cast to the query dtype instead
        q = q.to(k_ptr.dtype.element_ty)
    elif Q_FP16:  # bf16 query, FP8 cache: the products in fp16 (as the decode kernel)
        q = q.to(tl.float16)
    q_pos = ctx + m_idx

    m_i = tl.full([BLOCK_M * PACK], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M * PACK], tl.float32)
    acc = tl.zeros([BLOCK_M * PACK, D_PAD], tl.float32)
    bt_row = bt_ptr + r.to(tl.int64) * bt_s0
    if OFF32:
        head_off = (h * PACK // GROUP) * c_sh
    else:
        head_off = (h * PACK // GROUP).to(tl.int64) * c_sh
    if CAUSAL:
        end = tl.minimum(seq_len, ctx + (j + 1) * BLOCK_M)
        kv_end = seq_len
    else:
        # non-causal: every row sees every key of split s, [s per, min((s + 1) per, seq_len))
        per = tl.cdiv(tl.cdiv(seq_len, KV_SPLIT_GRANULE), kv_splits) * KV_SPLIT_GRANULE
        end = tl.minimum((s + 1) * per, seq_len)
        kv_end = end
    if HAS_WINDOW:
        # the tile's rows see keys in (q_pos - window, q_pos]: from the first row's window
        # start on, all masked (earlier blocks may be the null block and are never read)
        kv_lo = tl.maximum(ctx + j * BLOCK_M - window + 1, 0)
        first = kv_lo // BLOCK_N * BLOCK_N
        full_end = first
    else:
        # keys [0, full_end) are visible to every row of the tile; [full_end, end) need the mask
        kv_lo = 0
        if CAUSAL:
            first = 0
            full_end = (ctx + j * BLOCK_M + 1) // BLOCK_N * BLOCK_N
        else:
            first = s * per
            full_end = first + tl.maximum(end - first, 0) // BLOCK_N * BLOCK_N
    # each loop loads the next tile's block-table entries while it computes this one's
    # (:func:`_tile_blocks`); the masked tiles' entries up to the sequence end (keys past a
    # tile's causal limit are read, then masked out of the scores: finite values, never NaN)
    blk = _tile_blocks(bt_row, bt_width, first, full_end, BLOCK_SIZE, BLOCK_N)
    if RANGE_LOOP:  # compiled: for-range loops, software-pipelined by Triton
        for start in range(first, full_end, BLOCK_N):
            nxt = _tile_blocks(bt_row, bt_width, start + BLOCK_N, full_end, BLOCK_SIZE, BLOCK_N)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, blk,
                                         bt_width, c_sb, c_st, head_off, start, kv_end, kv_lo,
                                         window, d, scale_log2, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                                         D_PAD, False, DOT_PREC, HAS_WINDOW, SOFTCAP,
                                         CAUSAL, OFF32)
            blk = nxt
        blk = _tile_blocks(bt_row, bt_width, full_end, kv_end, BLOCK_SIZE, BLOCK_N)
        for start in range(full_end, end, BLOCK_N):
            nxt = _tile_blocks(bt_row, bt_width, start + BLOCK_N, kv_end, BLOCK_SIZE,
                               BLOCK_N)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, blk,
                                         bt_width, c_sb, c_st, head_off, start, kv_end, kv_lo,
                                         window, d, scale_log2, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                                         D_PAD, True, DOT_PREC, HAS_WINDOW, SOFTCAP,
                                         CAUSAL, OFF32)
            blk = nxt
    else:  # the interpreter cannot iterate range() over runtime scalars
        start = first + full_end * 0
        while start < full_end:
            nxt = _tile_blocks(bt_row, bt_width, start + BLOCK_N, full_end, BLOCK_SIZE, BLOCK_N)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, blk,
                                         bt_width, c_sb, c_st, head_off, start, kv_end, kv_lo,
                                         window, d, scale_log2, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                                         D_PAD, False, DOT_PREC, HAS_WINDOW, SOFTCAP,
                                         CAUSAL, OFF32)
            blk = nxt
            start += BLOCK_N
        blk = _tile_blocks(bt_row, bt_width, start, kv_end, BLOCK_SIZE, BLOCK_N)
        while start < end:
            nxt = _tile_blocks(bt_row, bt_width, start + BLOCK_N, kv_end, BLOCK_SIZE,
                               BLOCK_N)
            acc, l_i, m_i = _attend_tile(acc, l_i, m_i, q, q_pos, k_ptr, v_ptr, blk,
                                         bt_width, c_sb, c_st, head_off, start, kv_end, kv_lo,
                                         window, d, scale_log2, BLOCK_SIZE, BLOCK_N, HEAD_DIM,
                                         D_PAD, True, DOT_PREC, HAS_WINDOW, SOFTCAP,
                                         CAUSAL, OFF32)
            blk = nxt
            start += BLOCK_N
    if KV_FP8:
        acc = acc * v_scale
    l_i = _sink_denominator(l_i, m_i, sinks_ptr, hq, hq >= 0, HAS_SINKS)
    if CAUSAL:
        o = acc / l_i[:, None]
    else:  # a split without keys: output 0, log-sum-exp -inf
        o = tl.where(l_i[:, None] > 0, acc / l_i[:, None], 0.0)
    split = s.to(tl.int64)
    tl.store(out_ptr + split * o_split + rows[:, None] * o_s0 + hq[:, None] * o_s1 + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=md_mask)
    if WRITE_LSE:
        tl.store(lse_ptr + split * lse_split + rows * lse_s0 + hq, _lse(m_i, l_i), mask=m_ok)


def paged_prefill_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    scale: float,
    out: torch.Tensor,
    *,
    num_tokens: int | None = None,
    skip_decode: bool = False,
    config: PrefillConfig | None = None,
    check: bool = True,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    lse: torch.Tensor | None = None,
    kv_splits: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of every request's query rows over its paged context.

    Args:
        q, out: ``[T, H, D]``; rows no request owns are left as they are.
        kv_cache: ``[2, num_blocks, block_size, Hkv, D]`` holding every position already
            (bf16 / fp16 / fp32, or FP8: ``float8_e4m3fn`` read as ``k * k_scale``,
            ``v * v_scale``; the scales, host floats > 0, apply to FP8 caches only).
        block_table: int32 ``[>= num_reqs, width]``; query_start_loc: int32
            ``[>= num_reqs + 1]``; seq_lens: int32 ``[>= num_reqs]``.
        num_reqs: host int. scale: softmax scale.
        num_tokens: host upper bound of ``query_start_loc[num_reqs]`` (default ``T``).
        skip_decode: leave requests with exactly one query token alone.
        config: launch parameters; default per device.
        check: validate the arguments (False: the caller validated the same shapes already).
        sliding_window: W: a query at ``p`` sees keys ``p - W < k <= p`` (blocks before a
            tile's first window are not read). logits_soft_cap: c: scores -> ``c tanh(s / c)``.
        sinks: ``[H]`` attention sinks (GPT-OSS), as ``paged_decode_attention`` takes them:
            ``exp(sink)`` joins each row's softmax denominator.
        causal: False: every query row of a request sees all its ``seq_len`` keys (no mask
            but the sequence end; ``seq_len`` may be below the query count; no sliding
            window). Cascade attention runs the shared prefix so: the whole batch's query rows
            as one request whose ``seq_len`` is the prefix and whose table row holds the
            prefix blocks.
        lse: float32 ``[T, H]``: receives each served row's natural-log log-sum-exp (as
            ``paged_decode_attention`` writes it).
        kv_splits: S > 1 (non-causal only, ``lse`` required): the keys of each request are
            dealt into S contiguous ranges of ``per = ceil(ceil(seq_len / 16) / S) x 16``
            keys (split ``s``: ``[s per, min((s + 1) per, seq_len))``), one program per range,
            and ``out [S, T, H, D]`` / ``lse [S, T, H]`` receive each range's own normalized
            output and log-sum-exp (a range without keys: output 0, lse -inf), to be merged
            by ``merge_attention_states``. More programs for a short batch over a long
            shared prefix.
    Returns ``out``.
    """
    fn = "paged_prefill_attention"
    splits = _check_kv_splits(fn, kv_splits, causal, out, lse, q)
    if splits > 1 and (sinks is not None or skip_decode):
        raise ConfigError(f"{fn}: kv_splits > 1 takes no sinks and no skip_decode")
    out_rows = out if splits == 1 else out[0]  # one split's [T, H, D] for the shared checks
    lse_rows = lse if lse is None or splits == 1 else lse[0]
    if check:
        shape = check_attention_inputs(fn, q, kv_cache, block_table, query_start_loc, seq_lens,
                                       out_rows, num_reqs)
    else:
        shape = attn_shape(q, kv_cache)
    if num_tokens is None:
        num_tokens = q.shape[0]
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 0:
        raise ConfigError(f"{fn}: num_tokens must be a host int >= 0, got {num_tokens!r}")
    window = _check_window(fn, sliding_window)
    softcap = _check_softcap(fn, logits_soft_cap)
    if not isinstance(causal, bool):
        raise ConfigError(f"{fn}: causal must be a bool, got {causal!r}")
    if not causal and window:
        raise ConfigError(f"{fn}: non-causal attention takes no sliding window")
    if check:
        check_sinks(fn, sinks, q)
        check_lse(fn, lse_rows, q)
        check_kv_scale(fn, "k_scale", k_scale)
        check_kv_scale(fn, "v_scale", v_scale)
    if num_reqs == 0 or num_tokens == 0:
        return out
    if not use_triton(_prefill_kernel, q):
        return paged_prefill_attention_ref(q, kv_cache, block_table, query_start_loc, seq_lens,
                                           num_reqs, scale, out, skip_decode=skip_decode,
                                           sliding_window=sliding_window,
                                           logits_soft_cap=logits_soft_cap, sinks=sinks,
                                           causal=causal, lse=lse, kv_splits=splits,
                                           k_scale=k_scale, v_scale=v_scale)
    fp8 = is_fp8_kv(kv_cache.dtype)
    cfg = config or default_prefill_config(q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    pack = cfg.heads_per_program(shape.group)
    grid = (num_tokens // cfg.block_m + num_reqs, shape.num_heads // pack, splits)
    _prefill_kernel[grid](
        q, q.stride(0), q.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_table, block_table.stride(0), block_table.shape[1],
        query_start_loc, seq_lens, num_reqs, int(bool(skip_decode)), window,
        out_rows, out_rows.stride(0), out_rows.stride(1),
        q if sinks is None else sinks,  # never read without sinks
        float(scale) * LOG2E * (float(k_scale) if fp8 else 1.0),
        HAS_WINDOW=window > 0, SOFTCAP=softcap, HAS_SINKS=sinks is not None,
        GROUP=shape.group, HEAD_DIM=shape.head_dim,
        D_PAD=max(16, next_pow2(shape.head_dim)), BLOCK_SIZE=shape.block_size,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        DOT_PREC=dot_precision(q.dtype if fp8 else kv_cache.dtype),
        RANGE_LOOP=not interpreted(_prefill_kernel),
        lse_ptr=lse, lse_s0=0 if lse is None else lse_rows.stride(0), CAUSAL=causal,
        WRITE_LSE=lse is not None, v_scale=float(v_scale), KV_FP8=fp8, kv_splits=splits,
        Q_FP16=fp8 and q.dtype == torch.bfloat16,
        o_split=0 if splits == 1 else out.stride(0),
        lse_split=0 if splits == 1 else lse.stride(0), PACK=pack,
        OFF32=offsets_fit_int32(k_cache),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **pdl_launch_args(_prefill_kernel, q.device),
    )
    return out


def offsets_fit_int32(cache_half: torch.Tensor) -> bool:
    """Whether every element offset into one half of a KV cache (``kv_cache[0]`` or ``[1]``,
    ``[num_blocks, block_size, Hkv, D]`` with its strides) fits an int32: the kernel then
    computes its K / V addresses in 32-bit integers (``OFF32``), about a fifth fewer
    instructions on sm_90 (``pagedkv.tools.sm90_report``), else in 64-bit."""
    if cache_half.numel() == 0:
        return True
    span = 1 + sum((size - 1) * abs(stride)
                   for size, stride in zip(cache_half.shape, cache_half.stride()))
    return span < 2 ** 31


def _check_kv_splits(fn: str, kv_splits, causal: bool, out, lse, q: torch.Tensor) -> int:
    """The split count; S > 1 needs the non-causal mode and ``out [S, T, H, D]``, ``lse
    [S, T, H]`` (each split's slice as the one-split checks want it)."""
    if isinstance(kv_splits, bool) or not isinstance(kv_splits, int) or not 1 <= kv_splits <= 64:
        raise ConfigError(f"{fn}: kv_splits must be an int in [1, 64], got {kv_splits!r}")
    if kv_splits == 1:
        return 1
    if causal or lse is None:
        raise ConfigError(f"{fn}: kv_splits > 1 needs causal=False and an lse output")
    if not isinstance(out, torch.Tensor) or out.dim() != 4 or out.shape[0] != kv_splits \
            or not isinstance(lse, torch.Tensor) or lse.dim() != 3 \
            or lse.shape[0] != kv_splits:
        raise ConfigError(f"{fn}: with kv_splits={kv_splits}, out must be [S, T, H, D] and lse "
                          f"[S, T, H] with S = {kv_splits}; got {tuple(getattr(out, 'shape', ()))}"
                          f" and {tuple(getattr(lse, 'shape', ()))}")
    return kv_splits


def paged_prefill_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    num_reqs: int,
    scale: float,
    out: torch.Tensor,
    *,
    num_tokens: int | None = None,
    skip_decode: bool = False,
    config: PrefillConfig | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    sinks: torch.Tensor | None = None,
    causal: bool = True,
    lse: torch.Tensor | None = None,
    kv_splits: int = 1,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Plain torch twin of :func:`paged_prefill_attention` (``paged_attention_ref`` per request;
    reads lengths back to the host; key splits: each range's softmax over its gathered keys).
    The launch hints are ignored."""
    fn = "paged_prefill_attention_ref"
    splits = _check_kv_splits(fn, kv_splits, causal, out, lse, q)
    check_attention_inputs(fn, q, kv_cache, block_table, query_start_loc, seq_lens,
                           out if splits == 1 else out[0], num_reqs)
    if num_reqs == 0:
        return out
    if splits > 1:
        return _split_keys_ref(q, kv_cache, block_table, query_start_loc, seq_lens, num_reqs,
                               scale, out, lse, splits, k_scale, v_scale)
    qsl = [int(x) for x in query_start_loc[: num_reqs + 1].cpu()]
    lens = seq_lens[:num_reqs].cpu()
    keep = [r for r in range(num_reqs)
            if qsl[r + 1] > qsl[r] and not (skip_decode and qsl[r + 1] - qsl[r] == 1)]
    if not keep:
        return out
    rows = torch.cat([torch.arange(qsl[r], qsl[r + 1]) for r in keep]).to(q.device)
    sub_qsl = torch.zeros(len(keep) + 1, dtype=torch.int32)
    sub_qsl[1:] = torch.cumsum(torch.tensor([qsl[r + 1] - qsl[r] for r in keep]), 0)
    meta = SimpleNamespace(query_start_loc_cpu=sub_qsl, num_reqs=len(keep),
                           seq_lens_cpu=lens[keep], block_table_tensor=block_table[keep])
    sub_lse = None if lse is None else torch.empty(rows.shape[0], q.shape[1],
                                                   dtype=torch.float32, device=q.device)
    out[rows] = paged_attention_ref(q[rows], kv_cache, meta, scale, sliding_window=sliding_window,
                                    logits_soft_cap=logits_soft_cap, sinks=sinks, causal=causal,
                                    lse=sub_lse, k_scale=k_scale, v_scale=v_scale).to(out.dtype)
    if lse is not None:
        lse[rows] = sub_lse
    return out


def _split_keys_ref(q, kv_cache, block_table, query_start_loc, seq_lens, num_reqs, scale, out,
                    lse, splits, k_scale=1.0, v_scale=1.0):
    """Non-causal attention of each request's rows over each of its ``splits`` key ranges
    (``paged_prefill_attention``'s ``kv_splits``), in float32 (an FP8 cache dequantized)."""
    block_size, num_kv_heads, head_dim = kv_cache.shape[2], kv_cache.shape[3], kv_cache.shape[4]
    group = q.shape[1] // num_kv_heads
    qsl = [int(x) for x in query_start_loc[: num_reqs + 1].cpu()]
    lens = [int(x) for x in seq_lens[:num_reqs].cpu()]
    g = KV_SPLIT_GRANULE_TOKENS
    for r in range(num_reqs):
        start, end, n = qsl[r], qsl[r + 1], lens[r]
        if end == start:
            continue
        pos = torch.arange(n, device=q.device)
        slots = block_table[r, pos // block_size].long() * block_size + pos % block_size
        k = dequantize_ref(kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots], k_scale)
        v = dequantize_ref(kv_cache[1].reshape(-1, num_kv_heads, head_dim)[slots], v_scale)
        qr = q[start:end].reshape(end - start, num_kv_heads, group, head_dim).float()
        per = -(-(-(-n // g)) // splits) * g
        for s in range(splits):
            lo, hi = s * per, min((s + 1) * per, n)
            if lo >= hi:
                out[s, start:end] = 0
                lse[s, start:end] = float("-inf")
                continue
            sc = torch.einsum("qhgd,khd->qhgk", qr, k[lo:hi]) * scale
            o = torch.einsum("qhgk,khd->qhgd", torch.softmax(sc, -1), v[lo:hi])
            out[s, start:end] = o.reshape(end - start, -1, head_dim).to(out.dtype)
            lse[s, start:end] = torch.logsumexp(sc, -1).reshape(end - start, -1)
    return out


# ---------------------------------------------------------------------------------------------
# torch's varlen flash attention (fresh prefills: no cached context)


@functools.lru_cache(maxsize=None)
def _varlen_fn():
    """``(varlen_attn, has_enable_gqa)`` or ``(None, False)`` where this torch lacks it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    try:
        params = inspect.signature(varlen_attn).parameters
    except (TypeError, ValueError):
        params = {}
    return varlen_attn, "enable_gqa" in params


def varlen_available(q: torch.Tensor) -> bool:
    """True where ``varlen_prefill_attention`` can run: CUDA, bf16/fp16, torch has varlen."""
    return varlen_available_for(q.dtype, q.device)


def varlen_available_for(dtype: torch.dtype, device: torch.device) -> bool:
    """:func:`varlen_available` for queries of ``dtype`` on ``device``."""
    return (device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)
            and _varlen_fn()[0] is not None)


def varlen_prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_start_loc: torch.Tensor,
    num_tokens: int,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of fresh prefills (no cached context) with torch's varlen flash kernel.

    ``q [T, H, D]``, ``k``/``v [T, Hkv, D]`` (the step's new tokens), ``query_start_loc`` int32
    ``[num_reqs + 1]``, ``num_tokens`` its last entry and ``max_query_len`` the longest request
    (host ints). Returns ``[num_tokens, H, D]``, or writes rows ``< num_tokens`` of ``out`` and
    returns ``out`` (rows past ``num_tokens`` are left as they are).
    """
    fn = "varlen_prefill_attention"
    fn_varlen, has_gqa = _varlen_fn()
    if fn_varlen is None or not q.is_cuda:
        raise ConfigError(f"{fn}: needs CUDA and torch.nn.attention.varlen (torch >= 2.10)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(fn, name, t, dtypes=(torch.bfloat16, torch.float16), ndim=3,
                     contiguous_last=True)
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads % num_kv_heads or tuple(k.shape) != tuple(v.shape) or k.shape[2] != q.shape[2]:
        raise ConfigError(f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
                          "do not fit [T, H, D] / [T, Hkv, D] with H a multiple of Hkv")
    if isinstance(num_tokens, bool) or not 0 <= num_tokens <= min(q.shape[0], k.shape[0]):
        raise ConfigError(f"{fn}: num_tokens {num_tokens!r} outside the {q.shape[0]} query rows")
    n = int(num_tokens)
    q, k, v = q[:n], k[:n], v[:n]
    kwargs = {"scale": float(scale), "window_size": (-1, 0)}
    if num_heads != num_kv_heads:
        if has_gqa:
            kwargs["enable_gqa"] = True
        else:
            g = num_heads // num_kv_heads
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
    res = fn_varlen(q, k, v, query_start_loc, query_start_loc, int(max_query_len),
                    int(max_query_len), **kwargs)
    if out is None:
        return res
    out[:n] = res
    return out


__all__ = [
    "INTERPRET_PREFILL_CONFIG",
    "PrefillConfig",
    "default_prefill_config",
    "paged_prefill_attention",
    "paged_prefill_attention_ref",
    "varlen_available",
    "varlen_available_for",
    "varlen_prefill_attention",
]
