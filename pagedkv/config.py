"""Frozen, validated configuration dataclasses.

Every value is checked when the object is built; a bad value raises ``ConfigError`` with a
message that says which field is wrong and what to use instead. Objects are frozen: derive
a changed copy with ``dataclasses.replace`` (which validates again).

The engine adds more configs (model, parallelism, ...) beside these; each one validates
itself in ``__post_init__`` and cross-config checks live in the object that combines them.

Pure Python (control plane): no torch import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedkv.errors import ConfigError

# "blake2b" is pagedkv's fast builtin alternative (not in vLLM).
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor", "blake2b")
SCHEDULER_POLICIES = ("fcfs", "priority")
MAMBA_CACHE_MODES = ("none", "align", "all")
# KV-cache dtypes by vLLM's names -> the dtype the attention caches take (None: the model's).
# "fp8" is e4m3 as on vLLM's CUDA path; MLA latent caches and state layers keep the model's
# dtype (``pagedkv.core.spec.with_kv_cache_dtype``).
KV_CACHE_DTYPES = {"auto": None, "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn"}


def kv_cache_dtype_name(name: str, field: str = "kv_cache_dtype") -> str | None:
    """The attention caches' dtype (a torch dtype name) for the option value ``name``; None
    for "auto" (the model's dtype). Anything else is a ``ConfigError`` naming the choices."""
    if isinstance(name, str) and name in KV_CACHE_DTYPES:
        return KV_CACHE_DTYPES[name]
    hint = ("; pagedkv's FP8 cache is e4m3 ('fp8' / 'fp8_e4m3'), e5m2 is not supported"
            if name == "fp8_e5m2" else "")
    raise ConfigError(f"{field} must be one of {sorted(KV_CACHE_DTYPES)}, got {name!r}{hint}")


def _check_int(name: str, value, *, minimum: int, hint: str = "") -> None:
    # bool is an int subclass; reject it explicitly so True is not read as 1.
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        more = f"; {hint}" if hint else ""
        raise ConfigError(f"{name} must be an int >= {minimum}, got {value!r}{more}")


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name} must be True or False, got {value!r}")


