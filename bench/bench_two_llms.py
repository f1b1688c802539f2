"""Two engines, one after the other, in one process (a notebook's life): does the second run W1
as fast as a fresh process would?

Builds engine A, runs W1 (``run_throughput``, after its warm-up), then drops A (``del`` and
``gc.collect()``, or keeps it with ``--keep-first``), builds engine B, runs W1 again. For each
engine it records the output throughput, the KV pool it was given (blocks, how it was sized),
the device memory in use before it was built, and the cyclic GC's work during the timed run
(collections per generation and their total time, through ``gc.callbacks``), so a slower second
run can be told apart: a smaller pool (memory still held by A), longer collections (A's
objects still in the heap), or something else.

Option sets (``--first`` / ``--second``): ``defaults`` (``LLM.from_shape`` with no engine
option), ``plain`` (``async_scheduling=False, compile_model=False``), ``fast`` (both True).
W1's own settings are always passed: ``max_model_len`` 4096.

Usage (H200)::

    python bench/bench_two_llms.py --first plain --second fast --json two_llms.json
    python bench/bench_two_llms.py --first fast --second fast
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from pagedkv.tools.benchmark import environment, run_throughput, w1_workload  # noqa: E402
from pagedkv.engine.llm import LLM  # noqa: E402

OPTIONS = {
    "defaults": {},
    "plain": dict(async_scheduling=False, compile_model=False),
    "fast": dict(async_scheduling=True, compile_model=True),
}


class GCWatch:
    """Collections per generation and the time spent in them, between ``start`` and ``stop``."""

    def __init__(self) -> None:
        self.on = False
        self.t0 = 0.0
        self.counts = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self.longest = 0.0
        gc.callbacks.append(self._cb)

    def _cb(self, phase, info) -> None:
        if not self.on:
            return
        if phase == "start":
            self.t0 = time.perf_counter()
        else:
            dt = time.perf_counter() - self.t0
            g = info["generation"]
            self.counts[g] += 1
            self.seconds[g] += dt
            self.longest = max(self.longest, dt)

    def start(self) -> None:
        self.counts, self.seconds, self.longest = [0, 0, 0], [0.0, 0.0, 0.0], 0.0
        self.on = True

    def stop(self) -> dict:
        self.on = False
        return {"collections": self.counts, "seconds": [round(s, 4) for s in self.seconds],
                "longest_ms": round(self.longest * 1e3, 2)}


def memory() -> dict:
    if not torch.cuda.is_available():
        return {}
    free, total = torch.cuda.mem_get_info()
    return {"allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
            "reserved_gib": round(torch.cuda.memory_reserved() / 2**30, 2),
            "device_used_gib": round((total - free) / 2**30, 2)}


def run_one(name: str, opts: dict, args, watch: GCWatch) -> tuple[LLM, dict]:
    before = memory()
    t = time.perf_counter()
    llm = LLM.from_shape(args.shape, max_model_len=args.max_model_len, **opts)
    build_s = time.perf_counter() - t
    wl = w1_workload(args.num_requests, args.scale)
    watch.start()
    res = run_throughput(llm, wl)
    gcs = watch.stop()
    kv = llm.get_kv_stats()
    row = {"engine": name, "options": opts, "build_s": round(build_s, 1),
           "memory_before_build": before, "output_tokens_per_s": round(res.output_tokens_per_s, 1),
           "elapsed_s": round(res.elapsed_s, 3), "output_tokens": res.output_tokens,
           "preemptions": res.preemptions, "num_blocks": kv["num_blocks"],
           "sized_by": kv.get("sized_by"), "async": kv["async_scheduling"],
           "compiled": kv["compiled_model"], "gc_during_run": gcs,
           "gc_frozen_objects": gc.get_freeze_count()}
    print(json.dumps(row), flush=True)
    return llm, row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--first", default="plain", choices=sorted(OPTIONS))
    p.add_argument("--second", default="fast", choices=sorted(OPTIONS))
    p.add_argument("--keep-first", action="store_true", help="do not delete engine A")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--max-model-len", type=int, default=4096, help="W1's; smaller for CPU smoke runs")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    watch = GCWatch()
    rows = []
    llm, row = run_one(f"A ({args.first})", OPTIONS[args.first], args, watch)
    rows.append(row)
    if not args.keep_first:
        del llm
        gc.collect()
        llm = None
    try:
        _, row = run_one(f"B ({args.second})", OPTIONS[args.second], args, watch)
    except Exception as e:  # e.g. no memory left with --keep-first
        row = {"engine": f"B ({args.second})", "error": f"{type(e).__name__}: {e}"}
        print(json.dumps(row), flush=True)
    rows.append(row)
    print(f"\ntwo engines in one process ({'first kept' if args.keep_first else 'first deleted'})")
    for r in rows:
        if "error" in r:
            print(f"  {r['engine']:14s} error: {r['error']}")
            continue
        print(f"  {r['engine']:14s} {r['output_tokens_per_s']:>9,.0f} tok/s  blocks {r['num_blocks']:>6}"
              f"  device used before build {r['memory_before_build'].get('device_used_gib', '?')} GiB"
              f"  gc {r['gc_during_run']['collections']} {sum(r['gc_during_run']['seconds']):.3f} s"
              f"  preemptions {r['preemptions']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": environment(), "args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
