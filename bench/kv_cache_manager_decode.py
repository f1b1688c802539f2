#!/usr/bin/env python
"""CPU benchmark: KVCacheManager.allocate_slots on the decode hot path.

N running requests (prompts of 100-300 random tokens, B=16, prefix caching on) each get
``allocate_slots(req, 1)`` once per step, then one sampled token (which extends the block
hashes). Reported per step (median and p90 over the steps): the N allocate_slots calls, and
the N token appends (hashing included). Configs: one full-attention group, and full +
sliding window (W=128).

Run from the repository root:
    python bench/kv_cache_manager_decode.py --out bench/results/kv_cache_manager_decode.json
A table is printed last; JSON with every number goes to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from pagedkv.core.kv_cache_manager import KVCacheManager  # noqa: E402
from pagedkv.core.request import Request  # noqa: E402
from pagedkv.core.spec import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
)


def run(num_reqs: int, hybrid: bool, steps: int) -> dict:
    groups = [KVCacheGroupSpec(("full",), FullAttentionSpec(block_size=16))]
    if hybrid:
        groups.append(KVCacheGroupSpec(("swa",), SlidingWindowSpec(block_size=16, sliding_window=128)))
    cfg = KVCacheConfig(num_blocks=64 * num_reqs, kv_cache_groups=groups)
    mgr = KVCacheManager(cfg, max_model_len=4096)
    rng = random.Random(0)
    reqs = []
    for i in range(num_reqs):
        prompt = [rng.randrange(32000) for _ in range(rng.randint(100, 300))]
        r = Request(f"r{i}", prompt, block_hasher=mgr.block_hasher)
        hits, n = mgr.get_computed_blocks(r)
        mgr.allocate_slots(r, r.num_tokens - n, n, hits)
        r.num_computed_tokens = r.num_tokens
        r.append_output_token_ids(1)
        reqs.append(r)
    alloc, append = [], []
    for step in range(steps):
        t0 = time.perf_counter()
        for r in reqs:
            mgr.allocate_slots(r, 1)
        t1 = time.perf_counter()
        for r in reqs:
            r.num_computed_tokens += 1
            r.append_output_token_ids(step % 1000)
        t2 = time.perf_counter()
        alloc.append(t1 - t0)
        append.append(t2 - t1)

    def stats(xs):
        xs = sorted(xs)
        return {"median_ms": statistics.median(xs) * 1e3, "p90_ms": xs[int(len(xs) * 0.9)] * 1e3}

    return {"num_reqs": num_reqs, "groups": "full+swa" if hybrid else "full", "steps": steps,
            "allocate_slots": stats(alloc), "append_tokens": stats(append)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = [run(n, h, a.steps) for n in (256, 1024) for h in (False, True)]
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump({"python": sys.version.split()[0], "results": rows}, f, indent=1)
    print(f"{'reqs':>5} {'groups':>9} {'alloc med ms':>13} {'alloc p90 ms':>13} "
          f"{'us/call':>8} {'append med ms':>14}")
    for r in rows:
        al = r["allocate_slots"]
        print(f"{r['num_reqs']:>5} {r['groups']:>9} {al['median_ms']:>13.3f} {al['p90_ms']:>13.3f} "
              f"{al['median_ms'] * 1e3 / r['num_reqs']:>8.2f} {r['append_tokens']['median_ms']:>14.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
