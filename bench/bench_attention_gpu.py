#!/usr/bin/env python
"""GPU benchmark: paged decode and prefill attention (Triton) against torch's kernels.

Shapes (PERF.md kernel anchors): bf16, block size 16, 16 query / 8 KV heads, head_dim 128.

Decode (one query token per request) at B1/L512, B1/L8192, B64/L2048, B64/L8192, B256/L8192:
  * ours: ``paged_decode_attention`` (split-KV chosen by ``choose_num_splits``, reduce kernel
    included), timed as CUDA-graph replays over disjoint pages: one graph holds ``R`` calls,
    each over its own block table (shuffled, disjoint physical blocks of one big cache), query
    and output, with ``R`` chosen so that the pages touched exceed 0.5 GB (cold L2, 60 MB);
    microseconds per call = replay time / R, median over trials;
  * torch SDPA (cuDNN and flash backends, ``enable_gqa``), contiguous K/V ``[B, Hkv, L, D]``,
    the same rotation over R disjoint copies;
  * the fraction of 4.27 TB/s counts the K and V bytes read: ``2 * B * L * Hkv * D * 2``;
  * ``--sweep``: tile / warps / stages variants of our kernel and forced split counts.

Prefill, 8 requests x 2048 new tokens, causal, no cached context:
  * ours: ``paged_prefill_attention`` reading K/V through the block table (block 16);
  * torch 2.11 ``torch.nn.attention.varlen.varlen_attn`` on the packed new-token K/V (K/V heads
    repeated to 16 unless that torch has ``enable_gqa``; timed with and without the repeat);
  * torch SDPA flash / cuDNN on ``[8, 16, 2048, 128]`` (is_causal, enable_gqa);
  * TFLOP/s with causal FLOPs = ``2 * 2 * H * D * S * (S + 1) / 2`` per sequence (QK^T and PV,
    multiply-add = 2, the S(S+1)/2 visible pairs): 8 x 2048 -> 137.5 GFLOP.
  * timing: ``triton.testing.do_bench`` median (L2 flushed between calls).

Every kernel's output is checked against the torch reference (fp32) on a sample first:
``||out - ref|| / ||ref||`` is reported and must stay under 2e-2 (bf16).

Measured on the H200 (torch 2.11.0+cu130, triton 3.6.0; commit 7f2dad2, us per call; raw in
bench/records/h200_attention_gpu.{json,log}, table in BENCHMARKS.md):

    decode      ours, default policy (ranges)  one range   SDPA cuDNN     SDPA flash     vLLM split-K
    B1/L512       8.0 (16)                     17.3        8.4            9.2            -
    B1/L8192     18.7 (42%, 32)               226.7       15.1 (52%)     22.8 (34%)     28.1
    B64/L2048   146.3 (86%, 8)                128.9       124.8 (101%)   219.5 (57%)    147
    B64/L8192   517.6 (97%, 8)                506.3       480.9 (105%)   888.3 (57%)    533
    B256/L8192 1995.2 (101%, 4)              2059.0      1901.0 (106%)  3519.2 (57%)   2034
    prefill 8 x 2048 causal: ours 510 us (270 TFLOP/s), varlen_attn 671 (205; 501 / 274 without
    the K/V head repeat), SDPA cuDNN 284 (485), SDPA flash 483 (285).

Run on the GPU machine from the repository root (torch 2.11 + triton 3.6, no installs):
    python bench/bench_attention_gpu.py --out bench/results/attention_gpu.json [--sweep]
A table is printed last; JSON with every number goes to --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import triton  # noqa: E402

from pagedkv.attention.torch_ref import paged_attention_ref  # noqa: E402
from pagedkv.attention._triton_common import num_sms  # noqa: E402
from pagedkv.attention.triton_decode import (  # noqa: E402
    DecodeConfig,
    _decode_kernel,
    choose_num_splits,
    one_range_for,
    paged_decode_attention,
)
from pagedkv.attention.triton_prefill import (  # noqa: E402
    PrefillConfig,
    _prefill_kernel,
    _varlen_fn,
    paged_prefill_attention,
    varlen_prefill_attention,
)

COPY_TBPS = 4.27  # device-to-device copy ceiling (PERF.md), TB/s
H, HKV, D, BS = 16, 8, 128, 16
DTYPE = torch.bfloat16
DECODE_SHAPES = [(1, 512), (1, 8192), (64, 2048), (64, 8192), (256, 8192)]
VLLM_DECODE_US = {  # PERF.md anchors: (unified, split-K best)
    (1, 8192): (46.5, 28.1), (64, 2048): (147, 147), (64, 8192): (564, 533),
    (256, 8192): (2232, 2034),
}
COLD_BYTES = 512 << 20
MAX_ROT = 64
SCALE = D ** -0.5


def log(msg: str) -> None:
    print(msg, flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any():
        return float("nan")
    return float((out - ref).norm() / ref.norm())


# ---------------------------------------------------------------------------------------------
# timing


def time_graph(calls, min_ms: float = 20.0, trials: int = 7) -> float:
    """Capture ``calls`` (a list of no-arg callables) in one CUDA graph; median over trials of
    the replay time / len(calls), in us."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    us = replay_us(graph, min_ms, trials) / len(calls)
    del graph
    return us


