#!/usr/bin/env python3
"""The fused QKV projection (``pagedkv.kernels.qkv_rope_cache``: GEMM + q/k norms + RoPE + KV
write, one launch) against what the model runs without it (cuBLAS ``F.linear`` then
``qk_norm_rope_cache``), Qwen3-0.6B shape, bf16, H200.

For each batch size M, 28 layers over distinct weights and caches (cold in L2, as in the
model) are timed in one CUDA graph (``bench_attention_gpu.time_graph``), us per layer: the
unfused pair, and the fused kernel for each split count and launch config; each fused variant
is first checked against the unfused pair's output (q and the written K/V, bf16 tolerance).

    python3 bench/bench_qkv_rope_gpu.py --out $OUT/qkv_rope.json
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
from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache  # noqa: E402
from pagedkv.kernels.qkv_rope_cache import (  # noqa: E402
    QKVRopeConfig,
    default_splits,
    qkv_rope_cache,
)
from pagedkv.tools.benchmark import environment  # noqa: E402

H, HKV, D, K = 16, 8, 128, 1024
BS, NB = 16, 512
MS = (1, 8, 32, 64, 128, 192, 256)
# (block_m, block_k, warps, stages)
CFGS = [(64, 64, 4, 4), (64, 128, 4, 3), (32, 64, 4, 4), (16, 128, 4, 4), (64, 64, 8, 3),
        (128, 64, 8, 3)]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="qkv_rope.json")
    ap.add_argument("--ms", default=",".join(str(m) for m in MS))
    ap.add_argument("--splits", default="1,2,4")
    ap.add_argument("--trials", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    bf = torch.bfloat16
    torch.manual_seed(0)
    n = (H + 2 * HKV) * D
    layers = [dict(w=torch.randn(n, K, device=dev, dtype=bf) * 0.03,
                   qn=torch.rand(D, device=dev, dtype=bf) + 0.5,
                   kn=torch.rand(D, device=dev, dtype=bf) + 0.5,
                   kv=torch.zeros(2, NB, BS, HKV, D, device=dev, dtype=bf))
              for _ in range(LAYERS)]
    wbytes = n * K * 2
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        x = torch.randn(m, K, device=dev, dtype=bf)
        ang = torch.rand(m, D // 2, device=dev) * 6.28
        cos, sin = ang.cos().to(bf), ang.sin().to(bf)
        slots = torch.randperm(NB * BS, device=dev)[:m]
        q = torch.empty(m, H, D, device=dev, dtype=bf)

        def unfused(ly):
            return lambda: qk_norm_rope_cache(F.linear(x, ly["w"]), H, HKV, D, ly["qn"],
                                              ly["kn"], 1e-6, cos, sin, slots, ly["kv"][0],
                                              ly["kv"][1], q, check=False)

        def fused(ly, cfg):
            return lambda: qkv_rope_cache(x, ly["w"], None, H, HKV, D, ly["qn"], ly["kn"], 1e-6,
                                          cos, sin, slots, ly["kv"][0], ly["kv"][1], q,
                                          check=False, config=cfg)

        # reference outputs of layer 0 (into a zeroed cache: the last M's runs wrote slots too)
        layers[0]["kv"].zero_()
        unfused(layers[0])()
        torch.cuda.synchronize()
        q_ref = q.clone()
        kv_ref = layers[0]["kv"].clone()

        def check(cfg):
            layers[0]["kv"].zero_()
            q.zero_()
            fused(layers[0], cfg)()
            torch.cuda.synchronize()
            torch.testing.assert_close(q.float(), q_ref.float(), rtol=2e-2, atol=5e-2)
            torch.testing.assert_close(layers[0]["kv"].float(), kv_ref.float(), rtol=2e-2,
                                       atol=5e-2)

        configs, seen = [("default", None)], set()
        for splits in (int(v) for v in args.splits.split(",")):
            for bm, bk, warps, stages in CFGS:
                eff = (effective_block_m(bm, m), bk, warps, stages, splits)
                if eff not in seen:
                    seen.add(eff)
                    configs.append((f"{eff[0]}x{bk}x{warps}x{stages}/s{splits}",
                                    QKVRopeConfig(block_m=bm, block_k=bk, num_warps=warps,
                                                  num_stages=stages, splits=splits)))
        row = sweep(m, [unfused(ly) for ly in layers],
                    lambda cfg: [fused(ly, cfg) for ly in layers], check, configs, args.trials)
        row.update(weight_floor_us=wbytes / (COPY_TBPS * 1e6), default_splits=default_splits(m))
        rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"environment": environment(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