@dataclass(frozen=True)
class CacheConfig:
    """KV-cache pool settings.

    ``block_size``: tokens per KV block (the manager block size of a single-group model).
    ``num_gpu_blocks``: pool size including the null block 0; ``None`` means "profile the
    device memory" (the engine fills it in). ``prefix_match_unit``: optional override of
    the prefix-cache hash granularity for hybrid models (must divide every prefix-cacheable
    group's block size). ``mamba_block_size``: optional Mamba block size (else derived).
    ``cache_dtype``: the attention caches' dtype, by vLLM's names (``KV_CACHE_DTYPES``:
    "auto" = the model's, "fp8" / "fp8_e4m3" = ``float8_e4m3fn``).
    """

    block_size: int = 16
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool = True
    prefix_caching_hash_algo: str = "sha256"
    gpu_memory_utilization: float = 0.9
    cache_dtype: str = "auto"
    prefix_match_unit: int | None = None
    mamba_cache_mode: str = "none"
    mamba_block_size: int | None = None

    def __post_init__(self) -> None:
        _check_int("CacheConfig.block_size", self.block_size, minimum=1,
                   hint="use a power of two such as 16")
        if self.num_gpu_blocks is not None:
            _check_int("CacheConfig.num_gpu_blocks", self.num_gpu_blocks, minimum=2,
                       hint="block 0 is the null block, so at least 2 are needed; "
                            "or pass None to size the pool from device memory")
        _check_bool("CacheConfig.enable_prefix_caching", self.enable_prefix_caching)
        if self.prefix_caching_hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"CacheConfig.prefix_caching_hash_algo must be one of {HASH_ALGOS}, "
                f"got {self.prefix_caching_hash_algo!r}"
            )
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ConfigError(
                f"CacheConfig.gpu_memory_utilization must be a float in (0, 1], got {u!r}"
            )
        kv_cache_dtype_name(self.cache_dtype, "CacheConfig.cache_dtype")
        if self.prefix_match_unit is not None:
            _check_int("CacheConfig.prefix_match_unit", self.prefix_match_unit, minimum=1,
                       hint="or None to use the gcd of the groups' block sizes")
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ConfigError(
                f"CacheConfig.mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                f"got {self.mamba_cache_mode!r}"
            )
        if self.mamba_block_size is not None:
            _check_int("CacheConfig.mamba_block_size", self.mamba_block_size, minimum=1,
                       hint="or None to derive it from block_size / max_model_len")


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler limits and policies (defaults = vLLM 0.33.0's).

    ``max_num_batched_tokens``: input tokens per step. ``max_num_scheduled_tokens``: the
    token budget per step (defaults to ``max_num_batched_tokens``). ``max_model_len``:
    longest sequence (prompt + outputs). ``long_prefill_token_threshold``: when > 0, a
    prefill gets at most this many tokens per step while other requests exist.
    ``scheduler_reserve_full_isl``: admit a waiting request only if its whole current
    sequence fits in the pool. ``watermark``: fraction of the pool kept free when admitting.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    policy: Literal["fcfs", "priority"] = "fcfs"
    num_lookahead_tokens: int = 0
    scheduler_reserve_full_isl: bool = True
    watermark: float = 0.0
    max_num_scheduled_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_int("SchedulerConfig.max_num_seqs", self.max_num_seqs, minimum=1)
        _check_int("SchedulerConfig.max_num_batched_tokens", self.max_num_batched_tokens,
                   minimum=1)
        _check_int("SchedulerConfig.max_model_len", self.max_model_len, minimum=2,
                   hint="a sequence needs room for at least one prompt and one output token")
        _check_bool("SchedulerConfig.enable_chunked_prefill", self.enable_chunked_prefill)
        _check_int("SchedulerConfig.long_prefill_token_threshold",
                   self.long_prefill_token_threshold, minimum=0, hint="0 disables the cap")
        if self.policy not in SCHEDULER_POLICIES:
            raise ConfigError(
                f"SchedulerConfig.policy must be one of {SCHEDULER_POLICIES}, got {self.policy!r}"
            )
        _check_int("SchedulerConfig.num_lookahead_tokens", self.num_lookahead_tokens, minimum=0)
        _check_bool("SchedulerConfig.scheduler_reserve_full_isl", self.scheduler_reserve_full_isl)
        w = self.watermark
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w < 1.0:
            raise ConfigError(f"SchedulerConfig.watermark must be a float in [0, 1), got {w!r}")
        if self.max_num_scheduled_tokens is not None:
            _check_int("SchedulerConfig.max_num_scheduled_tokens", self.max_num_scheduled_tokens,
                       minimum=1, hint="or None to use max_num_batched_tokens")
            if self.max_num_scheduled_tokens > self.max_num_batched_tokens:
                raise ConfigError(
                    f"SchedulerConfig.max_num_scheduled_tokens ({self.max_num_scheduled_tokens}) "
                    f"must not exceed max_num_batched_tokens ({self.max_num_batched_tokens}); "
                    "lower it or raise max_num_batched_tokens"
                )
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                f"SchedulerConfig.max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_num_seqs ({self.max_num_seqs}): every running request needs at least "
                "one token per step; raise max_num_batched_tokens or lower max_num_seqs"
            )
        if not self.enable_chunked_prefill and self.token_budget < self.max_model_len:
            raise ConfigError(
                f"with chunked prefill disabled, the per-step token budget "
                f"(max_num_scheduled_tokens or max_num_batched_tokens: {self.token_budget}) "
                f"must be >= max_model_len ({self.max_model_len}) so that every prompt fits in "
                "one step; raise max_num_batched_tokens, lower max_model_len or enable chunked "
                "prefill"
            )

    @property
    def token_budget(self) -> int:
        """Tokens the scheduler may schedule per step."""
        if self.max_num_scheduled_tokens is None:
            return self.max_num_batched_tokens
        return self.max_num_scheduled_tokens


