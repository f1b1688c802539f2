"""KV-cache pool sizing: how many blocks the engine allocates, and what they hold.

Order of precedence:

1. ``num_gpu_blocks_override`` (a block count, null block included) wins;
2. ``kv_cache_memory_bytes``: a byte budget for the KV tensors of all layers (any device);
3. on a GPU: ``total * gpu_memory_utilization - (memory in use now) - (peak activations of the
   largest step, profiled) - (a reserve for CUDA graphs)``. "In use now" is measured with
   ``torch.cuda.mem_get_info`` after the profile's memory is released, so it counts the
   weights, the CUDA context and whatever other processes hold;
4. on a CPU: ``DEFAULT_CPU_KV_BYTES``.

Sizes found by 3 and 4 are capped at ``max_num_seqs`` full-length sequences plus the null block
(when ``max_num_seqs`` is given; a sequence's blocks counted over all KV-cache groups): more blocks could only keep prefix-cache entries longer, and
every block is a Python object in the block pool (a tiny model on a large GPU would otherwise ask
for millions). ``source`` then ends in ``"+cap"``.

The pool must hold at least one ``max_model_len`` sequence (plus the null block); otherwise a
``ConfigError`` says what to change.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import asdict, dataclass, replace

from pagedkv.core.spec import cdiv
from pagedkv.errors import ConfigError

logger = logging.getLogger(__name__)

# Engines alive in this process (weakly held): a new engine sized from free device memory gets
# what the others leave; ``warn_if_others_hold_memory`` says so.
_LIVE_ENGINES: "weakref.WeakSet" = weakref.WeakSet()


def register_engine(engine) -> None:
    """Remember ``engine`` (it must have ``runner.device`` and ``runner.kv_cache_bytes``)
    while it is alive."""
    _LIVE_ENGINES.add(engine)


def kv_bytes_held_by_other_engines(device) -> int:
    """KV-cache bytes the live engines of this process hold on ``device``."""
    held = 0
    for e in list(_LIVE_ENGINES):
        runner = getattr(e, "runner", None)
        if runner is not None and runner.device == device:
            held += runner.kv_cache_bytes
    return held


def warn_if_others_hold_memory(sizing: "KVCacheSizing", cap_blocks: int, held_bytes: int) -> str | None:
    """The warning (logged, and returned) when a GPU-profiled pool came out smaller than its
    cap while other engines of this process hold device memory: the case of a notebook that
    rebinds ``llm = LLM(...)`` (the old engine is alive until the new one is built). Measured
    on the H200 with W1: 5,066 blocks instead of 65,537, 137 preemptions, 13,591 instead of
    24,366 tok/s."""
    if held_bytes <= 0 or not sizing.source.startswith("gpu_profile") or sizing.num_blocks >= cap_blocks:
        return None
    msg = (
        f"other pagedkv engines in this process hold {held_bytes / GiB:.1f} GiB of KV cache on "
        f"this device, so this engine's pool is {sizing.num_blocks:,} blocks "
        f"({sizing.kv_cache_bytes / GiB:.1f} GiB, max concurrency {sizing.max_concurrency:.1f}) "
        f"instead of up to {cap_blocks:,}: expect preemptions and lower throughput. Shut the "
        "other engine down first (llm.shutdown() or del llm), e.g. before rebinding llm = LLM(...)"
    )
    logger.warning(msg)
    return msg

MiB = 1 << 20
GiB = 1 << 30
DEFAULT_CPU_KV_BYTES = 256 * MiB
CUDA_GRAPH_RESERVE_BYTES = 256 * MiB


def block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """Bytes of one block across all layers (K and V)."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


