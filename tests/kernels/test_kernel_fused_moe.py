"""The fused-MoE Triton kernels (``pagedkv.kernels.fused_moe.fused_moe``) against their torch
twin ``fused_moe_ref`` on random inputs, scratch buffers poisoned (CPU: the Triton interpreter,
fp32 / fp16; GPU: natively, bf16 at real model shapes and inside a CUDA graph); the device-side
alignment (``moe_align``) by its invariants."""

import pytest
import torch
from kernel_helpers import poison

import pagedkv.kernels.fused_moe as fm
from pagedkv.errors import ConfigError
from pagedkv.kernels.fused_moe import fused_moe, fused_moe_ref, moe_align, moe_block_config
from pagedkv.models.moe import route_topk


@pytest.fixture
def poisoned_scratch(monkeypatch):
    """The kernels' scratch buffers come back full of 0x5A bytes, never zeros."""
    monkeypatch.setattr(fm, "_empty", lambda shape, dtype, device: poison(shape, dtype, device))


def _inputs(seed, t, e, k, h, inter, dtype, device="cpu", weights_dtype=torch.float32, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * inter, h, generator=g) * scale
    w2 = torch.randn(e, h, inter, generator=g) * scale
    w, ids = route_topk(torch.randn(t, e, generator=g) * 2, k, True, weights_dtype)
    return tuple(a.to(device) for a in (x.to(dtype), w13.to(dtype), w2.to(dtype), w, ids))


CASES = [  # t, e, k, hidden, inter
    (1, 8, 2, 48, 40),
    (37, 6, 2, 64, 32),
    (20, 4, 3, 40, 24),
    (5, 16, 4, 64, 96),
    (70, 3, 1, 33, 17),  # one choice, sizes that fit no tile
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,e,k,h,inter", CASES)
def test_kernel_matches_reference(kernel_device, poisoned_scratch, t, e, k, h, inter, dtype):
    args = _inputs(t * 31 + e, t, e, k, h, inter, dtype, kernel_device)
    got = fused_moe(*args)
    ref = fused_moe_ref(*args)
    assert got.dtype == dtype and got.shape == (t, h)
    tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(got, ref, **tol)


def test_model_dtype_routing_weights_and_strided_input(kernel_device, poisoned_scratch):
    """Qwen3-MoE passes its weights in the model dtype; a strided token view."""
    x, w13, w2, w, ids = _inputs(3, 12, 8, 2, 64, 32, torch.float16, kernel_device)
    wide = torch.cat([x, x], dim=1)[:, 64:]  # row stride 128
    got = fused_moe(wide, w13, w2, w.half(), ids)
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w.half(), ids), atol=4e-3, rtol=4e-3)


def test_experts_without_tokens_are_not_read(kernel_device, poisoned_scratch):
    x, w13, w2, w, _ = _inputs(5, 9, 8, 2, 32, 32, torch.float32, kernel_device)
    ids = torch.tensor([[0, 2]] * 5 + [[2, 5]] * 4, device=kernel_device)
    for e in (1, 3, 4, 6, 7):
        w13[e] = float("nan")
        w2[e] = float("nan")
    got = fused_moe(x, w13, w2, w, ids)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, fused_moe_ref(x, w13, w2, w, ids), atol=2e-5, rtol=2e-5)


def test_empty_batch_and_errors(kernel_device):
    x, w13, w2, w, ids = _inputs(1, 4, 4, 2, 32, 16, torch.float32, kernel_device)
    assert fused_moe(x[:0], w13, w2, w[:0], ids[:0]).shape == (0, 32)
    with pytest.raises(ConfigError, match="w13 must be"):
        fused_moe(x, w13[:, 1:], w2, w, ids)
    with pytest.raises(ConfigError, match="share one dtype"):
        fused_moe(x, w13.half(), w2, w, ids)
    with pytest.raises(ConfigError, match="topk_ids must be"):
        fused_moe(x, w13, w2, w, ids.float())


