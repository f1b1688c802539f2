#!/usr/bin/env python3
"""Where W1's time goes on the GPU: a per-step timeline and torch-profiler windows.

Builds the engine exactly as ``bench/bench_w1.py`` does (Qwen3-0.6B shape, random bf16 weights,
async scheduling and compiled regions by default), then:

1. **Timeline run**: W1 once, recording per engine step the wall-clock time, the scheduled
   requests and tokens, the summed context of the scheduled requests (KV tokens attention
   reads) and how long the host waited for the device at the step's one sync (the sampled-ids
   event). Large waits mean the device is the bottleneck; waits near zero mean the host is.
2. **Profiler run**: W1 again (prefix cache reset first) with ``torch.profiler`` (CPU + CUDA)
   active during a few windows of steps (``--windows``, e.g. prefill at the start, decode at
   full and at half batch). For each window it writes a chrome trace and a text table of the
   kernels by device time under ``--out``, and prints each window's device time per step by
   kernel class (``pagedkv.tools.profile_breakdown``: GEMMs, attention, norms/rotary,
   activation, MoE, sampling, index, copies, other) with the device's busy and idle time;
   all windows in ``breakdown.json``. ``--workload w3`` profiles the shared-prefix workload.

Usage on the H200 (installs nothing)::

    python3 bench/profile_w1_gpu.py --out $OUT/prof
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from pagedkv.tools.benchmark import WORKLOAD_MAX_MODEL_LEN, environment, workload  # noqa: E402
from pagedkv.tools.profile_breakdown import (  # noqa: E402
    breakdown,
    decode_step_fit,
    device_gaps,
    format_breakdown,
    format_gaps,
    kernel_class,
)
from pagedkv.engine.llm import LLM  # noqa: E402
from pagedkv.sampling.params import SamplingParams  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class _TimedEvent:
    """A CUDA event whose ``synchronize`` adds its wait to a list."""

    def __init__(self, ev, waits: list):
        self.ev, self.waits = ev, waits

    def record(self, *a):
        self.ev.record(*a)

    def synchronize(self):
        t0 = time.perf_counter()
        self.ev.synchronize()
        self.waits.append(time.perf_counter() - t0)

    def query(self):
        return self.ev.query()


def instrument(llm, rec: list, waits: list):
    engine = llm.engine
    sched = engine.scheduler
    outputs = engine.runner.outputs  # AsyncOutputs: the pinned buffers' events
    if outputs._events is not None:
        outputs._events = [_TimedEvent(e, waits) for e in outputs._events]
    orig = sched.schedule

    def schedule():
        so = orig()
        ctx = sum(r.num_computed_tokens for r in sched.running)
        rec.append((time.perf_counter(), len(so.num_scheduled_tokens), so.total_num_scheduled_tokens,
                    ctx, len(waits)))
        return so

    sched.schedule = schedule


def run_w1(llm, wl, step_hook=None):
    """Run the workload through ``LLMEngine.step`` (as ``LLM.generate`` does, without
    collecting outputs); returns (seconds, engine steps)."""
    engine = llm.engine
    prompts = [p[: engine.max_model_len - 1] for p in wl.fit_vocab(engine.vocab_size).prompts]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m) for m in wl.max_tokens]
    engine.scheduler.reset_prefix_cache()
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp)
    _sync()
    gc.collect()
    gc.freeze()
    t0 = time.perf_counter()
    n = 0
    while engine.has_unfinished_requests():
        if step_hook is not None:
            step_hook(n)
        for o in engine.step(finished_only=True):
            if o.finished:
                engine.release(o.request_id)
        n += 1
    for o in engine.flush():
        engine.release(o.request_id)
    _sync()
    dt = time.perf_counter() - t0
    gc.unfreeze()
    return dt, n


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="qwen3-0.6b")
    p.add_argument("--out", default="prof_w1")
    p.add_argument("--windows", default="4:7,60:64,400:404,800:804",
                   help="engine-step windows [a, b) of the profiler run")
    p.add_argument("--no-async-scheduling", action="store_true")
    p.add_argument("--no-compile-model", action="store_true")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--skip-profile", action="store_true")
    p.add_argument("--no-trace-files", action="store_true",
                   help="delete each window's chrome trace after its gap analysis")
    p.add_argument("--log-compiles", action="store_true",
                   help="print every Triton compile (kernel, specialization) and torch.compile "
                        "recompile, with the engine step it happened in")
    p.add_argument("--phases", action="store_true",
                   help="host milliseconds per engine phase (bench/profile_engine_step.py's "
                        "wrappers), for prefill-like and decode steps of the timeline run")
    p.add_argument("--cprofile-steps", default=None,
                   help="A:B: cProfile engine steps [A, B) of the timeline run and print the "
                        "functions with the most own time (host cost of those steps)")
    p.add_argument("--decode-config", default="",
                   help="k=v,... DecodeConfig fields for this run's decode attention (A/B "
                        "runs, e.g. mid_splits=1 or large_splits=8)")
    p.add_argument("--num-requests", type=int, default=None,
                   help="default: the workload's (W1 256, W2 64, W3 256)")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--workload", default="w1", choices=["w1", "w2", "w3"],
                   help="the workload (pagedkv.tools.benchmark; W3: one shared system prompt)")
    p.add_argument("--splitk", action=argparse.BooleanOptionalAction, default=None,
                   help="as bench_w1.py's")
    p.add_argument("--splitk-gate-up", action=argparse.BooleanOptionalAction, default=None,
                   help="as bench_w1.py's")
    p.add_argument("--splitk-table", default=None, help="as bench_w1.py's")
    p.add_argument("--fused-qkv", action=argparse.BooleanOptionalAction, default=None,
                   help="as bench_w1.py's")
    p.add_argument("--fused-gate-up", action=argparse.BooleanOptionalAction, default=None,
                   help="as bench_w1.py's")
    p.add_argument("--fused-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="as bench_w1.py's")
    p.add_argument("--persistent-decode", action=argparse.BooleanOptionalAction, default=None,
                   help="as bench_w1.py's")
    p.add_argument("--decode-prologue", action=argparse.BooleanOptionalAction, default=None,
                   help="as bench_w1.py's")
    p.add_argument("--pdl", action=argparse.BooleanOptionalAction, default=None,
                   help="as bench_w1.py's")
    p.add_argument("--fresh-prefill", default=None, choices=["auto", "triton", "varlen"],
                   help="the Triton backend's fresh-prefill path, as bench_w1.py's")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    from bench_w1 import configure_splitk, decode_config_fields

    configure_splitk(args)

    backend_kw = {}
    if args.decode_config or args.fresh_prefill:
        # the engine's backend takes its decode config from the backend, not from the
        # module's default: an explicit backend with the defaults but what is given here
        from pagedkv.attention.triton_backend import TritonAttentionBackend
        from pagedkv.attention.triton_decode import DecodeConfig
        backend_kw["attention_backend"] = TritonAttentionBackend(
            decode_config=DecodeConfig(**decode_config_fields(args.decode_config))
            if args.decode_config else None,
            fresh_prefill=args.fresh_prefill or "auto")
        print(f"decode config for this run: {backend_kw['attention_backend'].decode_config}")
    t_build = time.perf_counter()
    llm = LLM.from_shape(args.shape, max_num_seqs=256,
                         max_model_len=WORKLOAD_MAX_MODEL_LEN[args.workload],
                         gpu_memory_utilization=0.9,
                         enforce_eager=args.enforce_eager,
                         async_scheduling=not args.no_async_scheduling,
                         compile_model=not args.no_compile_model,
                         **backend_kw)
    t_build = time.perf_counter() - t_build
    wl = workload(args.workload, args.num_requests, args.scale)
    rec: list = []
    waits: list = []
    if args.log_compiles:  # from the first user request on (the engine's own warm-up is done)
        from triton import knobs

        def on_compile(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
            spec = " ".join(str(x) for x in key[1]) if isinstance(key, tuple) else str(key)
            print(f"[triton compile] step {len(rec)} {fn.name} "
                  f"{' '.join(repr.split())[:300]} | {spec[:600]}", flush=True)
            return False

        knobs.runtime.jit_cache_hook = on_compile
        torch._logging.set_logs(recompiles=True)
    # warm-up: a few short requests (the first user requests after start-up: their step
    # times are printed, as a first request's latency; compiles in them are logged above)
    inner_step = llm.engine.step
    first_steps: list = []

    def first_step(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner_step(*a, **kw)
        finally:
            first_steps.append(time.perf_counter() - t0)

    llm.engine.step = first_step
    llm.generate([[1 + i] * 40 for i in range(4)],
                 SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8), use_tqdm=False)
    llm.engine.step = inner_step
    print("first user generate after start-up, ms a step: "
          + " ".join(f"{1e3 * t:.1f}" for t in first_steps), flush=True)

    instrument(llm, rec, waits)
    timer = None
    if args.phases:
        from profile_engine_step import Timer
        from profile_engine_step import instrument as instrument_phases

        timer = Timer()
        instrument_phases(llm.engine, timer)
        inner_step = llm.engine.step

        def timed_step(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner_step(*a, **kw)
            finally:
                timer.add("step total", time.perf_counter() - t0)
                timer.end_step(True)

        llm.engine.step = timed_step
    hook = None
    if args.cprofile_steps:
        import cProfile
        import pstats

        a, b = (int(x) for x in args.cprofile_steps.split(":"))
        cprof = cProfile.Profile()

        def hook(n):
            if n == a:
                cprof.enable()
            elif n == b:
                cprof.disable()
                st = pstats.Stats(cprof)
                st.sort_stats("tottime").print_stats(45)
                st.sort_stats("cumulative").print_stats(45)
    dt, nsteps = run_w1(llm, wl, hook)
    out_tokens = wl.requested_output_tokens  # ignore_eos: all are generated
    print(f"timeline run: {dt:.3f} s, {nsteps} steps, {out_tokens / dt:,.0f} output tok/s "
          f"(build {t_build:.1f} s)", flush=True)
    steps = []
    for i, (t, n, T, ctx, w_idx) in enumerate(rec):
        t_next = rec[i + 1][0] if i + 1 < len(rec) else None
        steps.append({"t": t - rec[0][0], "dt": None if t_next is None else t_next - t,
                      "reqs": n, "tokens": T, "ctx": ctx,
                      "wait": waits[w_idx] if w_idx < len(waits) else None})
    # summary by phase
    pre = [s for s in steps if s["tokens"] > s["reqs"] and s["dt"] is not None]
    dec = [s for s in steps if s["tokens"] == s["reqs"] and s["dt"] is not None]
    summ = {"elapsed_s": dt, "steps": nsteps, "output_tok_s": out_tokens / dt, "build_s": t_build,
            "prefill_like_steps": len(pre), "prefill_like_s": sum(s["dt"] for s in pre),
            "decode_steps": len(dec), "decode_s": sum(s["dt"] for s in dec),
            "decode_wait_s": sum(s["wait"] or 0 for s in dec)}
    print(json.dumps(summ, indent=1), flush=True)
    # decode steps by batch-size bins
    bins = {}
    for s in dec:
        b = min(s["reqs"] // 32, 7)
        e = bins.setdefault(b, [0, 0.0, 0.0, 0])
        e[0] += 1
        e[1] += s["dt"]
        e[2] += s["wait"] or 0.0
        e[3] += s["ctx"]
    print("decode steps by batch size: bin  steps  ms/step  wait ms/step  mean ctx tokens/step")
    for b in sorted(bins):
        c, t, w, x = bins[b]
        print(f"  [{32 * b:3d},{32 * b + 32:3d})  {c:5d}  {1e3 * t / c:7.3f}  {1e3 * w / c:7.3f}  {x / c:10.0f}")
    if len({s["ctx"] for s in dec}) > 1:
        sz = llm.engine.sizing
        bpt = sz.bytes_per_block // sz.block_size if sz is not None and not sz.groups else None
        fit = decode_step_fit(dec, bpt)
        summ["decode_fit"] = fit
        print(f"decode step = {fit['fixed_ms']:.3f} ms + {fit['ns_per_token']:.2f} ns x context "
              f"tokens (least squares over {fit['steps']} steps"
              + (f"; {bpt:,} K/V bytes a token: {fit['tb_per_s']:.2f} TB/s" if bpt else "")
              + f"): fixed {fit['fixed_s_total']:.3f} s + per-token {fit['per_token_s_total']:.3f} s"
              f" of {fit['decode_s']:.3f} s", flush=True)
    if timer is not None:
        phases = sorted({k for st in timer.steps for k in st})
        for label, pick in (("prefill-like", lambda s: s["tokens"] > s["reqs"]),
                            ("decode", lambda s: s["tokens"] == s["reqs"])):
            idx = [i for i, s in enumerate(steps) if s["dt"] is not None and pick(s)
                   and i < len(timer.steps)]
            if not idx:
                continue
            print(f"host ms per {label} step (mean over {len(idx)}; '_runner' = "
                  f"execute_model_async + get_output incl. the wait; wait = the event sync):")
            for ph in phases:
                vals = [timer.steps[i].get(ph, 0.0) for i in idx]
                print(f"  {ph:<16} {1e3 * sum(vals) / len(vals):8.3f}")
            w = [steps[i]["wait"] or 0.0 for i in idx]
            print(f"  {'wait':<16} {1e3 * sum(w) / len(w):8.3f}")
    with open(os.path.join(args.out, "timeline.json"), "w") as f:
        json.dump({"environment": environment(), "summary": summ, "steps": steps}, f)

    if args.skip_profile:
        return 0
    windows = [tuple(int(x) for x in w.split(":")) for w in args.windows.split(",")]
    state = {"prof": None, "win": None, "t0": 0.0}
    breakdowns = {}

    def hook(n):
        if state["prof"] is not None and n == state["win"][1]:
            _sync()
            wall = time.perf_counter() - state["t0"]
            prof = state["prof"]
            prof.stop()
            a, b = state["win"]
            trace_path = os.path.join(args.out, f"trace_{a}_{b}.json")
            prof.export_chrome_trace(trace_path)
            with open(trace_path) as f:
                gaps = device_gaps(json.load(f), b - a)
            if args.no_trace_files:
                os.remove(trace_path)
            with open(os.path.join(args.out, f"kernels_{a}_{b}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=60))
            # the host side of the window: ops by their own CPU time (launch costs, wrappers)
            with open(os.path.join(args.out, f"host_{a}_{b}.txt"), "w") as f:
                f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60))
            # device kernels only (CPU-side ops have no device self time)
            bd = breakdown(prof.key_averages(), wall, b - a)
            bd["gaps"] = gaps
            breakdowns[f"{a}:{b}"] = bd
            print(format_breakdown(f"window {a}:{b} ({args.workload})", bd), flush=True)
            print(format_gaps(f"window {a}:{b} device gaps", gaps), flush=True)
            others = sorted(((e.self_device_time_total, e.key) for e in prof.key_averages()
                             if e.self_device_time_total > 0 and kernel_class(e.key) == "other"),
                            reverse=True)[:8]
            for us, key in others:
                print(f"  other: {us / (b - a):9.1f} us/step  {key[:90]}", flush=True)
            state["prof"] = None
        for w in windows:
            if n == w[0]:
                prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                          torch.profiler.ProfilerActivity.CUDA])
                prof.start()
                # no device sync here: after one, the window's first step would prepare its
                # inputs on an idle device, and that host time would read as device gaps (the
                # fifth session's "~0.5 ms a step waiting for the host" was this)
                state["prof"], state["win"], state["t0"] = prof, w, time.perf_counter()

    dt2, _ = run_w1(llm, wl, hook)
    print(f"profiler run: {dt2:.3f} s (profiler overhead included)", flush=True)
    with open(os.path.join(args.out, "breakdown.json"), "w") as f:
        json.dump({"environment": environment(), "workload": args.workload,
                   "windows": breakdowns}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
