"""Workloads W1 (PERF.md), W2 (long context) and W3 (shared prefix) of issue 13, and the
offline-throughput measurement ``pagedkv bench`` and ``bench/bench_w1.py`` run.

W2: 64 requests of ``U[6000, 8000]`` prompt tokens, 512 output tokens each; W3: 256 requests
of one 2,048-token system prompt + ``U[50, 200]`` unique tokens, 256 output tokens each
(:func:`w2_workload`, :func:`w3_workload`).

W1, exactly: ``random.seed(0)``; for each of 256 requests ``randint(100, 1024)`` prompt tokens,
each ``randint(0, 10000)`` (the length is drawn, then its tokens); then for each request
``max_tokens = randint(100, 1024)``; EOS ignored. 133,966 output tokens in total.

Variants: ``num_requests`` draws the same way for another count; ``scale`` multiplies every
drawn prompt length and ``max_tokens`` afterwards (at least 1 each), so the random stream, and
with it the token ids, are W1's.

Throughput counts the tokens actually generated (``len(outputs[0].token_ids)`` summed), over the
wall time of one ``generate`` call, after a short warm-up run (kernel compilation, allocator);
the engine froze its start-up objects out of the cyclic garbage collector, as vLLM does
(``pagedkv.engine.heap``).
"""

from __future__ import annotations

import json
import os
import platform
import random
import time
from dataclasses import asdict, dataclass, field

from pagedkv.errors import ConfigError

W1_NUM_REQUESTS = 256
W1_LEN_RANGE = (100, 1024)
W1_TOKEN_MAX = 10000
W1_TOTAL_OUTPUT_TOKENS = 133_966


@dataclass
class Workload:
    name: str
    prompts: list[list[int]]
    max_tokens: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def requested_output_tokens(self) -> int:
        return sum(self.max_tokens)

    def fit_vocab(self, vocab_size: int) -> "Workload":
        """Token ids folded into ``[0, vocab_size)`` (W1 draws ids up to 10,000; a smaller
        vocabulary gets ``id % vocab_size``). Unchanged when they fit already."""
        if all(t < vocab_size for p in self.prompts for t in p):
            return self
        prompts = [[t % vocab_size for t in p] for p in self.prompts]
        return Workload(f"{self.name} (ids mod {vocab_size})", prompts, list(self.max_tokens))


