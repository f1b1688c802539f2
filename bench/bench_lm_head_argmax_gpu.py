"""The greedy step's LM head + argmax on the GPU: the fused kernel
(``pagedkv.kernels.lm_head_argmax``) against the unfused path (``F.linear`` to bf16 logits, then
the argmax kernels), Qwen3's head (151,936 x 1,024, bf16), device microseconds per call as
CUDA-graph replays (the weight, 311 MB, never fits the L2), with the weight bytes' time at
4.27 TB/s as the floor. Every fused result is checked: a maximal logit in every row and the
unfused token in >= 98% of rows.

    python3 bench/bench_lm_head_argmax_gpu.py --out lm_head_argmax.json [--sweep]
        [--table-out table.json]

``--sweep`` also times the launch configs of ``SWEEP`` at every row count; ``--table-out``
writes, per bucket of ``CONFIGS`` (rows up to 16 / 64 / 128 / 256), the config with the least
total time over the swept row counts in that bucket (``bench_w1.py --lm-head-argmax-table``
installs it).
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
from pagedkv.kernels import lm_head_argmax as lha  # noqa: E402
from pagedkv.kernels.argmax import argmax_rows  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

VOCAB, HIDDEN = 151936, 1024
BW = 4.27e12
# (block_m, block_n, block_k, warps, stages, programs a multiprocessor)
SWEEP = [
    (16, 128, 128, 4, 4, 2), (16, 128, 64, 4, 4, 2), (16, 64, 128, 4, 4, 4),
    (16, 256, 64, 4, 3, 2), (64, 128, 64, 4, 4, 2), (64, 128, 128, 4, 3, 1),
    (64, 64, 64, 4, 4, 4), (64, 256, 64, 8, 3, 1), (128, 128, 64, 8, 3, 1),
    (128, 64, 64, 4, 4, 2), (128, 256, 64, 8, 3, 1), (256, 128, 64, 8, 3, 1),
    (128, 128, 64, 8, 4, 1), (64, 128, 64, 4, 4, 4),
]


def check(got: torch.Tensor, h: torch.Tensor, w: torch.Tensor, unfused: torch.Tensor) -> float:
    logits = h.float() @ w.float().t()
    top = logits.max(-1).values
    picked = logits.gather(1, got[:, None])[:, 0]
    assert torch.all(picked >= top - top.abs() * 2 ** -7), "a row's token is not maximal"
    agree = (got == unfused).float().mean().item()
    assert agree >= 0.98, f"agreement with the unfused path {agree:.3f}"
    return agree


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,16,32,64,96,128,160,192,256")
    p.add_argument("--out", default="lm_head_argmax.json")
    p.add_argument("--sweep", action="store_true")
    p.add_argument("--table-out", default=None)
    args = p.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    w = (torch.randn(VOCAB, HIDDEN, device="cuda", generator=g) * 0.05).bfloat16()
    floor = VOCAB * HIDDEN * 2 / BW * 1e6
    rec = {"environment": environment(), "floor_us": floor, "rows": {}}
    for m in (int(x) for x in args.rows.split(",")):
        h = torch.randn(m, HIDDEN, device="cuda", generator=g).bfloat16()
        unfused = argmax_rows(F.linear(h, w))
        e = {"unfused_us": time_graph([lambda: argmax_rows(F.linear(h, w))]),
             "linear_us": time_graph([lambda: F.linear(h, w)])}
        e["agree_default"] = check(lha.lm_head_argmax(h, w), h, w, unfused)
        e["fused_us"] = time_graph([lambda: lha.lm_head_argmax(h, w)])
        if args.sweep:
            for c in SWEEP:
                cfg = lha.LMHeadArgmaxConfig(*c)
                key = "x".join(str(v) for v in c)
                try:
                    check(lha.lm_head_argmax(h, w, cfg), h, w, unfused)
                    e[f"cfg_{key}"] = time_graph([lambda cfg=cfg: lha.lm_head_argmax(h, w, cfg)])
                except Exception as ex:  # a config that fails to compile or run is reported
                    e[f"cfg_{key}_error"] = f"{type(ex).__name__}: {str(ex)[:200]}"
        rec["rows"][m] = e
        best = min(((k[4:], v) for k, v in e.items() if k.startswith("cfg_")
                    and isinstance(v, float)), key=lambda kv: kv[1], default=None)
        print(f"M {m:4d}: unfused {e['unfused_us']:6.1f} us (linear {e['linear_us']:6.1f}) | "
              f"fused default {e['fused_us']:6.1f} ({floor / e['fused_us']:.0%} of the weight "
              f"floor {floor:.1f})" + (f" | best {best[0]} {best[1]:.1f}" if best else ""),
              flush=True)
    if args.sweep:
        table = {}
        for bucket in sorted(lha.CONFIGS):
            lo = max([b for b in lha.CONFIGS if b < bucket], default=0)
            ms = [m for m in rec["rows"] if lo < m <= bucket]
            if not ms:
                continue
            totals = {}
            for c in SWEEP:
                key = "x".join(str(v) for v in c)
                ts = [rec["rows"][m].get(f"cfg_{key}") for m in ms]
                if all(isinstance(t, float) for t in ts):
                    totals[key] = sum(ts)
            best = min(totals, key=totals.get)
            table[bucket] = {"config": [float(v) if i == 5 else int(v) for i, v in
                                        enumerate(best.split("x"))],
                             "total_us": totals[best],
                             "unfused_total_us": sum(rec["rows"][m]["unfused_us"] for m in ms),
                             "rows": ms}
            print(f"bucket <= {bucket}: {best} {totals[best]:.1f} us over rows {ms} "
                  f"(unfused {table[bucket]['unfused_total_us']:.1f})", flush=True)
        rec["table"] = table
        if args.table_out:
            with open(args.table_out, "w") as f:
                json.dump(table, f, indent=1)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
