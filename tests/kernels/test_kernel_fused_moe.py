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


# ---- GPT-OSS's experts: biases, gate/up rows interleaved, the clamped SwiGLU


def test_clamped_swiglu_hand_computed():
    act = fm.GatedActivation("swiglu_clamp", alpha=1.0, limit=1.0)
    gate, up = torch.tensor([2.0, 0.0, -3.0]), torch.tensor([3.0, -0.5, -4.0])
    # g = min(gate, 1) = (1, 0, -3); u = clamp(up, -1, 1) = (1, -0.5, -1)
    want = torch.tensor([2.0 / (1 + torch.e ** -1.0), 0.0, 0.0 * -3.0 / (1 + torch.e ** 3.0)])
    torch.testing.assert_close(act(gate, up), want)
    torch.testing.assert_close(fm.SILU(gate, up), torch.nn.functional.silu(gate) * up)
    with pytest.raises(ConfigError, match="activation"):
        fm.GatedActivation("gelu")


def _gpt_oss_inputs(seed, t, e, k, h, inter, dtype, device="cpu", scale=0.6):
    """Inputs with biases, large enough products that the clamp (limit 1.5) bites."""
    x, w13, w2, w, ids = _inputs(seed, t, e, k, h, inter, dtype, device, scale=scale)
    g = torch.Generator().manual_seed(seed + 1)
    b13 = (torch.randn(e, 2 * inter, generator=g) * 0.5).to(dtype).to(device)
    b2 = (torch.randn(e, h, generator=g) * 0.5).to(dtype).to(device)
    return x, w13, w2, w, ids, b13, b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("t,e,k,h,inter", CASES[:4])
def test_kernel_gpt_oss_experts_match_reference(kernel_device, poisoned_scratch, t, e, k, h,
                                                inter, dtype, interleaved):
    x, w13, w2, w, ids, b13, b2 = _gpt_oss_inputs(t + 7 * e, t, e, k, h, inter, dtype,
                                                  kernel_device)
    act = fm.GatedActivation("swiglu_clamp", alpha=1.702, limit=1.5)
    kw = dict(b13=b13, b2=b2, activation=act, gate_up_interleaved=interleaved)
    got = fused_moe(x, w13, w2, w, ids, **kw)
    ref = fused_moe_ref(x, w13, w2, w, ids, **kw)
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    else:  # fp16: the kernel keeps float32 inside; against the float32 twin
        f = lambda a: None if a is None else a.float()  # noqa: E731
        want = fused_moe_ref(f(x), f(w13), f(w2), f(w), ids, **dict(kw, b13=f(b13), b2=f(b2)))
        torch.testing.assert_close(got.float(), want, atol=8e-3, rtol=8e-3)
    # the options matter: the clamp bites, the biases and the row order change the result
    pre = torch.einsum("th,eih->tei", x.float(), w13.float()) + b13.float()
    assert (pre > 1.5).any() and (pre < -1.5).any()
    for other in (dict(kw, b2=None), dict(kw, b13=None), dict(kw, activation=fm.SILU),
                  dict(kw, gate_up_interleaved=not interleaved)):
        assert (fused_moe_ref(x, w13, w2, w, ids, **other) - ref).abs().max() > 1e-2


def test_interleaved_rows_equal_halves(kernel_device, poisoned_scratch):
    """w13 with alternating gate/up rows gives what the same weights in halves give."""
    x, w13, w2, w, ids, b13, b2 = _gpt_oss_inputs(4, 9, 4, 2, 32, 24, torch.float32,
                                                  kernel_device)
    inter = 24
    halves = torch.cat([w13[:, 0::2], w13[:, 1::2]], dim=1)
    b_halves = torch.cat([b13[:, 0::2], b13[:, 1::2]], dim=1)
    act = fm.GatedActivation("swiglu_clamp", limit=1.5)
    a = fused_moe(x, w13, w2, w, ids, b13=b13, b2=b2, activation=act, gate_up_interleaved=True)
    b = fused_moe(x, halves, w2, w, ids, b13=b_halves, b2=b2, activation=act)
    assert halves.shape[1] == 2 * inter
    torch.testing.assert_close(a, b, atol=2e-5, rtol=2e-5)


def test_bias_errors(kernel_device):
    x, w13, w2, w, ids, b13, b2 = _gpt_oss_inputs(1, 4, 4, 2, 32, 16, torch.float32,
                                                  kernel_device)
    for bad in (dict(b13=b13[:, 1:]), dict(b2=b2.t()), dict(b2=b2[:, :5]),
                dict(b13=b13.to(torch.int32))):
        with pytest.raises(ConfigError, match="b13|b2"):
            fused_moe(x, w13, w2, w, ids, **bad)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64, 2048])
def test_gpu_kernel_bf16_gpt_oss_20b_shape(poisoned_scratch, t):
    """GPT-OSS-20B's experts (E 32, k 4, H = I = 2880, biases, interleaved gate/up, clamped
    SwiGLU alpha 1.702 limit 7) in bf16 against the float32 twin, no worse than the bf16
    twin (1.5x its error, or 2e-3)."""
    e, k, h, inter = 32, 4, 2880, 2880
    x, w13, w2, w, ids, b13, b2 = _gpt_oss_inputs(t, t, e, k, h, inter, torch.bfloat16, "cuda",
                                                  scale=4 * h ** -0.5)
    w = w.to(torch.bfloat16)
    kw = dict(activation=fm.GatedActivation("swiglu_clamp"), gate_up_interleaved=True)
    got = fused_moe(x, w13, w2, w, ids, b13=b13, b2=b2, **kw)
    want = fused_moe_ref(x.float(), w13.float(), w2.float(), w.float(), ids, b13=b13.float(),
                         b2=b2.float(), **kw)
    ref = fused_moe_ref(x, w13, w2, w, ids, b13=b13, b2=b2, **kw)
    err = (got.float() - want).norm() / want.norm()
    ref_err = (ref.float() - want).norm() / want.norm()
    assert err <= max(1.5 * ref_err, 2e-3), (float(err), float(ref_err))
