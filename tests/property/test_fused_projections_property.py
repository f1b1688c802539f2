"""Property tests of the fused decode kernels against their torch twins over random shapes,
launch tiles and split counts (Triton interpreter on CPU, natively on a GPU): the gate/up
projection with SiLU in its epilogue (``pagedkv.kernels.gate_up_silu``) and the QKV projection
with q/k norms, RoPE and the paged KV write (``pagedkv.kernels.qkv_rope_cache``), each with and
without the input RMSNorm applied on the fly, and the split-K projection with its residual add
(``splitk_gemm.splitk_residual``)."""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.kernels.gate_up_silu import GateUpConfig, fused_gate_up_silu, gate_up_silu_ref
from pagedkv.kernels.paired_splitk import counters
from pagedkv.kernels.qkv_rope_cache import QKVRopeConfig, qkv_rope_cache, qkv_rope_cache_ref
from pagedkv.kernels.splitk_gemm import SplitKConfig, splitk_residual, splitk_residual_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"
POW2 = st.sampled_from([16, 32])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 40), inter=st.integers(1, 48), k=st.integers(1, 80),
       bias=st.booleans(), ln=st.booleans(), splits=st.integers(1, 4), bm=POW2, bn=POW2,
       bk=POW2, seed=st.integers(0, 2**16))
def test_gate_up_silu_matches_twin(m, inter, k, bias, ln, splits, bm, bn, bk, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(2 * inter, k, generator=gen) / math.sqrt(k)
    b = torch.randn(2 * inter, generator=gen) if bias else None
    lw = torch.rand(k, generator=gen) + 0.5 if ln else None
    cfg = GateUpConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=1, num_stages=1,
                       splits=splits)
    dev = [None if t is None else t.to(DEV) for t in (x, w, b, lw)]
    got = fused_gate_up_silu(*dev[:3], cfg, dev[3], 1e-5)
    torch.testing.assert_close(got.cpu(), gate_up_silu_ref(x, w, b, lw, 1e-5), rtol=1e-5,
                               atol=1e-5)
    assert int(counters(got.device, 0).abs().sum()) == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 36), group=st.sampled_from([1, 2, 4]), kv_heads=st.integers(1, 2),
       d=st.sampled_from([32, 64]), k=st.integers(1, 72), bias=st.booleans(),
       norm=st.booleans(), ln=st.booleans(), splits=st.integers(1, 4), bm=POW2, bk=POW2,
       block_size=st.sampled_from([1, 4, 16]), seed=st.integers(0, 2**16))
def test_qkv_rope_cache_matches_twin(m, group, kv_heads, d, k, bias, norm, ln, splits, bm, bk,
                                     block_size, seed):
    gen = torch.Generator().manual_seed(seed)
    heads = group * kv_heads
    n = (heads + 2 * kv_heads) * d
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    b = torch.randn(n, generator=gen) if bias else None
    qw = torch.rand(d, generator=gen) + 0.5 if norm else None
    kw = torch.rand(d, generator=gen) + 0.5 if norm else None
    lw = torch.rand(k, generator=gen) + 0.5 if ln else None
    ang = torch.rand(m, d // 2, generator=gen) * 6.3
    cos, sin = ang.cos(), ang.sin()
    blocks = -(-m // block_size) + 2
    cap = blocks * block_size
    # a random subset of rows gets distinct slots, the rest PAD; a random prefix has slots
    slots = torch.randperm(cap, generator=gen)[:m]
    slots[torch.rand(m, generator=gen) < 0.3] = -1
    slots = slots[: int(torch.randint(0, m + 1, (1,), generator=gen))]
    ref_kv = torch.full((2, blocks, block_size, kv_heads, d), float("nan"))
    got_kv = ref_kv.clone().to(DEV)
    args = (heads, kv_heads, d)
    want_q = qkv_rope_cache_ref(x, w, b, *args, qw, kw, 1e-6, cos, sin, slots, ref_kv[0],
                                ref_kv[1], ln_weight=lw, ln_eps=1e-5)
    dev = [None if t is None else t.to(DEV) for t in (x, w, b, qw, kw, cos, sin, slots, lw)]
    cfg = QKVRopeConfig(block_m=bm, block_k=bk, num_warps=1, num_stages=1, splits=splits)
    got_q = qkv_rope_cache(*dev[:3], *args, dev[3], dev[4], 1e-6, dev[5], dev[6], dev[7],
                           got_kv[0], got_kv[1], config=cfg, ln_weight=dev[8], ln_eps=1e-5)
    torch.testing.assert_close(got_q.cpu(), want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_kv.cpu(), ref_kv, rtol=1e-5, atol=1e-5, equal_nan=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 40), n=st.integers(1, 48), k=st.integers(1, 100), bias=st.booleans(),
       splits=st.integers(1, 5), bm=POW2, bn=POW2, bk=POW2, seed=st.integers(0, 2**16))
def test_splitk_residual_matches_twin(m, n, k, bias, splits, bm, bn, bk, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / math.sqrt(k)
    b = torch.randn(n, generator=gen) if bias else None
    h = torch.randn(m, n, generator=gen)
    cfg = SplitKConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=1, num_stages=1)
    dev = [None if t is None else t.to(DEV) for t in (x, w, b, h)]
    got = splitk_residual(*dev, splits, cfg)
    torch.testing.assert_close(got.cpu(), splitk_residual_ref(x, w, b, h, splits, cfg),
                               rtol=1e-5, atol=1e-5)
    assert int(counters(got.device, 0).abs().sum()) == 0
