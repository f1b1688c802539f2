"""The gate/up projection with SiLU in its epilogue: kernel vs torch twin (one and several
inner-dimension splits, partial row and column tiles, bias), the split path's counters left at
zero and its result deterministic, the twin against F.linear + the activation's twin, the
custom op (opcheck, fake shapes), where it applies, the typed errors."""

import pytest
import torch
import torch.nn.functional as F

from pagedkv.errors import ConfigError
from pagedkv.kernels import gate_up_silu as mod
from pagedkv.kernels.activation import silu_and_mul_partials_ref
from pagedkv.kernels.gate_up_silu import (
    GateUpConfig,
    default_splits,
    fused_gate_up_applies,
    fused_gate_up_silu,
    gate_up_silu_op,
    gate_up_silu_ref,
)
from pagedkv.kernels.paired_splitk import counters

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2**-9, atol=4e-3),
       torch.bfloat16: dict(rtol=2**-7, atol=3e-2)}
SMALL = dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


def _case(gen, M, I, K, dtype, bias):
    x = torch.randn(M, K, generator=gen).to(dtype)
    w = (torch.randn(2 * I, K, generator=gen) / K ** 0.5).to(dtype)
    b = (torch.randn(2 * I, generator=gen) * 0.5).to(dtype) if bias else None
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("M", [1, 5, 21])
@pytest.mark.parametrize("I,K,bias", [(32, 64, False), (40, 40, True), (16, 48, True)],
                         ids=["I32K64", "I40K40b", "I16K48b"])
def test_random_matches_reference(kernel_device, dtype, splits, M, I, K, bias):
    gen = torch.Generator().manual_seed(M * 100 + I + K + splits)
    x, w, b = _case(gen, M, I, K, dtype, bias)
    want = gate_up_silu_ref(x, w, b)
    d = [None if t is None else t.to(kernel_device) for t in (x, w, b)]
    got = fused_gate_up_silu(*d, config=GateUpConfig(**SMALL, splits=splits))
    assert got.shape == (M, I) and got.dtype == dtype
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[dtype])


def test_split_counters_reset_and_deterministic(kernel_device):
    gen = torch.Generator().manual_seed(2)
    x, w, b = (t.to(kernel_device) for t in _case(gen, 20, 48, 64, torch.float32, True))
    cfg = GateUpConfig(**SMALL, splits=4)
    a, c = fused_gate_up_silu(x, w, b, cfg), fused_gate_up_silu(x, w, b, cfg)
    assert torch.equal(a, c)
    assert int(counters(x.device, 0).abs().sum()) == 0


def test_reference_is_the_product_then_the_activation():
    """The twin equals F.linear in float32 then the activation's float32 twin, rounded once."""
    gen = torch.Generator().manual_seed(4)
    x, w, b = _case(gen, 6, 24, 40, torch.float16, True)
    want = silu_and_mul_partials_ref(F.linear(x.float(), w.float(), b.float())[None], x.dtype)
    assert torch.equal(gate_up_silu_ref(x, w, b), want)


def test_default_splits_and_launch(kernel_device):
    assert [default_splits(m) for m in (1, 16, 17, 32, 33, 256)] == [4, 4, 2, 2, 1, 1]
    gen = torch.Generator().manual_seed(6)
    x, w, b = _case(gen, 3, 32, 64, torch.float32, False)
    got = fused_gate_up_silu(x.to(kernel_device), w.to(kernel_device))  # default config
    torch.testing.assert_close(got.cpu(), gate_up_silu_ref(x, w), **TOL[torch.float32])


def test_empty_and_zero_inner_dimension(kernel_device):
    w = torch.randn(8, 4, device=kernel_device)
    assert fused_gate_up_silu(torch.randn(0, 4, device=kernel_device), w).shape == (0, 4)
    b = torch.randn(8, device=kernel_device)
    got = fused_gate_up_silu(torch.randn(3, 0, device=kernel_device),
                             torch.randn(8, 0, device=kernel_device), b)
    gate, up = b.cpu().chunk(2)
    torch.testing.assert_close(got.cpu(), (F.silu(gate) * up).expand(3, 4))


