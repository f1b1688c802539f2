"""The MLP's activation inside the down projection's split-K launch on the GPU
(``splitk_gemm.splitk_linear(..., gated=True)``) against the two launches it replaces (the
activation kernel, then the plain split-K launch), Qwen3-0.6B's down projection (1024 x 3072,
bf16, ``gate_up`` [M, 6144]), device microseconds per call as CUDA-graph replays over 4 sets
of operands; every gated result checked bit for bit against the two launches'.

    python3 bench/bench_gated_down_gpu.py --out gated_down.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench_attention_gpu import time_graph  # noqa: E402
from pagedkv.kernels import splitk_gemm as sk  # noqa: E402
from pagedkv.kernels.activation import silu_and_mul_op  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

N, K = 1024, 3072


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32,64,96,128")
    p.add_argument("--out", default="gated_down.json")
    args = p.parse_args()
    S = sk.splitk_splits(N, K)
    rec = {"environment": environment(), "splits": S, "rows": {}}
    g = torch.Generator(device="cuda").manual_seed(0)
    ws = [torch.randn(N, K, device="cuda", generator=g).bfloat16() * 0.02 for _ in range(4)]
    for m in (int(v) for v in args.rows.split(",")):
        xs = [torch.randn(m, 2 * K, device="cuda", generator=g).bfloat16() for _ in range(4)]
        for x, w in zip(xs, ws):
            assert torch.equal(sk.splitk_linear_gated_op(x, w, S),
                               sk.splitk_linear_op(silu_and_mul_op(x), w, S))
        two = time_graph([lambda x=x, w=w: sk.splitk_linear_op(silu_and_mul_op(x), w, S)
                          for x, w in zip(xs, ws)])
        act = time_graph([lambda x=x: silu_and_mul_op(x) for x in xs])
        gated = time_graph([lambda x=x, w=w: sk.splitk_linear_gated_op(x, w, S)
                            for x, w in zip(xs, ws)])
        rec["rows"][m] = {"two_launches_us": two, "activation_us": act, "gated_us": gated}
        print(f"M {m:4d}: activation + split-K {two:5.2f} us (activation alone {act:4.2f}) | "
              f"gated split-K {gated:5.2f} us ({two - gated:+.2f})", flush=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
