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

Kernel (``_mla_decode_kernel``), grid ``(head tiles x value chunks, num_reqs, num_splits)``:
  * every query head reads the same one latent "KV head", so a program packs ``BLOCK_H`` query
    heads (``MLADecodeConfig.block_h``: 16 to 128; heads past ``H`` masked) as the rows of its
    ``tl.dot`` tiles, GQA style: each latent tile loaded from the cache serves ``BLOCK_H``
    heads, as keys (scores ``q_c c^T + q_r k_pe^T``, the two parts padded to powers of two
    separately: 512 + 64 at DeepSeek-V3's size, no padding to 1024) and, its first ``L``
    columns, as values (``acc += P c``). The programs of one request's range (its head tiles
    and value chunks) are adjacent on the grid's first axis, so they run together and the
    latent bytes they all load come from DRAM once;
  * value chunks (``v_chunks`` 2): a program owns one half of the ``L`` value columns (its
    fp32 accumulator ``[BLOCK_H, L / 2]``) and loads its tiles as that half, the other half
    and the rope part (scores from three products), so it still reads each latent byte once;
  * tiles of ``TILE_N`` positions, the block-table entry gathered per position (any block size;
    positions ``>= seq_len`` or columns past the table width are masked and never read);
    online softmax in base 2, fp32 accumulation, ``q`` cast to the cache dtype for the
    products (exact fp32 products for fp32 caches);
  * split-KV as the paged decode kernel (``triton_decode``): its split chooser
    (``choose_split`` over the ``num_reqs x head tiles x value chunks`` programs, with the
    config's ``DecodeConfig`` split fields: MLA's policies fill about one wave, see
    ``SPLIT_WIDE``), its ranges (``_split_range``) and its partials layout, so its reduce
    kernel (``_decode_reduce_kernel``) merges the ranges of a split request; a request that
    fits one range writes its normalized output directly.

Launch variants (``MLADecodeConfig``: heads per program, value chunks, tile, warps, stages,
register cap, split policy): ``MLA_DECODE_VARIANTS`` lists those ``bench/bench_swa_mla_decode_gpu.py
--sweep`` times, ``default_mla_decode_config`` picks one by head count (the call's ``config``
overrides it). Notes from compiling them for sm_90a (Triton 3.6): at ``BLOCK_H`` 64 with 8
warps the score product's warps all lie along the heads (Triton's rule for a dot feeding
another dot), so both warp groups compute the same ``64 x TILE_N`` scores; with 4 warps the
``64 x 512`` fp32 accumulator alone needs 256 registers a thread (spills), hence the value
chunks; every ``wgmma`` variant for 128 heads thus computes the scores twice per head (1.5x
the minimal tensor work of ``2 x (576 + 512)`` FLOPs per head and position; 16-32 heads a
program compute them once, with ``mma.sync``, and load each latent tile 4-8 times from L2).

CUDA graphs: the grid and the buffers depend on host ints only (no host syncs); ``num_reqs``
and the split arguments are not specialized, the head count is a runtime argument (16 and 128
heads share one compiled kernel per variant).

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
from pagedkv.kernels._common import (cdiv, check_launch_config, check_same_device, check_tensor,
                                     next_pow2, use_triton)

MAX_GRID_REQS = 65535  # requests ride the grid's second axis (CUDA's limit there)


