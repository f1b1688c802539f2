"""Probe: a decode layer's four projections in one persistent kernel with grid barriers.

Why (BENCHMARKS.md, nineteenth / twenty-sixth sessions): W1's decode step pays ~1.16 ms of
fixed cost, most of it ~10 small launches a layer (cuBLAS GEMMs at ~5 us for 1-3 us of weight
bytes, norms, SiLU, graph gaps: a no-op graph node alone costs ~1.1 us). A layer without its
attention takes 27.4-38.4 us at 1-256 rows against 7.4 us of weight bytes at 4.27 TB/s. The
question this probe answers before anything is built into the model: how fast is the same
work as **one** launch whose programs stay resident and wait for each other between the
projections (a grid barrier: an atomic counter in global memory), so that no launch, no graph
node and no tail of one kernel sits between two projections; and does asking the L2 for every
weight tile of the launch at its start (``PREFETCH``) hide the weights' first-byte latency.

The layer between two attention calls (Qwen3 order; ``attn`` is the attention output):

* phase 0: ``h1 = h + attn @ Wo^T``                                  (o_proj, residual)
* phase 1: ``act = silu(n1 @ Wg^T) * (n1 @ Wu^T)``, ``n1 = rmsnorm(h1) * g1`` (gate/up, SiLU)
* phase 2: ``h2 = h1 + act @ Wd^T``                                   (down_proj, residual)
* phase 3: ``qkv = (rmsnorm(h2) * g2) @ Wqkv^T``                      (next layer's QKV)

Each phase deals its output column tiles round robin over the programs; a tile's program walks
the whole inner dimension for every row (``BLOCK_M`` >= the row count), so a norm's row
statistics accumulate on the fly from the tiles it loads (``rmsnorm(x) * g @ W^T`` =
``rsqrt(mean(x^2) + eps) * ((x * g) @ W^T)``: the row scale leaves the product). ``h1``,
``act`` and ``h2`` go through global memory (bf16, as the model rounds them); a barrier separates
the phases. Rows past ``M`` are masked.

Grid barrier: every program adds one to ``bar[0]`` (release, GPU scope, after a CTA barrier)
and spins until it reads ``P * k`` at the k-th barrier (acquire); the last program out adds
to ``bar[1]`` and resets both, so the next launch starts from zero. All ``P`` programs must be
resident at once: the launch uses one program an SM. The interpreter runs programs one after
another, so a barrier there only passes with one program: the CPU test runs one program
through all phases, and several programs one phase a launch (``phases=(k, k)``, no barrier).

``layer_probe_ref`` is the torch twin (float32 products of the same bf16-rounded operands).
This is a probe for ``bench/bench_decode_layer_gpu.py`` (variants ``persistent`` and
``persistent_pf``), not an engine path: no biases, no q/k norms, RoPE or KV write (the bench
runs ``qk_norm_rope_cache`` after it, as the default path does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.kernels.paired_splitk import normed_product, paired_dot, rms_scale
from pagedkv.kernels.paired_splitk import chunk_and_splits, counters
from pagedkv.kernels.pdl import prefetch_lines, prefetch_weights_l2
from pagedkv.kernels.qkv_rope_cache import qkv_rope_tile


@triton.jit
def _grid_sync(bar_ptr, target):
    """Wait until ``target`` arrivals have been counted at ``bar_ptr`` (this one included)."""
    tl.debug_barrier()
    tl.atomic_add(bar_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(bar_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _tile_halves(a_ptr, lda, offs_m, M, w_ptr, n1, n2, g_ptr, K: tl.constexpr,
                 BM: tl.constexpr, BH: tl.constexpr, BK: tl.constexpr, DOT_PREC: tl.constexpr,
                 NORM: tl.constexpr):
    """The float32 products ``[BM, BH]`` of rows ``offs_m`` of ``a`` (rows ``>= M`` masked;
    with ``NORM`` times the norm weight ``g``) with the weight rows ``n1`` and ``n2`` over the
    whole inner dimension, and the rows' sums of squares (``paired_dot``: the fused decode
    kernels' two-tile product)."""
    return paired_dot(a_ptr + offs_m.to(tl.int64)[:, None] * lda,
                      w_ptr + n1.to(tl.int64)[:, None] * K, w_ptr + n2.to(tl.int64)[:, None] * K,
                      offs_m < M, n1 >= 0, 0, g_ptr, K, K, BM, BH, BK, DOT_PREC, NORM)


