#!/usr/bin/env python3
"""The MLP's activation + down projection of a decode step, H200: the SiLU-gated split-K launch
(``splitk_linear(..., silu_gated=True)``: the activation computed in the GEMM's operand loads)
against the two launches it replaces (the activation kernel, then the plain split-K GEMM) and
against the activation kernel + cuBLAS.

For each batch size M the 28 layers' launches over distinct weights and distinct ``gate_up``
inputs (``[M, 6144]`` bf16, the Qwen3-0.6B shape; down ``1024 x 3072``) are captured in one CUDA
graph (``bench_attention_gpu.time_graph``), us per layer; each variant's partial sum is checked
against the float64 expression first. The partials' sum folds into the next residual add +
RMSNorm in the model, so it is not timed.

    python3 bench/bench_silu_down_gpu.py --out $OUT/silu_down.json
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
from bench_decode_gemm_gpu import LAYER, LAYERS  # noqa: E402
from pagedkv.kernels.activation import silu_and_mul  # noqa: E402
from pagedkv.kernels.splitk_gemm import splitk_config_for, splitk_linear, splitk_splits  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="silu_down.json")
    ap.add_argument("--ms", default="1,8,32,64,128")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    n, k = LAYER["down"]
    splits = splitk_splits(n, k)
    cfg = splitk_config_for(n, k)
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(n, k, generator=g, device=dev, dtype=bf) * 0.02 for _ in range(LAYERS)]
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        gus = [torch.randn(m, 2 * k, generator=g, device=dev, dtype=bf) for _ in range(LAYERS)]
        acts = [torch.empty(m, k, device=dev, dtype=bf) for _ in range(LAYERS)]
        outs = [torch.empty(splits, m, n, device=dev, dtype=torch.float32) for _ in range(LAYERS)]
        lin = [torch.empty(m, n, device=dev, dtype=bf) for _ in range(LAYERS)]

        def gated(i):
            return lambda: splitk_linear(gus[i], ws[i], splits, cfg, out=outs[i], silu_gated=True)

        def two(i):
            def f():
                silu_and_mul(gus[i], out=acts[i])
                splitk_linear(acts[i], ws[i], splits, cfg, out=outs[i])
            return f

        def cublas(i):
            def f():
                silu_and_mul(gus[i], out=acts[i])
                torch.matmul(acts[i], ws[i].t(), out=lin[i])
            return f

        gate, up = gus[0].double().chunk(2, dim=-1)
        ref = (gate * torch.sigmoid(gate) * up) @ ws[0].double().T
        errs = {}
        for name, mk in (("gated", gated), ("two_launches", two)):
            mk(0)()
            torch.cuda.synchronize()
            errs[name] = float((outs[0].sum(0).double() - ref).norm() / ref.norm())
        cublas(0)()
        torch.cuda.synchronize()
        errs["cublas"] = float((lin[0].double() - ref).norm() / ref.norm())
        assert all(e < 1e-2 for e in errs.values()), errs
        res = {"m": m, "splits": splits, "rel_err": errs}
        for name, mk in (("gated", gated), ("two_launches", two), ("cublas", cublas)):
            res[name + "_us"] = time_graph([mk(i) for i in range(LAYERS)], min_ms=10.0,
                                           trials=args.trials)
        rows.append(res)
        print(f"M {m:4d}: gated {res['gated_us']:.2f} us, activation + split-K "
              f"{res['two_launches_us']:.2f}, activation + cuBLAS {res['cublas_us']:.2f} "
              f"(per layer; {splits} splits); errors {errs}", flush=True)
        del gus, acts, outs, lin
    with open(args.out, "w") as f:
        json.dump({"env": environment(), "shape": [n, k], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
