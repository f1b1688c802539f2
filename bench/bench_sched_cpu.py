#!/usr/bin/env python3
"""Benchmark: CPU control plane per step, pagedkv vs vLLM 0.33.0, side by side in one run.

Times ``Scheduler.schedule()`` and ``Scheduler.update_from_output()`` per step (median per
step, ``time.perf_counter_ns``) for

* pagedkv's ``Scheduler`` (in this process), and
* vLLM 0.33.0's real v1 ``Scheduler`` (subprocess ``--vllm-python PATH
  bench/vllm_sched_driver.py bench ...``, a separate venv; see that file for how to build it),

on the traces of PERF.md ("CPU control-plane target"): traces.make_trace presets decode256,
decode1024 and mixed, seed 0, prefix caching on, block size 16, fake model traces.next_token
(partial-prefill chunks sample nothing). Both sides replay the same step loop: requests are
added (and their prompts hashed) before the schedule() of their arrival step, outside the
timed region; the model output is built outside the timed region.

Steps timed: decodeN -> pure-decode steady state only (N requests scheduled, 1 token each, no
new request); mixed -> every step that schedules tokens. Each repetition replays the whole
trace through a fresh scheduler after ``--warmup`` untimed replays; the reported value is the
median over repetitions of the per-repetition medians. The two sides' step shapes (requests
and tokens scheduled per step) are compared: "same" means both did exactly the same work.

On top, pagedkv's worker input preparation is timed in separate replays (so it does not
disturb the scheduler timing): ``update_states`` (apply the SchedulerOutput to the persistent
InputBatch) + ``InputPreparer.prepare`` (CPU tensors: positions, input ids, query_start_loc,
seq_lens, slot mapping through the numpy host path of a CPU device; on a GPU that is one
Triton launch). ``record_sampled_tokens`` is reported in the JSON only.

Usage (2-core machine: run it alone, nothing else busy):
    .venv/bin/python bench/bench_sched_cpu.py --vllm-python /work/vllm-env/bin/python \
        --reps 5 --out /tmp/bench_sched_cpu.json
    .venv/bin/python bench/bench_sched_cpu.py --presets decode256 --reps 3   # pagedkv only
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def load_traces():
    spec = importlib.util.spec_from_file_location(
        "traces", os.path.join(ROOT, "tests", "vectors", "traces.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ----- pagedkv side ---------------------------------------------------------------------------

class PagedkvSide:
    def __init__(self, engine: dict, log_stats: bool, reorder_threshold: int | None) -> None:
        from pagedkv.config import CacheConfig, SchedulerConfig
        from pagedkv.core.output import ModelRunnerOutput
        from pagedkv.core.scheduler import Scheduler
        from pagedkv.core.spec import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

        if [g["type"] for g in engine["groups"]] != ["full"]:
            raise SystemExit(f"only single full-attention traces are supported, got {engine['groups']}")
        self.engine = engine
        self.log_stats = log_stats
        self.reorder_threshold = reorder_threshold
        bs = engine["block_size"]
        self.spec = FullAttentionSpec(block_size=bs)
        self._kv = lambda: KVCacheConfig(
            num_blocks=engine["num_blocks"],
            kv_cache_groups=[KVCacheGroupSpec(("model.layers.0.self_attn",), self.spec)])
        self.scheduler_config = SchedulerConfig(
            max_num_seqs=engine["max_num_seqs"],
            max_num_batched_tokens=engine["max_num_batched_tokens"],
            max_model_len=engine["max_model_len"],
            enable_chunked_prefill=engine["enable_chunked_prefill"],
            long_prefill_token_threshold=engine["long_prefill_token_threshold"])
        self.cache_config = lambda: CacheConfig(
            block_size=bs, enable_prefix_caching=engine["enable_prefix_caching"])
        self._Scheduler = Scheduler
        self.ModelRunnerOutput = ModelRunnerOutput

    def new_scheduler(self):
        return self._Scheduler(self.scheduler_config, self._kv(), self.cache_config(),
                               log_stats=self.log_stats)

    def new_worker(self):
        """(requests dict, InputBatch, InputPreparer) on CPU, sized like the model runner's."""
        from pagedkv.worker.input_batch import InputBatch
        from pagedkv.worker.inputs import InputPreparer

        e = self.engine
        batch = InputBatch(
            max_num_reqs=e["max_num_seqs"], max_model_len=e["max_model_len"],
            max_num_batched_tokens=e["max_num_batched_tokens"], device="cpu", pin_memory=False,
            block_sizes=[e["block_size"]],
            max_num_blocks_per_req=[self.spec.max_num_blocks_per_req(e["max_model_len"])],
            slot_mapping_modes=[self.spec.slot_mapping_mode])
        # Time the slot-mapping call inside prepare() on its own: on CPU it is the numpy host
        # path (compute_slot_mappings_host), on a GPU one Triton launch.
        bt = batch.block_table
        acc = [0]
        perf = time.perf_counter_ns

        def timed(inner):
            def timed_slot_mappings(*args, **kwargs):
                t = perf()
                try:
                    return inner(*args, **kwargs)
                finally:
                    acc[0] += perf() - t
            return timed_slot_mappings

        bt.compute_slot_mappings = timed(bt.compute_slot_mappings)
        bt.compute_slot_mappings_host = timed(bt.compute_slot_mappings_host)
        return {}, batch, InputPreparer.for_batch(batch), acc