def test_custom_op(kernel_device):
    gen = torch.Generator().manual_seed(8)
    x, w, b = (t.to(kernel_device) for t in _case(gen, 4, 16, 32, torch.float32, True))
    torch.library.opcheck(gate_up_silu_op, (x, w, b))
    torch.library.opcheck(gate_up_silu_op, (x, w, None))
    torch.testing.assert_close(torch.ops.pagedkv.gate_up_silu(x, w, b).cpu(),
                               gate_up_silu_ref(x.cpu(), w.cpu(), b.cpu()), **TOL[torch.float32])


def test_applies(monkeypatch, kernel_device):
    x = torch.randn(4, 8, device=kernel_device)
    w = torch.randn(6, 8, device=kernel_device)
    monkeypatch.setattr(mod, "FUSED_GATE_UP_ENABLED", False)
    assert not fused_gate_up_applies(x, w)
    monkeypatch.setattr(mod, "FUSED_GATE_UP_ENABLED", True)
    runs = mod.use_triton(mod._gate_up_silu_kernel, x)
    assert fused_gate_up_applies(x, w) is runs
    big = torch.randn(mod.FUSED_GATE_UP_MAX_ROWS + 1, 8, device=kernel_device)
    assert not fused_gate_up_applies(big, w)
    assert not fused_gate_up_applies(x.to(torch.float64), w.to(torch.float64))


BAD = {
    "rank": (lambda a: a.update(x=a["x"][None]), "need x"),
    "inner": (lambda a: a.update(w=a["w"][:, :5].contiguous()), "need x"),
    "odd_rows": (lambda a: a.update(w=a["w"][:5]), "need x"),
    "dtype": (lambda a: a.update(w=a["w"].half()), "must share"),
    "int": (lambda a: a.update(x=a["x"].int(), w=a["w"].int()), "must share"),
    "bias_shape": (lambda a: a.update(bias=a["bias"][:3]), "bias must be"),
    "bias_dtype": (lambda a: a.update(bias=a["bias"].double()), "bias must be"),
    "stride": (lambda a: a.update(x=torch.randn(8, 4).t()), "contiguous"),
    "not_tensor": (lambda a: a.update(w=[[1.0]]), "must be a tensor"),
}


@pytest.mark.parametrize("fn", [fused_gate_up_silu, gate_up_silu_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("rule", list(BAD))
def test_validation_errors(fn, rule):
    kwargs = dict(x=torch.randn(4, 8), w=torch.randn(6, 8), bias=torch.randn(6))
    mutate, pattern = BAD[rule]
    mutate(kwargs)
    with pytest.raises(ConfigError, match=pattern):
        fn(**kwargs)


def test_config_checks():
    with pytest.raises(ConfigError, match=">= 16"):
        GateUpConfig(block_n=8)
    with pytest.raises(ConfigError, match="splits"):
        GateUpConfig(splits=-1)


@pytest.mark.gpu
@pytest.mark.parametrize("ln", [False, True], ids=["normed", "ln"])
@pytest.mark.parametrize("M", [1, 8, 33, 64, 128, 256])
def test_gpu_qwen3_shape_bf16(M, ln):
    gen = torch.Generator().manual_seed(M)
    x, w, _ = _case(gen, M, 3072, 1024, torch.bfloat16, False)
    lw = (torch.rand(1024, generator=gen) + 0.5).to(torch.bfloat16) if ln else None
    want = gate_up_silu_ref(x, w, None, lw, 1e-6)
    got = fused_gate_up_silu(x.cuda(), w.cuda(), None, None, None if lw is None else lw.cuda(),
                             1e-6)
    torch.testing.assert_close(got.cpu().float(), want.float(), **TOL[torch.bfloat16])
    assert int(counters(x.cuda().device, 0).abs().sum()) == 0
