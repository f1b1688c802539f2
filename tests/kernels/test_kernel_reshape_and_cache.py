"""KV writer: kernel vs reference on poisoned caches; PAD skipping; kernel-block and compressed
geometries; strided cache layouts."""

import pytest
import torch
from kernel_helpers import poison, to

from pagedkv.errors import ConfigError
from pagedkv.kernels.compressed_slot_mapping import compute_compressed_slot_mapping
from pagedkv.kernels.reshape_and_cache import reshape_and_cache, reshape_and_cache_ref


def _slots(gen, num_tokens, num_blocks, block_size, pad_every=3):
    """Distinct slots outside the null block 0; every pad_every-th token is PAD (-1)."""
    perm = torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens]
    slots = perm.to(torch.int64) + block_size
    slots[::pad_every] = -1
    return slots


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


# (input dtype, cache dtype). fp32 -> bf16 rounds differently in the interpreter (it truncates),
# so that cast is compared exactly only on the GPU; bf16 -> bf16 is a plain copy everywhere.
DTYPES = [
    (torch.float32, torch.float32),
    (torch.float32, torch.float16),
    (torch.float16, torch.float16),
    (torch.bfloat16, torch.bfloat16),
    (torch.float16, torch.float32),
]


@pytest.mark.parametrize("in_dtype,cache_dtype", DTYPES,
                         ids=["f32", "f32->f16", "f16", "bf16", "f16->f32"])
