#!/usr/bin/env python3
"""Split-K GEMM (``pagedkv.kernels.splitk_gemm``) against cuBLAS on the decode-step projections of
the Qwen3-0.6B shape, H200.

For each batch size M and each of the four per-layer projections (``bench_decode_gemm_gpu.LAYER``)
the 28 layers' GEMMs over distinct weights (cold in L2, as in the model) are timed in one CUDA
graph (``bench_attention_gpu.time_graph``), us per GEMM: ``F.linear`` (cuBLAS, what the model
runs) and the split-K kernel for every launch config x split count, each checked first against
the float32 product (sum of the partials). The split-K time is the kernel alone: in the model
its partial sum is folded into the residual add + RMSNorm kernel that follows (that kernel then
reads ``S x M x N x 4`` bytes instead of ``M x N x 2``, column ``partial_mb``).

    python3 bench/bench_splitk_gemm_gpu.py --out $OUT/splitk_gemm.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench_attention_gpu import time_graph  # noqa: E402
from bench_decode_gemm_gpu import COPY_TBPS, LAYER, LAYERS  # noqa: E402
from pagedkv.kernels.splitk_gemm import SplitKConfig, split_chunk, splitk_linear  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

MS = (8, 64, 128, 256)
SPLITS = (1, 2, 3, 4, 6, 8)
# (BM, BN, BK, warps, stages)
CFGS = [(64, 64, 128, 4, 4), (64, 32, 128, 4, 4), (64, 128, 64, 4, 4), (32, 64, 128, 4, 4),
        (16, 64, 128, 4, 4), (64, 64, 64, 4, 5), (128, 64, 64, 8, 3), (64, 64, 256, 8, 3),
        (16, 128, 128, 4, 4), (32, 32, 256, 4, 3)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="splitk_gemm.json")
    ap.add_argument("--ms", default=",".join(str(m) for m in MS))
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--shapes", default="o,down",
                    help="projections to time (names of bench_decode_gemm_gpu.LAYER)")
    ap.add_argument("--table-ms", default="64,128,256",
                    help="batch sizes the chosen launch per shape is best over")
    ap.add_argument("--table-out", default=None, help="write the chosen launches (JSON)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    torch.manual_seed(0)
    weights = [{name: torch.randn(n, k, device=dev, dtype=bf) * 0.02 for name, (n, k) in LAYER.items()}
               for _ in range(LAYERS)]
    rows = []
    summary = []
    for m in (int(v) for v in args.ms.split(",")):
        xs = {name: torch.randn(m, k, device=dev, dtype=bf) for name, (n, k) in LAYER.items()}
        ys = {name: torch.empty(m, n, device=dev, dtype=bf) for name, (n, k) in LAYER.items()}
        row = {"m": m, "linear_us": {}, "splitk_us": {}, "errors": {}}
        best_total, lin_total = 0.0, 0.0
        for name, (n, k) in LAYER.items():
            if name not in args.shapes.split(","):
                continue
            lin = time_graph([lambda i=i: torch.mm(xs[name], weights[i][name].t(), out=ys[name])
                              for i in range(LAYERS)], min_ms=10.0, trials=args.trials)
            row["linear_us"][name] = lin
            ref = F.linear(xs[name].float(), weights[0][name].float())
            best = (lin, "linear")
            for cfg_t in CFGS:
                cfg = SplitKConfig(*cfg_t)
                for s in SPLITS:
                    if split_chunk(k, s, cfg.block_k) * (s - 1) >= k:
                        continue  # a split would be empty
                    key = f"{name}/{'x'.join(map(str, cfg_t))}/s{s}"
                    out = torch.empty(s, m, n, device=dev, dtype=torch.float32)
                    try:
                        got = splitk_linear(xs[name], weights[0][name], s, cfg, out=out).sum(0)
                        err = float((got - ref).norm() / ref.norm())
                        if not err < 1e-2:
                            row["errors"][key] = f"rel err {err:.3g}"
                            continue
                        t = time_graph([lambda i=i: splitk_linear(xs[name], weights[i][name], s,
                                                                   cfg, out=out)
                                        for i in range(LAYERS)], min_ms=10.0, trials=args.trials)
                    except Exception as e:  # noqa: BLE001
                        row["errors"][key] = f"{type(e).__name__}: {str(e)[:160]}"
                        continue
                    row["splitk_us"][key] = t
                    if t < best[0]:
                        best = (t, key)
            best_total += best[0]
            lin_total += lin
            wfloor = n * k * 2 / (COPY_TBPS * 1e6)
            line = (f"M={m:4d} {name:8s} floor {wfloor:5.2f} us | linear {lin:6.2f} | best "
                    f"{best[1]} {best[0]:6.2f} ({lin / best[0]:.2f}x)")
            print(line, flush=True)
            summary.append(line)
        row["best_total_us"], row["linear_total_us"] = best_total, lin_total
        print(f"M={m:4d} per layer: linear {lin_total:.1f} us, best mix {best_total:.1f} us",
              flush=True)
        rows.append(row)
    table = best_table(rows, args.table_ms)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "rows": rows, "table": table}, f, indent=1)
    if args.table_out:
        with open(args.table_out, "w") as f:
            json.dump(table, f, indent=1)
    print("\n".join(summary))
    for key, e in table.items():
        print(f"table {key}: {e}")
    return 0


def best_table(rows: list, table_ms: str) -> dict:
    """Per projection whose consumer reads the partials (o, down: the residual add + RMSNorm;
    gate_up: the activation, ``silu_and_mul_partials``): the split-K launch (config, splits) with the least
    total over the batch sizes ``table_ms`` of the kernel time plus the extra read of its
    partials by the consumer (``(S - 1/2) x M x N x 4`` bytes... counted as ``S x M x N x 4 -
    M x N x 2`` at 4.27 TB/s), if that beats cuBLAS there; the shapes ``bench_w1.py
    --splitk-table`` installs."""
    ms = {int(v) for v in table_ms.split(",")}
    sel = [r for r in rows if r["m"] in ms]
    table = {}
    for name, (n, k) in LAYER.items():
        if name not in ("o", "down", "gate_up") or not sel or name not in sel[0]["linear_us"]:
            continue
        lin = sum(r["linear_us"][name] for r in sel)
        cands = {}
        for r in sel:
            for key, t in r["splitk_us"].items():
                nm, cfg, sp = key.split("/")
                if nm != name:
                    continue
                s = int(sp[1:])
                extra = (s * r["m"] * n * 4 - r["m"] * n * 2) / (COPY_TBPS * 1e6)
                c = cands.setdefault((cfg, s), [0.0, 0])
                c[0] += t + extra
                c[1] += 1
        full = {key: v[0] for key, v in cands.items() if v[1] == len(sel)}
        if not full:
            continue
        (cfg, s), tot = min(full.items(), key=lambda kv: kv[1])
        table[f"{n},{k}"] = {"config": [int(v) for v in cfg.split("x")], "splits": s,
                             "total_us": tot, "linear_total_us": lin, "use": tot < lin}
    return table


if __name__ == "__main__":
    sys.exit(main())
