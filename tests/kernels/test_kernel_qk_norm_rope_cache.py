"""Fused q/k RMSNorm + RoPE + paged KV write: kernel vs reference on poisoned outputs (strided
qkv, strided caches, PAD / out-of-range slots, T_slots < T, GQA, with and without norm), the
reference against hand-computed numbers and against the unfused ops, the typed errors."""

import math

import pytest
import torch
from kernel_helpers import poison, to

from pagedkv.errors import ConfigError
from pagedkv.kernels import qk_norm_rope_cache as mod
from pagedkv.kernels.fp8_kv import quantize_fp8_ref
from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache, qk_norm_rope_cache_ref
from pagedkv.kernels.reshape_and_cache import reshape_and_cache_ref
from pagedkv.models.layers import rms_norm
from pagedkv.models.rotary import apply_rotary


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def _case(gen, T, T_slots, H, Hkv, D, NB, BS, dtype, *, norm, row_pad=5, cs_dtype=None):
    """Random inputs: qkv a strided view (row stride > width), cos/sin of real angles (more
    rows than T), slots with PAD, out-of-range values and distinct valid slots (not block 0)."""
    width = (H + 2 * Hkv) * D
    base = torch.randn(T, width + row_pad, generator=gen) * 2
    qkv = base.to(dtype)[:, :width]
    angles = torch.rand(T + 3, D // 2, generator=gen) * 2 * math.pi
    cs_dtype = cs_dtype or torch.float32
    cos, sin = angles.cos().to(cs_dtype), angles.sin().to(cs_dtype)
    if norm:
        qw = (torch.rand(D, generator=gen) + 0.5).to(dtype)
        kw = (torch.rand(D, generator=gen) + 0.5).to(dtype)
    else:
        qw = kw = None
    cap = NB * BS
    n_valid = min(T_slots, cap - BS)
    slots = torch.full((T_slots,), -1, dtype=torch.int64)
    valid = torch.randperm(cap - BS, generator=gen)[:n_valid] + BS
    slots[:n_valid] = valid
    slots = slots[torch.randperm(T_slots, generator=gen)]
    # PAD and out-of-range entries (overwrite a few rows).
    specials = [-1, cap, cap + 7, 2**40, -5]
    for i, v in enumerate(specials[: max(0, T_slots // 3)]):
        slots[(3 * i + 1) % T_slots] = v
    return qkv, qw, kw, cos, sin, slots


def _written(slots, cap):
    return {t: int(s) for t, s in enumerate(slots.tolist()) if 0 <= s < cap}


def _run_both(dev, args, H, Hkv, D, NB, BS, dtype, eps=1e-6, *, strided_q=False):
    """Run the reference on CPU and the kernel on ``dev``, each into poisoned [2, NB, BS, Hkv, D]
    caches (K = kv[0], V = kv[1]) and a poisoned q_out. Returns (ref, got) tuples (q, kv)."""
    qkv, qw, kw, cos, sin, slots = args
    T = qkv.shape[0]
    kv_ref = poison((2, NB, BS, Hkv, D), dtype)
    q_ref = poison((T, H, D), dtype)
    out = qk_norm_rope_cache_ref(qkv, H, Hkv, D, qw, kw, eps, cos, sin, slots, kv_ref[0],
                                 kv_ref[1], q_ref)
    assert out is q_ref
    kv = poison((2, NB, BS, Hkv, D), dtype, dev)
    if strided_q:  # q_out a view of a wider buffer: row and head strides are not the defaults
        q_buf = poison((T, H, D + 3), dtype, dev)
        q = q_buf[:, :, :D]
    else:
        q = poison((T, H, D), dtype, dev)
    d_qw, d_kw, d_cos, d_sin, d_slots = to(dev, qw, kw, cos, sin, slots)
    # qkv strided on the device too (row stride > width)
    d_base = poison((T, qkv.shape[1] + 5), dtype, dev)
    d_base[:, : qkv.shape[1]] = qkv.to(dev)
    d_qkv = d_base[:, : qkv.shape[1]]
    assert d_qkv.stride(0) > d_qkv.shape[1]
    out = qk_norm_rope_cache(d_qkv, H, Hkv, D, d_qw, d_kw, eps, d_cos, d_sin, d_slots, kv[0],
                             kv[1], q)
    assert out is q
    return (q_ref, kv_ref), (q.cpu(), kv.cpu())


def _assert_cache_matches(kv_got, kv_ref, slots, NB, BS, dtype, tol):
    """Written slots hold the reference values; every other slot keeps its poison bits."""
    cap = NB * BS
    written = _written(slots, cap)
    flat_got = kv_got.reshape(2, cap, -1)
    flat_ref = kv_ref.reshape(2, cap, -1)
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[list(written.values())] = False
    pois = poison((2, int(untouched.sum()), flat_got.shape[-1]), dtype)
    assert _same_bits(flat_got[:, untouched], pois), "kernel wrote outside the mapped slots"
    assert _same_bits(flat_ref[:, untouched], pois), "reference wrote outside the mapped slots"
    idx = list(written.values())
    torch.testing.assert_close(flat_got[0, idx].float(), flat_ref[0, idx].float(), **tol)
    # V is a plain copy: bit-exact.
    assert _same_bits(flat_got[1, idx], flat_ref[1, idx])


TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-5),
    torch.float16: dict(rtol=2**-9, atol=4e-3),
    torch.bfloat16: dict(rtol=2**-7, atol=3e-2),
}

# (H, Hkv, D, block size, norm): GQA groups 1/2/4, head dims 16/32/64 (+ non-power-of-two 24),
# block sizes 1/4/16, with and without q/k norm; (6, 3) gives partial head blocks.
CONFIGS = [
    (2, 2, 16, 1, True),
    (4, 2, 32, 4, False),
    (8, 2, 64, 16, True),
    (6, 3, 16, 4, True),
    (4, 1, 24, 16, False),
    (2, 2, 32, 16, False),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("H,Hkv,D,BS,norm", CONFIGS,
                         ids=[f"H{c[0]}kv{c[1]}D{c[2]}bs{c[3]}{'norm' if c[4] else ''}"
                              for c in CONFIGS])
def test_random_matches_reference(kernel_device, dtype, H, Hkv, D, BS, norm):
    gen = torch.Generator().manual_seed(H * 1000 + Hkv * 100 + D + BS)
    T, T_slots = 11, 8
    NB = max(3, -(-(T_slots + 2) // BS) + 2)
    args = _case(gen, T, T_slots, H, Hkv, D, NB, BS, dtype, norm=norm)
    slots = args[-1]
    assert (slots < 0).any() and (slots >= NB * BS).any() and len(_written(slots, NB * BS)) > 0
    (q_ref, kv_ref), (q, kv) = _run_both(kernel_device, args, H, Hkv, D, NB, BS, dtype,
                                         strided_q=(BS == 4))
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    _assert_cache_matches(kv, kv_ref, slots, NB, BS, dtype, TOL[dtype])


def test_head_blocks_split(kernel_device, monkeypatch):
    """A small tile cap forces several head blocks for q and for k/v (and a partial last one)."""
    monkeypatch.setattr(mod, "_MAX_TILE", 64)
    H, Hkv, D, BS, NB = 6, 3, 32, 4, 4
    geo = mod.launch_geometry(H, Hkv, D)
    assert geo["BLOCK_H"] == 2 and geo["parts"] == 3 + 2 * 2
    gen = torch.Generator().manual_seed(7)
    args = _case(gen, 5, 5, H, Hkv, D, NB, BS, torch.float32, norm=True)
    (q_ref, kv_ref), (q, kv) = _run_both(kernel_device, args, H, Hkv, D, NB, BS, torch.float32)
    torch.testing.assert_close(q, q_ref, **TOL[torch.float32])
    _assert_cache_matches(kv, kv_ref, args[-1], NB, BS, torch.float32, TOL[torch.float32])


@pytest.mark.parametrize("eps", [0.0, 0.5])
def test_eps_reaches_the_kernel(kernel_device, eps):
    """A large eps on small inputs changes the result: the kernel must add it like the ref."""
    H, Hkv, D, BS, NB, dtype = 2, 1, 16, 4, 3, torch.float32
    gen = torch.Generator().manual_seed(17)
    qkv, qw, kw, cos, sin, slots = _case(gen, 4, 4, H, Hkv, D, NB, BS, dtype, norm=True)
    args = (qkv * 0.25, qw, kw, cos, sin, slots)
    (q_ref, kv_ref), (q, kv) = _run_both(kernel_device, args, H, Hkv, D, NB, BS, dtype, eps=eps)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    _assert_cache_matches(kv, kv_ref, slots, NB, BS, dtype, TOL[dtype])


def test_head_major_cache_layout(kernel_device):
    """Caches stored head-major [NB, Hkv, BS, D] and passed as their [NB, BS, Hkv, D] view."""
    H, Hkv, D, BS, NB, dtype = 4, 2, 16, 4, 4, torch.float32
    gen = torch.Generator().manual_seed(13)
    qkv, qw, kw, cos, sin, slots = _case(gen, 7, 6, H, Hkv, D, NB, BS, dtype, norm=True)
    hnd_ref = poison((2, NB, Hkv, BS, D), dtype)
    q_ref = qk_norm_rope_cache_ref(qkv, H, Hkv, D, qw, kw, 1e-6, cos, sin, slots,
                                   hnd_ref[0].permute(0, 2, 1, 3), hnd_ref[1].permute(0, 2, 1, 3))
    hnd = poison((2, NB, Hkv, BS, D), dtype, kernel_device)
    d = to(kernel_device, qkv, qw, kw, cos, sin, slots)
    q = qk_norm_rope_cache(d[0], H, Hkv, D, d[1], d[2], 1e-6, d[3], d[4], d[5],
                           hnd[0].permute(0, 2, 1, 3), hnd[1].permute(0, 2, 1, 3))
    torch.testing.assert_close(q.cpu(), q_ref, **TOL[dtype])
    got = hnd.cpu().permute(0, 1, 3, 2, 4)
    want = hnd_ref.permute(0, 1, 3, 2, 4)
    _assert_cache_matches(got, want, slots, NB, BS, dtype, TOL[dtype])


def test_geometry_qwen3_0_6b():
    geo = mod.launch_geometry(16, 8, 128)
    assert geo == {"BLOCK_H": 8, "HALF_PAD": 64, "DIM_PAD": 128, "num_warps": 4, "parts": 4}


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_int32_slots_half_cos_and_no_slot_rows(kernel_device, slot_dtype):
    """int32 slot mapping, fp16 cos/sin, an empty slot mapping (caches untouched, q written)."""
    H, Hkv, D, BS, NB = 2, 1, 16, 4, 4
    gen = torch.Generator().manual_seed(11)
    qkv, qw, kw, cos, sin, slots = _case(gen, 6, 6, H, Hkv, D, NB, BS, torch.float32,
                                         norm=True, cs_dtype=torch.float16)
    for sl in (slots.to(slot_dtype), slots[:0].to(slot_dtype)):
        args = (qkv, qw, kw, cos, sin, sl)
        (q_ref, kv_ref), (q, kv) = _run_both(kernel_device, args, H, Hkv, D, NB, BS,
                                             torch.float32)
        torch.testing.assert_close(q, q_ref, **TOL[torch.float32])
        _assert_cache_matches(kv, kv_ref, sl.to(torch.int64), NB, BS, torch.float32,
                              TOL[torch.float32])
        if sl.numel() == 0:
            assert _same_bits(kv, poison((2, NB, BS, Hkv, D), torch.float32))


def test_q_out_allocated_and_empty_batch(kernel_device):
    H, Hkv, D = 2, 1, 8
    gen = torch.Generator().manual_seed(3)
    qkv, qw, kw, cos, sin, slots = _case(gen, 3, 3, H, Hkv, D, 3, 4, torch.float16, norm=False)
    kc = poison((3, 4, Hkv, D), torch.float16, kernel_device)
    vc = poison((3, 4, Hkv, D), torch.float16, kernel_device)
    d = to(kernel_device, qkv.contiguous(), cos, sin, slots)
    q = qk_norm_rope_cache(d[0], H, Hkv, D, None, None, 1e-6, d[1], d[2], d[3], kc, vc)
    assert q.shape == (3, H, D) and q.dtype == torch.float16 and q.is_contiguous()
    q_ref = qk_norm_rope_cache_ref(qkv, H, Hkv, D, None, None, 1e-6, cos, sin, slots,
                                   poison((3, 4, Hkv, D), torch.float16),
                                   poison((3, 4, Hkv, D), torch.float16))
    torch.testing.assert_close(q.cpu().float(), q_ref.float(), **TOL[torch.float16])
    empty = qk_norm_rope_cache(d[0][:0], H, Hkv, D, None, None, 1e-6, d[1], d[2], d[3][:0], kc,
                               vc)
    assert empty.shape == (0, H, D)


def test_reference_by_hand():
    """T=1, one q head and one kv head, D=4; hand-computed norm and rotation."""
    # angles (pi/2, 0): c = (0, 1), s = (1, 0)
    cos = torch.tensor([[0.0, 1.0]])
    sin = torch.tensor([[1.0, 0.0]])
    q = [2.0, 2.0, 2.0, 2.0]  # rms 2 -> ones, times qw = (1, 2, 3, 4)
    k = [3.0, -3.0, 3.0, -3.0]  # rms 3 -> (1, -1, 1, -1), times kw = (0.5, 1, 2, 4)
    v = [7.0, 8.0, 9.0, 10.0]
    qkv = torch.tensor([q + k + v])
    qw = torch.tensor([1.0, 2.0, 3.0, 4.0])
    kw = torch.tensor([0.5, 1.0, 2.0, 4.0])
    kv = torch.zeros(2, 2, 4, 1, 4)
    slots = torch.tensor([5])  # block 1, offset 1
    out = qk_norm_rope_cache_ref(qkv, 1, 1, 4, qw, kw, 0.0, cos, sin, slots, kv[0], kv[1])
    # normed q = (1, 2, 3, 4): x1 = (1, 2), x2 = (3, 4)
    # [x1*c - x2*s, x2*c + x1*s] = [(0-3, 2-0), (0+1, 4+0)]
    assert out.tolist() == [[[-3.0, 2.0, 1.0, 4.0]]]
    # normed k = (0.5, -1, 2, -4): [(0-2, -1-0), (0+0.5, -4+0)]
    assert kv[0, 1, 1, 0].tolist() == [-2.0, -1.0, 0.5, -4.0]
    assert kv[1, 1, 1, 0].tolist() == v
    kv[:, 1, 1] = 0
    assert not kv.any(), "only slot 5 may be written"

    # No norm: plain rotation of the raw q = (2, 2, 2, 2) -> (-2, 2, 2, 2).
    out = qk_norm_rope_cache_ref(qkv, 1, 1, 4, None, None, 0.0, cos, sin, slots, kv[0], kv[1])
    assert out.tolist() == [[[-2.0, 2.0, 2.0, 2.0]]]
    # k raw (3, -3, 3, -3): [(0-3, -3-0), (0+3, -3+0)]
    assert kv[0, 1, 1, 0].tolist() == [-3.0, -3.0, 3.0, -3.0]

    # eps counts: q = (1, 1, 1, 1), eps 3 -> rsqrt(1 + 3) = 0.5; identity rotation (c=1, s=0);
    # a 60-degree rotation mixes the halves: x1*c - x2*s with x1 = x2 = 0.5*w.
    ones = torch.tensor([[1.0] * 4 + k + v])
    ident = qk_norm_rope_cache_ref(ones, 1, 1, 4, qw, kw, 3.0, torch.ones(1, 2),
                                   torch.zeros(1, 2), slots[:0], kv[0], kv[1])
    assert ident.tolist() == [[[0.5, 1.0, 1.5, 2.0]]]
    c, s = 0.5, math.sqrt(3) / 2
    rot = qk_norm_rope_cache_ref(ones, 1, 1, 4, qw, kw, 3.0, torch.full((1, 2), c),
                                 torch.full((1, 2), s), slots[:0], kv[0], kv[1])
    x1, x2 = [0.5, 1.0], [1.5, 2.0]
    want = [x1[i] * c - x2[i] * s for i in range(2)] + [x2[i] * c + x1[i] * s for i in range(2)]
    torch.testing.assert_close(rot.flatten(), torch.tensor(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", [True, False])
def test_reference_equals_unfused_ops(norm):
    """fp32: rms_norm + apply_rotary + reshape_and_cache_ref give the same q and caches."""
    H, Hkv, D, BS, NB, T, T_slots = 4, 2, 16, 4, 6, 9, 7
    gen = torch.Generator().manual_seed(21)
    qkv, qw, kw, cos, sin, slots = _case(gen, T, T_slots, H, Hkv, D, NB, BS, torch.float32,
                                         norm=norm)
    eps = 1e-5
    kv_ref = poison((2, NB, BS, Hkv, D), torch.float32)
    q = qk_norm_rope_cache_ref(qkv, H, Hkv, D, qw, kw, eps, cos, sin, slots, kv_ref[0],
                               kv_ref[1])
    qq = qkv[:, :H * D].reshape(T, H, D)
    kk = qkv[:, H * D:(H + Hkv) * D].reshape(T, Hkv, D)
    vv = qkv[:, (H + Hkv) * D:].reshape(T, Hkv, D)
    if norm:
        qq, kk = rms_norm(qq, qw, eps), rms_norm(kk, kw, eps)
    qq, kk = apply_rotary(qq, cos[:T], sin[:T]), apply_rotary(kk, cos[:T], sin[:T])
    kv_unf = poison((2, NB, BS, Hkv, D), torch.float32)
    reshape_and_cache_ref(kk, vv, kv_unf[0], kv_unf[1], slots)
    torch.testing.assert_close(q, qq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kv_ref, kv_unf, rtol=1e-5, atol=1e-5)
    assert len(_written(slots, NB * BS)) > 0


# ---------------------------------------------------------------------------------------------
# FP8 (e4m3) caches: K quantized from its float32 norm + RoPE result, V from its input value.

F8 = torch.float8_e4m3fn


def _run_fp8(dev, args, H, Hkv, D, NB, BS, dtype, k_scale, v_scale, eps=1e-6):
    """The reference and the kernel into poisoned FP8 caches; returns (ref, got) (q, kv)."""
    qkv, qw, kw, cos, sin, slots = args
    T = qkv.shape[0]
    kv_ref, q_ref = poison((2, NB, BS, Hkv, D), F8), poison((T, H, D), dtype)
    qk_norm_rope_cache_ref(qkv, H, Hkv, D, qw, kw, eps, cos, sin, slots, kv_ref[0], kv_ref[1],
                           q_ref, k_scale=k_scale, v_scale=v_scale)
    kv, q = poison((2, NB, BS, Hkv, D), F8, dev), poison((T, H, D), dtype, dev)
    d_qkv, d_qw, d_kw, d_cos, d_sin, d_slots = to(dev, *args)
    qk_norm_rope_cache(d_qkv, H, Hkv, D, d_qw, d_kw, eps, d_cos, d_sin, d_slots, kv[0], kv[1],
                       q, k_scale=k_scale, v_scale=v_scale)
    return (q_ref, kv_ref), (q.cpu(), kv.cpu())


def _assert_fp8_cache_matches(kv, kv_ref, slots, NB, BS, v_exact=True):
    """Untouched slots keep their poison bits; V bit-exact (a copy of the input); K codes equal,
    or (fp32 results a rounding apart landing on both sides of a tie) neighbours, for at most 2%
    of the values. v_exact=False: V is a float32 result too (a fused GEMM's), the K rule for it."""
    cap = NB * BS
    written = list(_written(slots, cap).values())
    untouched = torch.ones(cap, dtype=torch.bool)
    untouched[written] = False
    flat, flat_ref = kv.reshape(2, cap, -1), kv_ref.reshape(2, cap, -1)
    pois = poison((2, int(untouched.sum()), flat.shape[-1]), F8)
    assert _same_bits(flat[:, untouched], pois) and _same_bits(flat_ref[:, untouched], pois)
    if v_exact:
        assert _same_bits(flat[1, written], flat_ref[1, written])
    for half in (0,) if v_exact else (0, 1):
        a = flat[half, written].contiguous().view(torch.uint8).to(torch.int16)
        b = flat_ref[half, written].contiguous().view(torch.uint8).to(torch.int16)
        # -0 (0x80) and +0 are the same value (a tiny value rounds to either sign of zero: the
        # H200's conversion and the twin differ there, 128 codes at T=2049)
        a, b = a.masked_fill(a == 0x80, 0), b.masked_fill(b == 0x80, 0)
        assert int((a - b).abs().max()) <= 1 and float((a != b).float().mean()) <= 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.3, 1.7)], ids=["s1", "s03_17"])
@pytest.mark.parametrize("norm", [True, False])
def test_fp8_cache_matches_reference(kernel_device, dtype, scales, norm):
    H, Hkv, D, BS = 6, 3, 32, 4
    gen = torch.Generator().manual_seed(int(scales[0] * 10) + norm)
    T, T_slots = 11, 8
    NB = max(3, -(-(T_slots + 2) // BS) + 2)
    args = _case(gen, T, T_slots, H, Hkv, D, NB, BS, dtype, norm=norm)
    (q_ref, kv_ref), (q, kv) = _run_fp8(kernel_device, args, H, Hkv, D, NB, BS, dtype, *scales)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[dtype])
    _assert_fp8_cache_matches(kv, kv_ref, args[-1], NB, BS)
    # the twin's FP8 K / V are its own float32 K / V, quantized once
    qkv, qw, kw, cos, sin, slots = args
    kv32 = poison((2, NB, BS, Hkv, D), torch.float32)
    qk_norm_rope_cache_ref(qkv.float(), H, Hkv, D, None if qw is None else qw.float(),
                           None if kw is None else kw.float(), 1e-6, cos, sin, slots, kv32[0],
                           kv32[1])
    idx = list(_written(slots, NB * BS).values())
    for i, scale in ((0, scales[0]), (1, scales[1])):
        want = quantize_fp8_ref(kv32[i].reshape(NB * BS, -1)[idx], scale, F8)
        assert _same_bits(kv_ref[i].reshape(NB * BS, -1)[idx], want)


# ---------------------------------------------------------------------------------------------
# Validation: one case per rule; each raises ConfigError and leaves the caches untouched.

def _good_kwargs(H=4, Hkv=2, D=8, T=5, NB=3, BS=4):
    kv = poison((2, NB, BS, Hkv, D), torch.float32)
    return dict(
        qkv=torch.randn(T, (H + 2 * Hkv) * D), num_heads=H, num_kv_heads=Hkv, head_dim=D,
        q_norm_weight=torch.ones(D), k_norm_weight=torch.ones(D), eps=1e-6,
        cos=torch.ones(T, D // 2), sin=torch.zeros(T, D // 2),
        slot_mapping=torch.arange(T, dtype=torch.int64), key_cache=kv[0], value_cache=kv[1],
        q_out=None,
    )


BAD = {
    "qkv_rank": (lambda a: a.update(qkv=a["qkv"].reshape(5, 8, -1)), "qkv must be 2-D"),
    "qkv_dtype": (lambda a: a.update(qkv=a["qkv"].to(torch.int32)), "qkv must have dtype"),
    "qkv_last_stride": (lambda a: a.update(qkv=torch.randn(64, 5).t()), "contiguous"),
    "qkv_width": (lambda a: a.update(qkv=a["qkv"][:, :-1]), "qkv width 63"),
    "num_heads": (lambda a: a.update(num_heads=0), "num_heads must be >= 1"),
    "num_kv_heads_type": (lambda a: a.update(num_kv_heads=2.0), "num_kv_heads must be a host int"),
    "head_dim_odd": (lambda a: a.update(head_dim=7), "head_dim must be even"),
    "eps": (lambda a: a.update(eps=-1.0), "eps must be a non-negative"),
    "one_norm_weight": (lambda a: a.update(k_norm_weight=None), "both q_norm_weight"),
    "norm_weight_shape": (lambda a: a.update(q_norm_weight=torch.ones(6)),
                          r"q_norm_weight must have shape \[8\]"),
    "norm_weight_dtype": (lambda a: a.update(k_norm_weight=torch.ones(8, dtype=torch.int64)),
                          "k_norm_weight must have dtype"),
    "cos_cols": (lambda a: a.update(cos=torch.ones(5, 8)), "cos must have shape"),
    "cos_rows": (lambda a: a.update(cos=torch.ones(4, 4)), "cos must have shape"),
    "sin_rank": (lambda a: a.update(sin=torch.zeros(5, 1, 4)), "sin must be 2-D"),
    "slot_dtype": (lambda a: a.update(slot_mapping=a["slot_mapping"].float()),
                   "slot_mapping must have dtype"),
    "slot_rows": (lambda a: a.update(slot_mapping=torch.arange(6)), "slot_mapping has 6 rows"),
    "cache_dtype": (lambda a: a.update(qkv=a["qkv"].half()), "same dtype as qkv"),
    "fp8_value_cache_only": (lambda a: a.update(value_cache=a["value_cache"].to(F8)),
                             "value_cache .* must have key_cache's dtype"),
    "k_scale": (lambda a: a.update(k_scale=0.0), "k_scale must be a finite host number > 0"),
    "v_scale": (lambda a: a.update(v_scale=float("nan")), "v_scale must be a finite"),
    "cache_heads": (lambda a: a.update(num_kv_heads=1, qkv=a["qkv"][:, :48]),
                    "key_cache .* does not match"),
    "cache_rank": (lambda a: a.update(value_cache=a["value_cache"][0]), "value_cache must be 4-D"),
    "cache_last_stride": (lambda a: a.update(key_cache=a["key_cache"].transpose(2, 3)),
                          "key_cache must be contiguous"),
    "value_cache_shape": (lambda a: a.update(value_cache=a["value_cache"][:2]),
                          "must have key_cache's shape"),
    "q_out_shape": (lambda a: a.update(q_out=torch.empty(5, 4, 4)), "q_out must have shape"),
    "q_out_dtype": (lambda a: a.update(q_out=torch.empty(5, 4, 8, dtype=torch.int32)),
                    "q_out must have dtype"),
}


@pytest.mark.parametrize("fn", [qk_norm_rope_cache, qk_norm_rope_cache_ref],
                         ids=["kernel", "ref"])
@pytest.mark.parametrize("rule", list(BAD))
def test_validation_errors(fn, rule):
    assert_refused_cleanly(fn, _good_kwargs(), *BAD[rule])


def assert_refused_cleanly(fn, kwargs: dict, mutate, pattern: str) -> None:
    """``fn(**kwargs)`` after ``mutate(kwargs)`` raises a ConfigError matching ``pattern`` and
    leaves ``kwargs``' key and value caches untouched."""
    caches = (kwargs["key_cache"], kwargs["value_cache"])
    before = tuple(c.clone() for c in caches)
    mutate(kwargs)
    with pytest.raises(ConfigError, match=pattern):
        fn(**kwargs)
    assert _same_bits(caches[0], before[0]) and _same_bits(caches[1], before[1])


def test_good_kwargs_are_accepted():
    """The validation baseline itself is valid (so each BAD case fails for its own rule)."""
    kwargs = _good_kwargs()
    q = qk_norm_rope_cache_ref(**kwargs)
    assert q.shape == (5, 4, 8)


# ---------------------------------------------------------------------------------------------
# GPU: Qwen3-0.6B shapes in bf16.

@pytest.mark.gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("T", [1, 7, 256, 2049])
def test_gpu_qwen3_shapes_bf16(T, norm):
    H, Hkv, D, BS = 16, 8, 128, 16
    NB = -(-T // BS) + 8
    T_slots = max(1, T - 3) if T > 1 else 1
    gen = torch.Generator().manual_seed(T)
    args = _case(gen, T, T_slots, H, Hkv, D, NB, BS, torch.bfloat16, norm=norm,
                 cs_dtype=torch.bfloat16)
    (q_ref, kv_ref), (q, kv) = _run_both("cuda", args, H, Hkv, D, NB, BS, torch.bfloat16)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[torch.bfloat16])
    # at most one bf16 ulp apart (fp32 math on both sides, one rounding)
    _assert_cache_matches(kv, kv_ref, args[-1], NB, BS, torch.bfloat16, TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 256, 2049])
def test_gpu_qwen3_shapes_bf16_fp8_cache(T):
    H, Hkv, D, BS = 16, 8, 128, 16
    NB = -(-T // BS) + 8
    gen = torch.Generator().manual_seed(T + 1)
    args = _case(gen, T, max(1, T - 3), H, Hkv, D, NB, BS, torch.bfloat16, norm=True,
                 cs_dtype=torch.bfloat16)
    (q_ref, kv_ref), (q, kv) = _run_fp8("cuda", args, H, Hkv, D, NB, BS, torch.bfloat16, 1.0, 1.0)
    torch.testing.assert_close(q.float(), q_ref.float(), **TOL[torch.bfloat16])
    _assert_fp8_cache_matches(kv, kv_ref, args[-1], NB, BS)


@pytest.mark.gpu
def test_gpu_device_mismatch():
    kwargs = _good_kwargs()
    kwargs["qkv"] = kwargs["qkv"].cuda()
    with pytest.raises(ConfigError, match="one device"):
        qk_norm_rope_cache(**kwargs)


@pytest.mark.gpu
def test_gpu_no_recompile_across_batch_sizes():
    """T and T_slots change every step: one compiled variant serves all of them."""
    H, Hkv, D, BS, NB = 4, 2, 64, 16, 16
    kern = mod._qk_norm_rope_cache_kernel
    sizes = []
    for T, T_slots in ((1, 1), (5, 3), (16, 16), (33, 2), (7, 0)):
        gen = torch.Generator().manual_seed(T)
        args = to("cuda", *_case(gen, T, max(T_slots, 1), H, Hkv, D, NB, BS, torch.bfloat16,
                                 norm=True, row_pad=0))
        qkv, qw, kw, cos, sin, slots = args
        kv = torch.zeros(2, NB, BS, Hkv, D, dtype=torch.bfloat16, device="cuda")
        qk_norm_rope_cache(qkv.contiguous(), H, Hkv, D, qw, kw, 1e-6, cos, sin,
                           slots[:T_slots], kv[0], kv[1])
        caches = getattr(kern, "device_caches", None)
        if not isinstance(caches, dict) or not caches:
            pytest.skip("this Triton keeps its compile cache elsewhere")
        entry = next(iter(caches.values()))
        sizes.append(len(entry[0] if isinstance(entry, tuple) else entry))
    assert sizes[-1] == sizes[0], f"recompiled across batch sizes: {sizes}"


@pytest.mark.gpu
def test_gpu_int64_cache_offsets():
    """A slot whose element offset exceeds 2**31 lands in the right place (int64 addressing)."""
    H, Hkv, D, BS = 2, 8, 128, 16
    per_block = BS * Hkv * D
    NB = 2**31 // per_block + 2
    key_cache = torch.empty(NB, BS, Hkv, D, dtype=torch.bfloat16, device="cuda")
    value_cache = torch.empty_like(key_cache)
    sentinel = torch.tensor(1234.0, dtype=torch.bfloat16)
    for c in (key_cache, value_cache):
        c[:2].fill_(sentinel)
        c[-2:].fill_(sentinel)
    gen = torch.Generator().manual_seed(0)
    qkv, qw, kw, cos, sin, _ = _case(gen, 2, 2, H, Hkv, D, 4, BS, torch.bfloat16, norm=True)
    slots = torch.tensor([(NB - 1) * BS + 5, -1])
    kc_ref = torch.zeros(1, BS, Hkv, D, dtype=torch.bfloat16)  # the last block alone
    vc_ref = torch.zeros_like(kc_ref)
    qk_norm_rope_cache_ref(qkv, H, Hkv, D, qw, kw, 1e-6, cos, sin, torch.tensor([5, -1]),
                           kc_ref, vc_ref)
    d = to("cuda", qkv, qw, kw, cos, sin, slots)
    qk_norm_rope_cache(d[0], H, Hkv, D, d[1], d[2], 1e-6, d[3], d[4], d[5], key_cache,
                       value_cache)
    torch.testing.assert_close(key_cache[-1, 5].cpu().float(), kc_ref[0, 5].float(),
                               **TOL[torch.bfloat16])
    assert torch.equal(value_cache[-1, 5].cpu(), vc_ref[0, 5])
    for c in (key_cache, value_cache):
        rest = torch.cat([c[:2].flatten(), c[-2].flatten(), c[-1, :5].flatten(),
                          c[-1, 6:].flatten()])
        assert bool((rest == sentinel.cuda()).all())
