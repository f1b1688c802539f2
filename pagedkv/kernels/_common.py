"""Helpers shared by the kernel modules: dispatch (Triton or reference), argument checks, the
launch geometry of the per-request token kernels and their shared padding writer.

Nothing here launches a kernel. The checks read only host-side tensor metadata (shape, dtype,
device, strides), never tensor values, so a launcher stays free of host syncs and can be captured
in a CUDA graph.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedkv.errors import ConfigError

PAD_SLOT_ID = -1
INDEX_DTYPES = (torch.int32, torch.int64)
KV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def use_triton(kernel, *tensors: torch.Tensor) -> bool:
    """True when ``kernel`` should run: the tensors live on CUDA, or the kernel was decorated
    under ``TRITON_INTERPRET=1`` (the Triton interpreter then runs it on CPU tensors).

    Otherwise (CPU tensors, compiled Triton) the caller uses the plain torch reference.
    Deciding on the kernel object rather than on the environment at call time keeps the two in
    agreement: ``triton.jit`` reads ``TRITON_INTERPRET`` once, when the module is imported.
    """
    if tensors and tensors[0].device.type == "cuda":
        return True
    return isinstance(kernel, InterpretedFunction)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_tensor(
    fn: str,
    name: str,
    t: torch.Tensor,
    *,
    dtypes: tuple[torch.dtype, ...],
    ndim: int,
    contiguous_last: bool = False,
) -> None:
    """Validate a tensor argument's type, dtype and rank (metadata only; a fast path first,
    because launchers run every step and their host time counts)."""
    try:
        if t.dtype in dtypes and t.dim() == ndim and (
            not contiguous_last or t.stride(-1) == 1 or t.shape[-1] <= 1
        ):
            return
    except (AttributeError, TypeError, IndexError):
        pass
    if not isinstance(t, torch.Tensor):
        raise ConfigError(f"{fn}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ConfigError(f"{fn}: {name} must have dtype in ({names}), got {t.dtype}")
    if t.dim() != ndim:
        raise ConfigError(f"{fn}: {name} must be {ndim}-D, got shape {tuple(t.shape)}")
    raise ConfigError(
        f"{fn}: {name} must be contiguous in its last dimension (stride {t.stride()}); "
        "pass .contiguous() or a view of a row-major buffer"
    )


def check_launch_config(config, tiles: tuple[str, ...], warps: bool = True) -> None:
    """The checks the kernels' launch-config dataclasses share (their ``__post_init__``): each
    attribute named in ``tiles`` a power of two >= 16 (a Triton block dimension); with
    ``warps``, positive ``num_warps`` and ``num_stages``."""
    cls = type(config).__name__
    for name in tiles:
        v = getattr(config, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ConfigError(f"{cls}.{name} must be a power of two >= 16, got {v!r}")
    if warps and (config.num_warps < 1 or config.num_stages < 1):
        raise ConfigError(f"{cls}: num_warps and num_stages must be positive")


def check_int(fn: str, name: str, value, *, lo: int | None = None, hi: int | None = None) -> int:
    """Validate a host integer argument; returns it as a Python int."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ConfigError(f"{fn}: {name} must be a host int, got {type(value).__name__}")
    value = int(value)
    if lo is not None and value < lo:
        raise ConfigError(f"{fn}: {name} must be >= {lo}, got {value}")
    if hi is not None and value > hi:
        raise ConfigError(f"{fn}: {name} must be <= {hi}, got {value}")
    return value


def check_same_device(fn: str, **tensors: torch.Tensor | None) -> None:
    """All given tensors (None entries skipped) live on one device."""
    first = None
    for t in tensors.values():
        if t is None:
            continue
        dev = t.get_device()
        if first is None:
            first = dev
        elif dev != first:
            listing = ", ".join(f"{k}={v.device}" for k, v in tensors.items() if v is not None)
            raise ConfigError(f"{fn}: all tensors must be on one device, got {listing}")


def check_cp(fn: str, cp_world_size, cp_rank, cp_interleave) -> tuple[int, int, int]:
    cp = check_int(fn, "cp_world_size", cp_world_size, lo=1)
    rank = check_int(fn, "cp_rank", cp_rank, lo=0, hi=cp - 1)
    inter = check_int(fn, "cp_interleave", cp_interleave, lo=1)
    return cp, rank, inter


def gather_table(table: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                 ok: torch.Tensor) -> torch.Tensor:
    """Reference-side bounded gather: ``table[rows, cols]`` as int64 where ``ok``, else 0.

    Entries outside ``ok`` are never read, so out-of-range rows/columns (and empty tables)
    are safe; callers turn them into -1 themselves.
    """
    if table.shape[0] == 0 or table.shape[1] == 0:
        return torch.zeros(ok.shape, dtype=torch.int64, device=table.device)
    rows = torch.broadcast_to(rows, ok.shape)
    cols = torch.broadcast_to(cols, ok.shape)
    return table[torch.where(ok, rows, 0), torch.where(ok, cols, 0)].to(torch.int64)