@dataclass(frozen=True)
class KVCacheSizing:
    """The pool chosen and how: ``num_blocks`` includes the null block 0."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    max_model_len: int
    source: str  # "override" | "budget" | "gpu_profile" | "cpu_default"
    budget_bytes: int | None = None
    peak_activation_bytes: int | None = None
    total_device_bytes: int | None = None
    used_device_bytes: int | None = None
    # per KV-cache group (``group_capacity``): what one max-length request holds in it;
    # empty: one full-attention group
    groups: tuple = ()
    # the attention caches' dtype (torch names, e.g. "bfloat16" or "float8_e4m3fn"; several
    # joined by "+"; "" when not given)
    kv_cache_dtype: str = ""

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def token_capacity(self) -> int:
        """Tokens the pool holds (the null block excluded)."""
        return self.num_usable_blocks * self.block_size

    @property
    def kv_cache_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def blocks_per_request(self) -> int:
        """Blocks one ``max_model_len`` request holds at most, over all groups (the groups
        share the pool)."""
        if self.groups:
            return sum(g["blocks_per_request"] for g in self.groups)
        return cdiv(self.max_model_len, self.block_size)

    @property
    def max_concurrency(self) -> float:
        """How many ``max_model_len`` sequences fit at once."""
        return self.num_usable_blocks / self.blocks_per_request

    def as_dict(self) -> dict:
        d = asdict(self)
        d.update(num_usable_blocks=self.num_usable_blocks, token_capacity=self.token_capacity,
                 kv_cache_bytes=self.kv_cache_bytes, max_concurrency=self.max_concurrency,
                 blocks_per_request=self.blocks_per_request)
        d["groups"] = [dict(g) for g in self.groups]
        return d

    def describe(self) -> str:
        dtype = f"{self.kv_cache_dtype}, " if self.kv_cache_dtype else ""
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens "
            f"({dtype}{self.kv_cache_bytes / GiB:.2f} GiB, {self.token_capacity} tokens, "
            f"max concurrency {self.max_concurrency:.2f} at max_model_len {self.max_model_len}; "
            f"sized by {self.source})" + self._describe_groups()
        )

    def _describe_groups(self) -> str:
        if len(self.groups) < 2:
            return ""
        parts = [f"group {g['group']} {g['kind']} ({g['num_layers']} layers): "
                 f"{g['blocks_per_request']} blocks per request" for g in self.groups]
        return "; " + ", ".join(parts)


def group_capacity(kv_cache_groups, max_model_len: int, max_num_batched_tokens: int,
                   block_size: int) -> tuple[dict, ...]:
    """Per KV-cache group (``kv_cache_groups``: a ``KVCacheConfig``'s groups): its kind,
    layers, and the blocks one ``max_model_len`` request holds in it at most (full attention: every block of the context; a sliding window ``W``: the
    blocks of ``W - 1`` tokens plus a step's tokens, plus one, as the admission reservation
    counts them; chunked-local: a chunk plus a step's tokens, plus one; state groups: one)."""
    from pagedkv.core.spec import (
        ChunkedLocalAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    out = []
    for gid, g in enumerate(kv_cache_groups):
        spec = g.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            spec = next(iter(dict(spec.specs).values()))
        b = spec.block_size
        if isinstance(spec, SlidingWindowSpec):
            kind = f"sliding_window {spec.sliding_window}"
            need = cdiv(min(spec.sliding_window - 1 + max_num_batched_tokens, max_model_len), b) + 1
        elif isinstance(spec, ChunkedLocalAttentionSpec):
            kind = f"chunked_local {spec.attention_chunk_size}"
            need = cdiv(min(spec.attention_chunk_size + max_num_batched_tokens, max_model_len), b) + 1
        elif isinstance(spec, MambaSpec):
            kind, need = "mamba", 1
        else:
            kind = "mla" if isinstance(spec, MLAAttentionSpec) else "full"
            need = cdiv(max_model_len, b)
        out.append(dict(group=gid, kind=kind, num_layers=len(g.layer_names), block_size=b,
                        blocks_per_request=min(need, cdiv(max_model_len, b))))
    return tuple(out)


def fitted_max_model_len(kv_cache_groups, num_usable_blocks: int, max_num_batched_tokens: int,
                         block_size: int, max_model_len: int) -> int:
    """The longest context up to ``max_model_len`` whose request fits ``num_usable_blocks``
    over all groups (``group_capacity``): the full-attention (and MLA) groups split what the
    other groups' fixed shares (sliding windows, states) leave; 0 if even those do not fit."""
    caps = group_capacity(kv_cache_groups, max_model_len, max_num_batched_tokens, block_size)
    full = [g for g in caps if g["kind"] in ("full", "mla")]
    fixed = sum(g["blocks_per_request"] for g in caps if g not in full)
    if fixed > num_usable_blocks:
        return 0
    if not full:
        return max_model_len
    per_group = (num_usable_blocks - fixed) // len(full)
    return min(max_model_len, per_group * min(g["block_size"] for g in full))


def blocks_from_bytes(budget: int, bytes_per_block: int) -> int:
    return max(0, int(budget) // bytes_per_block)


def check_pool(num_blocks: int, block_size: int, max_model_len: int, source: str,
               blocks_per_request: int | None = None) -> None:
    """Raise unless one ``max_model_len`` request fits: ``blocks_per_request`` (over all
    KV-cache groups; default: one full-attention group) plus the null block."""
    if blocks_per_request is None:
        blocks_per_request = cdiv(max_model_len, block_size)
    need = blocks_per_request + 1
    if num_blocks < need:
        raise ConfigError(
            f"the KV-cache pool ({source}) has {num_blocks} blocks of {block_size} tokens; one "
            f"sequence of max_model_len={max_model_len} tokens needs {need} (over all KV-cache "
            "groups, null block included). "
            "Lower max_model_len, or give the cache more memory (gpu_memory_utilization, "
            "kv_cache_memory_bytes or num_gpu_blocks_override; on the command line --max-model-len, "
            "--gpu-memory-utilization, --kv-cache-memory-bytes or --num-gpu-blocks)"
        )


def size_kv_cache(
    *,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    num_gpu_blocks_override: int | None = None,
    kv_cache_memory_bytes: int | None = None,
    device_type: str = "cpu",
    gpu_memory_utilization: float = 0.9,
    profile=None,
    graph_reserve_bytes: int = 0,
    check: bool = True,
    max_num_seqs: int | None = None,
    blocks_per_request: int | None = None,
) -> KVCacheSizing:
    """Choose the pool size (see the module docstring). ``profile``: a zero-argument callable
    returning the peak activation bytes of the largest step (GPU only; called only when needed).
    ``check=False`` skips the "one max_model_len sequence fits" check (the caller may lower
    ``max_model_len`` to the pool instead). ``blocks_per_request``: the blocks one
    ``max_model_len`` request holds over all KV-cache groups (``group_capacity``; default: one
    full-attention group), for the cap and the check."""
    if blocks_per_request is None:
        blocks_per_request = cdiv(max_model_len, block_size)
    if bytes_per_block <= 0:
        raise ConfigError(f"bytes_per_block must be positive, got {bytes_per_block}")
    common = dict(block_size=block_size, bytes_per_block=bytes_per_block, max_model_len=max_model_len)
    if num_gpu_blocks_override is not None:
        n = num_gpu_blocks_override
        if isinstance(n, bool) or not isinstance(n, int) or n < 2:
            raise ConfigError(
                f"num_gpu_blocks_override must be an int >= 2 (block 0 is the null block), got {n!r}"
            )
        sizing = KVCacheSizing(num_blocks=n, source="override", **common)
    elif kv_cache_memory_bytes is not None:
        b = kv_cache_memory_bytes
        if isinstance(b, bool) or not isinstance(b, int) or b <= 0:
            raise ConfigError(f"kv_cache_memory_bytes must be a positive int, got {b!r}")
        sizing = KVCacheSizing(num_blocks=blocks_from_bytes(b, bytes_per_block), source="budget",
                               budget_bytes=b, **common)
    elif device_type == "cuda":
        import torch

        if profile is None:
            raise ConfigError("sizing the KV cache on a GPU needs a profile function")
        peak = int(profile())
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        budget = int(total * gpu_memory_utilization) - used - peak - graph_reserve_bytes
        if budget <= 0:
            raise ConfigError(
                f"no GPU memory left for the KV cache: {total / GiB:.1f} GiB x "
                f"gpu_memory_utilization {gpu_memory_utilization} = "
                f"{total * gpu_memory_utilization / GiB:.1f} GiB, but {used / GiB:.1f} GiB are in "
                f"use and the largest step peaks at {peak / GiB:.2f} GiB; raise "
                "gpu_memory_utilization or lower max_num_batched_tokens (on the command line "
                "--gpu-memory-utilization, --max-num-batched-tokens); another engine in this "
                "process still holding memory is released by deleting it or LLM.shutdown()"
            )
        sizing = KVCacheSizing(
            num_blocks=blocks_from_bytes(budget, bytes_per_block), source="gpu_profile",
            budget_bytes=budget, peak_activation_bytes=peak, total_device_bytes=total,
            used_device_bytes=used, **common,
        )
    else:
        sizing = KVCacheSizing(
            num_blocks=blocks_from_bytes(DEFAULT_CPU_KV_BYTES, bytes_per_block),
            source="cpu_default", budget_bytes=DEFAULT_CPU_KV_BYTES, **common,
        )
    if max_num_seqs is not None and sizing.source in ("gpu_profile", "cpu_default"):
        cap = max_num_seqs * blocks_per_request + 1
        if sizing.num_blocks > cap:
            sizing = replace(sizing, num_blocks=cap, source=sizing.source + "+cap")
    if check:
        check_pool(sizing.num_blocks, block_size, max_model_len, sizing.source, blocks_per_request)
    return sizing


__all__ = [
    "fitted_max_model_len",
    "kv_bytes_held_by_other_engines",
    "register_engine",
    "warn_if_others_hold_memory",
    "CUDA_GRAPH_RESERVE_BYTES",
    "DEFAULT_CPU_KV_BYTES",
    "KVCacheSizing",
    "block_bytes",
    "check_pool",
    "size_kv_cache",
]
