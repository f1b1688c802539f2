#!/usr/bin/env python3
"""FP8 (e4m3) KV-cache decode attention on the H200: our Triton decode kernel on an FP8 cache
against the same kernel on a bf16 cache, and a sweep of launch variants for FP8.

An FP8 cache holds half the bytes, so a bandwidth-bound decode should take about half the time;
this bench measures how close the kernel gets (fraction of 4.27 TB/s for the FP8 bytes read) and
which ``DecodeConfig`` (tile / warps / stages) FP8 wants. Shapes: 16 query / 8 KV heads,
head_dim 128, block 16, equal lengths, CUDA-graph replays over disjoint pages (cold L2), as
``bench_attention_gpu.py`` (whose ``DecodeSetup`` it uses).

    python3 bench/bench_fp8_decode_gpu.py --out $OUT/fp8_decode.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_attention_gpu import COPY_TBPS, DecodeSetup, rel_err  # noqa: E402
from pagedkv.attention.triton_decode import DecodeConfig, default_decode_config  # noqa: E402

SHAPES = [(1, 8192), (16, 4096), (64, 2048), (64, 8192), (256, 2048), (256, 8192)]
VARIANTS = [(t, w, s) for t in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4, 5)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="fp8_decode.json")
    ap.add_argument("--no-sweep", action="store_true")
    args = ap.parse_args()
    fp8 = torch.float8_e4m3fn
    rows = []
    for batch, ctx in SHAPES:
        row = {"batch": batch, "ctx": ctx}
        bf = DecodeSetup(batch, ctx)
        row["bf16_us"] = bf.time()
        del bf
        st = DecodeSetup(batch, ctx, kv_dtype=fp8)
        tb = lambda us: st.kv_bytes / (us * 1e-6) / 1e12  # noqa: E731
        row["fp8_rel_err_vs_ref"] = st.check()
        default = default_decode_config(torch.device("cuda"))
        row["fp8_default"] = dataclasses.asdict(default)
        row["fp8_us"] = st.time()
        row["fp8_frac"] = tb(row["fp8_us"]) / COPY_TBPS
        ref_out = st.outs[0].clone()
        variants = {}
        if not args.no_sweep:
            base = DecodeConfig()
            for t, w, s in VARIANTS:
                cfg = dataclasses.replace(base, tile_n=t, num_warps=w, num_stages=s)
                name = f"t{t}w{w}s{s}"
                try:
                    st.call(0, config=cfg)()
                    torch.cuda.synchronize()
                    us = st.time(config=cfg)
                    variants[name] = {"us": us, "frac": tb(us) / COPY_TBPS,
                                      "rel_vs_default": rel_err(st.outs[0], ref_out)}
                except Exception as e:  # noqa: BLE001
                    variants[name] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            ok = [(v["us"], k) for k, v in variants.items() if "us" in v]
            row["best_us"], row["best"] = min(ok)
        row["variants"] = variants
        rows.append(row)
        print(f"B{batch}/L{ctx}: bf16 {row['bf16_us']:.1f} us, fp8 default {row['fp8_us']:.1f} us "
              f"({100 * row['fp8_frac']:.0f}% of BW, err {row['fp8_rel_err_vs_ref']:.1e})"
              + (f", fp8 best {row['best']} {row['best_us']:.1f} us" if variants else ""), flush=True)
        del st
        torch.cuda.empty_cache()
    if rows and rows[0]["variants"]:
        names = list(rows[0]["variants"])
        print("variant " + " ".join(f"B{r['batch']}/L{r['ctx']}" for r in rows))
        for n in names:
            print(f"{n:>10} " + " ".join(f"{r['variants'].get(n, {}).get('us', float('nan')):9.1f}"
                                         for r in rows))
    with open(args.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