def w1_workload(num_requests: int = W1_NUM_REQUESTS, scale: float = 1.0, seed: int = 0) -> Workload:
    """W1 (defaults) or a variant (see the module docstring)."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ConfigError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not scale > 0:
        raise ConfigError(f"scale must be > 0, got {scale!r}")
    rng = random.Random(seed)
    lo, hi = W1_LEN_RANGE
    prompts = [[rng.randint(0, W1_TOKEN_MAX) for _ in range(rng.randint(lo, hi))]
               for _ in range(num_requests)]
    max_tokens = [rng.randint(lo, hi) for _ in range(num_requests)]
    if scale != 1.0:
        prompts = [p[: max(1, round(len(p) * scale))] for p in prompts]
        max_tokens = [max(1, round(m * scale)) for m in max_tokens]
    name = "W1" if (num_requests, scale, seed) == (W1_NUM_REQUESTS, 1.0, 0) else (
        f"W1-variant(n={num_requests}, scale={scale}, seed={seed})")
    return Workload(name, prompts, max_tokens)


# Issue 13's workloads (Qwen3-0.6B shape, token-id prompts, EOS ignored)
W2_NUM_REQUESTS, W2_LEN_RANGE, W2_OUTPUT = 64, (6000, 8000), 512
W3_NUM_REQUESTS, W3_PREFIX, W3_TAIL_RANGE, W3_OUTPUT = 256, 2048, (50, 200), 256


def _scaled(prompts: list[list[int]], max_tokens: list[int], scale: float):
    if scale == 1.0:
        return prompts, max_tokens
    return ([p[: max(1, round(len(p) * scale))] for p in prompts],
            [max(1, round(m * scale)) for m in max_tokens])


def _check_variant(num_requests, scale) -> None:
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ConfigError(f"num_requests must be an int >= 1, got {num_requests!r}")
    if not scale > 0:
        raise ConfigError(f"scale must be > 0, got {scale!r}")


def w2_workload(num_requests: int = W2_NUM_REQUESTS, scale: float = 1.0, seed: int = 0) -> Workload:
    """W2, long context: ``random.Random(seed)``; per request ``randint(6000, 8000)`` prompt
    tokens, each ``randint(0, 10000)``; 512 output tokens each. ``scale`` shortens both."""
    _check_variant(num_requests, scale)
    rng = random.Random(seed)
    lo, hi = W2_LEN_RANGE
    prompts = [[rng.randint(0, W1_TOKEN_MAX) for _ in range(rng.randint(lo, hi))]
               for _ in range(num_requests)]
    prompts, max_tokens = _scaled(prompts, [W2_OUTPUT] * num_requests, scale)
    name = "W2" if (num_requests, scale, seed) == (W2_NUM_REQUESTS, 1.0, 0) else (
        f"W2-variant(n={num_requests}, scale={scale}, seed={seed})")
    return Workload(name, prompts, max_tokens)


def w3_workload(num_requests: int = W3_NUM_REQUESTS, scale: float = 1.0, seed: int = 0) -> Workload:
    """W3, shared prefix: ``random.Random(seed)``; one system prompt of 2048 tokens
    (``randint(0, 10000)`` each), then per request ``randint(50, 200)`` unique tokens after
    it; 256 output tokens each. ``scale`` shortens the prefix, the tails and the outputs."""
    _check_variant(num_requests, scale)
    rng = random.Random(seed)
    prefix = [rng.randint(0, W1_TOKEN_MAX) for _ in range(W3_PREFIX)]
    lo, hi = W3_TAIL_RANGE
    tails = [[rng.randint(0, W1_TOKEN_MAX) for _ in range(rng.randint(lo, hi))]
             for _ in range(num_requests)]
    if scale != 1.0:
        prefix = prefix[: max(1, round(len(prefix) * scale))]
        tails = [t[: max(1, round(len(t) * scale))] for t in tails]
    out = max(1, round(W3_OUTPUT * scale))
    name = "W3" if (num_requests, scale, seed) == (W3_NUM_REQUESTS, 1.0, 0) else (
        f"W3-variant(n={num_requests}, scale={scale}, seed={seed})")
    return Workload(name, [prefix + t for t in tails], [out] * num_requests)


WORKLOADS = {"w1": w1_workload, "w2": w2_workload, "w3": w3_workload}
# the max_model_len each workload needs on a GPU (prompt + output, rounded up)
WORKLOAD_MAX_MODEL_LEN = {"w1": 4096, "w2": 8704, "w3": 4096}


def workload(name: str, num_requests: int | None = None, scale: float = 1.0, seed: int = 0) -> Workload:
    """W1, W2 or W3 by name (``num_requests`` default: the workload's own)."""
    fn = WORKLOADS.get(name.lower())
    if fn is None:
        raise ConfigError(f"unknown workload {name!r}; choose one of {sorted(WORKLOADS)}")
    if num_requests is None:
        return fn(scale=scale, seed=seed)
    return fn(num_requests, scale, seed)


@dataclass
class ThroughputResult:
    workload: str
    num_requests: int
    prompt_tokens: int
    requested_output_tokens: int
    output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    steps: int
    preemptions: int
    prefix_cache_hit_rate: float
    peak_kv_usage: float
    cuda_graph_steps: int
    engine: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return asdict(self)


def run_throughput(llm, workload: Workload, *, temperature: float = 0.0, warmup: bool = True,
                   use_tqdm: bool = False, max_model_len: int | None = None) -> ThroughputResult:
    """Time one ``llm.generate`` over ``workload`` (ignore_eos, one max_tokens per request)."""
    from pagedkv.sampling.params import SamplingParams

    limit = max_model_len or llm.engine.max_model_len
    workload = workload.fit_vocab(llm.engine.vocab_size)
    prompts = [p[: limit - 1] for p in workload.prompts]
    params = [SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=m)
              for m in workload.max_tokens]
    engine = llm.engine
    if warmup:
        # other prompts than the workload's, and a prefix-cache reset after: the timed run
        # starts with nothing cached
        rng = random.Random(12345)
        warm = [[rng.randrange(engine.vocab_size) for _ in range(min(64, limit - 9))] for _ in range(4)]
        llm.generate(warm, SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=8),
                     use_tqdm=False)
        engine.scheduler.reset_prefix_cache()
    before = dict(engine.kv_stats())
    sync = _device_sync(engine.runner)
    sync()
    # (the engine froze its start-up objects out of the cyclic GC: pagedkv.engine.heap)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    sync()
    elapsed = time.perf_counter() - t0
    after = engine.kv_stats()
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    return ThroughputResult(
        workload=workload.name,
        num_requests=len(prompts),
        prompt_tokens=sum(len(p) for p in prompts),
        requested_output_tokens=workload.requested_output_tokens,
        output_tokens=generated,
        elapsed_s=elapsed,
        output_tokens_per_s=generated / elapsed,
        total_tokens_per_s=(generated + sum(len(p) for p in prompts)) / elapsed,
        steps=after["steps"] - before["steps"],
        preemptions=after["preemptions"] - before["preemptions"],
        prefix_cache_hit_rate=hits / queries if queries else 0.0,
        peak_kv_usage=after["peak_usage"],
        cuda_graph_steps=after["cuda_graph_steps"] - before["cuda_graph_steps"],
        engine={k: after[k] for k in ("num_blocks", "block_size", "token_capacity", "max_concurrency",
                                      "sized_by", "kv_cache_dtype", "cuda_graph_sizes",
                                      "async_scheduling", "compiled_model") if k in after},
    )