def replay_pagedkv(side: PagedkvSide, trace: dict, next_token, worker: bool = False,
                   freeze: bool = True) -> dict:
    """Same step loop as vllm_sched_driver.replay (keep the two in step). With ``freeze`` the
    objects built at "start-up" (scheduler, block pool, worker buffers; not the requests) are
    frozen out of the cyclic GC, as the engine does (``pagedkv.engine.heap``), and thawed after
    the replay."""
    sched = side.new_scheduler()
    if worker:
        w_reqs, batch, prep, slot_acc = side.new_worker()
    if freeze:
        from pagedkv.engine.heap import freeze_after_startup

        freeze_after_startup()
    try:
        return _replay(side, sched, trace, next_token,
                       (w_reqs, batch, prep, slot_acc) if worker else None)
    finally:
        if freeze:
            gc.unfreeze()


def _replay(side: PagedkvSide, sched, trace: dict, next_token, worker_parts) -> dict:
    worker = worker_parts is not None
    vocab = trace["vocab"]
    arrivals: dict[int, list] = {}
    for r in trace["requests"]:
        arrivals.setdefault(r["arrival_step"], []).append(
            sched.make_request(r["id"], r["prompt"], max_tokens=r["max_tokens"], ignore_eos=True))
    pending = len(trace["requests"])
    MRO = side.ModelRunnerOutput
    reqs = sched.requests
    perf = time.perf_counter_ns
    if worker:
        from pagedkv.worker.state_update import record_sampled_tokens, update_states
        w_reqs, batch, prep, slot_acc = worker_parts
        thr = side.reorder_threshold
    t_sched, t_upd, n_reqs, n_tok, n_new, n_running = [], [], [], [], [], []
    t_apply, t_prep, t_rec, t_slot = [], [], [], []
    step = 0
    while pending or sched.has_requests():
        for req in arrivals.pop(step, ()):
            sched.add_request(req)
            pending -= 1
        if not sched.has_requests():
            step += 1
            continue
        t0 = perf()
        out = sched.schedule()
        t1 = perf()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = reqs[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([next_token(rid, req.num_tokens, vocab)])
            else:
                sampled.append([])
        mro = MRO(ids, {rid: i for i, rid in enumerate(ids)}, sampled)
        if worker:
            w0 = perf()
            update_states(w_reqs, batch, out, thr)
            w1 = perf()
            slot_acc[0] = 0
            if batch.num_reqs and out.total_num_scheduled_tokens:
                nsched = batch.scheduled_tokens_per_row(out.num_scheduled_tokens)
                prep.prepare(batch, nsched)
            w2 = perf()
            idx = mro.req_id_to_index
            rows = [sampled[idx[rid]] for rid in batch.req_ids[: batch.num_reqs]]
            w3 = perf()
            record_sampled_tokens(w_reqs, batch, rows)
            w4 = perf()
            t_apply.append(w1 - w0)
            t_prep.append(w2 - w1)
            t_slot.append(slot_acc[0])
            t_rec.append(w4 - w3)
        t2 = perf()
        sched.update_from_output(out, mro)
        t3 = perf()
        t_sched.append(t1 - t0)
        t_upd.append(t3 - t2)
        n_reqs.append(len(ids))
        n_tok.append(out.total_num_scheduled_tokens)
        n_new.append(len(out.scheduled_new_reqs))
        n_running.append(len(sched.running))
        step += 1
    res = {"schedule_ns": t_sched, "update_ns": t_upd, "num_reqs": n_reqs,
           "num_tokens": n_tok, "num_new": n_new, "num_running": n_running}
    if worker:
        res.update(apply_ns=t_apply, prepare_ns=t_prep, record_ns=t_rec, slot_mapping_ns=t_slot)
    return res


def run_pagedkv(preset: str, trace: dict, next_token, a) -> dict:
    side = PagedkvSide(trace["engine"], a.log_stats, a.reorder_threshold)
    fz = not a.no_freeze
    for _ in range(a.warmup):
        replay_pagedkv(side, trace, next_token, freeze=fz)
    reps = [_timed(lambda: replay_pagedkv(side, trace, next_token, freeze=fz), a.no_gc)
            for _ in range(a.reps)]
    worker_reps = []
    if not a.no_worker:
        for _ in range(a.warmup):
            replay_pagedkv(side, trace, next_token, worker=True, freeze=fz)
        worker_reps = [_timed(lambda: replay_pagedkv(side, trace, next_token, worker=True,
                                                     freeze=fz), a.no_gc)
                       for _ in range(a.reps)]
    return {"reps": reps, "worker_reps": worker_reps}


def _timed(fn, no_gc: bool):
    gc.collect()
    if no_gc:
        gc.disable()
    try:
        return fn()
    finally:
        gc.enable()


# ----- vLLM side (subprocess) -------------------------------------------------------------------

def run_vllm(preset: str, a) -> dict:
    fd, path = tempfile.mkstemp(prefix=f"vllm_{preset}_", suffix=".json")
    os.close(fd)
    cmd = [a.vllm_python, os.path.join(ROOT, "bench", "vllm_sched_driver.py"), "bench",
           "--preset", preset, "--seed", str(a.seed), "--reps", str(a.reps),
           "--warmup", str(a.warmup), "--out", path,
           "--log-stats" if a.log_stats else "--no-log-stats"]
    if a.no_gc:
        cmd.append("--no-gc")
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stdout + p.stderr)
        raise SystemExit(f"vLLM driver failed ({p.returncode}): {' '.join(cmd)}")
    with open(path) as f:
        res = json.load(f)
    os.unlink(path)
    return res


