"""A decode layer between two attention calls in one persistent launch with grid barriers.

Why (BENCHMARKS.md, nineteenth / twenty-sixth sessions): W1's decode step pays ~1.16 ms of
fixed cost, most of it ~10 small launches a layer (cuBLAS GEMMs at ~5 us for 1-3 us of weight
bytes, norms, SiLU, graph gaps: a no-op graph node alone costs ~1.1 us). A layer without its
attention takes 27.4-38.4 us at 1-256 rows against 7.4 us of weight bytes at 4.27 TB/s. Here
the same work is **one** launch whose programs stay resident and wait for each other between
the projections (a grid barrier: an atomic counter in global memory), so that no launch, no
graph node and no tail of one kernel sits between two projections; optionally every weight
tile of the launch is asked of the L2 at its start (``PREFETCH_WEIGHTS``), so the weight stream
does not wait for the barriers. Measured on an H100 (BENCHMARKS.md, thirty-fifth session,
``bench/bench_decode_layer_gpu.py``): slower than the default path at every row count (1 / 32
/ 256 rows: 37.4 / 45.1 / 118.3 us against 29.8 / 31.9 / 41.0), so opt-in
(``DecoderForCausalLM.fuse_persistent_decode``). A grid barrier costs ~1.0 us; the phases
themselves are slower than the separate kernels: one program of 4 warps an SM keeps too few
weight bytes in flight.

The layer between two attention calls (Qwen3 order; ``attn`` is layer i's attention output):

* phase 0: ``h1 = h + attn @ Wo^T``                                  (o_proj, residual)
* phase 1: ``act = silu(n1 @ Wg^T) * (n1 @ Wu^T)``, ``n1 = rmsnorm(h1) * g1`` (gate/up, SiLU)
* phase 2: ``h2 = h1 + act @ Wd^T``                                   (down_proj, residual)
* phase 3: ``qkv = (rmsnorm(h2) * g2) @ Wqkv^T`` (layer i+1's QKV), or with ``rope`` the
  fused projection's tiles (``qkv_rope_cache.qkv_rope_tile``: bias, q/k norms, RoPE, q out,
  K / V written into layer i+1's pages)

Each phase deals its work items (a row tile and a column tile) round robin over the programs;
an item's program walks the whole inner dimension (``paired_splitk.paired_dot``), so a norm's
row statistics accumulate on the fly from the tiles it loads (``rmsnorm(x) * g @ W^T`` =
``rsqrt(mean(x^2) + eps) * ((x * g) @ W^T)``: the row scale leaves the product). ``h1``,
``act`` and ``h2`` go through global memory (rounded to the model dtype, as the model rounds
them); a barrier separates the phases. Rows past ``M`` are masked. No biases on o / gate-up /
down (the families with MLP or o biases take the other paths).

Grid barrier (:func:`grid_sync`): every program adds one to ``bar[0]`` (release, GPU scope,
after a CTA barrier) and spins until it reads ``P * k`` at the k-th barrier (acquire); the
last program out adds to ``bar[1]`` and resets both, so the next launch starts from zero. All
``P`` programs must be resident at once: the launch uses one program an SM (the kernel fits
at least two). The interpreter runs programs one after another, so a barrier there only
passes with one program: CPU runs use one program through all phases, or several programs one
phase a launch (``phases=(k, k)``, no barrier).

:func:`persistent_layer_ref` is the torch twin (float32 products of the same rounded operands;
the fused QKV phase's twin is ``qkv_rope_cache_ref`` on its ``h2``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedkv.attention._triton_common import num_sms
from pagedkv.errors import ConfigError
from pagedkv.kernels._common import check_tensor
from pagedkv.kernels.fp8_kv import is_fp8_kv
from pagedkv.kernels.paired_splitk import (
    chunk_and_splits,
    counters,
    normed_product,
    paired_dot,
    paired_split_sum,
    rms_scale,
)
from pagedkv.kernels.pdl import prefetch_lines, prefetch_weights_l2
from pagedkv.kernels.qk_norm_rope_cache import check_targets
from pagedkv.kernels.qkv_rope_cache import qkv_rope_tile
from pagedkv.kernels.splitk_gemm import GEMM_DTYPES

# every weight tile of a launch asked of the L2 at its start (CUDA only; the interpreter has
# no inline PTX): off, it cost 4.8 / 5.8 / 7.3 us a layer at 1 / 32 / 256 rows (H100,
# variants persistent_pf against persistent, thirty-fifth session)
PREFETCH_WEIGHTS = False


@triton.jit
def grid_sync(bar_ptr, target):
    """Wait until ``target`` arrivals have been counted at ``bar_ptr`` (this one included)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _tile_halves(a_ptr, lda, offs_m, M, w_ptr, n1, n2, g_ptr, s, K: tl.constexpr,
                 CHUNK: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr,
                 DOT_PREC: tl.constexpr, NORM: tl.constexpr):
    """The float32 products ``[BM, BH]`` of rows ``offs_m`` of ``a`` (rows ``>= M`` masked;
    with ``NORM`` times the norm weight ``g``) with the weight rows ``n1`` and ``n2`` over
    inner chunk ``s`` of ``CHUNK`` columns, and the rows' sums of squares (``paired_dot``: the
    fused decode kernels' two-tile product)."""
    return paired_dot(a_ptr + offs_m.to(tl.int64)[:, None] * lda,
                      w_ptr + n1.to(tl.int64)[:, None] * K, w_ptr + n2.to(tl.int64)[:, None] * K,
                      offs_m < M, n1 >= 0, s, g_ptr, K, CHUNK, BM, BH, BK, DOT_PREC, NORM)


