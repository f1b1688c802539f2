"""The fused QKV projection + q/k norm + RoPE + paged KV write: kernel vs torch twin on poisoned
outputs (one and several inner-dimension splits, partial row tiles, bias, GQA, PAD /
out-of-range slots, FP8 caches), the split path's counters left at zero and its result
deterministic, the twin against F.linear + the unfused kernel's twin, the typed errors."""

import math

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import poison, to
from test_kernel_qk_norm_rope_cache import (
    TOL,
    assert_refused_cleanly,
    _assert_fp8_cache_matches,
    _same_bits,
    _written,
)

from pagedkv.errors import ConfigError
from pagedkv.kernels import qkv_rope_cache as mod
from pagedkv.kernels.paired_splitk import counters
from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache_ref
from pagedkv.kernels.qkv_rope_cache import (
    QKVRopeConfig,
    default_splits,
    fused_applies,
    qkv_rope_cache,
    qkv_rope_cache_ref,
)

F8 = torch.float8_e4m3fn


def _case(gen, T, T_slots, H, Hkv, D, K, NB, BS, dtype, *, norm, bias):
    """Random inputs: x [T, K], weight / bias of the fused projection, cos / sin of real
    angles, slots with PAD, out-of-range and distinct valid entries (not block 0)."""
    n = (H + 2 * Hkv) * D
    x = (torch.randn(T, K, generator=gen)).to(dtype)
    w = (torch.randn(n, K, generator=gen) / math.sqrt(K)).to(dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to(dtype) if bias else None
    angles = torch.rand(T + 2, D // 2, generator=gen) * 2 * math.pi
    cos, sin = angles.cos(), angles.sin()
    qw = (torch.rand(D, generator=gen) + 0.5).to(dtype) if norm else None
    kw = (torch.rand(D, generator=gen) + 0.5).to(dtype) if norm else None
    cap = NB * BS
    slots = torch.full((T_slots,), -1, dtype=torch.int64)
    n_valid = min(T_slots, cap - BS)
    slots[:n_valid] = torch.randperm(cap - BS, generator=gen)[:n_valid] + BS
    slots = slots[torch.randperm(T_slots, generator=gen)]
    for i, v in enumerate([-1, cap, 2**40][: max(0, T_slots // 3)]):
        slots[(3 * i + 1) % T_slots] = v
    return x, w, b, qw, kw, cos, sin, slots


def _assert_written_close(kv, kv_ref, slots, NB, BS, tol):
    """Unmapped slots keep the poison on both sides; mapped ones agree to ``tol`` (V too: it is
    the projection itself here, float32 sums in another order, not a copy)."""
    cap = NB * BS
    written = list(_written(slots, cap).values())
    assert written
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[written] = False
    flat, flat_ref = kv.reshape(2, cap, -1), kv_ref.reshape(2, cap, -1)
    pois = poison((2, int(untouched.sum()), flat.shape[-1]), kv.dtype)
    assert _same_bits(flat[:, untouched], pois) and _same_bits(flat_ref[:, untouched], pois)
    torch.testing.assert_close(flat[:, written].float(), flat_ref[:, written].float(), **tol)


def _run_both(dev, args, H, Hkv, D, NB, BS, dtype, *, cache_dtype=None, scales=(1.0, 1.0),
              config=None, ln=None):
    x, w, b, qw, kw, cos, sin, slots = args
    T = x.shape[0]
    cdt = cache_dtype or dtype
    kv_ref, q_ref = poison((2, NB, BS, Hkv, D), cdt), poison((T, H, D), dtype)
    out = qkv_rope_cache_ref(x, w, b, H, Hkv, D, qw, kw, 1e-6, cos, sin, slots, kv_ref[0],
                             kv_ref[1], q_ref, k_scale=scales[0], v_scale=scales[1],
                             ln_weight=ln, ln_eps=1e-6)
    assert out is q_ref
    kv, q = poison((2, NB, BS, Hkv, D), cdt, dev), poison((T, H, D), dtype, dev)
    d = to(dev, *args, ln)
    out = qkv_rope_cache(*d[:3], H, Hkv, D, d[3], d[4], 1e-6, *d[5:8], kv[0], kv[1], q,
                         k_scale=scales[0], v_scale=scales[1], config=config,
                         ln_weight=d[8], ln_eps=1e-6)
    assert out is q
    return (q_ref, kv_ref), (q.cpu(), kv.cpu())


# (H, Hkv, D, K, block size, norm, bias): GQA groups 1/2/4, head dims 32/64, inner dims that
# are and are not a multiple of the 16-wide K step
CONFIGS = [
    (2, 2, 32, 64, 4, True, False),
    (4, 2, 32, 40, 16, False, True),
    (4, 1, 64, 48, 1, True, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("splits", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 5, 21])
@pytest.mark.parametrize("H,Hkv,D,K,BS,norm,bias", CONFIGS,
                         ids=[f"H{c[0]}kv{c[1]}D{c[2]}K{c[3]}bs{c[4]}{'n' if c[5] else ''}"
                              f"{'b' if c[6] else ''}" for c in CONFIGS])
def test_random_matches_reference(kernel_device, dtype, splits, T, H, Hkv, D, K, BS, norm,
                                  bias):
    gen = torch.Generator().manual_seed(H * 1000 + D * 10 + K + T + splits)
    T_slots = max(1, T - 2)
    NB = max(3, -(-(T_slots + 2) // BS) + 2)
    args = _case(gen, T, T_slots, H, Hkv, D, K, NB, BS, dtype, norm=norm, bias=bias)
    cfg = QKVRopeConfig(block_m=16, block_k=16, num_warps=1, num_stages=1, splits=splits)
    (q_ref, kv_ref), (q, kv) = _run_both(kernel_device, args, H, Hkv, D, NB, BS, dtype,
                                         config=cfg)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    _assert_written_close(kv, kv_ref, args[-1], NB, BS, TOL[dtype])


def test_split_counters_reset_and_deterministic(kernel_device):
    """Several splits and two row tiles: the counters are zero after each launch and two
    launches give the same bits (partials summed in split order by whichever arrives last)."""
    H, Hkv, D, K, BS, NB, dtype = 2, 1, 32, 64, 4, 6, torch.float32
    gen = torch.Generator().manual_seed(3)
    args = _case(gen, 20, 20, H, Hkv, D, K, NB, BS, dtype, norm=True, bias=True)
    cfg = QKVRopeConfig(block_m=16, block_k=16, num_warps=1, num_stages=1, splits=4)
    got = [_run_both(kernel_device, args, H, Hkv, D, NB, BS, dtype, config=cfg)[1]
           for _ in range(2)]
    assert _same_bits(got[0][0], got[1][0]) and _same_bits(got[0][1], got[1][1])
    cnt = counters(torch.empty(0, device=kernel_device).device, 0)  # this stream's buffer
    assert int(cnt.abs().sum()) == 0


def test_default_launch_uses_splits_by_rows(kernel_device):
    """The default config on a few rows takes the split path (4 splits at T <= 16)."""
    assert default_splits(1) == 4 and default_splits(16) == 4 and default_splits(17) == 2
    assert default_splits(64) == 2 and default_splits(65) == 1
    H, Hkv, D, K, BS, NB, dtype = 4, 2, 32, 64, 4, 4, torch.float32
    gen = torch.Generator().manual_seed(5)
    args = _case(gen, 3, 3, H, Hkv, D, K, NB, BS, dtype, norm=False, bias=False)
    (q_ref, kv_ref), (q, kv) = _run_both(kernel_device, args, H, Hkv, D, NB, BS, dtype)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    _assert_written_close(kv, kv_ref, args[-1], NB, BS, TOL[dtype])


@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.3, 1.7)], ids=["s1", "s03_17"])
def test_fp8_cache_matches_reference(kernel_device, scales):
    H, Hkv, D, K, BS, dtype = 4, 2, 32, 48, 4, torch.float32
    gen = torch.Generator().manual_seed(int(scales[0] * 10))
    T, T_slots = 9, 7
    NB = 6
    args = _case(gen, T, T_slots, H, Hkv, D, K, NB, BS, dtype, norm=True, bias=False)
    cfg = QKVRopeConfig(block_m=16, block_k=16, num_warps=1, num_stages=1, splits=2)
    (q_ref, kv_ref), (q, kv) = _run_both(kernel_device, args, H, Hkv, D, NB, BS, dtype,
                                         cache_dtype=F8, scales=scales, config=cfg)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    # V is a float32 sum here (not a copy): the K rule for both halves of the cache
    _assert_fp8_cache_matches(kv, kv_ref, args[-1], NB, BS, v_exact=False)


@pytest.mark.parametrize("bias", [True, False])
def test_reference_is_the_projection_then_the_unfused_twin(bias):
    """The twin equals F.linear (float32) followed by ``qk_norm_rope_cache_ref``."""
    H, Hkv, D, K, BS, NB = 4, 2, 32, 40, 4, 5
    gen = torch.Generator().manual_seed(9)
    x, w, b, qw, kw, cos, sin, slots = _case(gen, 6, 6, H, Hkv, D, K, NB, BS, torch.float32,
                                             norm=True, bias=bias)
    kv_a, kv_b = poison((2, NB, BS, Hkv, D), torch.float32), poison((2, NB, BS, Hkv, D),
                                                                   torch.float32)
    qa = qkv_rope_cache_ref(x, w, b, H, Hkv, D, qw, kw, 1e-6, cos, sin, slots, kv_a[0], kv_a[1])
    qkv = F.linear(x, w, b)
    qb = qk_norm_rope_cache_ref(qkv, H, Hkv, D, qw, kw, 1e-6, cos, sin, slots, kv_b[0], kv_b[1])
    assert _same_bits(qa, qb) and _same_bits(kv_a, kv_b)
    assert len(_written(slots, NB * BS)) > 0


def test_fused_applies():
    assert [d for d in range(2, 300, 2) if fused_applies(d)] == [32, 64, 128, 256]


def test_unserved_head_dim_is_a_config_error(kernel_device):
    H, Hkv, D, K, BS, NB = 2, 1, 24, 16, 4, 3
    gen = torch.Generator().manual_seed(1)
    args = _case(gen, 2, 2, H, Hkv, D, K, NB, BS, torch.float32, norm=False, bias=False)
    kv = poison((2, NB, BS, Hkv, D), torch.float32, kernel_device)
    d = to(kernel_device, *args)
    if kernel_device == "cpu" and not mod.use_triton(mod._qkv_rope_cache_kernel, d[0]):
        pytest.skip("the torch twin serves every head size")
    with pytest.raises(ConfigError, match="head_dim 24 is not served"):
        qkv_rope_cache(*d[:3], H, Hkv, D, d[3], d[4], 1e-6, *d[5:], kv[0], kv[1])


def _good_kwargs(H=4, Hkv=2, D=32, T=5, K=16, NB=3, BS=4):
    kv = poison((2, NB, BS, Hkv, D), torch.float32)
    n = (H + 2 * Hkv) * D
    return dict(
        x=torch.randn(T, K), weight=torch.randn(n, K), bias=torch.randn(n), num_heads=H,
        num_kv_heads=Hkv, head_dim=D, q_norm_weight=torch.ones(D), k_norm_weight=torch.ones(D),
        eps=1e-6, cos=torch.ones(T, D // 2), sin=torch.zeros(T, D // 2),
        slot_mapping=torch.arange(T, dtype=torch.int64), key_cache=kv[0], value_cache=kv[1],
    )


BAD = {
    "x_rank": (lambda a: a.update(x=a["x"].reshape(5, 4, 4)), "x must be 2-D"),
    "x_dtype": (lambda a: a.update(x=a["x"].to(torch.int32)), "x must have dtype"),
    "weight_dtype": (lambda a: a.update(weight=a["weight"].half()), "weight must have dtype"),
    "weight_rows": (lambda a: a.update(weight=a["weight"][:-1]), r"weight must have shape"),
    "weight_cols": (lambda a: a.update(weight=a["weight"][:, :8].contiguous()),
                    r"weight must have shape"),
    "bias_shape": (lambda a: a.update(bias=a["bias"][:3]), r"bias must have shape \[256\]"),
    "bias_dtype": (lambda a: a.update(bias=a["bias"].double()), "bias must have dtype"),
    "cache_dtype": (lambda a: a.update(x=a["x"].half(), weight=a["weight"].half(),
                                       bias=a["bias"].half()), "same dtype as x"),
    "slot_rows": (lambda a: a.update(slot_mapping=torch.arange(6)), "more than x's 5 tokens"),
    "head_dim_odd": (lambda a: a.update(head_dim=7), "head_dim must be even"),
    "cos_rows": (lambda a: a.update(cos=torch.ones(4, 16)), "cos must have shape"),
}


@pytest.mark.parametrize("fn", [qkv_rope_cache, qkv_rope_cache_ref], ids=["kernel", "ref"])
@pytest.mark.parametrize("rule", list(BAD))
def test_validation_errors(fn, rule):
    assert_refused_cleanly(fn, _good_kwargs(), *BAD[rule])


def test_good_kwargs_are_accepted():
    assert qkv_rope_cache_ref(**_good_kwargs()).shape == (5, 4, 32)


def test_config_checks():
    with pytest.raises(ConfigError, match=">= 16"):
        QKVRopeConfig(block_m=8)
    with pytest.raises(ConfigError, match="splits"):
        QKVRopeConfig(splits=17)


# ---------------------------------------------------------------------------------------------
# GPU: the Qwen3-0.6B shape in bf16 at decode batch sizes, default launch parameters

@pytest.mark.gpu
@pytest.mark.parametrize("ln", [False, True], ids=["normed", "ln"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("T", [1, 8, 33, 64, 128, 256])
def test_gpu_qwen3_shapes(T, fp8, ln):
    H, Hkv, D, K, BS, NB, dtype = 16, 8, 128, 1024, 16, 64, torch.bfloat16
    gen = torch.Generator().manual_seed(T)
    args = _case(gen, T, T, H, Hkv, D, K, NB, BS, dtype, norm=True, bias=False)
    lw = (torch.rand(K, generator=gen) + 0.5).to(dtype) if ln else None
    (q_ref, kv_ref), (q, kv) = _run_both("cuda", args, H, Hkv, D, NB, BS, dtype,
                                         cache_dtype=F8 if fp8 else None,
                                         scales=(0.5, 0.25) if fp8 else (1.0, 1.0), ln=lw)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    if fp8:
        _assert_fp8_cache_matches(kv, kv_ref, args[-1], NB, BS, v_exact=False)
    else:
        _assert_written_close(kv, kv_ref, args[-1], NB, BS, TOL[dtype])
    assert int(counters(torch.empty(0, device="cuda").device, 0).abs().sum()) == 0
