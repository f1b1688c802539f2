#!/usr/bin/env python
"""GPU benchmark: where the cost of splitting a decode batch goes (split kernel vs reduce).

At equal lengths B64/L2048 (bf16, block 16, 16 q / 8 KV heads, head_dim 128) one range per
request takes ~129 us on the H200 and any split (2, 4 or 8 ranges) ~144-155 us
(BENCHMARKS.md). This script separates the two launches of ``paged_decode_attention``: for each
shape and forced split count it times, as CUDA-graph replays over disjoint pages (the method
and setup of ``bench_attention_gpu.py``),

* ``full``: the call as the engine makes it (split kernel + reduce kernel);
* ``split``: the split kernel alone (the reduce launch replaced by nothing);
* ``reduce``: the reduce kernel alone, on the partials a previous full call left.

It also checks the full call against the reference first. Shapes: equal B64/L2048, B64/L8192,
B256/L8192 and mixed lengths U[100, 2048] at B64.

Run on the GPU machine from the repository root (no installs):
    python3 bench/bench_decode_split_cost.py --out $OUT/decode_split_cost.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import pagedkv.attention.triton_decode as td  # noqa: E402
from bench_attention_gpu import DecodeSetup, time_graph  # noqa: E402
from bench_decode_mixed import MixedSetup  # noqa: E402


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


@contextlib.contextmanager
def _without(name: str):
    saved = getattr(td, name)
    setattr(td, name, _NoLaunch())
    try:
        yield
    finally:
        setattr(td, name, saved)


def measure(setup, splits: list[int]) -> dict:
    res = {"rel_err": setup.check()}
    ws = [dict() for _ in range(setup.rot)]  # one workspace per rotation: partials persist

    def calls(**kw):
        return [(lambda i=i: setup.call(i, workspace=ws[i], **kw)()) for i in range(setup.rot)]

    for sp in splits:
        row = {"full": time_graph(calls(num_splits=sp))}
        if sp > 1:
            with _without("_decode_reduce_kernel"):
                row["split"] = time_graph(calls(num_splits=sp))
            for fn in calls(num_splits=sp):  # partials in place for the reduce-only timing
                fn()
            torch.cuda.synchronize()
            with _without("_decode_kernel"):
                row["reduce"] = time_graph(calls(num_splits=sp))
        res[f"splits{sp}"] = row
        print(f"  splits {sp}: " + ", ".join(f"{k} {v:.1f} us" for k, v in row.items()), flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--splits", default="1,2,4,8")
    p.add_argument("--out", default="decode_split_cost.json")
    args = p.parse_args()
    splits = [int(x) for x in args.splits.split(",")]
    out = {}
    for name, make in (("B64/L2048", lambda: DecodeSetup(64, 2048)),
                       ("B64/L8192", lambda: DecodeSetup(64, 8192)),
                       ("B256/L8192", lambda: DecodeSetup(256, 8192)),
                       ("B64 mixed U[100,2048]", lambda: MixedSetup(64, 100, 2048))):
        print(name, flush=True)
        st = make()
        out[name] = measure(st, splits)
        del st
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