@triton.jit
def _residual_phase(pid, P, a_ptr, w_ptr, g_ptr, res_ptr, dst_ptr, part_ptr, cnt_ptr, M, MT,
                    K: tl.constexpr, N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                    BK: tl.constexpr, DOT_PREC: tl.constexpr, SPLITS: tl.constexpr,
                    CHUNK: tl.constexpr):
    """``dst = res + a @ w^T`` (``a [M, K]``, ``w [N, K]``): this program's work items, each
    a row tile, a column tile of two halves and an inner chunk (``g_ptr`` unused: no norm).
    With ``SPLITS`` > 1 each item stores its float32 partials (``part_ptr``, ``[SPLITS, M,
    N]``) and counts itself at its tile's counter; the last of a tile's splits to arrive sums
    them in split order and stores (``paired_split_sum``)."""
    NT: tl.constexpr = N // BN
    BH: tl.constexpr = BN // 2
    t = pid
    while t < NT * MT * SPLITS:
        mt = t % MT
        nt = (t // MT) % NT
        offs_m = mt * BM + tl.arange(0, BM)
        r_ok = offs_m < M
        n = nt * BN + tl.arange(0, BH)
        acc1, acc2, ss = _tile_halves(a_ptr, K, offs_m, M, w_ptr, n, n + BH, g_ptr,
                                      t // (MT * NT), K, CHUNK, BM, BH, BK, DOT_PREC, False)
        if SPLITS == 1:
            _residual_store(res_ptr, dst_ptr, offs_m, r_ok[:, None], n, BH, N, acc1, acc2)
        else:
            part = part_ptr + offs_m.to(tl.int64)[:, None] * N + n[None, :]
            last, sum1, sum2, _ = paired_split_sum(
                acc1, acc2, ss, part, part + BH, part_ptr, M * N, M, t // (MT * NT),
                r_ok[:, None], r_ok, cnt_ptr + mt * NT + nt, SPLITS, False)
            if last:
                _residual_store(res_ptr, dst_ptr, offs_m, r_ok[:, None], n, BH, N, sum1, sum2)
        t += P


@triton.jit
def _residual_store(res_ptr, dst_ptr, offs_m, mrow, n, BH: tl.constexpr, N: tl.constexpr,
                    acc1, acc2):
    """``dst = res + acc`` on the two half tiles (columns ``n`` and ``n + BH``)."""
    ptrs = offs_m[:, None] * N + n[None, :]
    for half in tl.static_range(2):
        acc = acc1 if half == 0 else acc2
        res = tl.load(res_ptr + ptrs + half * BH, mask=mrow, other=0.0, cache_modifier=".cg")
        tl.store(dst_ptr + ptrs + half * BH, (res.to(tl.float32) + acc).to(dst_ptr.dtype.element_ty),
                 mask=mrow)


@triton.jit
def _prefetch_phase(w_ptr, n_tiles, MT, pid, P, K, w2_off, BN: tl.constexpr,
                    LINES: tl.constexpr, EPL: tl.constexpr, GATED: tl.constexpr):
    """Ask the L2 for every weight row of this program's tiles of one phase (work item ``t``
    is row tile ``t % MT`` of column tile ``t // MT``)."""
    t = pid
    while t < n_tiles * MT:
        rows = w_ptr + ((t // MT) * BN + tl.arange(0, BN)).to(tl.int64) * K
        prefetch_weights_l2(rows, 0, K, LINES, EPL, 1)
        if GATED:
            prefetch_weights_l2(rows + w2_off * K, 0, K, LINES, EPL, 1)
        t += P


@triton.jit
def _layer_kernel(h_ptr, attn_ptr, wo_ptr, g1_ptr, wgu_ptr, wd_ptr, g2_ptr, wqkv_ptr, bq_ptr,
                  h1_ptr, act_ptr, out_ptr, qkv_ptr, rpart_ptr, bar_ptr, M, MT, eps, P,
                  HD: tl.constexpr, HO: tl.constexpr, I: tl.constexpr, NQKV: tl.constexpr,
                  BM: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
                  BN_D: tl.constexpr, BN_QKV: tl.constexpr, BK: tl.constexpr,
                  SPLITS_O: tl.constexpr, CHUNK_O: tl.constexpr, SPLITS_D: tl.constexpr,
                  CHUNK_D: tl.constexpr, DOT_PREC: tl.constexpr,
                  PHASE_LO: tl.constexpr, PHASE_HI: tl.constexpr, PREFETCH: tl.constexpr,
                  LINES_HD: tl.constexpr, LINES_HO: tl.constexpr, LINES_I: tl.constexpr,
                  EPL: tl.constexpr,
                  # ROPE: phase 3 as qkv_rope_cache's tiles (q/k norms, RoPE, K/V write)
                  q_ptr, q_s0, q_s1, cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1,
                  qw_ptr, kw_ptr, slot_ptr, num_slot_rows, num_slots, block_size,
                  kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
                  part_ptr, ss_ptr, cnt_ptr, qk_eps,
                  ROPE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, HAS_QKV_BIAS: tl.constexpr,
                  QKV_SPLITS: tl.constexpr,
                  QKV_CHUNK: tl.constexpr, LINES_CHUNK: tl.constexpr):
    pid = tl.program_id(0)
    NH: tl.constexpr = NUM_HEADS + 2 * NUM_KV_HEADS
    if PREFETCH:
        for phase in tl.static_range(PHASE_LO, PHASE_HI + 1):
            if phase == 0:
                _prefetch_phase(wo_ptr, HD // BN_O, MT, pid, P, HO, 0, BN_O, LINES_HO, EPL, False)
            if phase == 1:
                _prefetch_phase(wgu_ptr, I // BN_GU, MT, pid, P, HD, I, BN_GU, LINES_HD, EPL, True)
            if phase == 2:
                _prefetch_phase(wd_ptr, HD // BN_D, MT, pid, P, I, 0, BN_D, LINES_I, EPL, False)
            if phase == 3:
                if ROPE:  # item t: row tile t % MT, head (t // MT) % NH, split t // (MT NH)
                    t = pid
                    while t < MT * NH * QKV_SPLITS:
                        hh = (t // MT) % NH
                        k0 = (t // (MT * NH)) * QKV_CHUNK
                        rows = wqkv_ptr + (hh * HEAD_DIM + tl.arange(0, HEAD_DIM)).to(tl.int64) * HD
                        prefetch_weights_l2(rows, k0, tl.minimum(k0 + QKV_CHUNK, HD), LINES_CHUNK,
                                            EPL, 1)
                        t += P
                else:
                    _prefetch_phase(wqkv_ptr, NQKV // BN_QKV, MT, pid, P, HD, 0, BN_QKV,
                                    LINES_HD, EPL, False)
    for phase in tl.static_range(PHASE_LO, PHASE_HI + 1):
        if phase > PHASE_LO:
            grid_sync(bar_ptr, P * (phase - PHASE_LO))
        if phase == 0:  # h1 = h + attn @ Wo^T
            _residual_phase(pid, P, attn_ptr, wo_ptr, g1_ptr, h_ptr, h1_ptr, rpart_ptr,
                            cnt_ptr, M, MT, HO, HD, BM, BN_O, BK, DOT_PREC, SPLITS_O, CHUNK_O)
        if phase == 1:  # act = silu(n1 @ Wg^T) * (n1 @ Wu^T)
            t = pid
            while t < I // BN_GU * MT:
                offs_m = (t % MT) * BM + tl.arange(0, BM)
                mrow = offs_m[:, None] < M
                n = (t // MT) * BN_GU + tl.arange(0, BN_GU)
                gate, up, ssq = _tile_halves(h1_ptr, HD, offs_m, M, wgu_ptr, n, n + I, g1_ptr, 0,
                                             HD, HD, BM, BN_GU, BK, DOT_PREC, True)
                r = rms_scale(ssq, eps, HD)
                gate = gate * r
                act = gate / (1.0 + tl.exp(-gate)) * (up * r)
                tl.store(act_ptr + offs_m[:, None] * I + n[None, :],
                         act.to(act_ptr.dtype.element_ty), mask=mrow)
                t += P
        if phase == 2:  # h2 = h1 + act @ Wd^T
            _residual_phase(pid, P, act_ptr, wd_ptr, g1_ptr, h1_ptr, out_ptr, rpart_ptr,
                            cnt_ptr, M, MT, I, HD, BM, BN_D, BK, DOT_PREC, SPLITS_D, CHUNK_D)
        if phase == 3 and ROPE:  # qkv_rope_cache's tiles on n2 = rmsnorm(h2) * g2
            t = pid
            while t < MT * NH * QKV_SPLITS:
                qkv_rope_tile(t % MT, (t // MT) % NH, t // (MT * NH), out_ptr, HD, wqkv_ptr, HD,
                              bq_ptr, g2_ptr, eps, q_ptr, q_s0, q_s1,
                              cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1, qw_ptr, kw_ptr,
                              slot_ptr, num_slot_rows, num_slots, block_size,
                              kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
                              part_ptr, ss_ptr, cnt_ptr, M, qk_eps, HD, QKV_CHUNK,
                              NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_NORM, HAS_QKV_BIAS, True,
                              BM, BK, QKV_SPLITS, DOT_PREC, 1.0, 1.0, False)
                t += P
        if phase == 3 and not ROPE:  # qkv = n2 @ Wqkv^T
            t = pid
            while t < NQKV // BN_QKV * MT:
                offs_m = (t % MT) * BM + tl.arange(0, BM)
                mrow = offs_m[:, None] < M
                n = (t // MT) * BN_QKV + tl.arange(0, BN_QKV // 2)
                acc1, acc2, ssq = _tile_halves(out_ptr, HD, offs_m, M, wqkv_ptr, n,
                                               n + BN_QKV // 2, g2_ptr, 0, HD, HD, BM,
                                               BN_QKV // 2, BK, DOT_PREC, True)
                r = rms_scale(ssq, eps, HD)
                dst = qkv_ptr + offs_m[:, None] * NQKV + n[None, :]
                tl.store(dst, (acc1 * r).to(qkv_ptr.dtype.element_ty), mask=mrow)
                tl.store(dst + BN_QKV // 2, (acc2 * r).to(qkv_ptr.dtype.element_ty), mask=mrow)
                t += P
    if PHASE_HI > PHASE_LO:
        grid_exit(bar_ptr, P)


@triton.jit
def grid_exit(bar_ptr, P):
    """After a launch's last barrier: the last of the ``P`` programs out resets both barrier
    counters for the next launch (every program has passed every barrier by then)."""
    tl.debug_barrier()
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == P - 1:
        tl.store(bar_ptr, 0)
        tl.store(bar_ptr + 1, 0)


@triton.jit
def _barrier_kernel(bar_ptr, count_ptr, seen_ptr, n, P, PMAX: tl.constexpr, CHECK: tl.constexpr):
    """``n`` grid barriers; program 0 counts them in ``count_ptr[0]``. With ``CHECK`` each
    program records its barrier count in ``seen_ptr[pid]`` before each barrier and, after it,
    counts into ``count_ptr[1]`` every program it sees behind (a barrier passed early)."""
    pid = tl.program_id(0)
    offs = tl.arange(0, PMAX)
    k = 0
    while k < n:
        k += 1
        if CHECK:
            tl.store(seen_ptr + pid, k)
        grid_sync(bar_ptr, P * k)
        if CHECK:
            seen = tl.load(seen_ptr + offs, mask=offs < P, other=k, volatile=True)
            behind = tl.sum((seen < k).to(tl.int32), 0)
            if behind > 0:
                tl.atomic_add(count_ptr + 1, behind, sem="relaxed", scope="gpu")
        if pid == 0:
            tl.store(count_ptr, k)
    grid_exit(bar_ptr, P)


def barrier_probe(n: int, bar: torch.Tensor, count: torch.Tensor, num_programs: int,
                  seen: torch.Tensor | None = None) -> None:
    """One launch of ``num_programs`` programs passing ``n`` grid barriers (its time at ``n``
    against ``n = 0``: the cost of one). ``count``: int32 ``[2]`` (barriers passed, programs
    seen behind at a barrier); ``seen``: int32 ``[num_programs]`` zeros to check the barrier
    (none: time it alone)."""
    _barrier_kernel[(num_programs,)](bar, count, count if seen is None else seen, n,
                                     num_programs, PMAX=triton.next_power_of_2(num_programs),
                                     CHECK=seen is not None, num_warps=4)


def layer_tiles(m: int, num_programs: int = 132, hd: int = 1024, inter: int = 3072,
                nqkv: int = 4096) -> dict:
    """Launch parameters for ``m`` rows on ``num_programs`` programs: row tiles of the next
    power of two >= 16 (the product's minimum), at most 64 (larger batches take several row
    tiles: a column tile's program reads its rows' whole inner dimension, so one row tile of
    256 would read all of ``act`` once per column tile); each phase's column tile (gate/up
    16-64 columns, the others 32-256 as two halves; a divisor of the phase's width) the one
    whose busiest program loads the fewest operand bytes: ``ceil(items / programs)`` work
    items of ``BM`` rows and ``BN`` weight rows (twice for gate/up) over the inner dimension
    (the A rows come from the L2 once per column tile: wide tiles read them fewer times,
    narrow tiles spread the weights over more programs); 64-deep inner steps. The o / down
    phases split their inner dimension (``SPLITS_O`` / ``SPLITS_D``, at most 8) where their
    items would leave programs idle (a few rows: 32 column tiles of 1,024 for 132 programs).
    Raises ``ConfigError`` for a width no tile divides."""
    bm = min(64, max(16, triton.next_power_of_2(m)))
    mt = -(-m // bm)

    def bn(n, gated=False, cap=256):
        # gate/up: BN gate rows and BN up rows an item; the others: two halves of BN / 2 rows
        # (the product's 16-row minimum each)
        def load(b):
            return -(-mt * (n // b) // num_programs) * (bm + (2 * b if gated else b))
        cands = [b for b in ((16, 32, 64, 128) if gated else (32, 64, 128, 256))
                 if b <= cap and n % b == 0]
        if not cands:
            raise ConfigError(f"persistent_layer: no column tile divides width {n}")
        return min(cands, key=load)

    bn_o, bn_d = bn(hd), bn(hd)
    return dict(BM=bm, BN_O=bn_o, BN_GU=bn(inter, True, 64), BN_D=bn_d, BN_QKV=bn(nqkv),
                BK=64, SPLITS_O=max(1, min(8, num_programs // (mt * (hd // bn_o)))),
                SPLITS_D=max(1, min(8, num_programs // (mt * (hd // bn_d)))), num_warps=4)


def shapes_served(hd: int, inter: int, head_dim: int | None = None) -> bool:
    """Whether the kernel serves a layer of hidden size ``hd`` and MLP width ``inter`` (every
    phase has a column tile that divides its width), and with ``head_dim`` the fused QKV
    phase (``qkv_rope_cache.fused_applies``)."""
    from pagedkv.kernels.qkv_rope_cache import fused_applies

    ok = hd % 32 == 0 and inter % 16 == 0
    return ok and (head_dim is None or fused_applies(head_dim))


def persistent_layer(h, attn, wo, g1, wgu, wd, g2, wqkv, eps, *, qkv_bias=None, rope=None,
                     phases=(0, 3), prefetch=None, num_programs=None, scratch=None, bar=None,
                     tiles=None, num_stages=3, check=True):
    """Run phases ``phases[0]..phases[1]`` of the layer (see the module doc) in one launch of
    ``num_programs`` programs (default: one an SM on CUDA; 1 under the interpreter, which runs
    programs one after another, so that only a lone program passes a barrier). Returns
    ``(h2, qkv, h1, act)``; outputs of phases not run are left as passed in ``scratch`` (a
    dict of those four; allocated here when absent).

    ``rope``: phase 3 as ``qkv_rope_cache`` with the input norm (its tiles ``qkv_rope_tile``:
    a head's product halves, ``qkv_bias``, the q/k norms, RoPE, q into ``q_out``, K / V into
    the paged caches at the slots), a dict of that function's arguments ``num_heads``,
    ``num_kv_heads``, ``head_dim``, ``q_norm_weight``, ``k_norm_weight``, ``eps``, ``cos``,
    ``sin``, ``slot_mapping``, ``key_cache``, ``value_cache``, ``q_out`` and optionally
    ``splits`` (inner splits: the last of a head's splits to arrive sums them and runs the
    epilogue; default: enough for the heads' tiles to cover the programs, at most 4); the
    second output is then ``q_out``. ``prefetch``: ask the L2 for every weight tile of the
    launch at its start (default ``PREFETCH_WEIGHTS`` on CUDA, never under the interpreter).
    ``bar``: int32 counters, zero between launches: the grid barrier's two, then one a tile of
    the phases that split their inner dimension (o / down column tiles, the fused QKV's heads;
    default: the stream's arrival counters, ``paired_splitk.counters``). ``tiles``: overrides
    of :func:`layer_tiles`' choices. No host syncs: CUDA-graph safe."""
    fn = "persistent_layer"
    m, hd = h.shape
    attn = attn.reshape(m, -1)
    ho = attn.shape[1]
    inter = wd.shape[1]
    nqkv = wqkv.shape[0]
    if check:
        for name, t in (("h", h), ("attn", attn), ("wo", wo), ("g1", g1), ("wgu", wgu),
                        ("wd", wd), ("g2", g2), ("wqkv", wqkv)):
            check_tensor(fn, name, t, dtypes=GEMM_DTYPES if name == "h" else (h.dtype,),
                         ndim=1 if name in ("g1", "g2") else 2, contiguous_last=True)
            if not t.is_contiguous():
                raise ConfigError(f"{fn}: {name} must be contiguous")
            if t.device != h.device:
                raise ConfigError(f"{fn}: {name} is on {t.device}, h on {h.device}")
        want = {"wo": (hd, ho), "g1": (hd,), "wgu": (2 * inter, hd), "wd": (hd, inter),
                "g2": (hd,), "wqkv": (nqkv, hd)}
        for name, t in (("wo", wo), ("g1", g1), ("wgu", wgu), ("wd", wd), ("g2", g2),
                        ("wqkv", wqkv)):
            if tuple(t.shape) != want[name]:
                raise ConfigError(f"{fn}: {name} must have shape {want[name]} for h "
                                  f"{tuple(h.shape)} and attn {tuple(attn.shape)}, got "
                                  f"{tuple(t.shape)}")
        if not (isinstance(phases, tuple) and len(phases) == 2 and 0 <= phases[0] <= phases[1] <= 3):
            raise ConfigError(f"{fn}: phases must be (lo, hi) with 0 <= lo <= hi <= 3, got {phases!r}")
        if qkv_bias is not None and rope is None:
            raise ConfigError(f"{fn}: qkv_bias needs the fused QKV phase (rope=...)")
    interpreted = isinstance(_layer_kernel, InterpretedFunction)
    if num_programs is None:
        num_programs = 1 if interpreted or h.device.type != "cuda" else num_sms(h.device)
    if interpreted and num_programs > 1 and phases[1] > phases[0]:
        raise ConfigError(f"{fn}: the interpreter runs programs one after another: a launch "
                          "with a barrier (several phases) needs num_programs=1")
    if prefetch is None:
        prefetch = PREFETCH_WEIGHTS
    prefetch = bool(prefetch) and not interpreted
    cfg = dict(layer_tiles(m, num_programs, hd, inter, nqkv if rope is None else hd), **(tiles or {}))
    if scratch is None:
        scratch = {}
    for name, cols in (("h2", hd), ("qkv", nqkv if rope is None else 0), ("h1", hd),
                       ("act", inter)):
        if name not in scratch:
            scratch[name] = torch.empty(m, cols, device=h.device, dtype=h.dtype)
    lo, hi = phases
    epl = 128 // h.element_size()
    lines = {k: prefetch_lines(k, h.element_size())[0] for k in (hd, ho, inter)}
    num_warps = cfg.pop("num_warps")
    mt = -(-m // cfg["BM"])
    cfg["CHUNK_O"], cfg["SPLITS_O"] = chunk_and_splits(ho, cfg["SPLITS_O"], cfg["BK"])
    cfg["CHUNK_D"], cfg["SPLITS_D"] = chunk_and_splits(inter, cfg["SPLITS_D"], cfg["BK"])
    rsplits = max(cfg["SPLITS_O"], cfg["SPLITS_D"])
    rpart = (torch.empty((rsplits, m, hd), dtype=torch.float32, device=h.device)
             if rsplits > 1 else h)
    # counters: the barrier's two, then one a tile of the split phases (o, down, fused QKV)
    tiles_counted = mt * hd // min(cfg["BN_O"], cfg["BN_D"])
    if rope is not None:
        tiles_counted = max(tiles_counted,
                            mt * (rope["num_heads"] + 2 * rope["num_kv_heads"]))
    cnt = counters(h.device, 2 + tiles_counted) if bar is None else bar
    if check and cnt.numel() < 2 + tiles_counted:
        raise ConfigError(f"{fn}: bar needs {2 + tiles_counted} counters, got {cnt.numel()}")
    bar = cnt[:2]
    if rope is None:
        q = cache = h
        rope_args = (q, 0, 0, q, 0, 0, q, 0, 0, q, q, bar, 0, 0, 1,
                     cache, 0, 0, 0, cache, 0, 0, 0, q, q, cnt[2:], 0.0)
        rope_const = dict(ROPE=False, NUM_HEADS=1, NUM_KV_HEADS=0, HEAD_DIM=16, HAS_NORM=False,
                          HAS_QKV_BIAS=False, QKV_SPLITS=1, QKV_CHUNK=hd, LINES_CHUNK=1)
        b_ptr = h
    else:
        r = rope
        heads, kv_heads, dim = r["num_heads"], r["num_kv_heads"], r["head_dim"]
        q = r["q_out"]
        kc, vc = r["key_cache"], r["value_cache"]
        if check:
            check_targets(fn, "h", h, heads, kv_heads, dim, r["q_norm_weight"],
                          r["k_norm_weight"], r["cos"], r["sin"], r["slot_mapping"], kc, vc, q)
            if nqkv != (heads + 2 * kv_heads) * dim or not shapes_served(hd, inter, dim):
                raise ConfigError(f"{fn}: wqkv {tuple(wqkv.shape)} is not (heads + 2 kv_heads) "
                                  f"x head_dim rows, or head_dim {dim} is not served")
            if is_fp8_kv(kc.dtype):
                raise ConfigError(f"{fn}: FP8 caches are not served (use qkv_rope_cache)")
            if qkv_bias is not None and (qkv_bias.shape != (nqkv,) or qkv_bias.dtype != h.dtype):
                raise ConfigError(f"{fn}: qkv_bias must be [{nqkv}] of {h.dtype}")
        nh = heads + 2 * kv_heads
        # default: enough inner splits for the heads' tiles to cover the programs (at most 4)
        chunk, splits = chunk_and_splits(
            hd, r.get("splits") or max(1, min(4, num_programs // (mt * nh))), cfg["BK"])
        part = torch.empty((splits, m, nqkv), dtype=torch.float32, device=h.device)
        ss = torch.empty((splits, m), dtype=torch.float32, device=h.device)
        has_norm = r["q_norm_weight"] is not None
        qw, kw = (r["q_norm_weight"], r["k_norm_weight"]) if has_norm else (h, h)
        rope_args = (q, q.stride(0), q.stride(1), r["cos"], *r["cos"].stride(), r["sin"],
                     *r["sin"].stride(), qw, kw, r["slot_mapping"], r["slot_mapping"].shape[0],
                     kc.shape[0] * kc.shape[1], kc.shape[1], kc, *kc.stride()[:3],
                     vc, *vc.stride()[:3], part, ss, cnt[2:], float(r["eps"]))
        rope_const = dict(ROPE=True, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim,
                          HAS_NORM=has_norm, HAS_QKV_BIAS=qkv_bias is not None,
                          QKV_SPLITS=splits, QKV_CHUNK=chunk,
                          LINES_CHUNK=prefetch_lines(chunk, h.element_size())[0])
        b_ptr = h if qkv_bias is None else qkv_bias
    if m == 0:
        return scratch["h2"], (scratch["qkv"] if rope is None else q), scratch["h1"], scratch["act"]
    _layer_kernel[(num_programs,)](
        h, attn, wo, g1, wgu, wd, g2, wqkv, b_ptr, scratch["h1"], scratch["act"], scratch["h2"],
        scratch["qkv"], rpart, bar, m, mt, float(eps), num_programs, HD=hd, HO=ho, I=inter,
        NQKV=nqkv, **cfg, PHASE_LO=lo, PHASE_HI=hi, PREFETCH=prefetch,
        LINES_HD=lines[hd], LINES_HO=lines[ho], LINES_I=lines[inter], EPL=epl,
        DOT_PREC="ieee" if h.dtype == torch.float32 else "tf32", num_warps=num_warps,
        num_stages=num_stages, **dict(zip(_ROPE_ARGS, rope_args)), **rope_const)
    return scratch["h2"], (scratch["qkv"] if rope is None else q), scratch["h1"], scratch["act"]


_ROPE_ARGS = ("q_ptr", "q_s0", "q_s1", "cos_ptr", "cos_s0", "cos_s1", "sin_ptr", "sin_s0",
              "sin_s1", "qw_ptr", "kw_ptr", "slot_ptr", "num_slot_rows", "num_slots",
              "block_size", "kc_ptr", "kc_s0", "kc_s1", "kc_s2", "vc_ptr", "vc_s0", "vc_s1",
              "vc_s2", "part_ptr", "ss_ptr", "cnt_ptr", "qk_eps")


def persistent_layer_ref(h, attn, wo, g1, wgu, wd, g2, wqkv, eps):
    """Torch twin: float32 products (``normed_product``, the fused kernels' normed operand),
    ``h1`` / ``act`` / ``h2`` / ``qkv`` rounded to ``h``'s dtype where the kernel stores them.
    Returns ``(h2, qkv, h1, act)``."""
    dt = h.dtype
    m = h.shape[0]
    inter = wd.shape[1]
    h1 = (h.float() + normed_product(attn.reshape(m, -1), wo, None, eps)).to(dt)
    gate = normed_product(h1, wgu[:inter], g1, eps)
    up = normed_product(h1, wgu[inter:], g1, eps)
    act = (torch.nn.functional.silu(gate) * up).to(dt)
    h2 = (h1.float() + normed_product(act, wd, None, eps)).to(dt)
    qkv = normed_product(h2, wqkv, g2, eps).to(dt)
    return h2, qkv, h1, act
