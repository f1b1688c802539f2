"""Reference paged attention and KV writer against dense causal attention.

Each case builds requests with a context already in the cache (chunked prefill / decode) and
new tokens (prefill / chunk / decode) in one mixed batch, scatters them over shuffled physical
blocks, poisons every slot nobody may read (null block, unused blocks, block tails) with NaN,
and compares with dense attention in float64.
"""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.attention import (
    TorchRefBackend,
    allocate_kv_caches,
    build_attention_metadata,
    paged_attention_ref,
    write_kv,
)
from pagedkv.errors import ConfigError, InvariantError


def dense_attention(q, k, v, scale):
    """q [Lq, H, D] at the last Lq positions of k/v [L, Hkv, D]; float64 causal GQA."""
    lq, h, d = q.shape
    L, hkv, _ = k.shape
    g = h // hkv
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    qpos = torch.arange(L - lq, L)[:, None]
    kpos = torch.arange(L)[None, :]
    s = s.masked_fill(kpos > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), vv)


def make_case(reqs, *, block_size, num_heads=4, num_kv_heads=2, head_dim=8, seed=0,
              dtype=torch.float32, pad_tokens=0, padded_reqs=0):
    """reqs: list of (context_len, query_len). Returns everything a test needs."""
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [math.ceil((c + q) / block_size) for c, q in reqs]
    num_blocks = sum(blocks_needed) + 4  # + null block + spare (poisoned, never used)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    width = max(blocks_needed + [1]) + 1
    table = torch.zeros(len(reqs) + padded_reqs, width, dtype=torch.int32)
    for r, n in enumerate(blocks_needed):
        for j in range(n):
            table[r, j] = free.pop()
    (cache,) = allocate_kv_caches(1, num_blocks, block_size, num_kv_heads, head_dim,
                                  dtype=dtype, fill=float("nan"))
    full_k, full_v, qs, slots, positions = [], [], [], [], []
    for r, (c, ql) in enumerate(reqs):
        L = c + ql
        k = torch.randn(L, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(L, num_kv_heads, head_dim, generator=g).to(dtype)
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(ql, num_heads, head_dim, generator=g).to(dtype))
        pos = torch.arange(L)
        s = table[r, pos // block_size].long() * block_size + pos % block_size
        # the context is in the cache already (written by earlier steps)
        write_kv(k[:c], v[:c], cache, s[:c])
        slots.append(s[c:])
        positions.append(pos[c:])
    q = torch.cat(qs) if qs else torch.zeros(0, num_heads, head_dim, dtype=dtype)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, reqs)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, reqs)])
    slot_mapping = torch.cat(slots + [torch.full((pad_tokens,), -1, dtype=torch.int64)])
    if pad_tokens:
        q = torch.cat([q, torch.randn(pad_tokens, num_heads, head_dim, generator=g).to(dtype)])
        k_new = torch.cat([k_new, torch.randn(pad_tokens, num_kv_heads, head_dim, generator=g).to(dtype)])
        v_new = torch.cat([v_new, torch.randn(pad_tokens, num_kv_heads, head_dim, generator=g).to(dtype)])
    query_lens = [ql for _, ql in reqs] + [0] * padded_reqs
    seq_lens = [c + ql for c, ql in reqs] + [0] * padded_reqs
    meta = build_attention_metadata(query_lens, seq_lens, table, slot_mapping)
    meta.num_actual_tokens = sum(ql for _, ql in reqs)
    return dict(q=q, k=k_new, v=v_new, cache=cache, meta=meta, full_k=full_k, full_v=full_v,
                table=table, reqs=reqs, scale=head_dim ** -0.5)


def check_case(case, atol=1e-5):
    out = TorchRefBackend().forward_with_metadata(0, case["q"], case["k"], case["v"], case["cache"], case["meta"], case["scale"])
    assert out.shape == case["q"].shape
    start = 0
    for r, (c, ql) in enumerate(case["reqs"]):
        ref = dense_attention(case["q"][start:start + ql], case["full_k"][r], case["full_v"][r], case["scale"])
        torch.testing.assert_close(out[start:start + ql].double(), ref, atol=atol, rtol=atol)
        start += ql
    assert torch.all(out[start:] == 0), "padding rows must be zero"
    assert not torch.isnan(out[:start]).any()
    return out


@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_mixed_batch_prefill_chunk_decode(block_size):
    # (context already cached, new tokens): prefill, chunked prefill, decodes, long context decode
    reqs = [(0, 7), (13, 5), (4, 1), (40, 1), (0, 1), (31, 33)]
    case = make_case(reqs, block_size=block_size)
    check_case(case)


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
def test_gqa_head_mapping(heads):
    case = make_case([(5, 3), (0, 9), (17, 1)], block_size=4, num_heads=heads[0], num_kv_heads=heads[1])
    check_case(case)