# ----- summary ----------------------------------------------------------------------------------

def select_steps(preset: str, trace: dict, rep: dict) -> list[int]:
    """decodeN: pure-decode steady state (N scheduled, 1 token each, nothing new); else every
    step that scheduled tokens."""
    if preset.startswith("decode"):
        n = len(trace["requests"])
        return [i for i, (r, t, new) in enumerate(zip(rep["num_reqs"], rep["num_tokens"], rep["num_new"]))
                if r == n and t == n and new == 0]
    return [i for i, t in enumerate(rep["num_tokens"]) if t > 0]


def _med_ms(rep: dict, key, sel: list[int]) -> float:
    if not sel:
        return float("nan")
    if isinstance(key, tuple):
        vals = [sum(rep[k][i] for k in key) for i in sel]
    else:
        vals = [rep[key][i] for i in sel]
    return statistics.median(vals) / 1e6


def _tail_ms(rep: dict, key, sel: list[int], q: float) -> float:
    """The q-quantile (0..1) of the per-step values (ms), nearest rank."""
    if not sel:
        return float("nan")
    keys = key if isinstance(key, tuple) else (key,)
    vals = sorted(sum(rep[k][i] for k in keys) for i in sel)
    return vals[min(len(vals) - 1, max(0, round(q * len(vals)) - 1))] / 1e6


def summarize(preset: str, trace: dict, reps: list[dict], keys: dict) -> dict:
    per_rep = []
    tail_key = keys.get("total_ms", keys.get("input_prep_ms"))
    for rep in reps:
        sel = select_steps(preset, trace, rep)
        per_rep.append({name: _med_ms(rep, key, sel) for name, key in keys.items()}
                       | {"steps_timed": len(sel), "steps": len(rep["num_reqs"]),
                          "p99_ms": _tail_ms(rep, tail_key, sel, 0.99),
                          "max_ms": _tail_ms(rep, tail_key, sel, 1.0)})
    out = {name: statistics.median(r[name] for r in per_rep) for name in keys}
    out["p99_ms"] = statistics.median(r["p99_ms"] for r in per_rep)
    out["max_ms"] = max(r["max_ms"] for r in per_rep)
    out["steps_timed"] = per_rep[0]["steps_timed"] if per_rep else 0
    out["steps"] = per_rep[0]["steps"] if per_rep else 0
    out["per_rep"] = per_rep
    return out


SCHED_KEYS = {"schedule_ms": "schedule_ns", "update_ms": "update_ns",
              "total_ms": ("schedule_ns", "update_ns")}
WORKER_KEYS = {"input_prep_ms": ("apply_ns", "prepare_ns"), "apply_ms": "apply_ns",
               "prepare_ms": "prepare_ns", "slot_mapping_ms": "slot_mapping_ns",
               "record_ms": "record_ns"}