@dataclass(frozen=True)
class MLADecodeConfig:
    """Launch parameters of the MLA decode kernel:

    * ``block_h``: query heads per program (power of two >= 16; capped at the head count's
      power of two): the rows of the ``tl.dot`` tiles. The ``H / block_h`` programs of a
      request each load the request's latent tiles (siblings on adjacent grid slots, so the
      repeats come from L2). At 64+ heads the products are Hopper ``wgmma``, at 16-32
      ``mma.sync``.
    * ``v_chunks``: 1, or 2 to split the ``kv_lora_rank`` value columns into two halves, one
      program each: the ``[block_h, L / v_chunks]`` fp32 accumulator halves (the register
      limit at 128 heads) while each program computes the whole scores (the score FLOPs
      repeat once per chunk; each program still loads every latent byte of its tiles once:
      its own half, the other half and the rope part, as three pieces).
    * ``tile_n``: positions per loop iteration (power of two >= 16); ``num_warps`` /
      ``num_stages`` as Triton's (on sm_90, Triton 3.6, the latent loads hang on the
      block-table load: ``num_stages`` 2 gives one latent buffer and a synchronous table
      load, 3 two buffers, 4 one buffer and a prefetched table, 5 two of both);
      ``maxnreg``: a register cap per thread (ptxas' ``.maxnreg``; None: ptxas' choice), to
      fit more programs per multiprocessor.
    * ``split``: the split-KV policy (``DecodeConfig``'s split fields through ``choose_split``,
      over ``num_reqs x head tiles x v_chunks`` programs; its tile and warp fields unused).

    ``MLA_DECODE_VARIANTS`` lists the variants ``bench/bench_swa_mla_decode_gpu.py --sweep``
    times; ``default_mla_decode_config`` picks one by head count.
    """

    block_h: int = 16
    tile_n: int = 32
    num_warps: int = 4
    num_stages: int = 2
    split: DecodeConfig = field(default_factory=DecodeConfig)
    v_chunks: int = 1
    maxnreg: int | None = None

    def __post_init__(self):
        check_launch_config(self, ("block_h", "tile_n"))
        if self.v_chunks not in (1, 2) or isinstance(self.v_chunks, bool):
            raise ConfigError(f"MLADecodeConfig.v_chunks must be 1 or 2, got {self.v_chunks!r}")
        if self.maxnreg is not None and not 24 <= self.maxnreg <= 255:
            raise ConfigError(f"MLADecodeConfig.maxnreg must be None or in [24, 255], got "
                              f"{self.maxnreg!r}")
        if not isinstance(self.split, DecodeConfig):
            raise ConfigError(f"MLADecodeConfig.split must be a DecodeConfig, got {self.split!r}")

    @property
    def name(self) -> str:
        """The kernel variant's short name, e.g. ``h64-v1-t32-w8-s3`` (``-r168`` with a
        register cap); the split policy is not part of it."""
        return (f"h{self.block_h}-v{self.v_chunks}-t{self.tile_n}-w{self.num_warps}"
                f"-s{self.num_stages}" + (f"-r{self.maxnreg}" if self.maxnreg else ""))


@dataclass(frozen=True)
class MLALaunch:
    """What a launch derives from a config and the shapes: heads per program (``block_h``,
    capped at ``max(16, next_pow2(H))``), head tiles, padded widths (``l_pad`` for the
    ``kv_lora_rank`` columns, ``r_pad`` for the rope columns), value columns per program and
    value chunks; ``programs_per_req = head_tiles x v_chunks`` programs per split range."""

    block_h: int
    head_tiles: int
    l_pad: int
    r_pad: int
    block_v: int
    v_chunks: int

    @property
    def programs_per_req(self) -> int:
        return self.head_tiles * self.v_chunks


