#!/usr/bin/env python3
"""Decode-step GEMMs of the Qwen3-0.6B shape on the H200: what the four per-layer projections
cost at decode batch sizes, against their weight-read and FLOP floors, and which way of
calling them is fastest.

W1's step profile (BENCHMARKS.md, fifth session) has the four projections of a layer (fused
q/k/v 1024 -> 4096, o 2048 -> 1024, fused gate/up 1024 -> 6144, down 3072 -> 1024) at ~26.5 us
a layer at batch ~240 (cuBLAS nvjet kernels), against 7.4 us for their 31.5 MB of bf16 weights
at 4.27 TB/s. This bench times, per batch size M, the 28 layers' four GEMMs over distinct
weights (each layer's weights cold in L2, as in the model) in one CUDA graph
(``bench_attention_gpu.time_graph``), us per layer, for:

* ``linear``: ``F.linear(x, W)``, W ``[N, K]`` (what the model runs);
* ``mm_t``: ``x @ Wt`` with Wt ``[K, N]`` contiguous (the other operand layout);
* ``cublaslt``: ``linear`` with ``torch.backends.cuda.preferred_blas_library("cublaslt")``;
* ``triton/<cfg>``: a plain Triton GEMM over W ``[N, K]`` (this file's ``_mm_kernel``; tiles
  BM x BN x BK, warps, stages), each config checked against ``linear`` first;
* ``linear_l2``: ``linear`` with every layer on layer 0's weights, L2-resident after the first
  (the GEMMs without their DRAM reads: the most a weight prefetch could give).

And, once, a graph node's floor: a one-wave no-op Triton kernel launched 112 times (28 layers
x 4) in one graph, us a launch.

And the LM head (151,936 x 1024) alone per M. Prints a table; JSON with every number to --out.

    python3 bench/bench_decode_gemm_gpu.py --out $OUT/decode_gemm.json
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from bench_attention_gpu import time_graph  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

COPY_TBPS = 4.27
DENSE_TFLOPS = 989.0  # H200 bf16 dense peak
LAYER = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
LM_HEAD = (151936, 1024)
LAYERS = 28
MS = (1, 8, 32, 64, 128, 192, 256)
TRITON_MS = (64, 128, 256)
# (BM, BN, BK, warps, stages)
TRITON_CFGS = [(16, 64, 128, 4, 4), (32, 64, 128, 4, 4), (64, 64, 128, 4, 4), (64, 128, 64, 4, 4),
               (64, 128, 128, 8, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 4), (64, 32, 128, 4, 5),
               (32, 128, 128, 4, 3), (128, 128, 128, 8, 3), (64, 256, 64, 8, 3), (16, 128, 256, 4, 3)]


@triton.jit
def _mm_kernel(x_ptr, w_ptr, y_ptr, M, N, sx, sw, sy, K: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for kt in range(0, K // BK):  # K is a multiple of BK here
        k = kt * BK
        a = tl.load(x_ptr + rm[:, None] * sx + (k + rk)[None, :], mask=m_ok[:, None], other=0.0)
        b = tl.load(w_ptr + rn[None, :] * sw + (k + rk)[:, None], mask=n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    tl.store(y_ptr + rm[:, None] * sy + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _noop_kernel(p):
    tl.store(p + tl.program_id(0), 1.0)


def triton_mm(x, w, y, cfg):
    bm, bn, bk, warps, stages = cfg
    m, k = x.shape
    n = w.shape[0]
    _mm_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm))](
        x, w, y, m, n, x.stride(0), w.stride(0), y.stride(0), K=k, BM=bm, BN=bn, BK=bk,
        num_warps=warps, num_stages=stages)
    return y


def floors_us(m: int, shapes) -> tuple[float, float]:
    wbytes = sum(n * k * 2 for n, k in shapes)
    flops = sum(2 * m * n * k for n, k in shapes)
    return wbytes / (COPY_TBPS * 1e6), flops / (DENSE_TFLOPS * 1e6)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="decode_gemm.json")
    ap.add_argument("--no-triton", action="store_true")
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    torch.manual_seed(0)
    weights = [{name: torch.randn(n, k, device=dev, dtype=bf) * 0.02 for name, (n, k) in LAYER.items()}
               for _ in range(LAYERS)]
    weights_t = [{name: w.t().contiguous() for name, w in lw.items()} for lw in weights]
    lm = torch.randn(*LM_HEAD, device=dev, dtype=bf) * 0.02
    rows = []
    for m in MS:
        xs = {name: torch.randn(m, k, device=dev, dtype=bf) for name, (n, k) in LAYER.items()}
        ys = {name: torch.empty(m, n, device=dev, dtype=bf) for name, (n, k) in LAYER.items()}
        wfloor, ffloor = floors_us(m, LAYER.values())
        row = {"m": m, "weight_floor_us": wfloor, "flop_floor_us": ffloor, "us_per_layer": {},
               "per_gemm_us": {}}

        def calls(fn):
            return [lambda lw=lw, name=name: fn(lw, name) for lw in range(LAYERS) for name in LAYER]

        lin = lambda i, name: torch.mm(xs[name], weights[i][name].t(), out=ys[name])  # noqa: E731
        mmt = lambda i, name: torch.mm(xs[name], weights_t[i][name], out=ys[name])  # noqa: E731
        row["us_per_layer"]["linear"] = time_graph(calls(lin)) * len(LAYER)
        # every layer on layer 0's weights (31.5 MB, L2-resident after the first): what the
        # GEMMs cost when their weights need no DRAM trip (the most a prefetch could give)
        row["us_per_layer"]["linear_l2"] = time_graph(
            calls(lambda i, name: lin(0, name))) * len(LAYER)
        row["us_per_layer"]["mm_t"] = time_graph(calls(mmt)) * len(LAYER)
        for name in LAYER:
            row["per_gemm_us"][f"linear/{name}"] = time_graph(
                [lambda i=i, name=name: lin(i, name) for i in range(LAYERS)])
        prev = torch.backends.cuda.preferred_blas_library()
        try:
            torch.backends.cuda.preferred_blas_library("cublaslt")
            row["us_per_layer"]["cublaslt"] = time_graph(calls(lin)) * len(LAYER)
        except Exception as e:  # noqa: BLE001
            row["cublaslt_error"] = f"{type(e).__name__}: {e}"
        finally:
            torch.backends.cuda.preferred_blas_library(prev)
        if not args.no_triton and m in TRITON_MS:
            ref = {name: F.linear(xs[name], weights[0][name]).float() for name in LAYER}
            for cfg in TRITON_CFGS:
                key = "triton/" + "x".join(str(c) for c in cfg)
                try:
                    errs = []
                    for name in LAYER:
                        out = triton_mm(xs[name], weights[0][name], ys[name], cfg).float()
                        errs.append(((out - ref[name]).abs().max() / ref[name].abs().max()).item())
                    if max(errs) > 2e-2:
                        row[key + "_error"] = f"max rel err {max(errs):.3g}"
                        continue
                    tm = lambda i, name, cfg=cfg: triton_mm(xs[name], weights[i][name], ys[name], cfg)  # noqa: E731
                    row["us_per_layer"][key] = time_graph(calls(tm)) * len(LAYER)
                    for name in LAYER:
                        row["per_gemm_us"][f"{key}/{name}"] = time_graph(
                            [lambda i=i, name=name: tm(i, name) for i in range(LAYERS)])
                except Exception as e:  # noqa: BLE001
                    row[key + "_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        if m == MS[0]:  # a graph node's floor: 112 launches of a one-wave no-op kernel
            sink = torch.zeros(4 * 132, device=dev)
            row["noop_launch_us"] = time_graph(
                [lambda: _noop_kernel[(4 * 132,)](sink, num_warps=4)] * (LAYERS * len(LAYER)))
            print(f"one-wave no-op kernel in a graph: {row['noop_launch_us']:.2f} us a launch",
                  flush=True)
        xl = torch.randn(m, LM_HEAD[1], device=dev, dtype=bf)
        yl = torch.empty(m, LM_HEAD[0], device=dev, dtype=bf)
        row["lm_head_us"] = time_graph([lambda: torch.mm(xl, lm.t(), out=yl)])
        row["lm_head_argmax_us"] = time_graph([lambda: torch.mm(xl, lm.t(), out=yl).argmax(-1)])
        row["lm_head_weight_floor_us"] = LM_HEAD[0] * LM_HEAD[1] * 2 / (COPY_TBPS * 1e6)
        rows.append(row)
        best = min(row["us_per_layer"].items(), key=lambda kv: kv[1])
        print(f"M={m:4d}: floors weight {wfloor:5.1f} us, flops {ffloor:5.1f} us | "
              + "  ".join(f"{k} {v:6.1f}" for k, v in row["us_per_layer"].items()
                          if not k.startswith("triton"))
              + f" | best {best[0]} {best[1]:.1f} | lm head {row['lm_head_us']:.1f} "
                f"(+argmax {row['lm_head_argmax_us']:.1f}, floor {row['lm_head_weight_floor_us']:.1f})",
              flush=True)
        tri = sorted((v, k) for k, v in row["us_per_layer"].items() if k.startswith("triton"))
        if tri:
            print("   triton best: " + ", ".join(f"{k[7:]} {v:.1f}" for v, k in tri[:4]), flush=True)
        print("   per GEMM (linear): " + ", ".join(
            f"{k[7:]} {v:.2f}" for k, v in row["per_gemm_us"].items() if k.startswith("linear/")),
              flush=True)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