def test_kv_written_to_slots_and_nothing_else():
    case = make_case([(3, 4), (0, 6), (9, 1)], block_size=4, pad_tokens=3)
    cache_before = case["cache"].clone()
    check_case(case)
    cache = case["cache"]
    written = torch.zeros(cache.shape[1], cache.shape[2], dtype=torch.bool)
    for r, (c, ql) in enumerate(case["reqs"]):
        for p in range(c + ql):
            b, o = int(case["table"][r, p // 4]), p % 4
            written[b, o] = True
            assert torch.equal(cache[0, b, o], case["full_k"][r][p])
            assert torch.equal(cache[1, b, o], case["full_v"][r][p])
    # the null block and every slot not owned by a token stays poisoned (NaN)
    assert torch.isnan(cache[:, 0]).all()
    assert torch.isnan(cache[:, ~written]).all()
    assert torch.isnan(cache_before[:, ~written]).all()


def test_padded_requests_and_padding_tokens():
    case = make_case([(2, 3), (6, 1)], block_size=2, pad_tokens=5, padded_reqs=2)
    check_case(case)


def test_bfloat16_close_to_dense():
    case = make_case([(10, 6), (0, 12), (20, 1)], block_size=16, dtype=torch.bfloat16, head_dim=32)
    check_case(case, atol=2e-2)


def test_reference_reads_only_through_block_table():
    """Same logical content in different physical blocks gives identical outputs."""
    a = make_case([(9, 3), (4, 1)], block_size=2, seed=1)
    out_a = TorchRefBackend().forward_with_metadata(0, a["q"], a["k"], a["v"], a["cache"], a["meta"], a["scale"])
    assert not torch.isnan(out_a).any()
    # relocate every block of the cache to a new id via a permutation
    nb = a["cache"].shape[1]
    perm = torch.tensor([0] + random.Random(5).sample(range(1, nb), nb - 1))
    moved = torch.full_like(a["cache"], float("nan"))
    moved[:, perm] = a["cache"]
    table = perm[a["meta"].block_table_tensor.long()].to(torch.int32)
    meta = build_attention_metadata([3, 1], [12, 5], table, a["meta"].slot_mapping)
    out_b = paged_attention_ref(a["q"], moved, meta, a["scale"])
    assert torch.equal(out_a, out_b)


@settings(max_examples=25, deadline=None)
@given(
    reqs=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=5),
    block_size=st.sampled_from([1, 2, 5, 16]),
    seed=st.integers(0, 2**16),
)
def test_property_random_schedules(reqs, block_size, seed):
    check_case(make_case(reqs, block_size=block_size, seed=seed))


# ---- KV writer


@pytest.mark.parametrize("writer", ["ref", "kernel"])
def test_write_kv_skips_negative_and_out_of_range_slots(writer):
    """Token count from the slot mapping; slot -1 and slots past the cache are skipped."""
    (cache,) = allocate_kv_caches(1, 3, 2, 1, 2, dtype=torch.float32, fill=float("nan"))
    k = torch.arange(10, dtype=torch.float32).reshape(5, 1, 2)
    v = -k
    # 5 K rows (a padded tensor) but only 4 slot entries; -1 and 6 (= 3 blocks * 2) are skipped
    write_kv(k, v, cache, torch.tensor([2, -1, 5, 6]), writer=writer)
    assert torch.equal(cache[0, 1, 0], k[0]) and torch.equal(cache[1, 1, 0], v[0])
    assert torch.equal(cache[0, 2, 1], k[2]) and torch.equal(cache[1, 2, 1], v[2])
    assert torch.isnan(cache[:, 0]).all()
    assert torch.isnan(cache[:, 1, 1]).all() and torch.isnan(cache[:, 2, 0]).all()


def test_write_kv_errors():
    (cache,) = allocate_kv_caches(1, 2, 2, 1, 2, dtype=torch.float32)
    k = torch.zeros(2, 1, 2)
    with pytest.raises(ConfigError, match="slot_mapping has 3"):
        write_kv(k, k, cache, torch.tensor([0, 1, 2]))
    with pytest.raises(ConfigError, match="does not match key_cache"):
        write_kv(torch.zeros(2, 2, 2), torch.zeros(2, 2, 2), cache, torch.tensor([0, 1]))
    with pytest.raises(InvariantError, match="KV cache must be"):
        write_kv(k, k, cache[0], torch.tensor([0, 1]))
    with pytest.raises(ConfigError, match="unknown KV writer"):
        write_kv(k, k, cache, torch.tensor([0, 1]), writer="fast")
    with pytest.raises(ConfigError, match="unknown KV writer"):
        TorchRefBackend(writer="fast")


def test_backend_with_triton_writer():
    """The backend through the index layer's Triton writer (interpreted on CPU)."""
    case = make_case([(3, 4), (6, 1)], block_size=4, pad_tokens=2)
    out = TorchRefBackend(writer="kernel").forward_with_metadata(
        0, case["q"], case["k"], case["v"], case["cache"], case["meta"], case["scale"])
    ref_case = make_case([(3, 4), (6, 1)], block_size=4, pad_tokens=2)
    assert torch.equal(out, check_case(ref_case))
    assert torch.equal(case["cache"].nan_to_num(-7.0), ref_case["cache"].nan_to_num(-7.0))


def test_table_too_narrow_is_an_error():
    case = make_case([(0, 5)], block_size=2)
    meta = case["meta"]
    meta.block_table_tensor = meta.block_table_tensor[:, :1]
    with pytest.raises(InvariantError, match="more blocks than the table"):
        paged_attention_ref(case["q"], case["cache"], meta, case["scale"])