def shapes(rep: dict) -> list:
    return list(zip(rep["num_reqs"], rep["num_tokens"], rep["num_new"]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", default="decode256,decode1024,mixed")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1, help="untimed full replays per side first")
    ap.add_argument("--vllm-python", help="python of a venv with vLLM 0.33.0 (see vllm_sched_driver.py)")
    ap.add_argument("--log-stats", action=argparse.BooleanOptionalAction, default=True,
                    help="both schedulers build per-step stats (prefix-cache counters), as the "
                         "recorded logs did")
    ap.add_argument("--no-gc", action="store_true", help="disable the GC during timed replays")
    ap.add_argument("--no-freeze", action="store_true",
                    help="do not freeze the start-up objects out of the GC (the engine does)")
    ap.add_argument("--no-worker", action="store_true", help="skip pagedkv input-prep timing")
    ap.add_argument("--reorder-threshold", type=int, default=None,
                    help="worker batch reorder threshold (default: none, as the model runner's "
                         "attention backends)")
    ap.add_argument("--cpu", type=int, default=None,
                    help="pin this process and the vLLM subprocess to one CPU core")
    ap.add_argument("--out", help="write JSON results here")
    a = ap.parse_args()
    if a.cpu is not None:
        os.sched_setaffinity(0, {a.cpu})
    import numpy as np  # noqa: F401  (worker deps; imported before timing)
    import torch

    torch.set_num_threads(1)
    traces = load_traces()
    results = []
    started = time.time()
    for preset in a.presets.split(","):
        trace = traces.make_trace(preset, a.seed)
        row = {"preset": preset, "seed": a.seed, "engine": trace["engine"],
               "num_requests": len(trace["requests"])}
        vraw = None
        if a.vllm_python:
            print(f"[{preset}] vLLM ...", file=sys.stderr, flush=True)
            vraw = run_vllm(preset, a)
            row["vllm"] = summarize(preset, trace, vraw["reps"], SCHED_KEYS)
            row["vllm_version"] = vraw["vllm"]
            row["vllm_torch"] = vraw["torch"]
        print(f"[{preset}] pagedkv ...", file=sys.stderr, flush=True)
        praw = run_pagedkv(preset, trace, traces.next_token, a)
        row["pagedkv"] = summarize(preset, trace, praw["reps"], SCHED_KEYS)
        if praw["worker_reps"]:
            row["pagedkv_worker"] = summarize(preset, trace, praw["worker_reps"], WORKER_KEYS)
        if vraw is not None:
            row["same_schedule"] = all(shapes(vr) == shapes(praw["reps"][0]) for vr in vraw["reps"])
            row["speedup"] = row["vllm"]["total_ms"] / row["pagedkv"]["total_ms"]
        results.append(row)

    meta = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "python": sys.version.split()[0], "torch": torch.__version__,
        "platform": platform.platform(), "cpu": platform.processor() or platform.machine(),
        "nproc": os.cpu_count(), "loadavg_end": os.getloadavg(),
        "reps": a.reps, "warmup": a.warmup, "log_stats": a.log_stats, "gc": not a.no_gc,
        "freeze": not a.no_freeze,
        "wall_s": round(time.time() - started, 1),
    }
    try:
        meta["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                        capture_output=True, text=True).stdout.strip()
    except OSError:
        pass
    f3 = lambda x: f"{x:7.3f}" if x == x else "    n/a"  # noqa: E731
    fx = lambda x: f"{x:6.2f}x" if x == x else "    n/a"  # noqa: E731
    nan = float("nan")
    print(f"CPU control plane, median per step over {a.reps} reps (ms); seed {a.seed}; "
          f"log_stats={a.log_stats}; loadavg at end {meta['loadavg_end'][0]:.2f}")
    print("input prep = update_states + prepare (CPU tensors; slot mapping via the numpy "
          "host path, shown apart); 'x incl prep' = vLLM total / (pagedkv total + input prep)")
    print(f"{'trace':10s} | {'vLLM sched':>10s} {'update':>7s} {'total':>7s} | "
          f"{'pagedkv sched':>13s} {'update':>7s} {'total':>7s} {'p99':>7s} {'max':>7s} | "
          f"{'speedup':>7s} | {'input prep':>10s} {'(slot map)':>10s} | {'x incl prep':>11s} | "
          "steps | same sched")
    for r in results:
        v = r.get("vllm") or {}
        p = r["pagedkv"]
        w = r.get("pagedkv_worker") or {}
        prep = w.get("input_prep_ms", nan)
        r["speedup_incl_input_prep"] = (v.get("total_ms", nan) / (p["total_ms"] + prep)
                                        if v and w else None)
        print(f"{r['preset']:10s} | {f3(v.get('schedule_ms', nan)):>10s} "
              f"{f3(v.get('update_ms', nan))} {f3(v.get('total_ms', nan))} | "
              f"{f3(p['schedule_ms']):>13s} {f3(p['update_ms'])} {f3(p['total_ms'])} "
              f"{f3(p['p99_ms'])} {f3(p['max_ms'])} | "
              f"{fx(r.get('speedup', nan))} | {f3(prep):>10s} {f3(w.get('slot_mapping_ms', nan)):>10s} | "
              f"{fx(r['speedup_incl_input_prep'] or nan):>11s} | {p['steps_timed']:5d} | "
              f"{r.get('same_schedule', 'n/a')}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
