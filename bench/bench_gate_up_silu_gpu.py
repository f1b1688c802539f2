#!/usr/bin/env python3
"""The gate/up projection with SiLU in its epilogue (``pagedkv.kernels.gate_up_silu``, one
launch) against what the model runs without it (cuBLAS ``F.linear`` into ``[M, 2I]``, then the
activation kernel), Qwen3-0.6B shape (I 3072, K 1024), bf16, H200.

For each batch size M, 28 layers over distinct weights (cold in L2, as in the model) are timed
in one CUDA graph (``fused_sweep.sweep``), us per layer: the unfused pair, the fused kernel's
defaults, then each launch config x split count; each fused variant is first checked against
the unfused output (bf16 tolerance).

    python3 bench/bench_gate_up_silu_gpu.py --out $OUT/gate_up_silu.json
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

from bench_decode_gemm_gpu import COPY_TBPS, LAYERS  # noqa: E402
from fused_sweep import effective_block_m, sweep  # noqa: E402
from pagedkv.kernels.activation import silu_and_mul_op  # noqa: E402
from pagedkv.kernels.gate_up_silu import GateUpConfig, default_splits, fused_gate_up_silu  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

INTER, K = 3072, 1024
MS = (1, 8, 32, 64, 128, 192, 256)
# (block_m, block_n, block_k, warps, stages)
CFGS = [(64, 32, 64, 4, 4), (64, 64, 64, 4, 4), (64, 16, 128, 4, 4), (32, 32, 128, 4, 3),
        (64, 32, 128, 4, 3), (128, 32, 64, 8, 3), (64, 64, 64, 8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gate_up_silu.json")
    ap.add_argument("--ms", default=",".join(str(m) for m in MS))
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    torch.manual_seed(0)
    weights = [torch.randn(2 * INTER, K, device=dev, dtype=bf) * 0.03 for _ in range(LAYERS)]
    wbytes = 2 * INTER * K * 2
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, K, device=dev, dtype=bf)
        want = silu_and_mul_op(F.linear(x, weights[0]))

        def check(cfg):
            got = fused_gate_up_silu(x, weights[0], None, cfg)
            torch.cuda.synchronize()
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)

        configs, seen = [("default", None)], set()
        for splits in (int(v) for v in args.splits.split(",")):
            for bm, bn, bk, warps, stages in CFGS:
                eff = (effective_block_m(bm, m), bn, bk, warps, stages, splits)
                if eff not in seen:
                    seen.add(eff)
                    configs.append(("x".join(str(v) for v in eff[:5]) + f"/s{splits}",
                                    GateUpConfig(block_m=bm, block_n=bn, block_k=bk,
                                                 num_warps=warps, num_stages=stages,
                                                 splits=splits)))
        row = sweep(m, [lambda w=w: silu_and_mul_op(F.linear(x, w)) for w in weights],
                    lambda cfg: [lambda w=w: fused_gate_up_silu(x, w, None, cfg)
                                 for w in weights],
                    check, configs, args.trials)
        row.update(weight_floor_us=wbytes / (COPY_TBPS * 1e6), default_splits=default_splits(m))
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
