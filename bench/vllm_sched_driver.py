#!/usr/bin/env python3
"""Reference side of bench/bench_sched_cpu.py: vLLM 0.33.0's real v1 ``Scheduler`` driven by
a traces.py trace and the fake model (``traces.next_token``), timed per step.

Runs ONLY in a separate venv that has vLLM (nothing of vLLM is in this repo; vLLM is imported
at run time, inside functions). The repo's tests never import this file.

Building the venv (CPU machine; torch 2.13.0 CPU build from the local wheel dir; vLLM without
its ~80 GPU/serving dependencies, then only what importing the scheduler and building its
configs needs, each with --no-deps):

    python3 -m venv /work/vllm-env
    /work/vllm-env/bin/pip install torch==2.13.0
    /work/vllm-env/bin/pip install --no-deps /tmp/vllmwhl/vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl
    /work/vllm-env/bin/pip install --no-deps numpy packaging pydantic pydantic-core \
        typing-inspection annotated-types regex cbor2 psutil pyzmq urllib3 \
        "transformers>=5.16.1,<5.21.0" huggingface_hub tqdm httpx2 idna pyyaml httpcore2 \
        truststore h11 "safetensors>=0.8.0" tokenizers aiohttp multidict attrs yarl propcache \
        aiohappyeyeballs aiosignal frozenlist requests certifi openai-harmony openai sniffio \
        anyio "pillow>=13.0.0" pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo \
        prometheus_client xgrammar==0.2.8 apache-tvm-ffi==0.1.11 "fastapi>=0.133.0,<0.137.0" \
        starlette annotated_doc partial-json-parser "llguidance>=1.7.0,<1.8.0" einops

(vllm/parser imports xgrammar at module level, and ModelConfig inspects the model class in a
subprocess, which imports einops.) The driver sets VLLM_TARGET_DEVICE=cpu and HF_HUB_OFFLINE=1,
and writes a tiny local HF config.json (Qwen3-0.6B shape) to a temp dir: no weights, no hub.

The Scheduler is built the way vLLM's own unit tests build it (tests/v1/core/utils.py):
ModelConfig(skip_tokenizer_init) + SchedulerConfig + CacheConfig -> VllmConfig, a
KVCacheConfig with one FullAttentionSpec group, a StructuredOutputManager, the sync
``Scheduler`` (async scheduling off, V1 runner flavour on CPU), block hasher as EngineCore
makes it (``prefix_caching_hash_algo``, default sha256).

Usage:
    /work/vllm-env/bin/python bench/vllm_sched_driver.py verify \
        --trace tests/vectors/traces/small-s1000.json --log tests/vectors/vllm-logs/small-s1000.jsonl
    /work/vllm-env/bin/python bench/vllm_sched_driver.py bench --preset decode256 --seed 0 \
        --reps 5 --out /tmp/vllm_decode256.json
"""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A Qwen3-0.6B-shaped HF config (only read by ModelConfig; no weights are ever loaded).
_TINY_HF_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
    "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu",
}


