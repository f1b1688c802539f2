"""Helpers shared by the Triton attention kernels (decode, prefill) and their backend.

Host-side only: argument checks that read tensor metadata (never values, so launchers stay free
of host syncs and can be captured in CUDA graphs), the dot precision per dtype and the device's
multiprocessor count.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from triton.runtime.interpreter import InterpretedFunction

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import check_same_device, check_tensor
from pagedkv.kernels.fp8_kv import FP8_KV_DTYPES

ATTN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class AttnShape:
    """What a launcher derives from the query and the cache shapes."""

    num_heads: int
    num_kv_heads: int
    group: int  # query heads per KV head
    head_dim: int
    block_size: int


def check_attention_inputs(
    fn: str,
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    num_reqs: int,
) -> AttnShape:
    """Validate the arguments of a paged attention launcher (metadata only). The cache is
    bf16 / fp16 / fp32, or FP8 (``float8_e4m3fn``, dequantized in the kernels)."""
    check_tensor(fn, "q", q, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "out", out, dtypes=ATTN_DTYPES, ndim=3, contiguous_last=True)
    check_tensor(fn, "kv_cache", kv_cache, dtypes=ATTN_DTYPES + FP8_KV_DTYPES, ndim=5)
    check_tensor(fn, "block_table", block_table, dtypes=(torch.int32,), ndim=2,
                 contiguous_last=True)
    check_tensor(fn, "query_start_loc", query_start_loc, dtypes=(torch.int32,), ndim=1,
                 contiguous_last=True)
    check_tensor(fn, "seq_lens", seq_lens, dtypes=(torch.int32,), ndim=1,
                 contiguous_last=True)
    if kv_cache.shape[0] != 2:
        raise ConfigError(f"{fn}: kv_cache must be [2, num_blocks, block_size, num_kv_heads, "
                          f"head_dim], got {tuple(kv_cache.shape)}")
    if kv_cache.stride(-1) != 1:
        raise ConfigError(f"{fn}: kv_cache must be contiguous in head_dim (strides "
                          f"{kv_cache.stride()})")
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens, num_heads, q_dim = q.shape
    if q_dim != head_dim:
        raise ConfigError(f"{fn}: q head_dim {q_dim} differs from the cache's {head_dim}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"{fn}: {num_heads} query heads are not a multiple of "
                          f"{num_kv_heads} KV heads")
    if tuple(out.shape) != tuple(q.shape):
        raise ConfigError(f"{fn}: out {tuple(out.shape)} must have q's shape {tuple(q.shape)}")
    if not isinstance(num_reqs, int) or isinstance(num_reqs, bool) or num_reqs < 0:
        raise ConfigError(f"{fn}: num_reqs must be a host int >= 0, got {num_reqs!r}")
    if query_start_loc.shape[0] < num_reqs + 1 or seq_lens.shape[0] < num_reqs:
        raise ConfigError(f"{fn}: query_start_loc needs num_reqs + 1 = {num_reqs + 1} entries "
                          f"(has {query_start_loc.shape[0]}), seq_lens num_reqs (has "
                          f"{seq_lens.shape[0]})")
    if block_table.shape[0] < num_reqs:
        raise ConfigError(f"{fn}: block_table has {block_table.shape[0]} rows for "
                          f"{num_reqs} requests")
    check_same_device(fn, q=q, kv_cache=kv_cache, block_table=block_table,
                      query_start_loc=query_start_loc, seq_lens=seq_lens, out=out)
    return AttnShape(num_heads, num_kv_heads, num_heads // num_kv_heads, head_dim, block_size)


def attn_shape(q: torch.Tensor, kv_cache: torch.Tensor) -> AttnShape:
    """The :class:`AttnShape` of already validated ``q`` / ``kv_cache`` (no checks)."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    return AttnShape(num_heads, num_kv_heads, num_heads // num_kv_heads, head_dim, block_size)


def interpreted(kernel) -> bool:
    """True when ``kernel`` runs under the Triton interpreter (``TRITON_INTERPRET=1`` at import).

    The kernels then loop with ``while`` instead of ``range``: the interpreter cannot iterate a
    ``range`` over runtime scalars, and compiled code wants ``range`` (software pipelining).
    """
    return isinstance(kernel, InterpretedFunction)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision: exact fp32 for fp32 caches (Triton would use tf32), native otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def num_sms(device: torch.device) -> int:
    """Multiprocessors of ``device`` (132 on an H200); 132 for CPU (interpreter) runs."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


__all__ = ["ATTN_DTYPES", "AttnShape", "LOG2E", "attn_shape", "check_attention_inputs", "dot_precision",
           "interpreted", "num_sms"]