def _device_sync(runner):
    """A wait for ``runner``'s device work: its own ``synchronize`` when it has one (the
    tensor-parallel executor), else the CUDA device's."""
    import torch

    if hasattr(runner, "synchronize"):
        return runner.synchronize
    device = runner.device
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def environment() -> dict:
    """Versions and device, for the JSON record."""
    import torch

    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(0)
        env["cuda"] = torch.version.cuda
        env["gpu_state"] = _gpu_state()
    env["cudnn_frontend"] = _cudnn_frontend()
    env["cpu"] = _cpu_model()
    return env


def _cudnn_frontend() -> str | None:
    """``"<frontend version> (cuDNN <backend version>)"`` where cuDNN's paged attention can run
    (``pagedkv.attention.cudnn_paged.frontend``: the Triton backend's default prefill path
    then), else None (its prefills take the Triton kernel)."""
    from pagedkv.attention.cudnn_paged import frontend

    fe = frontend()
    if fe is None:
        return None
    return f"{fe.__version__} (cuDNN {fe.backend_version()})"


def _gpu_state() -> str | None:
    """Clocks, power and temperature from nvidia-smi (best effort): runs on different machine
    leases differ, and these say by how much the device did."""
    import subprocess

    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.max.sm,clocks.mem,power.draw,power.limit,"
             "temperature.gpu", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip() + f" x {os.cpu_count()}"
    except OSError:
        pass
    return platform.processor() or None


def format_table(rows: list[tuple[str, str]], title: str = "") -> str:
    width = max(len(k) for k, _ in rows)
    lines = [title] if title else []
    lines += [f"  {k.ljust(width)}  {v}" for k, v in rows]
    return "\n".join(lines)


def result_table(r: ThroughputResult, label: str = "pagedkv") -> str:
    return format_table([
        ("engine", label),
        ("workload", r.workload),
        ("requests", str(r.num_requests)),
        ("prompt tokens", f"{r.prompt_tokens:,}"),
        ("output tokens (generated)", f"{r.output_tokens:,} of {r.requested_output_tokens:,} requested"),
        ("time", f"{r.elapsed_s:.2f} s"),
        ("output throughput", f"{r.output_tokens_per_s:,.1f} tok/s"),
        ("total throughput", f"{r.total_tokens_per_s:,.1f} tok/s"),
        ("steps", f"{r.steps:,} ({r.cuda_graph_steps:,} CUDA-graph replays)"),
        ("async scheduling / compiled", f"{r.engine.get('async_scheduling')} / "
                                        f"{r.engine.get('compiled_model')}"),
        ("preemptions", str(r.preemptions)),
        ("prefix-cache hit rate", f"{r.prefix_cache_hit_rate:.1%}"),
        ("peak KV usage", f"{r.peak_kv_usage:.1%}"),
    ])


def write_json(path: str, payload: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=str)


__all__ = [
    "ThroughputResult",
    "W1_TOTAL_OUTPUT_TOKENS",
    "Workload",
    "environment",
    "format_table",
    "result_table",
    "run_throughput",
    "w1_workload",
    "write_json",
]