@pytest.mark.parametrize("t,e,k,bm", [(1, 8, 2, 16), (37, 6, 2, 16), (300, 4, 3, 64), (10, 64, 8, 16)])
def test_align_invariants(t, e, k, bm):
    g = torch.Generator().manual_seed(t + e)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    pairs, block_expert = moe_align(ids, e, bm)
    n = t * k
    blocks = -(-n // bm) + min(e, n)
    assert pairs.shape == (blocks * bm,) and block_expert.shape == (blocks,)
    real = pairs[pairs < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
    assert torch.all(pairs[pairs >= n] == n)  # the rest is the sentinel
    flat = ids.reshape(-1)
    counts = torch.bincount(flat, minlength=e)
    pos = 0
    for expert in range(e):  # segments in expert order, stable, padded to bm
        c = int(counts[expert])
        seg = pairs[pos:pos + c]
        assert torch.all(flat[seg] == expert) and torch.all(seg[1:] > seg[:-1])
        padded = -(-c // bm) * bm
        assert torch.all(pairs[pos + c:pos + padded] == n)
        assert torch.all(block_expert[pos // bm:(pos + padded) // bm] == expert)
        pos += padded
    assert torch.all(block_expert[pos // bm:] == e)  # unused blocks


def test_block_config_is_host_only():
    assert moe_block_config(2, 128, 2048, 768, torch.device("cpu"))[0] == 16
    assert moe_block_config(8192 * 8, 128, 2048, 768, torch.device("cpu"))[0] == 64
    assert moe_block_config(100, 8, 64, 32, torch.device("cuda"))[1:3] == (64, 64)


# ---- natively on the GPU


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 7, 256, 2048])
@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "mixtral-8x7b-ish"])
def test_gpu_kernel_bf16_model_shapes(poisoned_scratch, t, shape):
    e, k, h, inter, wdt = {"qwen3-30b-a3b": (128, 8, 2048, 768, torch.bfloat16),
                           "mixtral-8x7b-ish": (8, 2, 4096, 3584, torch.float32)}[shape]
    x, w13, w2, w, ids = _inputs(t, t, e, k, h, inter, torch.bfloat16, "cuda",
                                 weights_dtype=wdt, scale=h ** -0.5)
    got = fused_moe(x, w13, w2, w, ids)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), w.float(), ids)  # fp32 reference
    ref = fused_moe_ref(x, w13, w2, w, ids)  # the bf16 twin
    err = (got.float() - want).norm() / want.norm()
    ref_err = (ref.float() - want).norm() / want.norm()
    assert err <= max(1.5 * ref_err, 2e-3), (float(err), float(ref_err))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gpu_kernel_matches_reference(poisoned_scratch, dtype):
    for t, e, k, h, inter in CASES:
        args = _inputs(t, t, e, k, h, inter, dtype, "cuda")
        tol = dict(atol=2e-5, rtol=2e-5) if dtype == torch.float32 else dict(atol=4e-3, rtol=4e-3)
        torch.testing.assert_close(fused_moe(*args), fused_moe_ref(*args), **tol)


@pytest.mark.gpu
def test_gpu_kernel_in_a_cuda_graph():
    """Captured once, replayed with other tokens and other routing: the graph's result equals
    eager execution (no host sync, no shape that depends on the routing)."""
    x, w13, w2, w, ids = _inputs(0, 24, 16, 4, 256, 128, torch.bfloat16, "cuda")
    fused_moe(x, w13, w2, w, ids)  # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, w, ids)
    for seed in (1, 2):
        x2, _, _, w_new, ids_new = _inputs(seed, 24, 16, 4, 256, 128, torch.bfloat16, "cuda")
        x.copy_(x2)
        w.copy_(w_new)
        ids.copy_(ids_new)
        graph.replay()
        torch.testing.assert_close(out, fused_moe(x, w13, w2, w, ids), atol=0, rtol=0)