def mla_launch(config: MLADecodeConfig, num_heads: int, rank: int, rope: int) -> MLALaunch:
    """The :class:`MLALaunch` of ``config`` for ``num_heads`` heads over a ``rank + rope``
    latent (two value chunks need ``next_pow2(rank) >= 32``: 16 columns each at least)."""
    block_h = min(config.block_h, max(16, next_pow2(num_heads)))
    l_pad, r_pad = max(16, next_pow2(rank)), max(16, next_pow2(rope))
    v_chunks = config.v_chunks if l_pad >= 32 else 1
    return MLALaunch(block_h, cdiv(num_heads, block_h), l_pad, r_pad, l_pad // v_chunks, v_chunks)


# Split policies (DecodeConfig's split fields, over head tiles x value chunks programs), sized
# for equal-length batches to fill about one wave of resident programs (choose_split rounds the
# split count up, hence the 0.97 = 128 / 132 of an H200's multiprocessors: a power-of-two batch
# does not spill into a second wave) and, from 2 x multiprocessors programs on, never to split:
# a split range's fp32 partial is 2 KB a head, written and read back; at 128 heads and the 8
# ranges DecodeConfig's GQA policy chose at B64 / L8192, 44% more bytes than the latent's.
# SPLIT_PACKED: two programs resident a multiprocessor (4 warps, 200-255 registers a thread).
SPLIT_PACKED = DecodeConfig(max_splits=MAX_SPLITS, small_waves=2 * 0.97, mid_splits=1,
                            large_splits=1, few_waves=None)
# SPLIT_WIDE: one program a multiprocessor (8 warps, ~250 registers a thread).
SPLIT_WIDE = DecodeConfig(max_splits=MAX_SPLITS, small_waves=0.97, small_min_split_tokens=64,
                          mid_splits=1, large_splits=1, few_waves=None)
# SPLIT_TRIPLE: three programs a multiprocessor (4 warps, at most 168 registers a thread).
SPLIT_TRIPLE = DecodeConfig(max_splits=MAX_SPLITS, small_waves=3 * 0.97, mid_splits=1,
                            large_splits=1, few_waves=None)

# The variants bench/bench_swa_mla_decode_gpu.py --sweep times (on the H200 at DeepSeek-V3's
# latent, 16 and 128 heads); default_mla_decode_config picks among them. Compiled for sm_90a
# with Triton 3.6 (registers a thread / shared memory / spills, bf16, latent 512 + 64):
MLA_DECODE_VARIANTS = (
    MLADecodeConfig(16, 32, 4, 2),  # the first version: 213 / 55 KB / 0, one latent buffer
    MLADecodeConfig(16, 32, 4, 2, SPLIT_PACKED),
    MLADecodeConfig(16, 32, 4, 5, SPLIT_PACKED),  # 255 / 91 KB / 0, two latent buffers
    MLADecodeConfig(16, 32, 4, 4, SPLIT_PACKED),  # 218 / 55 KB / 0, table prefetched
    MLADecodeConfig(16, 16, 4, 5, SPLIT_PACKED),  # 208 / 54 KB / 0
    MLADecodeConfig(16, 16, 4, 5, SPLIT_TRIPLE, maxnreg=168),  # 168 / 54 KB / 0: 3 an SM
    MLADecodeConfig(32, 64, 8, 4, SPLIT_WIDE),  # mma.sync, 255 / 112 KB / 104 B
    MLADecodeConfig(64, 32, 8, 3, SPLIT_WIDE),  # wgmma, 255 / 144 KB / 208 B
    MLADecodeConfig(64, 16, 8, 3, SPLIT_WIDE),  # wgmma, 255 / 128 KB / 72 B
    MLADecodeConfig(64, 16, 4, 3, SPLIT_PACKED, v_chunks=2),  # wgmma, 255 / 108 KB / 0
    MLADecodeConfig(128, 16, 8, 3, SPLIT_WIDE, v_chunks=2),  # wgmma, 249 / 180 KB / 0
    MLADecodeConfig(128, 32, 8, 2, SPLIT_WIDE, v_chunks=2),  # wgmma, 253 / 216 KB / 0
)

INTERPRET_MLA_DECODE_CONFIG = MLADecodeConfig(
    block_h=16, tile_n=16, num_warps=1, num_stages=1,
    split=DecodeConfig(tile_n=16, num_warps=1, num_stages=1, min_split_tokens=16))

# default_mla_decode_config's choice on a GPU: (most heads, config), the first that fits.
# From the H200 sweep (c6b42eb, bench/records/h200_session4_mla_sweep*): at 16 heads the
# 16-a-program, two-buffer variant is the fastest at B >= 16 (53-67% of 4.27 TB/s); at 128
# heads the 128-a-program, two-value-chunk, 8-warp variant (671.8 us at B64 / L8192, 21%)
# beats 64 a program (997.0 us) and the first version (1,552 us) at every batch of 16 or more.
_GPU_POLICY = (
    (32, MLADecodeConfig(16, 32, 4, 5, SPLIT_PACKED)),
    (64, MLADecodeConfig(64, 16, 4, 3, SPLIT_PACKED, v_chunks=2)),
    (None, MLADecodeConfig(128, 32, 8, 2, SPLIT_WIDE, v_chunks=2)),
)


def default_mla_decode_config(device: torch.device, num_heads: int | None = None,
                              num_reqs: int | None = None) -> MLADecodeConfig:
    """The launch the kernel uses without a ``config``: on a GPU by head count (up to 32
    heads: 16 a program, two latent buffers; up to 64: 64 heads a program in one warp group,
    the value columns in two chunks; more: 128 heads a program in two warp groups, two value
    chunks), with about one wave of split ranges; ``num_reqs`` is
    accepted for batch-dependent policies (none yet). Without a GPU: small tiles for the
    interpreter."""
    del num_reqs
    if device.type != "cuda":
        return INTERPRET_MLA_DECODE_CONFIG
    for most, cfg in _GPU_POLICY:
        if most is None or num_heads is None or num_heads <= most:
            return cfg
    raise AssertionError("unreachable: the policy's last entry takes every head count")


@triton.jit
def _cols_mask(valid, d, WIDTH: tl.constexpr, EXACT: tl.constexpr):
    """``valid`` rows x columns ``d < WIDTH``; the rows alone when ``EXACT`` (every column of
    ``d`` is below ``WIDTH``: no column predicates)."""
    if EXACT:
        mask = valid[:, None]
    else:
        mask = valid[:, None] & (d < WIDTH)[None, :]
    return mask


@triton.jit
def _latent_tile_v(acc, l_i, m_i, q_v, q_o, q_r, tok, valid, c_ptr, dv, do, dr, scale_log2,
                   RANK: tl.constexpr, ROPE: tl.constexpr, DOT_PREC: tl.constexpr,
                   HAS_OTHER: tl.constexpr, EXACT: tl.constexpr):
    """One tile of the online softmax over latent rows: the rows at element offsets ``tok``
    (``valid`` ones only; others are never read). A program's value columns ``dv`` (all of
    ``[0, RANK)``, or one half with ``HAS_OTHER``, the other half being ``do``) serve as keys
    and values; scores ``q_v c_v^T (+ q_o c_o^T) + q_r k_pe^T`` in base 2, ``acc += P c_v``.
    Heads that have seen no valid row yet keep ``m = -inf`` and zero sums (the sparse MLA
    kernel's tiles may hold none). ``EXACT``: no padded columns (``RANK`` and ``ROPE`` are
    the padded widths), so no column predicates."""
    c = tl.load(c_ptr + tok[:, None] + dv[None, :], mask=_cols_mask(valid, dv, RANK, EXACT),
                other=0.0)
    kr = tl.load(c_ptr + tok[:, None] + RANK + dr[None, :],
                 mask=_cols_mask(valid, dr, ROPE, EXACT), other=0.0)
    scores = tl.dot(q_v, tl.trans(c), input_precision=DOT_PREC)
    if HAS_OTHER:
        co = tl.load(c_ptr + tok[:, None] + do[None, :], mask=_cols_mask(valid, do, RANK, EXACT),
                     other=0.0)
        scores = tl.dot(q_o, tl.trans(co), scores, input_precision=DOT_PREC)
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
def _latent_tile(acc, l_i, m_i, q_c, q_r, tok, valid, c_ptr, dl, dr, scale_log2,
                 RANK: tl.constexpr, ROPE: tl.constexpr, DOT_PREC: tl.constexpr):
    """:func:`_latent_tile_v` over all the value columns ``dl``: the tile of
    ``mla_sparse_attention``."""
    return _latent_tile_v(acc, l_i, m_i, q_c, q_c, q_r, tok, valid, c_ptr, dl, dl, dr,
                          scale_log2, RANK, ROPE, DOT_PREC, False, False)


@triton.jit
def _mla_decode_tile(acc, l_i, m_i, q_v, q_o, q_r, t, seq_len, c_ptr, bt_row, bt_width, c_sb,
                     c_st, dv, do, dr, scale_log2, RANK: tl.constexpr, ROPE: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, DOT_PREC: tl.constexpr,
                     HAS_OTHER: tl.constexpr, EXACT: tl.constexpr):
    """Positions ``[t * TILE_N, (t + 1) * TILE_N)`` of the online softmax over latent rows."""
    n = t * TILE_N + tl.arange(0, TILE_N)
    col = n // BLOCK_SIZE
    valid = (n < seq_len) & (col < bt_width)
    blk = tl.load(bt_row + col, mask=valid, other=0).to(tl.int64)
    tok = blk * c_sb + (n % BLOCK_SIZE).to(tl.int64) * c_st
    return _latent_tile_v(acc, l_i, m_i, q_v, q_o, q_r, tok, valid, c_ptr, dv, do, dr,
                          scale_log2, RANK, ROPE, DOT_PREC, HAS_OTHER, EXACT)


@triton.jit(do_not_specialize=["num_reqs", "num_splits", "min_split_tiles", "zero_rows"])
def _mla_decode_kernel(
    q_ptr, q_s0, q_s1,
    c_ptr, c_sb, c_st,
    bt_ptr, bt_s0, bt_width,
    qsl_ptr, seq_ptr, num_reqs, num_splits, min_split_tiles, zero_rows,
    out_ptr, o_s0, o_s1,
    m_ptr, l_ptr, acc_ptr,
    scale_log2,
    num_heads,
    BLOCK_H: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    L_PAD: tl.constexpr,
    R_PAD: tl.constexpr,
    V_CHUNKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RANGE_LOOP: tl.constexpr,
):
    hv = tl.program_id(0)  # head tile x value chunk: the programs that share a latent range
    r = tl.program_id(1)
    s = tl.program_id(2)
    vc = hv % V_CHUNKS
    head = (hv // V_CHUNKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    head64 = head.to(tl.int64)
    dv = vc * (L_PAD // V_CHUNKS) + tl.arange(0, L_PAD // V_CHUNKS)  # this program's columns
    do = (1 - vc) * (L_PAD // V_CHUNKS) + tl.arange(0, L_PAD // V_CHUNKS)  # the other half
    dr = tl.arange(0, R_PAD)
    h_ok = head < num_heads
    out_mask = h_ok[:, None] & (dv < RANK)[None, :]
    q_row = tl.load(qsl_ptr + r)
    q_len = tl.load(qsl_ptr + r + 1) - q_row
    seq_len = tl.load(seq_ptr + r)  # with the offsets (in bounds: >= num_reqs entries)
    if q_len != 1:
        if (zero_rows != 0) & (q_len == 0) & (s == 0):
            # a padded request (no query rows) zeroes row r when no request owns it
            if r >= tl.load(qsl_ptr + num_reqs):
                tl.store(out_ptr + r.to(tl.int64) * o_s0 + head64[:, None] * o_s1 + dv[None, :],
                         tl.zeros([BLOCK_H, L_PAD // V_CHUNKS],
                                  tl.float32).to(out_ptr.dtype.element_ty),
                         mask=out_mask)
        return
    t0, t1, per, n_tiles = _split_range(seq_len, 0, s, num_splits, min_split_tiles, TILE_N)
    if t0 >= t1:
        return
    q_base = q_ptr + q_row.to(tl.int64) * q_s0 + head64[:, None] * q_s1
    q_v = tl.load(q_base + dv[None, :], mask=out_mask, other=0.0).to(c_ptr.dtype.element_ty)
    if V_CHUNKS == 2:
        q_o = tl.load(q_base + do[None, :], mask=h_ok[:, None] & (do < RANK)[None, :],
                      other=0.0).to(c_ptr.dtype.element_ty)
    else:
        q_o = q_v  # not used
    q_r = tl.load(q_base + RANK + dr[None, :], mask=h_ok[:, None] & (dr < ROPE)[None, :],
                  other=0.0).to(c_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, L_PAD // V_CHUNKS], tl.float32)
    bt_row = bt_ptr + r.to(tl.int64) * bt_s0
    if RANGE_LOOP:  # compiled: a for-range loop, software-pipelined by Triton
        for t in range(t0, t1):
            acc, l_i, m_i = _mla_decode_tile(acc, l_i, m_i, q_v, q_o, q_r, t, seq_len, c_ptr,
                                             bt_row, bt_width, c_sb, c_st, dv, do, dr,
                                             scale_log2, RANK, ROPE, BLOCK_SIZE, TILE_N,
                                             DOT_PREC, V_CHUNKS == 2,
                                             (L_PAD == RANK) & (R_PAD == ROPE))
    else:  # the interpreter cannot iterate range() over runtime scalars
        t = t0
        while t < t1:
            acc, l_i, m_i = _mla_decode_tile(acc, l_i, m_i, q_v, q_o, q_r, t, seq_len, c_ptr,
                                             bt_row, bt_width, c_sb, c_st, dv, do, dr,
                                             scale_log2, RANK, ROPE, BLOCK_SIZE, TILE_N,
                                             DOT_PREC, V_CHUNKS == 2,
                                             (L_PAD == RANK) & (R_PAD == ROPE))
            t += 1

    if per >= n_tiles:
        # this request fits in one split: write the final output directly
        tl.store(out_ptr + q_row.to(tl.int64) * o_s0 + head64[:, None] * o_s1 + dv[None, :],
                 (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # the partials layout of triton_decode's reduce kernel (L_PAD columns a head)
        part = (r.to(tl.int64) * num_heads + head64) * num_splits + s
        if vc == 0:  # one value chunk stores the softmax statistics
            tl.store(m_ptr + part, m_i, mask=h_ok)
            tl.store(l_ptr + part, l_i, mask=h_ok)
        tl.store(acc_ptr + part[:, None] * L_PAD + dv[None, :], acc, mask=out_mask)


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
            count (1 .. 64); config: launch parameters (default:
            ``default_mla_decode_config`` of the device and the head count).
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
    if num_reqs > MAX_GRID_REQS:
        raise ConfigError(f"{fn}: at most {MAX_GRID_REQS} requests a launch (the grid's second "
                          f"axis), got {num_reqs}: split the batch")
    if not use_triton(_mla_decode_kernel, q):
        return mla_decode_attention_ref(q, kv_cache, block_table, query_start_loc, seq_lens,
                                        num_reqs, scale, out, kv_lora_rank=kv_lora_rank,
                                        zero_padded_rows=zero_padded_rows)
    num_heads, rank = q.shape[1], kv_lora_rank
    cfg = config or default_mla_decode_config(q.device, num_heads, num_reqs)
    launch = mla_launch(cfg, num_heads, rank, kv_cache.shape[2] - rank)
    auto_splits, min_split_tokens = choose_split(num_reqs, launch.programs_per_req, max_seq_len,
                                                 num_sms(q.device), cfg.split)
    if num_splits is None:
        num_splits = auto_splits
    l_pad = launch.l_pad
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
    _mla_decode_kernel[(launch.programs_per_req, num_reqs, num_splits)](
        q, q.stride(0), q.stride(1),
        kv_cache, kv_cache.stride(0), kv_cache.stride(1),
        block_table, block_table.stride(0), block_table.shape[1],
        query_start_loc, seq_lens, num_reqs, num_splits, min_split_tiles,
        int(bool(zero_padded_rows)),
        out, out.stride(0), out.stride(1),
        m_buf, l_buf, acc_buf,
        float(scale) * LOG2E, num_heads,
        BLOCK_H=launch.block_h, RANK=rank, ROPE=kv_cache.shape[2] - rank, L_PAD=l_pad,
        R_PAD=launch.r_pad, V_CHUNKS=launch.v_chunks,
        BLOCK_SIZE=kv_cache.shape[1], TILE_N=cfg.tile_n, DOT_PREC=dot_precision(kv_cache.dtype),
        RANGE_LOOP=not interpreted(_mla_decode_kernel),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        **({} if cfg.maxnreg is None else {"maxnreg": cfg.maxnreg}),
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


__all__ = ["INTERPRET_MLA_DECODE_CONFIG", "MLA_DECODE_VARIANTS", "MLADecodeConfig", "MLALaunch",
           "SPLIT_PACKED", "SPLIT_TRIPLE", "SPLIT_WIDE", "default_mla_decode_config", "mla_decode_attention",
           "mla_decode_attention_ref", "mla_launch"]