@dataclass(frozen=True)
class EngineConfig:
    """Every option of an engine, in one place: ``LLM(path, **options)``, ``LLM.from_shape``,
    ``LLM.from_model``, ``build_engine`` and the CLI all build one of these, so no option is
    named (or defaulted) twice. Unknown names raise ``ConfigError`` naming the closest option.

    ``async_scheduling`` / ``compile_model`` / ``warmup``: ``None`` means "on with CUDA, off on
    CPU" (:meth:`resolved` fills them in for a device). ``block_size=None``: pages of 64
    tokens on CUDA, 16 elsewhere (:func:`default_block_size`). ``max_num_batched_tokens=None``: 16,384
    on a CUDA GPU with at least 70 GiB that is not an A100, else 8,192 (vLLM's ``LLM`` defaults;
    :func:`default_max_num_batched_tokens`). ``max_model_len=None``: the model's
    trained context, fitted to the pool when smaller. ``kv_cache_memory_bytes``: a KV byte
    budget instead of ``gpu_memory_utilization`` (on CPU the default is 256 MiB).
    ``num_gpu_blocks_override``: exactly this many blocks (the null block included).
    ``kv_cache_dtype``: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (vLLM's names): the
    attention layers' paged K/V in ``float8_e4m3fn`` with per-layer scales 1.0 (vLLM's default
    without checkpoint scales); half the bytes per block, so twice the blocks for a budget.
    ``sanitize``: check every index-layer invariant on every step (slow; for debugging).
    ``mixed_cuda_graphs`` (on by default): besides the pure-decode graphs, capture CUDA graphs
    of mixed prefill / decode steps (padded to a few token counts) where the backend and the
    model allow it (``pagedkv.worker.cuda_graphs``); off: those steps run eagerly. On the H200
    they take an eager mixed step's ~20-90 ms of host launches off W3's shared-prefix extends
    (W3 50,150-50,830 against 45,500-47,804 output tok/s eager, BENCHMARKS.md, twenty-second
    session); a padded step's GEMMs round differently in bf16 (other row counts, other cuBLAS
    kernels), so its logits differ from an eager step's by bf16 rounding (the float32 GPU test
    matches eager at 1e-3).
    ``tensor_parallel_size``: worker processes, one per rank, each holding a shard of the
    model (``pagedkv.distributed``; NCCL on GPUs, gloo on CPU); 1: the model runs in this
    process. ``distributed_timeout_s``: how long the engine waits for a rank's reply (or a
    collective) before it reports the rank as hung. ``decode_context_parallel_size`` M (it
    divides ``tensor_parallel_size``, as in vLLM): the M ranks of a DCP group hold the same KV
    heads and each stores only its interleaved share of every request's tokens (runs of
    ``dcp_kv_cache_interleave_size`` positions dealt round-robin: the slot mapping's CP rule,
    -1 for the others); attention computes a partial result per rank, merged with the
    log-sum-exp correction across the group; a scheduler block spans ``block_size * M``
    tokens, so the pool holds M times the tokens.
    """

    block_size: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float = 0.9
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    enforce_eager: bool = False
    cuda_graph_sizes: tuple[int, ...] | None = None
    mixed_cuda_graphs: bool = True
    long_prefill_token_threshold: int = 0
    async_scheduling: bool | None = None
    compile_model: bool | None = None
    warmup: bool | None = None
    allow_long_max_model_len: bool = False
    sanitize: bool = False
    seed: int = 0
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1
    distributed_timeout_s: float = 300.0

    def __post_init__(self) -> None:
        if self.block_size is not None:
            _check_int("block_size", self.block_size, minimum=1,
                       hint="or None for the device's default")
        _check_int("max_num_seqs", self.max_num_seqs, minimum=1)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1,
                       hint="or None for the device's default")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, minimum=2)
        for name in ("enable_prefix_caching", "enforce_eager", "allow_long_max_model_len",
                     "sanitize", "mixed_cuda_graphs"):
            _check_bool(name, getattr(self, name))
        for name in ("async_scheduling", "compile_model", "warmup"):
            if getattr(self, name) is not None:
                _check_bool(name, getattr(self, name))
        u = self.gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0.0 < u <= 1.0:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {u!r}")
        if self.num_gpu_blocks_override is not None:
            _check_int("num_gpu_blocks_override", self.num_gpu_blocks_override, minimum=2,
                       hint="the pool needs the null block and one more")
        if self.kv_cache_memory_bytes is not None:
            _check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1)
        _check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0)
        _check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1)
        t = self.distributed_timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
            raise ConfigError(f"distributed_timeout_s must be a positive number, got {t!r}")
        _check_int("decode_context_parallel_size", self.decode_context_parallel_size, minimum=1)
        _check_int("dcp_kv_cache_interleave_size", self.dcp_kv_cache_interleave_size, minimum=1)
        if self.tensor_parallel_size % self.decode_context_parallel_size:
            raise ConfigError(
                f"decode_context_parallel_size={self.decode_context_parallel_size} must divide "
                f"tensor_parallel_size={self.tensor_parallel_size} (a DCP group is a set of "
                "tensor-parallel ranks)")
        if self.block_size is not None and self.block_size % self.dcp_kv_cache_interleave_size:
            raise ConfigError(
                f"dcp_kv_cache_interleave_size={self.dcp_kv_cache_interleave_size} must divide "
                f"block_size={self.block_size}")
        if self.tensor_parallel_size > 1 and self.sanitize:
            raise ConfigError("sanitize=True checks the runner's tables in this process; with "
                              "tensor_parallel_size > 1 the runners live in the worker "
                              "processes: run the sanitizer with tensor_parallel_size=1")
        kv_cache_dtype_name(self.kv_cache_dtype)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an int, got {self.seed!r}")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if isinstance(sizes, (str, bytes)) or not hasattr(sizes, "__iter__"):
                raise ConfigError(f"cuda_graph_sizes must be a list of ints, got {sizes!r}")
            sizes = tuple(sizes)
            for s in sizes:
                _check_int("cuda_graph_sizes entries", s, minimum=1)
            object.__setattr__(self, "cuda_graph_sizes", sizes)

    @classmethod
    def from_options(cls, **options) -> "EngineConfig":
        """An ``EngineConfig`` from keyword options; an unknown name is a ``ConfigError``
        naming the closest option."""
        import difflib
        from dataclasses import fields

        known = [f.name for f in fields(cls)]
        for key in options:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise ConfigError(f"unknown engine option {key!r}{hint} (options: "
                                  f"{', '.join(known)})")
        return cls(**options)

    def resolved(self, device) -> "EngineConfig":
        """The defaults that depend on the device (a ``torch.device`` or its type / name)
        filled in: ``None`` switches on with CUDA, ``block_size=None`` becomes
        :func:`default_block_size`, ``max_num_batched_tokens=None``
        :func:`default_max_num_batched_tokens`."""
        from dataclasses import replace

        device_type = device if isinstance(device, str) else device.type
        on = device_type.split(":")[0] == "cuda"
        tokens = self.max_num_batched_tokens
        return replace(
            self,
            block_size=default_block_size(device) if self.block_size is None else self.block_size,
            max_num_batched_tokens=default_max_num_batched_tokens(device) if tokens is None else tokens,
            async_scheduling=on if self.async_scheduling is None else self.async_scheduling,
            compile_model=on if self.compile_model is None else self.compile_model,
            warmup=on if self.warmup is None else self.warmup,
        )


