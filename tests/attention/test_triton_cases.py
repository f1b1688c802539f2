"""Random paged-attention cases for the Triton kernel tests (imported by test_triton_*.py),
plus checks of the case builder itself.

A case: requests ``(context_len, query_len)`` scattered over shuffled physical blocks; every
slot nobody may read (the null block 0, spare blocks, block tails, table columns past a
request's blocks, which point at the null block) holds NaN; the context is in the cache
already, the step's new K/V are returned for the backend to write (or written too, for the
kernel-only tests, ``write_new=True``).
"""

from __future__ import annotations

import math
import random

import torch

from pagedkv.attention import allocate_kv_caches, build_attention_metadata, paged_attention_ref
from pagedkv.kernels.reshape_and_cache import reshape_and_cache_ref


def make_case(reqs, *, block_size, num_heads=4, num_kv_heads=2, head_dim=16, seed=0,
              dtype=torch.float32, device="cpu", pad_tokens=0, padded_reqs=0,
              write_new=False, spare_blocks=3, sliding_window=None):
    """``sliding_window`` W: table entries of blocks wholly before the request's first
    query's window (positions ``< context - W + 1``) are the null block, as the
    sliding-window manager leaves them; the case keeps the full table as ``full_table``."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [math.ceil((c + q) / block_size) for c, q in reqs]
    num_blocks = 1 + sum(need) + spare_blocks
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    width = max(need + [1]) + 2
    table = torch.zeros(len(reqs) + padded_reqs, width, dtype=torch.int32)
    for r, nb in enumerate(need):
        for j in range(nb):
            table[r, j] = free.pop()
    (cache,) = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device, fill=float("nan"))
    qs, ks, vs, slots = [], [], [], []
    for r, (c, ql) in enumerate(reqs):
        L = c + ql
        k = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(L, num_kv_heads, head_dim, generator=gen).to(dtype)
        qs.append(torch.randn(ql, num_heads, head_dim, generator=gen).to(dtype))
        pos = torch.arange(L)
        s = table[r, pos // block_size].long() * block_size + pos % block_size
        upto = L if write_new else c
        reshape_and_cache_ref(k[:upto].to(device), v[:upto].to(device), cache[0], cache[1],
                              s[:upto].to(device))
        ks.append(k[c:])
        vs.append(v[c:])
        slots.append(s[c:])
    extra = lambda h: torch.randn(pad_tokens, h, head_dim, generator=gen).to(dtype)  # noqa: E731
    q = torch.cat(qs + [extra(num_heads)])
    k_new = torch.cat(ks + [extra(num_kv_heads)])
    v_new = torch.cat(vs + [extra(num_kv_heads)])
    slot_mapping = torch.cat(slots + [torch.full((pad_tokens,), -1, dtype=torch.int64)])
    query_lens = [ql for _, ql in reqs] + [0] * padded_reqs
    seq_lens = [c + ql for c, ql in reqs] + [0] * padded_reqs
    full_table = table.clone()
    if sliding_window:
        for r, (c, _) in enumerate(reqs):
            first = max(0, c - sliding_window + 1)
            table[r, : first // block_size] = 0  # wholly outside every query's window
    meta = build_attention_metadata(query_lens, seq_lens, table, slot_mapping, device=device)
    return dict(q=q.to(device), k=k_new.to(device), v=v_new.to(device), cache=cache,
                meta=meta, reqs=list(reqs), scale=head_dim ** -0.5, device=device,
                full_table=full_table)


def reference(case) -> torch.Tensor:
    """``paged_attention_ref`` in float32 (on the case's device) over a cache holding every
    position; returned on the CPU."""
    meta = case["meta"]
    ref = paged_attention_ref(case["q"].float(), case["cache"].float(), meta, case["scale"])
    return ref.cpu()


def rows_of(case, pred) -> list[int]:
    """Query rows of the requests whose query length satisfies ``pred``."""
    out, start = [], 0
    for _, ql in case["reqs"]:
        if pred(ql):
            out.extend(range(start, start + ql))
        start += ql
    return out


def poisoned_out(case) -> torch.Tensor:
    return torch.full_like(case["q"], float("nan"))


def capture_graph(call) -> torch.cuda.CUDAGraph:
    """``call`` run once on a side stream (kernels compiled, workspaces allocated), then
    captured into a CUDA graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    return graph


def set_lengths(case, lens) -> None:
    """Writes new sequence lengths in place (device and host copies), as a graph replay
    sees them."""
    m = case["meta"]
    m.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    m.seq_lens_cpu.copy_(torch.tensor(lens, dtype=torch.int32))


def assert_rows_close(out, ref, rows, atol, rtol=None):
    idx = torch.tensor(rows, dtype=torch.int64)
    got = out.float().cpu()[idx]
    want = ref.float()[idx]
    assert not torch.isnan(got).any(), "a served row was not written"
    torch.testing.assert_close(got, want, atol=atol, rtol=atol if rtol is None else rtol)


def assert_rows_untouched(out, rows):
    if rows:
        idx = torch.tensor(rows, dtype=torch.int64)
        assert torch.isnan(out.float().cpu()[idx]).all(), "a row of another request was written"


# ---- the builder itself


def test_case_poisons_everything_unowned():
    case = make_case([(5, 2), (0, 3)], block_size=3, write_new=True)
    cache, table = case["cache"], case["meta"].block_table_tensor
    assert torch.isnan(cache[:, 0]).all(), "the null block must stay poisoned"
    owned = torch.zeros(cache.shape[1], cache.shape[2], dtype=torch.bool)
    for r, (c, ql) in enumerate(case["reqs"]):
        for p in range(c + ql):
            owned[int(table[r, p // 3]), p % 3] = True
    assert not torch.isnan(cache[:, owned]).any()
    assert torch.isnan(cache[:, ~owned]).all()
    assert int(table[0, 3]) == 0 and int(table[1, 1]) == 0  # columns past the blocks: null


def test_reference_is_finite_on_served_rows():
    case = make_case([(4, 1), (0, 5), (7, 3)], block_size=2, write_new=True, pad_tokens=2,
                     padded_reqs=1)
    ref = reference(case)
    assert not torch.isnan(ref).any()
    assert torch.all(ref[9:] == 0)