def test_random_matches_reference_and_skips_pad(kernel_device, in_dtype, cache_dtype):
    gen = torch.Generator().manual_seed(0)
    T, pad_tokens, H, D, Dv, NB, BS = 9, 3, 2, 16, 8, 5, 4
    key = torch.randn(T + pad_tokens, H, D, generator=gen).to(in_dtype)  # padded longer than T
    value = torch.randn(T + pad_tokens, H, Dv, generator=gen).to(in_dtype)
    slots = _slots(gen, T, NB, BS)
    ref_k, ref_v = poison((NB, BS, H, D), cache_dtype), poison((NB, BS, H, Dv), cache_dtype)
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    kc = poison((NB, BS, H, D), cache_dtype, kernel_device)
    vc = poison((NB, BS, H, Dv), cache_dtype, kernel_device)
    reshape_and_cache(*to(kernel_device, key, value), kc, vc, *to(kernel_device, slots))
    assert _same_bits(kc.cpu(), ref_k) and _same_bits(vc.cpu(), ref_v)
    # Written slots hold the tokens; every other slot (null block included) is still poison.
    untouched = torch.ones(NB * BS, dtype=torch.bool)
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        untouched[s] = False
        assert torch.equal(ref_k[s // BS, s % BS], key[t].to(cache_dtype))
        assert torch.equal(ref_v[s // BS, s % BS], value[t].to(cache_dtype))
    flat_k = ref_k.reshape(NB * BS, -1)
    assert _same_bits(flat_k[untouched], poison(flat_k[untouched].shape, cache_dtype))
    assert _same_bits(ref_k[0], poison((BS, H, D), cache_dtype)), "null block must stay poison"


def test_fp32_to_bf16_cast(kernel_device):
    gen = torch.Generator().manual_seed(1)
    key = torch.randn(6, 2, 8, generator=gen)
    slots = torch.tensor([4, -1, 5, 9, 10, 15])
    ref = poison((4, 4, 2, 8), torch.bfloat16)
    reshape_and_cache_ref(key, None, ref, None, slots)
    kc = poison((4, 4, 2, 8), torch.bfloat16, kernel_device)
    reshape_and_cache(*to(kernel_device, key), None, kc, None, *to(kernel_device, slots))
    if kernel_device == "cuda":
        assert _same_bits(kc.cpu(), ref)  # round to nearest even, like torch
    else:
        written = slots[slots >= 0]
        got = kc.cpu().reshape(16, 2, 8)[written].float()
        want = ref.reshape(16, 2, 8)[written].float()
        torch.testing.assert_close(got, want, rtol=2 ** -7, atol=0)


def test_mla_latent_cache_value_none(kernel_device):
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(5, 1, 36, generator=gen).half()  # latent 32 + rope 4, one "head"
    slots = torch.tensor([-1, 3, 17, 8, -1])
    ref = poison((3, 8, 1, 36), torch.float16)
    reshape_and_cache_ref(key, None, ref, None, slots)
    kc = poison((3, 8, 1, 36), torch.float16, kernel_device)
    reshape_and_cache(*to(kernel_device, key), None, kc, None, *to(kernel_device, slots))
    assert _same_bits(kc.cpu(), ref)
    assert torch.equal(ref[2, 1, 0], key[2, 0])


@pytest.mark.parametrize("ratio", [2, 4])
def test_kernel_block_view_writes_identical_memory(kernel_device, ratio):
    """[NB, B, H, D] and its kernel-block view [NB*ratio, B/ratio, H, D] get the same bytes."""
    gen = torch.Generator().manual_seed(ratio)
    T, H, D, NB, B = 10, 2, 8, 4, 8
    key = torch.randn(T, H, D, generator=gen)
    value = torch.randn(T, H, D, generator=gen)
    slots = _slots(gen, T, NB, B)
    dev_k, dev_v, dev_s = to(kernel_device, key, value, slots)
    kc_a = poison((NB, B, H, D), torch.float32, kernel_device)
    vc_a = poison((NB, B, H, D), torch.float32, kernel_device)
    reshape_and_cache(dev_k, dev_v, kc_a, vc_a, dev_s)
    kc_b = poison((NB, B, H, D), torch.float32, kernel_device)
    vc_b = poison((NB, B, H, D), torch.float32, kernel_device)
    kbs = B // ratio
    reshape_and_cache(dev_k, dev_v, kc_b.view(NB * ratio, kbs, H, D),
                      vc_b.view(NB * ratio, kbs, H, D), dev_s)
    assert _same_bits(kc_a.cpu(), kc_b.cpu()) and _same_bits(vc_a.cpu(), vc_b.cpu())


def test_strided_cache_layouts(kernel_device):
    """K and V as the two halves of one [2, NB, B, H, D] buffer, and an HND-stored cache."""
    gen = torch.Generator().manual_seed(5)
    T, H, D, NB, B = 7, 4, 8, 3, 4
    key = torch.randn(T, H, D, generator=gen)
    value = torch.randn(T, H, D, generator=gen)
    slots = _slots(gen, T, NB, B, pad_every=4)
    kv_ref = poison((2, NB, B, H, D), torch.float32)
    reshape_and_cache_ref(key, value, kv_ref[0], kv_ref[1], slots)
    kv = poison((2, NB, B, H, D), torch.float32, kernel_device)
    dk, dv, ds = to(kernel_device, key, value, slots)
    reshape_and_cache(dk, dv, kv[0], kv[1], ds)
    assert _same_bits(kv.cpu(), kv_ref)
    hnd_ref = poison((NB, H, B, D), torch.float32)  # stored head-major, viewed [NB, B, H, D]
    reshape_and_cache_ref(key, None, hnd_ref.permute(0, 2, 1, 3), None, slots)
    hnd = poison((NB, H, B, D), torch.float32, kernel_device)
    reshape_and_cache(dk, None, hnd.permute(0, 2, 1, 3), None, ds)
    assert _same_bits(hnd.cpu(), hnd_ref)
    # Non-contiguous K (a slice of a fused QKV projection).
    qkv = torch.randn(T, 3 * H, D, generator=gen)
    ref2 = poison((NB, B, H, D), torch.float32)
    reshape_and_cache_ref(qkv[:, H:2 * H], None, ref2, None, slots)
    out2 = poison((NB, B, H, D), torch.float32, kernel_device)
    reshape_and_cache(qkv.to(kernel_device)[:, H:2 * H], None, out2, None, ds)
    assert _same_bits(out2.cpu(), ref2)


def test_compressed_geometry_with_compressed_slot_mapping(kernel_device):
    """DSV4 compressed cache [NB, S, 1, D]: only group-closing tokens write their state."""
    C, S, D, NB = 4, 4, 12, 8  # manager block = S*C = 16 tokens
    gen = torch.Generator().manual_seed(9)
    table = torch.tensor([[5, 6, 7, 1], [2, 3, 4, 1]], dtype=torch.int32)
    qsl = torch.tensor([0, 10, 13], dtype=torch.int32)
    seq = torch.tensor([10, 20], dtype=torch.int32)
    dt, dq, dseq = to(kernel_device, table, qsl, seq)
    slots = poison(16, torch.int64, kernel_device)
    compute_compressed_slot_mapping(dt, dq, dseq, slots, 2, 13, S, C)
    states = torch.randn(16, 1, D, generator=gen)
    cache = poison((NB, S, 1, D), torch.float32, kernel_device)
    reshape_and_cache(*to(kernel_device, states), None, cache, None, slots)
    cache = cache.cpu()
    slots = slots.cpu()
    # Writers: req0 pos 3, 7 (tokens 3, 7); req1 pos 19 (token 12).
    writers = {t: int(slots[t]) for t in range(16) if int(slots[t]) >= 0}
    assert sorted(writers) == [3, 7, 12]
    assert writers[3] == int(table[0, 0]) * S + 0
    assert writers[7] == int(table[0, 0]) * S + 1
    assert writers[12] == int(table[1, 1]) * S + 0
    flat = cache.reshape(NB * S, D)
    for t, s in writers.items():
        assert torch.equal(flat[s], states[t, 0])
    others = torch.ones(NB * S, dtype=torch.bool)
    others[list(writers.values())] = False
    assert _same_bits(flat[others], poison((int(others.sum()), D), torch.float32))


def test_out_of_capacity_slot_is_skipped(kernel_device):
    key = torch.ones(3, 1, 4)
    slots = torch.tensor([2, 8, 1000])  # capacity 2 blocks x 4 = 8 slots
    for fn in (reshape_and_cache, reshape_and_cache_ref):
        kc = poison((2, 4, 1, 4), torch.float32, kernel_device)
        fn(*to(kernel_device, key), None, kc, None, *to(kernel_device, slots))
        flat = kc.cpu().reshape(8, 4)
        assert torch.equal(flat[2], torch.ones(4))
        assert _same_bits(flat[torch.arange(8) != 2], poison((7, 4), torch.float32))


def test_typed_errors():
    key = torch.zeros(3, 2, 4)
    kc = torch.zeros(2, 4, 2, 4)
    slots = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ConfigError, match="does not match"):
        reshape_and_cache(torch.zeros(3, 2, 5), None, kc, None, slots)
    with pytest.raises(ConfigError, match="tokens"):
        reshape_and_cache(key, None, kc, None, torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ConfigError, match="value_cache"):
        reshape_and_cache(key, None, kc, kc, slots)
    with pytest.raises(ConfigError, match="value_cache is None"):
        reshape_and_cache(key, key, kc, None, slots)
    with pytest.raises(ConfigError, match="dtype"):
        reshape_and_cache(key, None, kc.to(torch.int32), None, slots)


@pytest.mark.gpu
def test_gpu_large_bf16_against_reference():
    gen = torch.Generator().manual_seed(4)
    T, H, D, NB, B = 3000, 8, 128, 600, 16
    key = torch.randn(T + 5, H, D, generator=gen)
    value = torch.randn(T + 5, H, D, generator=gen)
    slots = _slots(gen, T, NB, B, pad_every=7)
    ref_k, ref_v = poison((NB, B, H, D), torch.bfloat16), poison((NB, B, H, D), torch.bfloat16)
    reshape_and_cache_ref(key, value, ref_k, ref_v, slots)
    kc = poison((NB, B, H, D), torch.bfloat16, "cuda")
    vc = poison((NB, B, H, D), torch.bfloat16, "cuda")
    reshape_and_cache(key.cuda(), value.cuda(), kc, vc, slots.cuda())
    assert _same_bits(kc.cpu(), ref_k) and _same_bits(vc.cpu(), ref_v)