# Pages of 64 tokens on CUDA, 16 elsewhere (vLLM's default). On the H200 (bench_w1.py
# --block-size, alternating pairs, Triton's prefill: the cuDNN frontend was not installed in
# those runs): W1 +0.6-0.7%, W2 +1.9-2.4% (twenty-sixth session) and +0.9% (twenty-ninth), W3
# -0.9 / +1.3%; cuDNN's paged prefill kernel 451 against 418 TFLOP/s (fewer, longer page
# reads); the workloads with cuDNN's prefill at 64 are not measured yet. The price: a
# prefix-cache hit covers whole blocks, so a shared prefix is reused in steps of 64 tokens.
CUDA_BLOCK_SIZE = 64
DEFAULT_BLOCK_SIZE = 16


def default_block_size(device) -> int:
    """``EngineConfig.block_size=None`` on ``device``: :data:`CUDA_BLOCK_SIZE` on CUDA, else
    :data:`DEFAULT_BLOCK_SIZE`."""
    device_type = device if isinstance(device, str) else device.type
    return CUDA_BLOCK_SIZE if device_type.split(":")[0] == "cuda" else DEFAULT_BLOCK_SIZE


# vLLM's ``LLM``-class defaults (``EngineArgs``): GPUs with at least 70 GiB that are not an
# A100 (H100, H200, MI300X, ...) schedule up to 16,384 tokens a step, others 8,192. On the H200,
# W1 through ``LLM.generate``: 16,384 gave 25,535 / 25,321 output tok/s against 8,192's
# 24,505 / 23,493 (two alternating pairs, BENCHMARKS.md).
LARGE_GPU_BYTES = 70 * 1024**3
LARGE_GPU_BATCHED_TOKENS = 16384
DEFAULT_BATCHED_TOKENS = 8192


def large_gpu(total_memory: int, name: str) -> bool:
    """vLLM's rule for its larger scheduling defaults: >= 70 GiB and not an A100."""
    return total_memory >= LARGE_GPU_BYTES and "A100" not in name.upper()


def default_max_num_batched_tokens(device) -> int:
    """``EngineConfig.max_num_batched_tokens=None`` on ``device``: 16,384 on a CUDA GPU that
    :func:`large_gpu` accepts, else 8,192."""
    device_type = device if isinstance(device, str) else device.type
    if device_type.split(":")[0] != "cuda":
        return DEFAULT_BATCHED_TOKENS
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_BATCHED_TOKENS
    index = torch.device(device).index
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index)
    return LARGE_GPU_BATCHED_TOKENS if large_gpu(props.total_memory, props.name) else DEFAULT_BATCHED_TOKENS
