#!/usr/bin/env python3
"""CPU profile of one engine step: host milliseconds per phase at W1-like concurrency.

The real engine loop (``LLMEngine.step`` -> ``Scheduler`` -> ``ModelRunner`` -> ``Sampler`` ->
``update_from_output`` -> output processing) drives a *stub* model: a real
``DecoderForCausalLM`` with 1 layer, hidden 64 and (by default) the Qwen3 vocabulary of 151,936
tokens, whose attention backend does no attention (``NullBackend``: zeros). So the model call
costs almost nothing and what is left is the engine's host work, which on the GPU is the part
that does not overlap with the device (every phase below except the device work itself).

Workload: ``--num-requests`` (256) requests with prompts of ``randint(100, 1024)`` tokens and
``max_tokens`` large enough that none finishes while timed; the engine first prefills them all
(untimed), then ``--steps`` pure-decode steps at full concurrency (contexts grow from ~100-1000
to ~100-1000 + steps) are timed. ``--finish-every K`` lets one request finish every K steps
(W1's batch shrinks over time; this exercises the finish path and batch changes).

Phases (host ms per step, median and mean over the timed steps; measured by wrapping the
engine's own methods, so the same harness times every engine version):

  schedule         Scheduler.schedule()
  update_states    ModelRunner: SchedulerOutput -> persistent batch (+ block zero/copy ops)
  prepare          InputPreparer.prepare (index math, H2D copies, slot mapping)
  model            the forward pass (graph replay on a GPU)
  logits+sample    compute_logits + the Sampler (+ sampling-metadata rebuilds); the greedy
                   fast path's argmax is counted under "runner other"
  runner other     the rest of the runner (execute_model_async + get_output, or the old
                   execute_model): placeholders, recording the sampled tokens, output lists,
                   the device -> host sync (none on a CPU)
  update_output    Scheduler.update_from_output()
  output proc      LLMEngine.step's own work (metrics, detokenization, RequestOutputs)
  step total       one LLMEngine.step()

On a CPU the model and the logits/sampling run synchronously, so "model" and "logits+sample" hold
compute time that on the GPU is device time (a CUDA-graph replay and two launches): ``--vocab
128`` shows the host-only cost of that phase (the default 151,936 makes it ~100x larger on a CPU).
Not counted either: the GPU launch costs of input preparation on CUDA (the H2D copies and the
slot-mapping kernel; on a CPU device the worker takes numpy fast paths instead).

The objects built before the timed steps are frozen out of the cyclic GC (``gc.freeze()``, as
``run_throughput`` does; ``--no-gc-freeze`` to see the collections' spikes). ``--async`` runs the engine with ``async_scheduling=True`` (the step's phases are then
the same, the overlap is what changes on a GPU). ``--cprofile N`` prints the N most expensive
functions (cumulative) of the timed steps.

Usage (2 shared cores: run alone):
    .venv/bin/python bench/profile_engine_step.py                 # 256 decodes, vocab 151936
    .venv/bin/python bench/profile_engine_step.py --vocab 128 --steps 200 [--async]
    .venv/bin/python bench/profile_engine_step.py --json /tmp/prof.json --cprofile 30
    .venv/bin/python bench/profile_engine_step.py --w3-prefill --vocab 128 --async
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import io
import json
import os
import pstats
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402

from pagedkv.attention.backend import AttentionBackend  # noqa: E402

PHASES = ("schedule", "update_states", "prepare", "model", "logits+sample", "runner other",
          "update_output", "output proc", "step total")


class NullBackend(AttentionBackend):
    """No attention: returns zeros (writes nothing). Keeps the model call cheap."""

    name = "null"
    supports_cuda_graphs = False

    def forward(self, layer_idx, q, k, v, kv_cache, plan, scale):
        return torch.zeros_like(q)


def stub_model(vocab: int, hidden: int, dtype: torch.dtype):
    from pagedkv.models.config import ModelArchConfig
    from pagedkv.models.decoder import DecoderForCausalLM

    cfg = ModelArchConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": hidden, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
        "intermediate_size": 2 * hidden, "vocab_size": vocab, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
        "eos_token_id": 2, "dtype": str(dtype).removeprefix("torch."),
    }, source="stub")
    model = DecoderForCausalLM(cfg, backend=NullBackend(), dtype=dtype, device="cpu")
    return model.init_random_weights(0).eval()


class Timer:
    def __init__(self) -> None:
        self.cur: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []

    def add(self, phase: str, dt: float) -> None:
        self.cur[phase] = self.cur.get(phase, 0.0) + dt

    def wrap(self, phase: str, fn):
        add = self.add
        clock = time.perf_counter

        def timed(*a, **kw):
            t0 = clock()
            try:
                return fn(*a, **kw)
            finally:
                add(phase, clock() - t0)

        return timed

    def end_step(self, keep: bool) -> None:
        if keep:
            self.steps.append(self.cur)
        self.cur = {}


def instrument(engine, timer: Timer) -> None:
    """Wrap the engine's phases (instance attributes and the runner module's globals)."""
    import pagedkv.worker.model_runner as mr

    sched = engine.scheduler
    runner = engine.runner
    sched.schedule = timer.wrap("schedule", sched.schedule)
    sched.update_from_output = timer.wrap("update_output", sched.update_from_output)
    mr.update_states = timer.wrap("update_states", mr.update_states)
    runner._apply_block_ops = timer.wrap("update_states", runner._apply_block_ops)
    runner.preparer.prepare = timer.wrap("prepare", runner.preparer.prepare)
    model = engine.model
    model.forward = timer.wrap("model", model.forward)
    if hasattr(runner, "_compute_logits"):
        runner._compute_logits = timer.wrap("logits+sample", runner._compute_logits)
    else:
        model.compute_logits = timer.wrap("logits+sample", model.compute_logits)
    if hasattr(runner, "_sample"):
        runner._sample = timer.wrap("logits+sample", runner._sample)
    if hasattr(runner, "execute_model_async"):  # the sync execute_model calls these two
        runner.execute_model_async = timer.wrap("_runner", runner.execute_model_async)
        runner.get_output = timer.wrap("_runner", runner.get_output)
    else:
        runner.execute_model = timer.wrap("_runner", runner.execute_model)


def build(args):
    from pagedkv.engine.llm_engine import build_engine

    dtype = getattr(torch, args.dtype)
    model = stub_model(args.vocab, args.hidden, dtype)
    kw = {}
    params = inspect.signature(build_engine).parameters
    takes_options = any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values())
    if "async_scheduling" in params or takes_options:
        kw["async_scheduling"] = args.async_sched
    elif args.async_sched:
        raise SystemExit("this engine has no async_scheduling option")
    blocks_per_req = -(-(1024 + args.steps + args.warmup + 64) // 16)
    engine = build_engine(
        model, None, block_size=16, max_num_seqs=args.num_requests,
        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
        num_gpu_blocks_override=args.num_requests * blocks_per_req + 2, **kw)
    return engine


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=150, help="timed decode steps")
    p.add_argument("--warmup", type=int, default=20, help="untimed decode steps first")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--finish-every", type=int, default=0,
                   help="one request finishes every K timed steps (0: none)")
    p.add_argument("--async", dest="async_sched", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cprofile", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-gc-freeze", action="store_true",
                   help="leave the objects built before the timed steps in the cyclic GC "
                        "(run_throughput freezes them, as vLLM does after start-up)")
    p.add_argument("--w3-prefill", action="store_true",
                   help="instead: W3's 256 prompts (one 2,048-token system prompt + 50-200 own "
                        "tokens) added at once, then the host phases of each step until the "
                        "first pure-decode step (the prefill-like steps, prefix-cache hits)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from pagedkv.sampling.params import SamplingParams

    engine = build(args)
    if args.w3_prefill:
        return w3_prefill(engine, args)
    rng = random.Random(args.seed)
    n = args.num_requests
    total = args.warmup + args.steps + 8
    for i in range(n):
        prompt = [rng.randint(3, min(10000, args.vocab - 1)) for _ in range(rng.randint(100, 1024))]
        m = total + 1000 if not args.finish_every else args.warmup + 4 + (i + 1) * args.finish_every
        engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m))
    # prefill (untimed): until every request decodes
    t0 = time.perf_counter()
    prefill_steps = 0
    while True:
        engine.step(finished_only=True)
        prefill_steps += 1
        reqs = engine.scheduler.running
        if len(reqs) == n and all(r.num_computed_tokens >= r.num_prompt_tokens for r in reqs):
            break
    t_prefill = time.perf_counter() - t0

    timer = Timer()
    instrument(engine, timer)
    if not args.no_gc_freeze:
        gc.collect()
        gc.freeze()
    step = engine.step
    prof = cProfile.Profile() if args.cprofile else None
    clock = time.perf_counter
    batch_sizes = []
    for i in range(args.warmup + args.steps):
        keep = i >= args.warmup
        if keep and prof is not None:
            prof.enable()
        t0 = clock()
        step(finished_only=True)
        timer.add("step total", clock() - t0)
        if keep and prof is not None:
            prof.disable()
        if keep:
            batch_sizes.append(len(engine.scheduler.running))
        timer.end_step(keep)

    rows = []
    for ph in PHASES:
        if ph == "runner other":
            vals = [s.get("_runner", 0.0) - sum(s.get(k, 0.0) for k in
                    ("update_states", "prepare", "model", "logits+sample")) for s in timer.steps]
        elif ph == "output proc":
            vals = [s["step total"] - sum(s.get(k, 0.0) for k in
                    ("schedule", "_runner", "update_output")) for s in timer.steps]
        else:
            vals = [s.get(ph, 0.0) for s in timer.steps]
        vals = [v * 1e3 for v in vals]
        rows.append((ph, statistics.median(vals), statistics.fmean(vals)))

    print(f"engine step profile (CPU): {n} running decodes, {args.steps} timed steps after "
          f"{args.warmup} warm-up, vocab {args.vocab}, hidden {args.hidden}, "
          f"async_scheduling={args.async_sched}, batch {min(batch_sizes)}-{max(batch_sizes)}, "
          f"prefill {prefill_steps} steps {t_prefill:.1f} s, torch threads {args.threads}, "
          f"gc.freeze {not args.no_gc_freeze}")
    print(f"  {'phase':<16} {'median ms':>10} {'mean ms':>10}")
    for ph, med, mean in rows:
        print(f"  {ph:<16} {med:>10.3f} {mean:>10.3f}")
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.cprofile)
        print(s.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "phases_ms": {ph: {"median": med, "mean": mean}
                                                         for ph, med, mean in rows}}, f, indent=1)
    return 0


def w3_prefill(engine, args) -> int:
    """``--w3-prefill``: the add_request time of W3's prompts, then per step (until one
    schedules only decodes) its wall time and host phases (ms)."""
    from pagedkv.sampling.params import SamplingParams
    from pagedkv.tools.benchmark import workload

    wl = workload("w3", None, 1.0).fit_vocab(args.vocab)
    timer = Timer()
    instrument(engine, timer)
    if not args.no_gc_freeze:
        gc.collect()
        gc.freeze()
    t0 = time.perf_counter()
    for prompt, m in zip(wl.prompts, wl.max_tokens):
        engine.add_request(prompt, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=m))
    t_add = time.perf_counter() - t0
    print(f"W3 prefill-like steps (CPU host phases): add_request x {wl.num_requests} "
          f"{1e3 * t_add:.1f} ms; vocab {args.vocab}, hidden {args.hidden}, "
          f"async_scheduling={args.async_sched}")
    rows = []
    sched = engine.scheduler
    prof = cProfile.Profile() if args.cprofile else None
    for i in range(64):
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        engine.step(finished_only=True)
        dt = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
        timer.end_step(True)
        ph = {k: 1e3 * v for k, v in sorted(timer.steps[-1].items())}
        rows.append({"step": i, "ms": 1e3 * dt, "phases_ms": ph})
        print(f"  step {i}: {1e3 * dt:7.1f} ms  " + "  ".join(f"{k} {v:.1f}" for k, v in ph.items()))
        if all(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running) \
                and len(sched.running) == wl.num_requests:
            break
    if prof is not None:  # the prefill-like steps' host functions (own time, then cumulative)
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.cprofile)
            print(out.getvalue())
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "add_request_ms": 1e3 * t_add, "steps": rows}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
