"""FP8 (e4m3) KV writes: the quantization rule by hand, the writer kernel's FP8 store against the
torch twin bit for bit (every e4m3 value, every tie between neighbours, saturation, subnormals,
signed zeros; scales 1 and others; fp32 / fp16 / bf16 inputs), poisoned caches with PAD slots,
and the typed errors. Through the Triton interpreter on CPU (natively on a GPU)."""

import pytest
import torch
from kernel_helpers import poison, to

from pagedkv.errors import ConfigError
from pagedkv.kernels.fp8_kv import dequantize_ref, quantize_fp8_ref
from pagedkv.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref

F8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _finite_codes() -> torch.Tensor:
    """Every finite e4m3fn value, ascending, as float32 (254 of them: 0x7F / 0xFF are NaN)."""
    vals = torch.arange(256, dtype=torch.uint8).view(F8).float()
    return vals[torch.isfinite(vals)].sort().values


def test_quantize_by_hand():
    x = torch.tensor([1.0, 0.1, 500.0, -1000.0, 464.0, 17.0, 19.0, 2.0 ** -10, 3 * 2.0 ** -10,
                      2.0 ** -9, -0.0, 0.013, 240.5])
    want = [1.0, 0.1015625, 448.0, -448.0, 448.0,
            16.0,   # tie 16 / 18: the even mantissa
            20.0,   # tie 18 / 20
            0.0,    # tie 0 / 2^-9 (the smallest subnormal)
            2.0 ** -8,  # tie 2^-9 / 2^-8
            2.0 ** -9, -0.0,
            7 * 2.0 ** -9,  # subnormal: 0.013 / 2^-9 = 6.66 -> 7
            240.0]
    q = quantize_fp8_ref(x, 1.0, F8)
    assert q.dtype == F8 and q.float().tolist() == want
    assert _bits(q)[10].item() == 0x80  # -0 keeps its sign
    # a scale divides before rounding; dequantization multiplies back
    q2 = quantize_fp8_ref(torch.tensor([3.0, 1000.0]), 2.0, F8)
    assert q2.float().tolist() == [1.5, 448.0]
    assert dequantize_ref(q2, 2.0).tolist() == [3.0, 896.0]
    # scales apply to FP8 caches only
    assert dequantize_ref(torch.tensor([3.0], dtype=torch.bfloat16), 2.0).tolist() == [3.0]


def _rounding_inputs(gen) -> torch.Tensor:
    codes = _finite_codes()
    mids = (codes[1:] + codes[:-1]) / 2  # every tie between two neighbouring e4m3 values
    wide = torch.randn(3000, generator=gen) * torch.exp2(
        torch.randint(-14, 11, (3000,), generator=gen).float())  # subnormals .. saturation
    special = torch.tensor([0.0, -0.0, 448.0, -448.0, 449.0, 464.0, 480.0, 1e6, -1e6, 1e-30,
                            -1e-30, 2.0 ** -10, -2.0 ** -10])
    return torch.cat([codes, mids, codes * 1.0001, codes * 0.9999, wide, special])


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.37, 2.5)], ids=["s1", "s037_25"])
def test_writer_rounds_like_torch(kernel_device, in_dtype, k_scale, v_scale):
    """Every value class through the writer: the kernel's FP8 bits equal the twin's."""
    gen = torch.Generator().manual_seed(3)
    vals = _rounding_inputs(gen).to(in_dtype)
    H, D = 2, 32
    T = -(-vals.numel() // (H * D))
    flat = torch.zeros(T * H * D, dtype=in_dtype)
    flat[: vals.numel()] = vals
    key = flat.reshape(T, H, D)
    value = key.flip(0).contiguous()
    BS = 8
    NB = -(-T // BS) + 1
    slots = torch.arange(T, dtype=torch.int64) + BS  # every token, past the null block
    ref_k, ref_v = poison((NB, BS, H, D), F8), poison((NB, BS, H, D), F8)
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots, k_scale, v_scale)
    kc, vc = poison((NB, BS, H, D), F8, kernel_device), poison((NB, BS, H, D), F8, kernel_device)
    reshape_and_cache(*to(kernel_device, key, value), kc, vc, *to(kernel_device, slots),
                      k_scale=k_scale, v_scale=v_scale)
    assert torch.equal(_bits(kc.cpu()), _bits(ref_k)) and torch.equal(_bits(vc.cpu()), _bits(ref_v))
    # the twin is the rule: e4m3(x / scale), saturating
    got_k = ref_k.reshape(-1, H, D)[BS:BS + T]
    assert torch.equal(_bits(got_k), _bits(quantize_fp8_ref(key, k_scale, F8)))
    assert torch.isfinite(got_k.float()).all()  # saturates, never NaN


def test_writer_fp8_skips_pad_and_keeps_poison(kernel_device):
    gen = torch.Generator().manual_seed(0)
    T, pad_tokens, H, D, NB, BS = 9, 3, 2, 16, 5, 4
    key = torch.randn(T + pad_tokens, H, D, generator=gen) * 3
    value = torch.randn(T + pad_tokens, H, D, generator=gen) * 0.05
    perm = torch.randperm((NB - 1) * BS, generator=gen)[:T]
    slots = perm.to(torch.int64) + BS
    slots[::3] = -1
    slots[1] = NB * BS + 2  # past the cache: skipped too
    ref_k, ref_v = poison((NB, BS, H, D), F8), poison((NB, BS, H, D), F8)
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots, 0.5, 0.25)
    kc, vc = poison((NB, BS, H, D), F8, kernel_device), poison((NB, BS, H, D), F8, kernel_device)
    reshape_and_cache(*to(kernel_device, key, value), kc, vc, *to(kernel_device, slots),
                      k_scale=0.5, v_scale=0.25)
    assert torch.equal(_bits(kc.cpu()), _bits(ref_k)) and torch.equal(_bits(vc.cpu()), _bits(ref_v))
    untouched = torch.ones(NB * BS, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if not 0 <= s < NB * BS:
            continue
        untouched[s] = False
        assert torch.equal(_bits(ref_k[s // BS, s % BS]), _bits(quantize_fp8_ref(key[t], 0.5, F8)))
        # dequantized values are within half an e4m3 step (relative 2^-4) of the input
        torch.testing.assert_close(dequantize_ref(ref_v[s // BS, s % BS], 0.25), value[t],
                                   rtol=2 ** -4, atol=2 ** -10)
    flat = ref_k.reshape(NB * BS, -1)
    assert torch.equal(_bits(flat[untouched]), _bits(poison(flat[untouched].shape, F8)))


def test_errors():
    key = torch.randn(2, 1, 8)
    kc = torch.zeros(2, 4, 1, 8, dtype=F8)
    slots = torch.tensor([4, 5])
    for bad in (0.0, -1.0, float("nan"), float("inf"), torch.tensor(1.0), True, "1"):
        with pytest.raises(ConfigError, match="k_scale"):
            reshape_and_cache_ref(key, key, kc, kc.clone(), slots, bad, 1.0)
        with pytest.raises(ConfigError, match="v_scale"):
            reshape_and_cache(key, key, kc, kc.clone(), slots, 1.0, bad)
    with pytest.raises(ConfigError, match="both be FP8"):
        reshape_and_cache(key, key, kc, torch.zeros(2, 4, 1, 8), slots)
    with pytest.raises(ConfigError, match="dtype"):
        reshape_and_cache(key, key, torch.zeros(2, 4, 1, 8, dtype=torch.float8_e5m2),
                          torch.zeros(2, 4, 1, 8, dtype=torch.float8_e5m2), slots)
