"""Greedy argmax over Qwen3's 151,936 logits a row: the engine's kernels
(``pagedkv.kernels.argmax.greedy_argmax``) against ``torch.argmax``, bf16, device
microseconds per call (CUDA-graph replays of one call on each of 4 buffers of logits, so the
input is mostly not in L2, as after the LM-head GEMM), and the fraction of 4.27 TB/s for the
logits' bytes; every result checked against torch's.

    python3 bench/bench_argmax_gpu.py --out argmax.json
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
from pagedkv.kernels.argmax import greedy_argmax  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

VOCAB = 151936
BW = 4.27e12


def time_us(fn, bufs) -> float:
    """Device microseconds per call: one CUDA graph of a call on each buffer, replayed
    (``bench_attention_gpu.time_graph``; the host's launch overhead, ~0.1 ms a call for two
    Triton launches, is not device time, and in the engine it overlaps the device's work)."""
    return time_graph([lambda b=b: fn(b) for b in bufs])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,64,128,200,256")
    p.add_argument("--out", default="argmax.json")
    p.add_argument("--sweep", action="store_true",
                   help="also the kernels at other tile widths and programs a multiprocessor "
                        "(pagedkv.kernels.argmax._BLOCK / _PROGRAMS_PER_SM)")
    args = p.parse_args()
    import pagedkv.kernels.argmax as mod

    variants = [(mod._BLOCK, mod._PROGRAMS_PER_SM)]
    if args.sweep:
        variants += [(b, q) for b in (1024, 2048, 4096) for q in (8, 16, 32)
                     if (b, q) != variants[0]]
    rec = {"environment": environment(), "rows": {}}
    for m in (int(x) for x in args.rows.split(",")):
        bufs = [torch.randn(m, VOCAB, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
        for b in bufs:
            assert greedy_argmax(b).tolist() == b.argmax(-1).tolist()
        ref = time_us(lambda b: b.argmax(-1), bufs)
        gb = m * VOCAB * 2
        entry = {"torch_us": ref, "torch_bw": gb / ref / 1e-6 / BW}
        default = variants[0]
        for block, per_sm in variants:
            mod._BLOCK, mod._PROGRAMS_PER_SM = block, per_sm
            try:
                assert greedy_argmax(bufs[0]).tolist() == bufs[0].argmax(-1).tolist()
                entry[f"kernels_{block}_{per_sm}_us"] = time_us(greedy_argmax, bufs)
            finally:
                mod._BLOCK, mod._PROGRAMS_PER_SM = default
        ours = entry[f"kernels_{default[0]}_{default[1]}_us"]
        entry.update(kernels_us=ours, kernels_bw=gb / ours / 1e-6 / BW)
        rec["rows"][m] = entry
        print(f"M {m:4d}: kernels {ours:6.1f} us ({100 * gb / ours / 1e-6 / BW:3.0f}% of BW), "
              f"torch.argmax {ref:6.1f} us ({100 * gb / ref / 1e-6 / BW:3.0f}%)"
              + "".join(f"; {k[8:-3]} {v:.1f}" for k, v in entry.items()
                        if k.startswith("kernels_") and k.endswith("_us")
                        and k != f"kernels_{default[0]}_{default[1]}_us" and k != "kernels_us"),
              flush=True)
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