def replay_us(graph, min_ms: float = 20.0, trials: int = 7, max_reps: int = 200) -> float:
    """Median over ``trials`` of a captured graph's replay time in us (each trial at least
    ``min_ms`` of back-to-back replays, at most ``max_reps``)."""
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    graph.replay()
    torch.cuda.synchronize()
    one = max(time.perf_counter() - t, 1e-6)
    reps = max(3, min(max_reps, int(min_ms / 1e3 / one)))
    samples = []
    for _ in range(trials):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            graph.replay()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(samples)


def do_bench_us(fn) -> float:
    return float(triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")) * 1e3


# ---------------------------------------------------------------------------------------------
# decode


class DecodeSetup:
    """R rotations of (query, block table, output) over disjoint pages of one cache."""

    def __init__(self, batch: int, ctx: int, seed: int = 0, kv_dtype: torch.dtype = DTYPE):
        self.batch, self.ctx = batch, ctx
        self.kv_bytes = 2 * batch * ctx * HKV * D * torch.empty((), dtype=kv_dtype).element_size()
        self.rot = max(2, min(MAX_ROT, math.ceil(COLD_BYTES / self.kv_bytes)))
        gen = torch.Generator(device="cuda").manual_seed(seed)
        blocks_per_req = -(-ctx // BS)
        per_rot = batch * blocks_per_req
        num_blocks = 1 + self.rot * per_rot
        self.cache = torch.randn((2, num_blocks, BS, HKV, D), generator=gen, device="cuda",
                                 dtype=DTYPE).to(kv_dtype)
        perm = torch.randperm(num_blocks - 1, generator=gen, device="cuda").to(torch.int32) + 1
        self.tables = [perm[i * per_rot:(i + 1) * per_rot].view(batch, blocks_per_req)
                       for i in range(self.rot)]
        self.qs = [torch.randn((batch, H, D), generator=gen, device="cuda", dtype=DTYPE)
                   for _ in range(self.rot)]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        self.seq = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")

    def call(self, i: int, **kw):
        # host hints as the engine passes them: the longest length and whether the lengths
        # are balanced (equal here)
        kw.setdefault("balanced", one_range_for([self.ctx] * self.batch, self.batch, HKV,
                                                num_sms(torch.device("cuda")),
                                                kw.get("config") or DecodeConfig()))
        return lambda: paged_decode_attention(
            self.qs[i], self.cache, self.tables[i], self.qsl, self.seq, self.batch, SCALE,
            self.outs[i], max_seq_len=self.ctx, **kw)

    def check(self, i: int = 0, sample: int = 4) -> float:
        self.outs[i].fill_(float("nan"))
        self.call(i)()
        torch.cuda.synchronize()
        n = min(sample, self.batch)
        qsl = torch.arange(n + 1, dtype=torch.int32)
        meta = SimpleNamespace(query_start_loc_cpu=qsl, num_reqs=n,
                               seq_lens_cpu=torch.full((n,), self.ctx, dtype=torch.int32),
                               block_table_tensor=self.tables[i][:n])
        ref = paged_attention_ref(self.qs[i][:n].float(), self.cache, meta, SCALE)
        return rel_err(self.outs[i][:n], ref)

    def time(self, **kw) -> float:
        return time_graph([self.call(i, **kw) for i in range(self.rot)])


def sdpa_decode(batch: int, ctx: int, backend_name: str) -> dict:
    """torch SDPA on contiguous K/V ``[B, Hkv, L, D]`` (R disjoint copies), ``enable_gqa``;
    where the backend refuses GQA, K/V repeated to the query heads (bytes still counted at
    Hkv)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    backend = getattr(SDPBackend, backend_name)
    kv_bytes = 2 * batch * ctx * HKV * D * 2
    rot = max(2, min(MAX_ROT, math.ceil(COLD_BYTES / kv_bytes)))
    qs = [torch.randn((batch, H, 1, D), device="cuda", dtype=DTYPE) for _ in range(rot)]
    ks = [torch.randn((batch, HKV, ctx, D), device="cuda", dtype=DTYPE) for _ in range(rot)]
    vs = [torch.randn((batch, HKV, ctx, D), device="cuda", dtype=DTYPE) for _ in range(rot)]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    ns = min(batch, 2)  # reference on a sample of the batch
    ref = sdpa(qs[0][:ns].float(), ks[0][:ns].float().repeat_interleave(H // HKV, 1),
               vs[0][:ns].float().repeat_interleave(H // HKV, 1), scale=SCALE)
    res = {}
    for mode in ("enable_gqa", "repeat"):
        try:
            if mode == "repeat":
                if 2 * kv_bytes * rot > (40 << 30):
                    raise RuntimeError("repeated K/V would not fit")
                ks = [x.repeat_interleave(H // HKV, 1) for x in ks]
                vs = [x.repeat_interleave(H // HKV, 1) for x in vs]
            kw = {"enable_gqa": True} if mode == "enable_gqa" else {}

            def mk(i, kw=kw):
                def fn():
                    with sdpa_kernel([backend]):
                        sdpa(qs[i], ks[i], vs[i], scale=SCALE, **kw)
                return fn
            with sdpa_kernel([backend]):
                o = sdpa(qs[0], ks[0], vs[0], scale=SCALE, **kw)
            res["rel_err"] = rel_err(o[:ns], ref)
            res["us"] = time_graph([mk(i) for i in range(rot)])
            res["mode"] = mode
            return res
        except Exception as e:  # noqa: BLE001 - report and try the next mode
            res[f"error_{mode}"] = f"{type(e).__name__}: {str(e)[:200]}"
    return res


DECODE_SWEEP = [  # (num_stages - 3) K/V buffers deep, per the sm_90 TTGIR (Triton 3.6)
    DecodeConfig(tile_n=32, num_warps=4, num_stages=7),
    DecodeConfig(tile_n=64, num_warps=4, num_stages=5),
]
EXTRA_DECODE_SHAPES = [(32, 8192), (128, 8192)]  # --sweep only: check the split heuristic


def bench_decode(sweep: bool) -> list[dict]:
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    base = DecodeConfig()
    for batch, ctx in DECODE_SHAPES + (EXTRA_DECODE_SHAPES if sweep else []):
        try:
            rows.append(bench_decode_shape(batch, ctx, sweep, sms, base))
        except Exception:  # noqa: BLE001 - keep the other shapes
            rows.append({"batch": batch, "ctx": ctx, "error": traceback.format_exc()})
            log(rows[-1]["error"])
        torch.cuda.empty_cache()
    return rows


def bench_decode_shape(batch: int, ctx: int, sweep: bool, sms: int, base: DecodeConfig) -> dict:
    t0 = time.time()
    st = DecodeSetup(batch, ctx)
    gbps = lambda us: st.kv_bytes / (us * 1e-6) / 1e12  # noqa: E731
    row = {"batch": batch, "ctx": ctx, "kv_bytes": st.kv_bytes, "rotations": st.rot,
           "splits_auto": choose_num_splits(batch, HKV, ctx, sms, base, True)}
    row["rel_err"] = st.check()
    row["us"] = st.time()
    row["tbps"] = gbps(row["us"])
    row["frac"] = row["tbps"] / COPY_TBPS
    if sweep:
        ref_out = st.outs[0].clone()
        variants = {}
        for cfg in DECODE_SWEEP:
            name = f"t{cfg.tile_n}w{cfg.num_warps}s{cfg.num_stages}"
            try:
                st.call(0, config=cfg)()
                torch.cuda.synchronize()
                err = rel_err(st.outs[0], ref_out)
                variants[name] = {"us": st.time(config=cfg), "rel_vs_default": err}
            except Exception as e:  # noqa: BLE001
                variants[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
        if batch == 1:  # shorter splits (more programs) for short contexts
            for ms in (32, 64, 128):
                cfg = DecodeConfig(min_split_tokens=ms)
                variants[f"minsplit{ms}"] = {"us": st.time(config=cfg),
                                             "splits": choose_num_splits(batch, HKV, ctx, sms, cfg, True)}
            forced, splits = DecodeConfig(min_split_tokens=16), [1, 4, 8, 16]
        else:
            # the regime's split count with longer minimum ranges (fewer, longer splits)
            for ms in (512, 1024):
                cfg = DecodeConfig(min_split_tokens=ms)
                variants[f"minsplit{ms}"] = {"us": st.time(config=cfg),
                                             "splits": choose_num_splits(batch, HKV, ctx, sms, cfg, True)}
            forced, splits = base, [1, 2, 4, 8]
        for sp in splits:
            variants[f"splits{sp}"] = {"us": st.time(num_splits=sp, config=forced)}
        row["variants"] = variants
        best = min(((v["us"], k) for k, v in variants.items() if "us" in v))
        row["best_variant"], row["best_us"] = best[1], best[0]
    del st
    torch.cuda.empty_cache()
    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION") if (batch, ctx) in DECODE_SHAPES else ():
        r = sdpa_decode(batch, ctx, be)
        if "us" in r:
            r["frac"] = (2 * batch * ctx * HKV * D * 2) / (r["us"] * 1e-6) / 1e12 / COPY_TBPS
        row[f"sdpa_{be.split('_')[0].lower()}"] = r
        torch.cuda.empty_cache()
    log(f"decode B{batch}/L{ctx}: ours {row['us']:.1f} us ({row['frac']:.0%}), err "
        f"{row['rel_err']:.1e}, splits {row['splits_auto']}, rot {row['rotations']}"
        + (f", best {row['best_variant']} {row['best_us']:.1f}" if sweep else "")
        + f"  [{time.time() - t0:.0f}s]")
    return row


# ---------------------------------------------------------------------------------------------
# prefill

PREFILL_SWEEP = [
    # with the block table loaded a tile ahead, 3 stages keep 2 K/V tiles in flight (4 stages:
    # 3 tiles, 147 KB of shared memory, one program a multiprocessor)
    PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=4),
    PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3),
    PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=4),
    PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=3),
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2),
    PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=3),
    PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3),
    # 128 query rows in one warpgroup (4 warps: two m64 products a tile, 255 registers, no
    # spills on sm_90); the twenty-second session's one-page-a-tile probe reached 374 TFLOP/s
    # at 128 x 64 x 4 warps on pages of 64 (the package kernel: 339 there, 314 on pages of 16)
    PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    PrefillConfig(block_m=128, block_n=64, num_warps=4, num_stages=2),
    PrefillConfig(block_m=128, block_n=32, num_warps=4, num_stages=3),
    PrefillConfig(block_m=128, block_n=32, num_warps=4, num_stages=4),
    PrefillConfig(block_m=128, block_n=128, num_warps=4, num_stages=2),
    # the two query heads of a K/V head packed into one program (rows = block_m x 2)
    PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=3, pack_heads=2),
    PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=3, pack_heads=2),
    PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, pack_heads=2),
]


def bench_prefill(sweep: bool, num_seqs: int = 8, seq: int = 2048) -> dict:
    torch.manual_seed(1)
    flops = num_seqs * 4 * H * D * seq * (seq + 1) / 2
    tflops = lambda us: flops / (us * 1e-6) / 1e12  # noqa: E731
    T = num_seqs * seq
    q = torch.randn((T, H, D), device="cuda", dtype=DTYPE)
    k = torch.randn((T, HKV, D), device="cuda", dtype=DTYPE)
    v = torch.randn((T, HKV, D), device="cuda", dtype=DTYPE)
    blocks = -(-seq // BS)
    cache = torch.full((2, 1 + num_seqs * blocks, BS, HKV, D), float("nan"), device="cuda",
                       dtype=DTYPE)
    table = (torch.randperm(num_seqs * blocks, device="cuda").to(torch.int32) + 1).view(
        num_seqs, blocks)
    pos = torch.arange(T, device="cuda") % seq
    slots = table.view(-1)[(torch.arange(T, device="cuda") // seq) * blocks + pos // BS].long() \
        * BS + pos % BS
    cache[0].view(-1, HKV, D)[slots] = k
    cache[1].view(-1, HKV, D)[slots] = v
    qsl = torch.arange(0, T + 1, seq, dtype=torch.int32, device="cuda")
    seq_lens = torch.full((num_seqs,), seq, dtype=torch.int32, device="cuda")
    out = torch.empty_like(q)

    # reference for the first sequence (fp32)
    meta = SimpleNamespace(query_start_loc_cpu=qsl[:2].cpu(), num_reqs=1,
                           seq_lens_cpu=seq_lens[:1].cpu(), block_table_tensor=table[:1])
    ref = paged_attention_ref(q[:seq].float(), cache, meta, SCALE)
    res = {"num_seqs": num_seqs, "seq": seq, "gflop": flops / 1e9,
           "flop_formula": "2 * 2 * H * D * S * (S + 1) / 2 per sequence"}

    def ours(cfg=None):
        return lambda: paged_prefill_attention(q, cache, table, qsl, seq_lens, num_seqs, SCALE,
                                               out, num_tokens=T, config=cfg)

    out.fill_(float("nan"))
    ours()()
    torch.cuda.synchronize()
    res["triton"] = {"rel_err": rel_err(out[:seq], ref), "us": do_bench_us(ours())}
    res["triton"]["tflops"] = tflops(res["triton"]["us"])
    log(f"prefill triton default: {res['triton']['us']:.0f} us, "
        f"{res['triton']['tflops']:.0f} TFLOP/s, err {res['triton']['rel_err']:.1e}")
    if sweep:
        variants = {}
        for cfg in PREFILL_SWEEP:
            name = f"m{cfg.block_m}n{cfg.block_n}w{cfg.num_warps}s{cfg.num_stages}p{cfg.pack_heads}"
            try:
                out.fill_(float("nan"))
                ours(cfg)()
                torch.cuda.synchronize()
                us = do_bench_us(ours(cfg))
                variants[name] = {"us": us, "tflops": tflops(us),
                                  "rel_err": rel_err(out[:seq], ref)}
            except Exception as e:  # noqa: BLE001
                variants[name] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            log(f"  prefill {name}: {variants[name]}")
        res["triton_variants"] = variants

    fn, has_gqa = _varlen_fn()
    res["varlen_has_enable_gqa"] = has_gqa
    if fn is not None:
        try:
            vl = lambda: varlen_prefill_attention(q, k, v, qsl, T, seq, SCALE, out)  # noqa: E731
            out.fill_(float("nan"))
            vl()
            torch.cuda.synchronize()
            r = {"rel_err": rel_err(out[:seq], ref), "us": do_bench_us(vl)}
            r["tflops"] = tflops(r["us"])
            kr, vr = k.repeat_interleave(H // HKV, 1), v.repeat_interleave(H // HKV, 1)
            kern = lambda: fn(q, kr, vr, qsl, qsl, seq, seq, scale=SCALE,  # noqa: E731
                              window_size=(-1, 0))
            r["kernel_only_us"] = do_bench_us(kern)
            r["kernel_only_tflops"] = tflops(r["kernel_only_us"])
            res["varlen"] = r
        except Exception as e:  # noqa: BLE001
            res["varlen"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    else:
        res["varlen"] = {"error": "torch.nn.attention.varlen missing"}
    log(f"prefill varlen: {res['varlen']}")

    from torch.nn.attention import SDPBackend, sdpa_kernel
    qb = q.view(num_seqs, seq, H, D).transpose(1, 2).contiguous()
    kb = k.view(num_seqs, seq, HKV, D).transpose(1, 2).contiguous()
    vb = v.view(num_seqs, seq, HKV, D).transpose(1, 2).contiguous()
    for be in ("CUDNN_ATTENTION", "FLASH_ATTENTION"):
        name = f"sdpa_{be.split('_')[0].lower()}"
        r = {}
        for mode in ("enable_gqa", "repeat"):
            try:
                if mode == "enable_gqa":
                    args, kw = (qb, kb, vb), {"enable_gqa": True}
                else:
                    args = (qb, kb.repeat_interleave(2, 1), vb.repeat_interleave(2, 1))
                    kw = {}

                def f(args=args, kw=kw, be=be):
                    with sdpa_kernel([getattr(SDPBackend, be)]):
                        return torch.nn.functional.scaled_dot_product_attention(
                            *args, is_causal=True, scale=SCALE, **kw)
                o = f()
                r["rel_err"] = rel_err(o[0].transpose(0, 1), ref)
                r["us"] = do_bench_us(f)
                r["tflops"] = tflops(r["us"])
                r["mode"] = mode
                break
            except Exception as e:  # noqa: BLE001
                r[f"error_{mode}"] = f"{type(e).__name__}: {str(e)[:200]}"
        res[name] = r
        log(f"prefill {name}: {r}")
    return res


# ---------------------------------------------------------------------------------------------


def kernel_report() -> dict:
    """Registers, spills, shared memory and markers of the compiled variants."""
    rep = {}
    for name, kern in (("decode", _decode_kernel), ("prefill", _prefill_kernel)):
        try:
            caches = kern.device_caches
            for dev, entry in caches.items():
                for key, ck in entry[0].items():
                    ttgir = ck.asm.get("ttgir", "")
                    ptx = ck.asm.get("ptx", "")
                    rep[f"{name}:{len(rep)}"] = {
                        "n_regs": getattr(ck, "n_regs", None),
                        "n_spills": getattr(ck, "n_spills", None),
                        "shared": getattr(ck.metadata, "shared", None),
                        "num_warps": getattr(ck.metadata, "num_warps", None),
                        "num_stages": getattr(ck.metadata, "num_stages", None),
                        "async_copy": ttgir.count("async_copy_global_to_local"),
                        "cp_async_ptx": ptx.count("cp.async"),
                        "wgmma": ptx.count("wgmma.mma_async"),
                        "mma_sync": ptx.count("mma.sync"),
                        "ld_v4": ptx.count("ld.global.v4") + ptx.count("ld.global.nc.v4"),
                        "constants": str(getattr(ck, "constants", ""))[:300],
                    }
        except Exception as e:  # noqa: BLE001
            rep[name] = f"{type(e).__name__}: {e}"
    return rep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results/attention_gpu.json")
    ap.add_argument("--sweep", action="store_true", help="also time config / split variants")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-prefill", action="store_true")
    ap.add_argument("--block-size", type=int, default=BS,
                    help=f"tokens a page (default {BS}, the engine's default block)")
    args = ap.parse_args()
    globals()["BS"] = args.block_size  # the module's page size, read by every case
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (run it on the H200 machine)")
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET to benchmark compiled kernels")
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__, "cuda": torch.version.cuda,
            "python": platform.python_version(),
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "shape": {"heads": H, "kv_heads": HKV, "head_dim": D, "block_size": BS,
                      "dtype": str(DTYPE)},
            "copy_ceiling_tbps": COPY_TBPS}
    results = {"meta": meta}
    out_dir = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(out_dir, exist_ok=True)

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2, default=str)

    t0 = time.time()
    if not args.skip_decode:
        try:
            results["decode"] = bench_decode(args.sweep)
        except Exception:  # noqa: BLE001
            results["decode_error"] = traceback.format_exc()
            log(results["decode_error"])
        save()
    if not args.skip_prefill:
        try:
            results["prefill"] = bench_prefill(args.sweep)
        except Exception:  # noqa: BLE001
            results["prefill_error"] = traceback.format_exc()
            log(results["prefill_error"])
        save()
    results["kernels"] = kernel_report()
    results["elapsed_s"] = time.time() - t0
    bad = [f"decode B{r['batch']}/L{r['ctx']}" for r in results.get("decode", [])
           if "error" in r or not r["rel_err"] < 2e-2]
    pre = results.get("prefill", {})
    bad += [f"prefill {k}" for k in ("triton", "varlen")
            if "rel_err" in pre.get(k, {}) and not pre[k]["rel_err"] < 2e-2]
    bad += [k for k in ("decode_error", "prefill_error") if k in results]
    results["correctness_failures"] = bad
    save()

    print()
    print(f"attention on {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; "
          f"bf16, block {BS}, {H} q / {HKV} kv heads, head_dim {D}")
    print("decode: us per call, CUDA-graph replays over disjoint pages "
          "(fraction of 4.27 TB/s for K+V bytes)")
    hdr = (f"{'shape':<11}| {'ours':>15} | {'splits':>6} | {'err':>7} | {'sdpa cudnn':>15} | "
           f"{'sdpa flash':>15} | {'vLLM split-K':>12}")
    print(hdr)
    print("-" * len(hdr))
    for r in results.get("decode", []):
        if "error" in r:
            print(f"B{r['batch']}/L{r['ctx']:<6}| error: {r['error'].strip().splitlines()[-1]}")
            continue

        def cell(x):
            return f"{x['us']:7.1f} ({x['frac']:4.0%})" if "us" in x else f"{'n/a':>15}"
        if "sdpa_cudnn" not in r:
            print(f"B{r['batch']}/L{r['ctx']:<6}| {r['us']:7.1f} ({r['frac']:4.0%}) | "
                  f"{r['splits_auto']:>6} | {r['rel_err']:7.1e} | (extra shape, sweep: "
                  f"{ {k: round(v['us'], 1) for k, v in r.get('variants', {}).items()} })")
            continue
        vl = VLLM_DECODE_US.get((r["batch"], r["ctx"]))
        print(f"B{r['batch']}/L{r['ctx']:<6}| {r['us']:7.1f} ({r['frac']:4.0%}) | "
              f"{r['splits_auto']:>6} | {r['rel_err']:7.1e} | {cell(r['sdpa_cudnn'])} | "
              f"{cell(r['sdpa_flash'])} | {(f'{vl[1]:.1f}' if vl else '-'):>12}")
        if "best_variant" in r:
            print(f"{'':<11}  best variant {r['best_variant']}: {r['best_us']:.1f} us; "
                  + ", ".join(f"{k} {v['us']:.1f}" for k, v in r["variants"].items()
                              if "us" in v))
    p = results.get("prefill")
    if p:
        print(f"prefill {p['num_seqs']} x {p['seq']} causal ({p['gflop']:.1f} GFLOP, "
              f"{p['flop_formula']}): us / TFLOP/s / rel err")
        for name in ("triton", "varlen", "sdpa_cudnn", "sdpa_flash"):
            x = p.get(name, {})
            if "us" in x:
                extra = (f"  (kernel only, K/V pre-repeated: {x['kernel_only_us']:.0f} us, "
                         f"{x['kernel_only_tflops']:.0f})" if "kernel_only_us" in x else "")
                print(f"  {name:<11} {x['us']:8.0f} us {x['tflops']:6.0f} TFLOP/s  "
                      f"{x['rel_err']:.1e}{extra}")
            else:
                print(f"  {name:<11} n/a: {x}")
        for name, x in p.get("triton_variants", {}).items():
            if "us" in x:
                print(f"  triton {name:<14} {x['us']:8.0f} us {x['tflops']:6.0f} TFLOP/s "
                      f"{x['rel_err']:.1e}")
    print(f"JSON: {args.out}  ({results['elapsed_s']:.0f} s)")
    if bad:
        print("CORRECTNESS FAILURES: " + ", ".join(bad))
        raise SystemExit(1)


if __name__ == "__main__":
    main()
