#!/usr/bin/env python
"""GPU benchmark: decode-attention launch shapes against the device's concurrent programs.

The decode kernel's K/V loads go through the block table, so Triton's pipeliner keeps only
``num_stages // 2`` K/V tiles per program in shared memory (tile 32 x 5 stages: 2 tiles, 38 KB,
96 registers: 5 programs per SM, 660 on the H200's 132 SMs). At equal lengths B64/L2048 one
range per request is 512 programs, one wave that starts and ends together; any split makes
more programs than fit, and the turnover costs ~10% (bench_decode_split_cost.py). This sweep
times, for equal and mixed lengths, the split counts 1/2/4/8 (ranges of >= 32 positions) under
launch configurations with deeper K/V pipelines (fewer programs per SM), plus the cost of a
launch whose extra ranges are all empty (splits launched, every request in one range).

Run on the GPU machine from the repository root (no installs):
    python3 bench/bench_decode_waves.py --out $OUT/decode_waves.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from bench_attention_gpu import COPY_TBPS, DecodeSetup  # noqa: E402
from bench_decode_mixed import MixedSetup  # noqa: E402
from pagedkv.attention.triton_decode import DecodeConfig  # noqa: E402

CONFIGS = {
    "t32s5": {},
    "t32s7": {"num_stages": 7},
    "t32s9": {"num_stages": 9},
    "t16s9": {"tile_n": 16, "num_stages": 9},
    "t16s13": {"tile_n": 16, "num_stages": 13},
}
SHAPES = "B64/L2048,B128/L2048,B64/L8192,B1/L8192,B8xU100-2048,B40xU100-2048,B64xU100-2048," \
         "B128xU100-2048,B256xU100-2048"


def make_setup(name: str):
    """``B64/L2048``: 64 requests of 2048 positions; ``B64xU100-2048``: lengths U[100, 2048]
    (names without commas: --shapes is a comma list)."""
    b, rest = name[1:].replace("/", "x").split("x", 1)
    if rest.startswith("L"):
        return DecodeSetup(int(b), int(rest[1:]))
    lo, hi = rest[1:].split("-")
    return MixedSetup(int(b), int(lo), int(hi))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--shapes", default=SHAPES)
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--policy-vs-one", action="store_true",
                   help="time only the default split policy and one range per request")
    p.add_argument("--out", default="decode_waves.json")
    args = p.parse_args()
    out = {}
    for shape in args.shapes.split(","):
        st = make_setup(shape)
        frac = lambda us: st.kv_bytes / (us * 1e-6) / (COPY_TBPS * 1e12)  # noqa: E731
        res = {}
        print(shape, flush=True)
        for name in args.configs.split(","):
            try:
                row = {"policy": st.time(config=DecodeConfig(**CONFIGS[name]))}
                if isinstance(st, MixedSetup):
                    row["rel_err_policy"] = st.check(config=DecodeConfig(**CONFIGS[name]))
            except Exception as e:  # noqa: BLE001 (a variant that fails to compile or run)
                print(f"  {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            if args.policy_vs_one:
                row["splits1"] = st.time(num_splits=1, config=DecodeConfig(**CONFIGS[name]))
                res[name] = row
                print(f"  {name:7s} " + "  ".join(f"{k} {v:.1f} ({frac(v):.0%})" for k, v in row.items()
                                                  if not k.startswith("rel_err"))
                      + (f"  err {row['rel_err_policy']:.1e}" if "rel_err_policy" in row else ""),
                      flush=True)
                continue
            for sp in [int(x) for x in args.splits.split(",")]:
                cfg = DecodeConfig(min_split_tokens=32, **CONFIGS[name])
                row[f"splits{sp}"] = st.time(num_splits=sp, config=cfg)
            # 8 ranges launched, every request in one (7 of 8 programs return at once)
            cfg = DecodeConfig(min_split_tokens=1 << 20, **CONFIGS[name])
            row["launch8_one_range"] = st.time(num_splits=8, config=cfg)
            err = st.check(config=DecodeConfig(min_split_tokens=32, **CONFIGS[name])) \
                if isinstance(st, MixedSetup) else None
            row["rel_err"] = err
            res[name] = row
            print(f"  {name:7s} " + "  ".join(f"{k} {v:.1f} ({frac(v):.0%})" for k, v in row.items()
                                              if not k.startswith("rel_err")) + f"  err {err}", flush=True)
        out[shape] = res
        del st
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
