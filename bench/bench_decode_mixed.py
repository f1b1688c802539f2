#!/usr/bin/env python
"""GPU benchmark: paged decode attention on batches of *mixed* context lengths (W1-like).

``bench_attention_gpu.py`` times equal lengths (PERF.md's anchors). In a serving batch lengths
differ (W1: prompts U[100, 1024] plus up to 1024 generated tokens), programs of one launch do
unequal work, and the split-KV choice that is best for equal lengths need not be best here.
This sweep times ``paged_decode_attention`` on random lengths U[lo, hi] for batch sizes B,
forced split counts and ``min_split_tokens`` values, as CUDA-graph replays over disjoint pages
(cold L2, same method as ``bench_attention_gpu.py``), and reports microseconds per call, the
fraction of 4.27 TB/s for the K/V bytes actually read (sum of lengths), and what the default
``choose_num_splits`` picks (with ``max_seq_len=None``, as a captured decode graph does).

Run on the GPU machine from the repository root (no installs):
    python3 bench/bench_decode_mixed.py --out $OUT/decode_mixed.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_attention_gpu import BS, COPY_TBPS, D, DTYPE, H, HKV, SCALE, rel_err, time_graph  # noqa: E402
from pagedkv.attention._triton_common import num_sms  # noqa: E402
from pagedkv.attention.torch_ref import paged_attention_ref  # noqa: E402
from pagedkv.attention.triton_decode import (  # noqa: E402
    DecodeConfig,
    choose_num_splits,
    longest_first_order,
    one_range_for,
    paged_decode_attention,
)

COLD_BYTES = 512 << 20


def _per_request(**kw) -> DecodeConfig:
    """The per-request split launch in request order (no flat split, no longest-first order or
    one-range policy, a reduce launch after every split) with ``kw`` changed."""
    return DecodeConfig(**{"use_order": False, "flat_split": False, "lpt_one_range": False,
                           "fused_reduce_programs_per_sm": 0.0, **kw})


VARIANTS = {
    # the per-request launch in request order, the default before the sixteenth session:
    # every other variant below changes it (the row "default" is DecodeConfig())
    "per_request": _per_request(),
    "mid1": _per_request(mid_splits=1),
    # launch-parameter variants (every regime)
    "s3": _per_request(num_stages=3),
    "s4": _per_request(num_stages=4),
    "s6": _per_request(num_stages=6),
    "t16s5": _per_request(tile_n=16),
    "t64s4": _per_request(tile_n=64, num_stages=4),
    "w2": _per_request(num_warps=2),
    "w8": _per_request(num_warps=8),
    # query heads a reduce program merges (default 4)
    "rh1": _per_request(reduce_heads=1),
    "rh2": _per_request(reduce_heads=2),
    "rh8": _per_request(reduce_heads=8),
    "rh16": _per_request(reduce_heads=16),
    # programs dispatched request by request, longest request first (``order``), with the
    # default split policy and with finer large-batch splits
    "lpt": _per_request(use_order=True),
    "lpt_l256": _per_request(large_min_split_tokens=256, use_order=True),
    "lpt_l8": _per_request(large_splits=8, large_min_split_tokens=256, use_order=True),
    "l256": _per_request(large_min_split_tokens=256),
    # the flat split (the batch's tiles cut into equal shares, one wave of programs; default 4
    # an SM, registers uncapped): shares of at least 128 / 256 / 512 positions; 5 an SM at 96
    # registers; 10 an SM (several waves)
    "flat": _per_request(flat_split=True),
    "flat_m128": _per_request(flat_split=True, flat_min_split_tokens=128),
    "flat_m512": _per_request(flat_split=True, flat_min_split_tokens=512),
    "flat_p5": _per_request(flat_split=True, flat_programs_per_sm=5.0, flat_max_registers=96),
    "flat_p10": _per_request(flat_split=True, flat_programs_per_sm=10.0),
    # longest first with fewer ranges: one range a request up to 1,024 / 2,048 positions in
    # the large regime; every request one range (no partials, no reduce launch)
    "lpt_l1k": _per_request(large_min_split_tokens=1024, use_order=True),
    "lpt_l2k": _per_request(large_min_split_tokens=2048, use_order=True),
    "lpt1": _per_request(max_splits=1, use_order=True),
    # the longest-first one-range policy (DecodeConfig.lpt_one_range) at load fractions 0.75
    # (its default) and 1.0; with the flat split for the launches it leaves split
    "lptor": _per_request(use_order=True, lpt_one_range=True),
    "lptor100": _per_request(use_order=True, lpt_one_range=True, lpt_load_fraction=1.0),
    "lptor_flat": _per_request(use_order=True, lpt_one_range=True, flat_split=True),
    # the split kernels merging their own ranges (no reduce launch): the per-request launch,
    # and the default config with it (per-request below the flat split's floor, flat above);
    # the default config with a reduce launch after every split (the default fuses the
    # per-request launches of one wave, DecodeConfig.fused_reduce_programs_per_sm)
    "fused": _per_request(fused_reduce=True),
    "default_fused": DecodeConfig(fused_reduce=True),
    "default_unfused": DecodeConfig().unfused(),
    # the defaults without the balanced one-wave rule (only equal lengths count as balanced):
    # long, nearly equal lengths (W2's decode) then take the flat split's equal shares
    "nobal": DecodeConfig(balanced_fraction=1.0),
    # the balanced rule by the fraction alone (the default before the twentieth session, which
    # added the excess bound DecodeConfig.balanced_max_excess)
    "frac_only": DecodeConfig(balanced_max_excess=None),
    # no one range a request but on equal lengths: no longest-first bound either (the flat
    # split wherever the launch splits), to time that bound's one-wave launches (B72-B82 at 8
    # KV heads) against the flat split
    "flat_only": DecodeConfig(balanced_fraction=1.0, lpt_one_range=False),
    # small batches (P < 2 S): up to 64 ranges a request instead of 32 (B1 of 8 KV heads: 512
    # programs, one wave, fused merge); the split count filling one wave of 5 an SM
    # (small_waves 5: B2 42, B3 28, B4 21 ranges); the same with 16-position tiles
    "ms64": DecodeConfig(max_splits=64),
    "ms64_w5": DecodeConfig(max_splits=64, small_waves=5.0),
    "ms64_t16": DecodeConfig(max_splits=64, tile_n=16),
    # every small batch (P < 2 S) with ~2 / 3 / 4 / 8 programs an SM, no fewest-programs rule
    # (DecodeConfig.few_waves; sw8 is the default before the twenty-first session): B3 of 8 KV
    # heads 768 -> 408 programs at 3 (17 ranges). (The twenty-first session's first runs of
    # these, before the few_waves field existed, are the same launches.)
    "sw2": DecodeConfig(small_waves=2.0, few_waves=None),
    "sw3": DecodeConfig(small_waves=3.0, few_waves=None),
    "sw4": DecodeConfig(small_waves=4.0, few_waves=None),
    "sw8": DecodeConfig(small_waves=8.0, few_waves=None),
    # the block table a tile ahead (DecodeConfig.table_ahead at table_ahead_stages, both decode
    # kernels; thirty-first session; its first run, B1-B16 only (per-request launches), set
    # num_stages, which the per-request kernel then used): the K / V
    # copies (num_stages - 2) tiles ahead of the one computed (sm_90 TTGIR: the loop waits
    # with 2 x (stages - 2) copy groups outstanding) against ~one for the plain loop; shared
    # memory 37 / 54 / 71 / 87 / 103 KB at 3-7 stages (5 / 4 / 3 / 2 / 2 programs an SM); tile
    # 64 x 4 stages 104 KB (2 an SM)
    "ta3": DecodeConfig(table_ahead=True, table_ahead_stages=3),
    "ta4": DecodeConfig(table_ahead=True, table_ahead_stages=4),
    "ta5": DecodeConfig(table_ahead=True, table_ahead_stages=5),
    "ta6": DecodeConfig(table_ahead=True, table_ahead_stages=6),
    "ta7": DecodeConfig(table_ahead=True, table_ahead_stages=7),
    "ta7_ms16": DecodeConfig(table_ahead=True, table_ahead_stages=7, max_splits=16),
    "ta4_t64": DecodeConfig(table_ahead=True, table_ahead_stages=4, tile_n=64),
    "ta4_ms64": DecodeConfig(table_ahead=True, table_ahead_stages=4, max_splits=64),
    # the ranges a merge loads in one round trip (DecodeConfig.merge_chunk; the thirty-second
    # session): B1's 32 ranges in 2 / 1 dependent loads instead of 4 (16 keeps 5 programs an
    # SM in the fused split kernel, 32 takes 158 registers and 3). Every merge at one chunk
    # (no wide chunk): mc4-mc32; the defaults since the thirty-sixth session (16, and 32 for
    # fused launches of at most 3 programs an SM) against the former 8 everywhere: mc8; 64
    # ranges at B1 with 16 / 32 a round trip (the twenty-first session's 64 lost at 8)
    "mc4": DecodeConfig(merge_chunk=4, wide_merge_chunk=None),
    "mc8": DecodeConfig(merge_chunk=8, wide_merge_chunk=None),
    "mc16": DecodeConfig(merge_chunk=16, wide_merge_chunk=None),
    "mc32": DecodeConfig(merge_chunk=32, wide_merge_chunk=None),
    "mc16_ms64": DecodeConfig(merge_chunk=16, wide_merge_chunk=None, max_splits=64),
    "mc32_ms64": DecodeConfig(merge_chunk=32, wide_merge_chunk=None, max_splits=64),
    "mc8_plain": DecodeConfig(merge_chunk=8, wide_merge_chunk=None, table_ahead=False),
}


def decode_rel_err(q, cache, table, lens, out, n: int = 6) -> float:
    """Relative error of a decode launch's first ``n`` requests (one query token each, block
    table rows ``table``, lengths ``lens`` on the host) against the torch reference."""
    n = min(n, q.shape[0])
    meta = type("M", (), {})()
    meta.query_start_loc_cpu = torch.arange(n + 1, dtype=torch.int32)
    meta.num_reqs = n
    meta.seq_lens_cpu = lens[:n]
    meta.block_table_tensor = table[:n]
    return rel_err(out[:n], paged_attention_ref(q[:n].float(), cache, meta, SCALE))


class MixedSetup:
    """R rotations of (query, block table, output) over disjoint pages; lengths U[lo, hi]."""

    def __init__(self, batch: int, lo: int, hi: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.lens = torch.randint(lo, hi + 1, (batch,), generator=g, dtype=torch.int32)
        self.batch = batch
        self.max_len = int(self.lens.max())
        self.kv_bytes = 2 * int(self.lens.sum()) * HKV * D * 2
        self.rot = max(2, min(64, math.ceil(COLD_BYTES / self.kv_bytes)))
        width = -(-self.max_len // BS)
        per_rot = batch * width
        num_blocks = 1 + self.rot * per_rot
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.cache = torch.randn((2, num_blocks, BS, HKV, D), generator=gen, device="cuda", dtype=DTYPE)
        perm = torch.randperm(num_blocks - 1, generator=gen, device="cuda").to(torch.int32) + 1
        self.tables = [perm[i * per_rot:(i + 1) * per_rot].view(batch, width) for i in range(self.rot)]
        self.qs = [torch.randn((batch, H, D), generator=gen, device="cuda", dtype=DTYPE)
                   for _ in range(self.rot)]
        self.outs = [torch.empty_like(q) for q in self.qs]
        self.qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
        self.seq = self.lens.cuda()
        self.order = torch.from_numpy(longest_first_order(self.lens.numpy())).cuda()
        # one workspace for every call, as the engine's layers of a step share their plan's
        # (partials; the fused reduce's counters, which every launch leaves at zero)
        self.ws: dict = {}

    def call(self, i, **kw):
        # as a decode graph launches: no max length, the one-range value from the host lengths
        # (a graph variant), the longest-first order where the config reads it
        cfg = kw.get("config") or DecodeConfig()
        kw.setdefault("balanced", one_range_for(self.lens.numpy(), self.batch, HKV,
                                                num_sms(torch.device("cuda")), cfg))
        if cfg.use_order:
            kw.setdefault("order", self.order)
        kw.setdefault("workspace", self.ws)
        return lambda: paged_decode_attention(self.qs[i], self.cache, self.tables[i], self.qsl,
                                              self.seq, self.batch, SCALE, self.outs[i], **kw)

    def check(self, **kw) -> float:
        self.outs[0].fill_(float("nan"))
        self.call(0, **kw)()
        torch.cuda.synchronize()
        return decode_rel_err(self.qs[0], self.cache, self.tables[0], self.lens, self.outs[0])

    def time(self, **kw) -> float:
        return time_graph([self.call(i, **kw) for i in range(self.rot)], min_ms=10.0, trials=5)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="8,16,32,64,96,128,160,192,224,256")
    p.add_argument("--splits", default="1,2,3,4,6,8,12,16")
    p.add_argument("--min-split-tokens", default="32,128,256,512")
    p.add_argument("--lo", type=int, default=100)
    p.add_argument("--hi", type=int, default=2048)
    p.add_argument("--variants", default="mid1",
                   help="DecodeConfig variants timed against the default (names in VARIANTS): "
                        "mid1 (mid regime unsplit), launch parameters (s3, t16s5, w8, ...)")
    p.add_argument("--out", default="decode_mixed.json")
    args = p.parse_args()
    sms = num_sms(torch.device("cuda"))
    base = DecodeConfig()
    rows = []
    for b in [int(x) for x in args.batches.split(",")]:
        s = MixedSetup(b, args.lo, args.hi)
        default = choose_num_splits(b, HKV, None, sms, base,
                                    one_range_for(s.lens.numpy(), b, HKV, sms, base))
        err = s.check()
        # the balanced rule's excess positions over the mean (DecodeConfig.balanced_max_excess)
        excess = (s.max_len * b - int(s.lens.sum())) * HKV
        res = {"batch": b, "sum_len": int(s.lens.sum()), "max_len": s.max_len, "default_splits": default,
               "excess": excess, "rel_err": err, "times": {}}
        t_def = s.time()
        res["default_us"] = t_def
        res["variants"] = {}
        for name in filter(None, args.variants.split(",")):
            kw = {"config": VARIANTS[name]}
            res["variants"][name] = {"us": s.time(**kw), "rel_err": s.check(**kw)}
        for mst in filter(None, args.min_split_tokens.split(",")):
            mst = int(mst)
            cfg = DecodeConfig(min_split_tokens=mst)
            for sp in [int(x) for x in filter(None, args.splits.split(","))]:
                if sp == 1 and mst != 32:
                    continue
                res["times"][f"{sp}/{mst}"] = s.time(num_splits=sp, config=cfg)
        frac = lambda us: s.kv_bytes / (us * 1e-6) / (COPY_TBPS * 1e12)  # noqa: E731
        line = (f"B{b:4d} sum_len {res['sum_len']:7d} excess {excess:7d} default {default} "
                f"splits: {t_def:8.1f} us "
                f"({frac(t_def):.0%}), err {err:.1e}; "
                + "  ".join(f"{k} {v['us']:.1f} ({frac(v['us']):.0%})" for k, v in res["variants"].items()))
        if res["times"]:
            best = min(res["times"], key=res["times"].get)
            res["best"], res["best_us"] = best, res["times"][best]
            line += f"; best forced {best}: {res['best_us']:.1f} us ({frac(res['best_us']):.0%})"
        print(line, flush=True)
        if res["times"]:
            print("      " + "  ".join(f"{k}:{v:.1f}" for k, v in res["times"].items()), flush=True)
        rows.append(res)
        del s
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({"sms": sms, "lo": args.lo, "hi": args.hi, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