def load_traces():
    """tests/vectors/traces.py (standard library only)."""
    spec = importlib.util.spec_from_file_location(
        "traces", os.path.join(ROOT, "tests", "vectors", "traces.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class VllmSide:
    """Imports vLLM (at construction) and builds Schedulers / Requests for one trace engine."""

    def __init__(self, engine: dict, log_stats: bool, hash_algo: str = "sha256") -> None:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        import torch
        import vllm
        from vllm import SamplingParams
        from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        from vllm.v1.structured_output import StructuredOutputManager

        if [g["type"] for g in engine["groups"]] != ["full"]:
            raise SystemExit(f"only single full-attention traces are supported, got {engine['groups']}")
        self.vllm_version = vllm.__version__
        self.torch_version = torch.__version__
        self.engine = engine
        self.log_stats = log_stats
        bs = engine["block_size"]
        self._model_dir = tempfile.mkdtemp(prefix="vllm_tiny_cfg_")
        atexit.register(shutil.rmtree, self._model_dir, True)
        with open(os.path.join(self._model_dir, "config.json"), "w") as f:
            json.dump(_TINY_HF_CONFIG, f)
        model_config = ModelConfig(
            model=self._model_dir, skip_tokenizer_init=True, dtype="bfloat16", seed=0,
            max_model_len=engine["max_model_len"])
        scheduler_config = SchedulerConfig(
            max_num_seqs=engine["max_num_seqs"],
            max_num_batched_tokens=engine["max_num_batched_tokens"],
            max_model_len=engine["max_model_len"],
            long_prefill_token_threshold=engine["long_prefill_token_threshold"],
            enable_chunked_prefill=engine["enable_chunked_prefill"],
            is_encoder_decoder=False,
            async_scheduling=False,
        )
        cache_config = CacheConfig(
            block_size=bs, enable_prefix_caching=engine["enable_prefix_caching"],
            prefix_caching_hash_algo=hash_algo)
        self.vllm_config = VllmConfig(
            model_config=model_config, cache_config=cache_config, scheduler_config=scheduler_config)
        cache_config.num_gpu_blocks = engine["num_blocks"]
        self._check_config()
        self._kv_cache_config = lambda: KVCacheConfig(
            num_blocks=engine["num_blocks"], kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(
                ["model.layers.0.self_attn"],
                FullAttentionSpec(block_size=bs, num_kv_heads=1, head_size=1, dtype=torch.float32))])
        self._Scheduler = Scheduler
        self._SOM = StructuredOutputManager
        self._Request = Request
        self._SamplingParams = SamplingParams
        self.ModelRunnerOutput = ModelRunnerOutput
        self.block_hasher = None
        if engine["enable_prefix_caching"]:
            fn = get_hash_fn_by_name(hash_algo)
            init_none_hash(fn)
            self.block_hasher = get_request_block_hasher(bs, fn)

    def _check_config(self) -> None:
        """The CPU platform may rewrite configs in VllmConfig.__post_init__; refuse if it did."""
        vc, e = self.vllm_config, self.engine
        got = {
            "block_size": vc.cache_config.block_size,
            "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
            "enable_chunked_prefill": vc.scheduler_config.enable_chunked_prefill,
            "max_num_seqs": vc.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
            "max_model_len": vc.model_config.max_model_len,
            "long_prefill_token_threshold": vc.scheduler_config.long_prefill_token_threshold,
        }
        bad = {k: (v, e[k]) for k, v in got.items() if v != e[k]}
        if bad:
            raise SystemExit(f"vLLM rewrote the trace's engine config (got, wanted): {bad}")
        if vc.scheduler_config.async_scheduling or vc.use_v2_model_runner:
            raise SystemExit("expected the sync Scheduler and the V1 runner flavour")

    def new_scheduler(self):
        return self._Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self._kv_cache_config(),
            structured_output_manager=self._SOM(self.vllm_config),
            block_size=self.engine["block_size"], log_stats=self.log_stats)

    def new_request(self, r: dict):
        return self._Request(
            request_id=r["id"], prompt_token_ids=list(r["prompt"]),
            sampling_params=self._SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True),
            pooling_params=None, block_hasher=self.block_hasher)


