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


def varlen_state_batch(gen: torch.Generator, lens, slots: int, *, pad=(), init=None):
    """A varlen batch of state rows: ``(query_start_loc int32 [N+1], state_indices int32 [N],
    has_initial_state bool [N])`` for sequences of ``lens`` tokens; distinct random slots in
    ``[0, slots)``, -1 for the rows in ``pad``; ``init`` random unless given."""
    n = len(lens)
    qsl = torch.tensor([0] + torch.tensor(list(lens), dtype=torch.int64).cumsum(0).tolist(),
                       dtype=torch.int32)
    perm = torch.randperm(slots, generator=gen)[:n].tolist()
    idx = torch.tensor([-1 if i in pad else perm[i] for i in range(n)], dtype=torch.int32)
    if init is None:
        init = torch.rand(n, generator=gen) < 0.5
    if not isinstance(init, torch.Tensor):
        init = torch.tensor(init, dtype=torch.bool)
    return qsl, idx, init


def prefill_pieces(qsl: torch.Tensor, lens, cuts):
    """A chunked prefill of the sequences of ``lens`` tokens (packed at ``qsl``) cut at the
    token offsets ``cuts``: per piece ``(index, token rows [M] int64, sub query_start_loc
    int32 [N+1])`` on ``qsl``'s device (a sequence shorter than a cut has 0 tokens there)."""
    q = qsl.tolist()
    bounds = [0, *cuts, max(lens)]
    for piece, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        rows, sub_lens = [], []
        for b, n in enumerate(lens):
            a, e = min(lo, n), min(hi, n)
            rows.append(torch.arange(q[b] + a, q[b] + e, device=qsl.device))
            sub_lens.append(e - a)
        sub_qsl = torch.tensor([0] + torch.tensor(sub_lens).cumsum(0).tolist(),
                               dtype=torch.int32, device=qsl.device)
        yield piece, torch.cat(rows), sub_qsl


def check_state_rows(state_before, state_after, out, qsl, idx):
    """After a state kernel on NaN-poisoned outputs: slots no row names are unchanged, the
    tokens of PAD_SLOT_ID rows still NaN, every other row's tokens written (no NaN)."""
    used = {i for i in idx.tolist() if i >= 0}
    for s in range(state_before.shape[0]):
        if s not in used:
            assert torch.equal(state_after[s], state_before[s]), f"slot {s} was touched"
    q = qsl.tolist()
    for b, i in enumerate(idx.tolist()):
        rows = out[q[b]:q[b + 1]]
        if i < 0:
            assert torch.isnan(rows).all(), f"padded row {b}'s outputs were written"
        else:
            assert not torch.isnan(rows).any(), f"row {b}'s outputs are not all written"


def rel_close(got, want, tol: float, what: str) -> None:
    """The largest difference within ``tol`` of the largest ``|want|`` (GPU bf16 checks)."""
    scale = want.float().abs().max().clamp_min(1e-6)
    err = (got.float() - want.float()).abs().max() / scale
    assert err < tol, f"{what}: max error {float(err):.3g} of the largest value"
