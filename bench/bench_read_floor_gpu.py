"""How fast the H200 reads a decode call's K/V bytes when nothing else is asked of it: the
floor a paged decode kernel is measured against, at the sizes of the decode anchors.

For each shape, a contiguous bf16 buffer of the shape's K/V bytes (B x L positions x 8 KV
heads x 128 x 2 bytes x 2 for K and V) read by ``torch.sum`` (float32 accumulation: a
vendor reduction, one or two launches) and by ``torch.amax`` of a [rows, 128 x 1024] view
(every element read, one output per row), as CUDA-graph replays over 4 buffers (cold L2 for
the large ones), in microseconds and as a fraction of 4.27 TB/s; and one graph node of a
one-element kernel (the launch cost every kernel boundary of a decode call pays).

    python3 bench/bench_read_floor_gpu.py --out read_floor.json
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
from pagedkv.tools.benchmark import environment  # noqa: E402

BW = 4.27e12
SHAPES = [(1, 512), (1, 2048), (1, 8192), (8, 8192), (64, 2048), (64, 8192)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="read_floor.json")
    args = p.parse_args()
    rec = {"environment": environment(), "shapes": {}}
    one = torch.zeros(1, device="cuda")
    rec["tiny_node_us"] = time_graph([lambda: one.add_(1)])
    print(f"one graph node of a one-element kernel: {rec['tiny_node_us']:.2f} us", flush=True)
    for b, length in SHAPES:
        nbytes = b * length * 8 * 128 * 2 * 2
        n = nbytes // 2
        bufs = [torch.randn(n, device="cuda").bfloat16() for _ in range(4)]
        rows = n // (128 * 1024)
        s = time_graph([lambda x=x: torch.sum(x, dtype=torch.float32) for x in bufs])
        m = time_graph([lambda x=x: torch.amax(x.view(rows, -1), dim=1) for x in bufs])
        floor = nbytes / BW * 1e6
        rec["shapes"][f"B{b}/L{length}"] = {"bytes": nbytes, "floor_us": floor, "sum_us": s,
                                            "amax_rows_us": m}
        print(f"B{b}/L{length}: {nbytes / 1e6:7.1f} MB, bytes at 4.27 TB/s {floor:7.2f} us | "
              f"torch.sum {s:7.2f} us ({floor / s:4.0%}) | amax of rows {m:7.2f} us "
              f"({floor / m:4.0%})", flush=True)
        del bufs
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