# ---------------------------------------------------------------------------------------------
# Per-request token kernels (slot mapping, compressed slot mapping): launch geometry and the
# shared padding writer.

MAX_TOKEN_BLOCK = 1024
TOKEN_BLOCK_LEVELS = (32, 256, MAX_TOKEN_BLOCK)
PAD_BLOCK = 1024
MAX_SPLIT = 64


def token_launch_geometry(num_reqs: int, num_tokens: int, buffer_len: int,
                          max_query_len: int | None) -> tuple[int, int, int, int]:
    """``(BLOCK, num_warps, S, P)`` for a grid ``(num_reqs + P, ..., S)``, from host ints only.

    ``BLOCK`` lanes per chunk: the smallest of the levels ``TOKEN_BLOCK_LEVELS`` (32, 256,
    1024) that holds the longest request (``max_query_len`` when the caller knows it, else
    ``num_tokens``, an upper bound), 1024 beyond. Few levels, because each is a compiled
    variant of every kernel launched with it: with every power of two from 32 to 1024, a
    W3 run compiled the slot-mapping kernel in its third step (BLOCK 256: queries of 129-256
    tokens), which ``LLMEngine.warm_up``'s steps had not met; its steps meet these three. ``S`` splits deal one request's chunks over several programs so that none walks
    more than two chunks (1 unless a request exceeds 2048 tokens). ``P`` padding programs, each
    with ``S`` workers, store at most ~4 PAD_BLOCK chunks of -1 each.
    """
    longest = num_tokens if max_query_len is None else min(max_query_len, num_tokens)
    block = next((b for b in TOKEN_BLOCK_LEVELS if b >= longest), MAX_TOKEN_BLOCK)
    num_warps = max(1, min(4, block // 256))
    splits = max(1, min(MAX_SPLIT, cdiv(longest, 2 * block)))
    pad_programs = max(1, cdiv(buffer_len, 4 * PAD_BLOCK * splits))
    return block, num_warps, splits, pad_programs


@triton.jit
def arrive(cnt, expected):
    """Counts one arrival at the int32 counter ``cnt`` (after a barrier: every thread's stores
    of this program come first; acquire-release at GPU scope); True for the ``expected``-th
    arrival, which sets the counter back to 0 for the next launch. The "last program to arrive
    finishes the work" pattern of the kernels that merge partial results without another
    launch: the decode's fused reduce, the QKV projection's split-K epilogue. Interpreter-safe
    (no program ever waits for another)."""
    tl.debug_barrier()
    done = tl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu")
    last = done == expected - 1
    if last:
        tl.store(cnt, 0)
    return last


@triton.jit
def fill_pad_tail(out_ptr, qsl_ptr, num_reqs, num_tokens, length, r, s, num_row_programs,
                  num_splits, PAD: tl.constexpr):
    """Padding program ``num_reqs <= r < num_row_programs``: store -1 into
    ``out[min(qsl[num_reqs], num_tokens):length]``; the ``(num_row_programs - num_reqs) *
    num_splits`` workers take chunks round robin."""
    worker = (r - num_reqs) * num_splits + s
    step = (num_row_programs - num_reqs) * num_splits * PAD
    t0 = tl.minimum(tl.load(qsl_ptr + num_reqs), num_tokens) + worker * PAD
    lanes = tl.arange(0, PAD)
    while t0 < length:
        t = t0 + lanes
        tl.store(out_ptr + t, tl.full([PAD], -1, tl.int64), mask=t < length)
        t0 += step


# ---------------------------------------------------------------------------------------------
# Reference-side helpers of the state kernels (causal conv1d, SSM scans, gated delta rule).


def varlen_state_rows(query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                      has_initial_state: torch.Tensor):
    """The rows of a varlen state batch, for torch twins (host reads: never in a launcher):
    ``(row, slot, start, end, init)`` for every row whose state index is not ``PAD_SLOT_ID``
    (tokens ``start:end``, ``init``: continue from the slot)."""
    qsl = query_start_loc.tolist()
    init = has_initial_state.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        if slot != PAD_SLOT_ID:
            yield b, slot, qsl[b], qsl[b + 1], bool(init[b])


def start_state(state: torch.Tensor, slot: int, init: bool) -> torch.Tensor:
    """A sequence's state before its tokens, in float32: the slot's (``init``) or zeros."""
    if init:
        return state[slot].float()
    return torch.zeros(state.shape[1:], dtype=torch.float32, device=state.device)
