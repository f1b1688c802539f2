"""One attention layer of W2-like prefill steps: the Triton backend with ``fresh_prefill``
"triton" (every prefill row through the paged kernel) against "cudnn" (fresh requests of
>= 4,096 tokens through cuDNN's attention, one call a request, the rest paged) and "cudnn256"
(from 256 tokens); bf16, 16 query / 8 K/V heads, head_dim 128, block 16, the step's K/V
already in the cache (as the engine's fused writer leaves them).

Cases (requests as (context, query tokens); decode rows have query 1):
  * w2_step: 24 decode rows + fresh 7,000 + fresh 6,500 + a chunk of 2,860 after 4,000;
  * w2_fresh2: two fresh prompts of 7,500 and 6,200 (+ 48 decode rows);
  * fresh8x2048: 8 fresh prompts of 2,048 (PERF.md's prefill shape);
  * w1_like: 64 fresh prompts of 100-1,000 tokens.
Each is timed with CUDA events (median of ``--reps`` calls after a warm-up), with its error
against the fp32 reference of the last three requests;
and the wall time of cuDNN calls whose length changes every call, before and after the
plans of every padded length were built (what plan building costs).

    python3 bench/bench_cudnn_prefill_gpu.py --out cudnn_prefill.json
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

import torch  # noqa: E402

from pagedkv.attention import allocate_kv_caches, build_attention_metadata  # noqa: E402
from pagedkv.attention.backend import AttentionLayout  # noqa: E402
from pagedkv.attention.cudnn_prefill import (  # noqa: E402
    cudnn_prefill_attention,
    cudnn_prefill_support,
    warm_plans,
)
from pagedkv.attention.torch_ref import paged_attention_ref  # noqa: E402
from pagedkv.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedkv.tools.benchmark import environment  # noqa: E402

H, HKV, D, BS = 16, 8, 128, 16
DT = torch.bfloat16


def cases() -> dict:
    rng = random.Random(0)
    return {
        "w2_step": [(rng.randint(6000, 8000), 1) for _ in range(24)]
        + [(0, 7000), (0, 6500), (4000, 2860)],
        "w2_fresh2": [(rng.randint(6000, 8000), 1) for _ in range(48)] + [(0, 7500), (0, 6200)],
        "fresh8x2048": [(0, 2048)] * 8,
        "w1_like": [(0, rng.randint(100, 1000)) for _ in range(64)],
    }


def flops(reqs) -> float:
    return sum(4 * H * D * (q * (q + 1) / 2 + q * c) for c, q in reqs if q > 1)


def build(reqs, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    need = [-(-(c + q) // BS) for c, q in reqs]
    num_blocks = 1 + sum(need)
    perm = (torch.randperm(num_blocks - 1, device="cuda", generator=gen) + 1).to(torch.int32)
    table = torch.zeros(len(reqs), max(need), dtype=torch.int32, device="cuda")
    at = 0
    for r, nb in enumerate(need):
        table[r, :nb] = perm[at:at + nb]
        at += nb
    (cache,) = allocate_kv_caches(1, num_blocks, BS, HKV, D, dtype=DT, device="cuda")
    cache.normal_(generator=gen)
    slots = []
    for r, (c, q) in enumerate(reqs):
        pos = torch.arange(c, c + q, device="cuda")
        slots.append(table[r, pos // BS].long() * BS + pos % BS)
    slot_mapping = torch.cat(slots)
    T = slot_mapping.shape[0]
    q = torch.randn(T, H, D, device="cuda", dtype=DT, generator=gen)
    k = cache[0].view(-1, HKV, D)[slot_mapping].clone()
    v = cache[1].view(-1, HKV, D)[slot_mapping].clone()
    meta = build_attention_metadata([q_ for _, q_ in reqs], [c + q_ for c, q_ in reqs],
                                    table.cpu(), slot_mapping.cpu(), device="cuda")
    return q, k, v, cache, meta


def time_us(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        samples.append(a.elapsed_time(b) * 1e3)
    return statistics.median(samples)


def run_case(name, reqs, reps) -> dict:
    q, _, _, cache, meta = build(reqs)
    layout = AttentionLayout.of(q, cache)
    res = {"reqs": len(reqs), "tokens": q.shape[0], "gflop": flops(reqs) / 1e9}
    outs = {}
    modes = {"triton": dict(fresh_prefill="triton"), "cudnn": dict(fresh_prefill="cudnn"),
             "cudnn256": dict(fresh_prefill="cudnn", cudnn_min_query_len=256)}
    for key, opts in modes.items():
        be = TritonAttentionBackend(**opts)

        def call(be=be):  # the engine's way: the K/V already in the cache (fused writer)
            plan = be.plan(meta, layout)
            return be.forward(0, q, None, None, cache, plan, D ** -0.5)

        us = time_us(call, reps)
        res[key] = {"us": us, "tflops": flops(reqs) / us / 1e6}
        outs[key] = call()
    # error of the last three requests (the long ones) against the fp32 reference
    n = len(reqs)
    sub = list(range(max(0, n - 3), n))
    rows = torch.cat([torch.arange(int(meta.query_start_loc_cpu[r]),
                                   int(meta.query_start_loc_cpu[r + 1])) for r in sub]).cuda()
    from types import SimpleNamespace
    ql = [reqs[r][1] for r in sub]
    qsl = torch.zeros(len(sub) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(ql), 0)
    sm = SimpleNamespace(query_start_loc_cpu=qsl, num_reqs=len(sub),
                         seq_lens_cpu=torch.tensor([sum(reqs[r]) for r in sub]),
                         block_table_tensor=meta.block_table_tensor[sub])
    ref = paged_attention_ref(q[rows].float(), cache, sm, D ** -0.5)
    for key, o in outs.items():
        o = o[rows].float()
        res[key]["rel_err"] = float((o - ref).norm() / ref.norm())
    print(f"{name}: " + ", ".join(f"{kk} {vv['us']:.0f} us {vv['tflops']:.0f} TFLOP/s "
                                  f"err {vv['rel_err']:.1e}" for kk, vv in res.items()
                                  if isinstance(vv, dict)), flush=True)
    return res


def profile_case(name, reqs, calls: int = 5) -> None:
    """torch.profiler over ``calls`` calls of one case in each mode (after a warm-up call):
    device microseconds per call by kernel, and the wall time per call with a sync."""
    from torch.profiler import ProfilerActivity, profile

    q, _, _, cache, meta = build(reqs)
    layout = AttentionLayout.of(q, cache)
    for key, opts in {"triton": dict(fresh_prefill="triton"),
                      "cudnn": dict(fresh_prefill="cudnn")}.items():
        be = TritonAttentionBackend(**opts)

        def call(be=be):
            plan = be.plan(meta, layout)
            return be.forward(0, q, None, None, cache, plan, D ** -0.5)

        call()
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                call()
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t) / calls * 1e6
        kern = {}
        for e in prof.key_averages():
            dev = getattr(e, "device_time_total", None)
            if dev is None:
                dev = e.cuda_time_total
            if dev and e.device_type.name == "CUDA":
                kern[e.key] = (dev / calls, e.count / calls)
        total = sum(v[0] for v in kern.values())
        print(f"{name} {key}: wall {wall:.0f} us a call (profiler on), device {total:.0f} us:",
              flush=True)
        for k, (us, cnt) in sorted(kern.items(), key=lambda kv: -kv[1][0])[:12]:
            print(f"   {us:8.1f} us  x{cnt:4.1f}  {k[:110]}", flush=True)


def churn(n_calls: int = 30) -> dict:
    """One request a call whose length changes every call (4,096-8,000 tokens), wall time
    per call with a sync, before and after ``warm_plans`` (plan building shows here)."""
    rng = random.Random(1)
    top = 8192
    q = torch.randn(top, H, D, device="cuda", dtype=DT)
    (cache,) = allocate_kv_caches(1, top // BS + 1, BS, HKV, D, dtype=DT, device="cuda")
    cache.normal_()
    slots = torch.arange(BS, BS + top, device="cuda")
    out = torch.empty_like(q)

    def one(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        cudnn_prefill_attention(q, 0, n, cache, slots[:n], D ** -0.5, out)
        torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1e6, 4 * H * D * n * (n + 1) / 2

    cold = [one(rng.randint(4096, 8000)) for _ in range(5)]
    t = time.perf_counter()
    warm_plans(q, HKV, D ** -0.5, 4096, top)
    warm_s = time.perf_counter() - t
    warm = [one(rng.randint(4096, 8000)) for _ in range(n_calls)]
    res = {"cold_us": [round(u) for u, _ in cold], "warm_plans_s": warm_s,
           "warm_us_median": statistics.median(u for u, _ in warm),
           "warm_tflops_median": statistics.median(f / u / 1e6 for u, f in warm)}
    print(f"churn: {res}", flush=True)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="cudnn_prefill.json")
    p.add_argument("--profile", default=None, metavar="CASE",
                   help="instead: torch.profiler over 5 calls of CASE in each mode, the device "
                        "time per kernel (where a mode's time goes)")
    args = p.parse_args()
    print("cuDNN attention support (bf16, head_dim 128):",
          cudnn_prefill_support(torch.cuda.current_device(), DT, D), flush=True)
    if args.profile:
        profile_case(args.profile, cases()[args.profile])
        return
    rec = {"environment": environment(), "cases": {}}
    for name, reqs in cases().items():
        rec["cases"][name] = run_case(name, reqs, args.reps)
    rec["churn"] = churn()
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