def replay(side: VllmSide, trace: dict, next_token, on_step=None, timed: bool = True):
    """One full replay of ``trace`` through a fresh scheduler (the engine's step loop).

    Returns per-step timings (ns) and step shape flags. Requests are built (prompt hashed)
    before the run, outside the timed region, like EngineCore.add_request would.
    """
    sched = side.new_scheduler()
    vocab = trace["vocab"]
    arrivals: dict[int, list] = {}
    for r in trace["requests"]:
        arrivals.setdefault(r["arrival_step"], []).append(side.new_request(r))
    pending = len(trace["requests"])
    MRO = side.ModelRunnerOutput
    reqs = sched.requests
    perf = time.perf_counter_ns
    t_sched, t_upd, n_reqs, n_tok, n_new, n_running = [], [], [], [], [], []
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
        # The fake model: rows whose known tokens are all computed sample one token.
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for rid in ids:
            req = reqs[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled.append([next_token(rid, req.num_tokens, vocab)])
            else:
                sampled.append([])
        mro = MRO(req_ids=ids, req_id_to_index={rid: i for i, rid in enumerate(ids)},
                  sampled_token_ids=sampled)
        t2 = perf()
        eco = sched.update_from_output(out, mro)
        t3 = perf()
        t_sched.append(t1 - t0)
        t_upd.append(t3 - t2)
        n_reqs.append(len(ids))
        n_tok.append(out.total_num_scheduled_tokens)
        n_new.append(len(out.scheduled_new_reqs))
        n_running.append(len(sched.running))
        if on_step is not None:
            on_step(step, sched, out, eco)
        step += 1
    return {"schedule_ns": t_sched, "update_ns": t_upd, "num_reqs": n_reqs,
            "num_tokens": n_tok, "num_new": n_new, "num_running": n_running}


# ----- verify: reproduce a recorded vLLM log ----------------------------------------------

def _finished_ids(eco) -> list[str]:
    ids = []
    for outs in (eco or {}).values():
        for o in outs.outputs:
            if o.finish_reason is not None:
                ids.append(o.request_id)
    return sorted(ids)


def _bids(b):
    return None if b is None else [list(g) for g in b]


def verify(args) -> int:
    traces = load_traces()
    with open(args.trace) as f:
        trace = json.load(f)
    side = VllmSide(trace["engine"], log_stats=True, hash_algo=args.hash_algo)
    with open(args.log) as f:
        log = [json.loads(line) for line in f]
    want = [entry for entry in log if entry.get("kind") == "step"]
    got = []

    def on_step(step, sched, out, eco):
        c = out.scheduled_cached_reqs
        got.append({
            "step": step,
            "num_scheduled_tokens": [[k, v] for k, v in out.num_scheduled_tokens.items()],
            "new": [{"id": n.req_id, "block_ids": _bids(n.block_ids),
                     "num_computed_tokens": n.num_computed_tokens}
                    for n in out.scheduled_new_reqs],
            "cached": {"req_ids": list(c.req_ids),
                       "new_block_ids": [_bids(b) for b in c.new_block_ids],
                       "num_computed_tokens": list(c.num_computed_tokens),
                       "resumed_req_ids": sorted(c.resumed_req_ids)},
            "finished_req_ids": sorted(out.finished_req_ids),
            "preempted_req_ids": sorted(out.preempted_req_ids or ()),
            "finished": _finished_ids(eco),
            "num_free_blocks": sched.kv_cache_manager.block_pool.get_num_free_blocks(),
            "num_running": len(sched.running),
            "num_waiting": len(sched.waiting),
        })

    replay(side, trace, traces.next_token, on_step=on_step)
    fields = ["step", "num_scheduled_tokens", "new", "cached", "finished_req_ids",
              "preempted_req_ids", "finished", "num_free_blocks", "num_running", "num_waiting"]
    n = len(want) if args.steps <= 0 else min(args.steps, len(want))
    mismatches = []
    for i in range(n):
        if i >= len(got):
            mismatches.append((i, "missing step", None, None))
            break
        for k in fields:
            if got[i][k] != want[i][k]:
                mismatches.append((i, k, got[i][k], want[i][k]))
    count_ok = args.steps > 0 or len(got) == len(want)
    print(f"vllm {side.vllm_version}: replayed {len(got)} steps, log has {len(want)}; "
          f"compared {n} steps x {len(fields)} fields: {len(mismatches)} mismatches"
          + ("" if count_ok else " (step count differs)"))
    for i, k, g, w in mismatches[:10]:
        print(f"  step {i} {k}: got {json.dumps(g)[:300]} want {json.dumps(w)[:300]}")
    for entry in want[: min(n, args.show)]:
        print(f"  step {entry['step']:3d}: " + " ".join(
            f"{rid}:{t}" for rid, t in entry["num_scheduled_tokens"]))
    return 0 if not mismatches and count_ok else 1


# ----- bench --------------------------------------------------------------------------------

def bench(args) -> int:
    traces = load_traces()
    trace = traces.make_trace(args.preset, args.seed)
    side = VllmSide(trace["engine"], log_stats=args.log_stats, hash_algo=args.hash_algo)
    for _ in range(args.warmup):
        replay(side, trace, traces.next_token)
    reps = []
    for _ in range(args.reps):
        gc.collect()
        if args.no_gc:
            gc.disable()
        try:
            reps.append(replay(side, trace, traces.next_token))
        finally:
            gc.enable()
    result = {"side": "vllm", "vllm": side.vllm_version, "torch": side.torch_version,
              "python": sys.version.split()[0], "preset": args.preset, "seed": args.seed,
              "log_stats": args.log_stats, "hash_algo": args.hash_algo,
              "gc": not args.no_gc, "engine": trace["engine"], "reps": reps}
    text = json.dumps(result, separators=(",", ":"))
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("verify", help="replay a trace and compare with a recorded vLLM log")
    v.add_argument("--trace", default=os.path.join(ROOT, "tests/vectors/traces/small-s1000.json"))
    v.add_argument("--log", default=os.path.join(ROOT, "tests/vectors/vllm-logs/small-s1000.jsonl"))
    v.add_argument("--steps", type=int, default=0, help="compare the first N steps (0 = all)")
    v.add_argument("--show", type=int, default=0, help="print the first N steps' token counts")
    v.add_argument("--hash-algo", default="sha256")
    b = sub.add_parser("bench", help="time schedule() and update_from_output() per step")
    b.add_argument("--preset", required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--reps", type=int, default=5)
    b.add_argument("--warmup", type=int, default=1, help="untimed full replays first")
    b.add_argument("--log-stats", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument("--no-gc", action="store_true", help="disable the GC during timed replays")
    b.add_argument("--hash-algo", default="sha256")
    b.add_argument("--out", help="JSON output path (default stdout)")
    a = ap.parse_args()
    return verify(a) if a.cmd == "verify" else bench(a)


if __name__ == "__main__":
    sys.exit(main())
