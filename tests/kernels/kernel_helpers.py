"""Helpers for the kernel-vs-reference tests: poisoned outputs, device moves, random batches."""

from __future__ import annotations

import torch

# Poison patterns (never zeros): every byte 0x5A.
POISON_I64 = 0x5A5A5A5A5A5A5A5A
POISON_I32 = 0x5A5A5A5A


def poison(shape, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """A tensor whose bytes are all 0x5A (ints: 0x5A5A..., floats: the same bit pattern)."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if dtype == torch.int64:
        return torch.full(shape, POISON_I64, dtype=dtype, device=device)
    if dtype == torch.int32:
        return torch.full(shape, POISON_I32, dtype=dtype, device=device)
    itemsize = torch.empty((), dtype=dtype).element_size()
    numel = 1
    for n in shape:
        numel *= n
    raw = torch.full((numel * itemsize,), 0x5A, dtype=torch.uint8, device=device)
    return raw.view(dtype).reshape(shape)


def to(device: str, *tensors):
    return tuple(None if t is None else t.to(device) for t in tensors)


def random_batch(gen: torch.Generator, num_reqs: int, max_q: int, *, max_prefix: int = 40,
                 allow_empty: bool = True):
    """Random query lengths (some 0 if allowed) and prefix lengths.

    Returns (query_start_loc int32 [num_reqs+1], positions int64 [num_tokens],
    seq_lens int32 [num_reqs], num_tokens).
    """
    lo = 0 if allow_empty else 1
    q = torch.randint(lo, max_q + 1, (num_reqs,), generator=gen)
    prefix = torch.randint(0, max_prefix + 1, (num_reqs,), generator=gen)
    qsl = torch.zeros(num_reqs + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0).to(torch.int32)
    num_tokens = int(qsl[-1])
    pos = torch.cat([torch.arange(int(p), int(p) + int(n)) for p, n in zip(prefix, q)]
                    + [torch.zeros(0, dtype=torch.int64)]).to(torch.int64)
    seq_lens = (prefix + q).to(torch.int32)
    return qsl, pos, seq_lens, num_tokens


def random_table(gen: torch.Generator, rows: int, width: int, num_blocks: int = 1000):
    """int32 block table with distinct-ish random ids in [1, num_blocks)."""
    return torch.randint(1, num_blocks, (rows, width), generator=gen, dtype=torch.int32)