@triton.jit
def _residual_phase(pid, P, a_ptr, w_ptr, g_ptr, res_ptr, dst_ptr, M, MT, K: tl.constexpr,
                    N: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                    DOT_PREC: tl.constexpr):
    """``dst = res + a @ w^T`` (``a [M, K]``, ``w [N, K]``): this program's work items, each
    a row tile and a column tile of two halves (``g_ptr`` unused: no norm)."""
    t = pid
    while t < N // BN * MT:
        offs_m = (t % MT) * BM + tl.arange(0, BM)
        mrow = offs_m[:, None] < M
        n = (t // MT) * BN + tl.arange(0, BN // 2)
        acc1, acc2, _ = _tile_halves(a_ptr, K, offs_m, M, w_ptr, n, n + BN // 2, g_ptr, K, BM,
                                     BN // 2, BK, DOT_PREC, False)
        ptrs = offs_m[:, None] * N + n[None, :]
        for half in tl.static_range(2):
            acc = acc1 if half == 0 else acc2
            res = tl.load(res_ptr + ptrs + half * (BN // 2), mask=mrow, other=0.0)
            tl.store(dst_ptr + ptrs + half * (BN // 2),
                     (res.to(tl.float32) + acc).to(dst_ptr.dtype.element_ty), mask=mrow)
        t += P


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
def _layer_kernel(h_ptr, attn_ptr, wo_ptr, g1_ptr, wgu_ptr, wd_ptr, g2_ptr, wqkv_ptr,
                  h1_ptr, act_ptr, out_ptr, qkv_ptr, bar_ptr, M, MT, eps, P,
                  HD: tl.constexpr, HO: tl.constexpr, I: tl.constexpr, NQKV: tl.constexpr,
                  BM: tl.constexpr, BN_O: tl.constexpr, BN_GU: tl.constexpr,
                  BN_D: tl.constexpr, BN_QKV: tl.constexpr, BK: tl.constexpr,
                  DOT_PREC: tl.constexpr,
                  PHASE_LO: tl.constexpr, PHASE_HI: tl.constexpr, PREFETCH: tl.constexpr,
                  LINES_HD: tl.constexpr, LINES_HO: tl.constexpr, LINES_I: tl.constexpr,
                  EPL: tl.constexpr,
                  # ROPE: phase 3 as qkv_rope_cache's tiles (q/k norms, RoPE, K/V write)
                  q_ptr, q_s0, q_s1, cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1,
                  qw_ptr, kw_ptr, slot_ptr, num_slot_rows, num_slots, block_size,
                  kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
                  part_ptr, ss_ptr, cnt_ptr, qk_eps,
                  ROPE: tl.constexpr, NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr, QKV_SPLITS: tl.constexpr,
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
            _grid_sync(bar_ptr, P * (phase - PHASE_LO))
        if phase == 0:  # h1 = h + attn @ Wo^T
            _residual_phase(pid, P, attn_ptr, wo_ptr, g1_ptr, h_ptr, h1_ptr, M, MT, HO, HD,
                            BM, BN_O, BK, DOT_PREC)
        if phase == 1:  # act = silu(n1 @ Wg^T) * (n1 @ Wu^T)
            t = pid
            while t < I // BN_GU * MT:
                offs_m = (t % MT) * BM + tl.arange(0, BM)
                mrow = offs_m[:, None] < M
                n = (t // MT) * BN_GU + tl.arange(0, BN_GU)
                gate, up, ssq = _tile_halves(h1_ptr, HD, offs_m, M, wgu_ptr, n, n + I, g1_ptr,
                                             HD, BM, BN_GU, BK, DOT_PREC, True)
                r = rms_scale(ssq, eps, HD)
                gate = gate * r
                act = gate / (1.0 + tl.exp(-gate)) * (up * r)
                tl.store(act_ptr + offs_m[:, None] * I + n[None, :],
                         act.to(act_ptr.dtype.element_ty), mask=mrow)
                t += P
        if phase == 2:  # h2 = h1 + act @ Wd^T
            _residual_phase(pid, P, act_ptr, wd_ptr, g1_ptr, h1_ptr, out_ptr, M, MT, I, HD,
                            BM, BN_D, BK, DOT_PREC)
        if phase == 3 and ROPE:  # qkv_rope_cache's tiles on n2 = rmsnorm(h2) * g2
            t = pid
            while t < MT * NH * QKV_SPLITS:
                qkv_rope_tile(t % MT, (t // MT) % NH, t // (MT * NH), out_ptr, HD, wqkv_ptr, HD,
                              wqkv_ptr, g2_ptr, eps, q_ptr, q_s0, q_s1,
                              cos_ptr, cos_s0, cos_s1, sin_ptr, sin_s0, sin_s1, qw_ptr, kw_ptr,
                              slot_ptr, num_slot_rows, num_slots, block_size,
                              kc_ptr, kc_s0, kc_s1, kc_s2, vc_ptr, vc_s0, vc_s1, vc_s2,
                              part_ptr, ss_ptr, cnt_ptr, M, qk_eps, HD, QKV_CHUNK,
                              NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, HAS_NORM, False, True,
                              BM, BK, QKV_SPLITS, DOT_PREC, 1.0, 1.0, False)
                t += P
        if phase == 3 and not ROPE:  # qkv = n2 @ Wqkv^T
            t = pid
            while t < NQKV // BN_QKV * MT:
                offs_m = (t % MT) * BM + tl.arange(0, BM)
                mrow = offs_m[:, None] < M
                n = (t // MT) * BN_QKV + tl.arange(0, BN_QKV // 2)
                acc1, acc2, ssq = _tile_halves(out_ptr, HD, offs_m, M, wqkv_ptr, n,
                                               n + BN_QKV // 2, g2_ptr, HD, BM, BN_QKV // 2,
                                               BK, DOT_PREC, True)
                r = rms_scale(ssq, eps, HD)
                dst = qkv_ptr + offs_m[:, None] * NQKV + n[None, :]
                tl.store(dst, (acc1 * r).to(qkv_ptr.dtype.element_ty), mask=mrow)
                tl.store(dst + BN_QKV // 2, (acc2 * r).to(qkv_ptr.dtype.element_ty), mask=mrow)
                t += P
    if PHASE_HI > PHASE_LO:  # the last program out resets the barrier for the next launch
        tl.debug_barrier()
        left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if left == P - 1:
            tl.store(bar_ptr, 0)
            tl.store(bar_ptr + 1, 0)


@triton.jit
def _barrier_kernel(bar_ptr, count_ptr, n, P):
    """``n`` grid barriers and nothing else; program 0 counts them in ``count_ptr``."""
    pid = tl.program_id(0)
    k = 0
    while k < n:
        k += 1
        _grid_sync(bar_ptr, P * k)
        if pid == 0:
            tl.store(count_ptr, k)
    tl.debug_barrier()
    left = tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel", scope="gpu")
    if left == P - 1:
        tl.store(bar_ptr, 0)
        tl.store(bar_ptr + 1, 0)


def barrier_probe(n: int, bar: torch.Tensor, count: torch.Tensor, num_programs: int) -> None:
    """One launch of ``num_programs`` programs passing ``n`` grid barriers (the probe's cost
    per barrier: time at ``n`` against ``n = 0``)."""
    _barrier_kernel[(num_programs,)](bar, count, n, num_programs, num_warps=4)


def probe_tiles(m: int, num_programs: int = 132, hd: int = 1024, inter: int = 3072,
                nqkv: int = 4096) -> dict:
    """Launch parameters for ``m`` rows on ``num_programs`` programs: row tiles of the next
    power of two >= 16 (the product's minimum), at most 64 (larger batches take several row
    tiles: a column tile's program reads its rows' whole inner dimension, so one row tile of
    256 would read all of ``act`` once per column tile); each phase's column tile (gate/up
    16-64 columns, the others 32-256 as two halves) the one whose busiest program loads the
    fewest operand bytes: ``ceil(items / programs)`` work items of ``BM`` rows and ``BN``
    weight rows (twice for gate/up) over the inner
    dimension (the A rows come from the L2 once per column tile: wide tiles read them fewer
    times, narrow tiles spread the weights over more programs); 64-deep inner steps."""
    bm = min(64, max(16, triton.next_power_of_2(m)))
    mt = -(-m // bm)

    def bn(n, gated=False, cap=256):
        # gate/up: BN gate rows and BN up rows an item; the others: two halves of BN / 2 rows
        # (the product's 16-row minimum each)
        def load(b):
            return -(-mt * (n // b) // num_programs) * (bm + (2 * b if gated else b))
        cands = (16, 32, 64, 128) if gated else (32, 64, 128, 256)
        return min((b for b in cands if b <= cap and n % b == 0), key=load)

    return dict(BM=bm, BN_O=bn(hd), BN_GU=bn(inter, True, 64), BN_D=bn(hd), BN_QKV=bn(nqkv),
                BK=64, num_warps=4)


def layer_probe(h, attn, wo, g1, wgu, wd, g2, wqkv, eps, *, num_programs=None,
                phases=(0, 3), prefetch=False, bar=None, scratch=None, num_stages=3, tiles=None,
                rope=None):
    """Run phases ``phases[0]..phases[1]`` of the layer (see the module doc) in one launch of
    ``num_programs`` programs (default: one an SM). Returns ``(h2, qkv, h1, act)``; phases not
    run leave their outputs as passed in ``scratch`` (a dict of those four, allocated here
    when absent). ``bar``: an int32[2] zero tensor (allocated when absent).

    ``rope``: phase 3 as ``qkv_rope_cache`` with the input norm (its tiles ``qkv_rope_tile``:
    a head's product halves, the q/k norms, RoPE, q into ``q_out``, K / V into the paged
    caches), a dict of that function's arguments ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``q_norm_weight``, ``k_norm_weight``, ``eps``, ``cos``, ``sin``,
    ``slot_mapping``, ``key_cache``, ``value_cache``, ``q_out`` and ``splits`` (inner
    splits: the last of a head's splits to arrive sums them and runs the epilogue); the
    second output is then ``q_out``."""
    m, hd = h.shape
    ho = attn.shape[-1]
    inter = wd.shape[1]
    nqkv = wqkv.shape[0]
    attn = attn.reshape(m, ho)
    for t in (h, attn, wo, g1, wgu, wd, g2, wqkv):
        assert t.is_contiguous()
    assert wo.shape == (hd, ho) and wgu.shape == (2 * inter, hd) and wqkv.shape[1] == hd
    if num_programs is None:
        num_programs = torch.cuda.get_device_properties(h.device).multi_processor_count
    cfg = dict(probe_tiles(m, num_programs, hd, inter, nqkv), **(tiles or {}))
    for n, bn in ((hd, cfg["BN_O"]), (inter, cfg["BN_GU"]), (hd, cfg["BN_D"]), (nqkv, cfg["BN_QKV"])):
        assert n % bn == 0
    for k in (hd, ho, inter):
        assert k % cfg["BK"] == 0
    if scratch is None:
        scratch = {}
    for name, cols in (("h2", hd), ("qkv", nqkv), ("h1", hd), ("act", inter)):
        if name not in scratch:
            scratch[name] = torch.empty(m, cols, device=h.device, dtype=h.dtype)
    if bar is None:
        bar = torch.zeros(2, device=h.device, dtype=torch.int32)
    lo, hi = phases
    assert 0 <= lo <= hi <= 3
    epl = 128 // h.element_size()
    lines = {k: prefetch_lines(k, h.element_size())[0] for k in (hd, ho, inter)}
    num_warps = cfg.pop("num_warps")
    mt = -(-m // cfg["BM"])
    if rope is None:
        q = cache = h
        rope_args = (q, 0, 0, q, 0, 0, q, 0, 0, q, q, bar, 0, 0, 1,
                     cache, 0, 0, 0, cache, 0, 0, 0, q, q, bar, 0.0)
        rope_const = dict(ROPE=False, NUM_HEADS=1, NUM_KV_HEADS=0, HEAD_DIM=16, HAS_NORM=False,
                          QKV_SPLITS=1, QKV_CHUNK=hd, LINES_CHUNK=1)
    else:
        r = rope
        heads, kv_heads, dim = r["num_heads"], r["num_kv_heads"], r["head_dim"]
        assert nqkv == (heads + 2 * kv_heads) * dim
        chunk, splits = chunk_and_splits(hd, r.get("splits", 1), cfg["BK"])
        nh = heads + 2 * kv_heads
        q = r["q_out"]
        part = torch.empty((splits, m, nqkv), dtype=torch.float32, device=h.device)
        ss = torch.empty((splits, m), dtype=torch.float32, device=h.device)
        cnt = counters(h.device, mt * nh)
        kc, vc = r["key_cache"], r["value_cache"]
        has_norm = r["q_norm_weight"] is not None
        qw, kw = (r["q_norm_weight"], r["k_norm_weight"]) if has_norm else (h, h)
        rope_args = (q, q.stride(0), q.stride(1), r["cos"], *r["cos"].stride(), r["sin"],
                     *r["sin"].stride(), qw, kw, r["slot_mapping"], r["slot_mapping"].shape[0],
                     kc.shape[0] * kc.shape[1], kc.shape[1], kc, *kc.stride()[:3],
                     vc, *vc.stride()[:3], part, ss, cnt, float(r["eps"]))
        rope_const = dict(ROPE=True, NUM_HEADS=heads, NUM_KV_HEADS=kv_heads, HEAD_DIM=dim,
                          HAS_NORM=has_norm, QKV_SPLITS=splits, QKV_CHUNK=chunk,
                          LINES_CHUNK=prefetch_lines(chunk, h.element_size())[0])
    _layer_kernel[(num_programs,)](
        h, attn, wo, g1, wgu, wd, g2, wqkv, scratch["h1"], scratch["act"], scratch["h2"],
        scratch["qkv"], bar, m, mt, float(eps), num_programs, HD=hd, HO=ho, I=inter,
        NQKV=nqkv, **cfg, PHASE_LO=lo, PHASE_HI=hi, PREFETCH=bool(prefetch),
        LINES_HD=lines[hd], LINES_HO=lines[ho], LINES_I=lines[inter], EPL=epl,
        DOT_PREC="ieee" if h.dtype == torch.float32 else "tf32", num_warps=num_warps,
        num_stages=num_stages, **dict(zip(_ROPE_ARGS, rope_args)), **rope_const)
    return scratch["h2"], (scratch["qkv"] if rope is None else q), scratch["h1"], scratch["act"]


_ROPE_ARGS = ("q_ptr", "q_s0", "q_s1", "cos_ptr", "cos_s0", "cos_s1", "sin_ptr", "sin_s0",
              "sin_s1", "qw_ptr", "kw_ptr", "slot_ptr", "num_slot_rows", "num_slots",
              "block_size", "kc_ptr", "kc_s0", "kc_s1", "kc_s2", "vc_ptr", "vc_s0", "vc_s1",
              "vc_s2", "part_ptr", "ss_ptr", "cnt_ptr", "qk_eps")


def layer_probe_ref(h, attn, wo, g1, wgu, wd, g2, wqkv, eps):
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
