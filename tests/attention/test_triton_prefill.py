"""Paged prefill / extend kernel vs the torch reference: interpreted on CPU (tiny shapes,
fp32/fp16, 16 x 16 tiles so requests span several query and key tiles), natively on CUDA (bf16,
model-sized), plus torch's varlen flash path on CUDA."""

import pytest
import torch
from test_triton_cases import (
    assert_rows_close,
    assert_rows_untouched,
    make_case,
    poisoned_out,
    reference,
    rows_of,
)

import pagedkv.attention.triton_prefill as triton_prefill
from pagedkv.attention.triton_prefill import (
    PrefillConfig,
    offsets_fit_int32,
    paged_prefill_attention,
    paged_prefill_attention_ref,
    varlen_available,
    varlen_prefill_attention,
)
from pagedkv.errors import ConfigError

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}

# fresh prefill, chunked prefill with context, decode rows, a chunk crossing tiles, a prefix hit
MIXED = [(0, 20), (13, 5), (4, 1), (30, 17), (0, 1), (37, 2)]


def run_prefill(case, **kw):
    m = case["meta"]
    out = poisoned_out(case)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out, **kw)
    return out


@pytest.mark.parametrize("block_size,heads", [
    (1, (2, 2)), (3, (4, 2)), (16, (4, 1)), (32, (4, 2)),
])
def test_prefill_matches_reference(kernel_device, block_size, heads):
    case = make_case(MIXED, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1],
                     device=kernel_device, write_new=True, pad_tokens=3, padded_reqs=1,
                     seed=block_size)
    out = run_prefill(case)
    assert_rows_close(out, reference(case), rows_of(case, lambda ql: ql > 0), TOL[torch.float32])
    assert torch.isnan(out[-3:].cpu()).all(), "padding rows are no request's"


def test_prefill_skip_decode_leaves_decode_rows(kernel_device):
    case = make_case(MIXED, block_size=3, device=kernel_device, write_new=True, seed=2)
    out = run_prefill(case, skip_decode=True, num_tokens=case["meta"].num_actual_tokens)
    assert_rows_close(out, reference(case), rows_of(case, lambda ql: ql > 1), TOL[torch.float32])
    assert_rows_untouched(out, rows_of(case, lambda ql: ql == 1))


def test_prefill_fp16_and_odd_head_dim(kernel_device):
    case = make_case([(5, 18), (0, 9)], block_size=5, head_dim=24, dtype=torch.float16,
                     device=kernel_device, write_new=True, seed=3)
    out = run_prefill(case)
    assert_rows_close(out, reference(case), rows_of(case, lambda ql: ql > 0), TOL[torch.float16])


def test_prefill_wider_tiles(kernel_device):
    """block_m 32 / block_n 16: several key tiles on the diagonal of one query tile."""
    case = make_case([(3, 40), (17, 6)], block_size=4, device=kernel_device, write_new=True,
                     seed=4)
    out = run_prefill(case, config=PrefillConfig(block_m=32, block_n=16, num_warps=1,
                                                 num_stages=1))
    assert_rows_close(out, reference(case), rows_of(case, lambda ql: ql > 0), TOL[torch.float32])


def test_prefill_twin_agrees(kernel_device):
    case = make_case([(6, 7), (0, 1), (2, 3)], block_size=2, device=kernel_device,
                     write_new=True, seed=5)
    m = case["meta"]
    a = run_prefill(case, skip_decode=True)
    b = poisoned_out(case)
    paged_prefill_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], b,
                                skip_decode=True)
    torch.testing.assert_close(a.nan_to_num(7.0), b.nan_to_num(7.0), atol=1e-4, rtol=1e-4)


def test_heads_per_program_by_hand():
    """The largest power of two dividing the GQA group, capped by ``pack_heads``."""
    for pack, group, want in [(4, 2, 2), (4, 8, 4), (4, 6, 2), (4, 3, 1), (2, 1, 1), (1, 8, 1),
                              (8, 8, 8), (2, 12, 2)]:
        assert PrefillConfig(pack_heads=pack).heads_per_program(group) == want, (pack, group)
    for bad in (0, 3, -2, True, 2.0):
        with pytest.raises(ConfigError, match="pack_heads"):
            PrefillConfig(pack_heads=bad)


@pytest.mark.parametrize("heads,pack", [((4, 2), 2), ((8, 2), 4), ((6, 2), 4), ((4, 1), 4)])
def test_prefill_packed_heads(kernel_device, heads, pack):
    """The query heads of one K/V head packed into one program's rows (group 2: 2 heads;
    group 4: 4; group 3: odd, so one head a program): the reference's output, and the one-head
    launch's row for row (the same arithmetic per row); padding rows untouched."""
    case = make_case(MIXED, block_size=3, num_heads=heads[0], num_kv_heads=heads[1],
                     device=kernel_device, write_new=True, pad_tokens=2, seed=11 + pack)
    tiles = dict(block_m=16, block_n=16, num_warps=1, num_stages=1)
    packed = run_prefill(case, config=PrefillConfig(pack_heads=pack, **tiles))
    one = run_prefill(case, config=PrefillConfig(**tiles))
    rows = rows_of(case, lambda ql: ql > 0)
    assert_rows_close(packed, reference(case), rows, TOL[torch.float32])
    torch.testing.assert_close(packed.cpu()[rows], one.cpu()[rows], atol=1e-6, rtol=1e-6)
    assert torch.isnan(packed[-2:].cpu()).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_packed_heads_window_cap_sinks(kernel_device, dtype):
    """Packed heads with a sliding window, a soft cap and per-head sinks (each row reads its
    own head's sink), decodes skipped: the twin's output."""
    reqs = [(50, 20), (0, 40), (3, 17), (9, 1)]
    case = make_case(reqs, block_size=8, num_heads=8, num_kv_heads=2, write_new=True,
                     sliding_window=6, device=kernel_device, dtype=dtype, seed=12)
    m = case["meta"]
    gen = torch.Generator().manual_seed(3)
    sinks = (torch.randn(8, generator=gen) * 2).to(kernel_device).to(dtype)
    kw = dict(skip_decode=True, sliding_window=6, logits_soft_cap=7.0, sinks=sinks)
    out = poisoned_out(case)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out,
                            config=PrefillConfig(block_m=16, block_n=16, num_warps=1,
                                                 num_stages=1, pack_heads=4), **kw)
    want = paged_prefill_attention_ref(case["q"].float(), case["cache"].float(),
                                       m.block_table_tensor, m.query_start_loc, m.seq_lens,
                                       m.num_reqs, case["scale"], poisoned_out(case).float(),
                                       **kw)
    rows = rows_of(case, lambda ql: ql > 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    got = out.float().cpu()
    assert not torch.isnan(got[rows]).any()
    torch.testing.assert_close(got[rows], want.cpu()[rows], atol=tol, rtol=tol)
    assert torch.isnan(got[rows_of(case, lambda ql: ql == 1)]).all()


@pytest.mark.parametrize("splits", [1, 3])
def test_prefill_packed_heads_non_causal_lse(kernel_device, splits):
    """Cascade attention's shared-prefix launch with packed heads: every row against all keys,
    each row's own head's log-sum-exp, key splits: the twin's outputs and lse."""
    case = make_case([(0, 37)], block_size=4, num_heads=4, num_kv_heads=2, write_new=True,
                     device=kernel_device, seed=13)
    m, q = case["meta"], case["q"]
    T, H, D = q.shape
    results = []
    for fn, cfg in ((paged_prefill_attention,
                     PrefillConfig(block_m=16, block_n=16, num_warps=1, num_stages=1,
                                   pack_heads=2)),
                    (paged_prefill_attention_ref, None)):
        shape = (splits, T, H) if splits > 1 else (T, H)
        out = torch.full(shape + (D,), float("nan"), device=kernel_device)
        lse = torch.full(shape, float("nan"), device=kernel_device)
        fn(q, case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens, 1,
           case["scale"], out, causal=False, lse=lse, kv_splits=splits, config=cfg)
        results.append((out.cpu(), lse.cpu()))
    (ko, kl), (to, tl_) = results
    assert not torch.isnan(ko).any() and not torch.isnan(kl).any()
    torch.testing.assert_close(ko, to, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(kl, tl_, atol=1e-4, rtol=1e-4)


def test_offsets_fit_int32_by_hand():
    """The largest element offset of a cache half, ``sum((size - 1) x stride)``, below 2^31
    (meta tensors: shapes and strides without memory)."""
    fits = torch.empty((65536, 16, 8, 128), device="meta")  # largest offset 2^30 - 1
    assert offsets_fit_int32(fits)
    assert not offsets_fit_int32(torch.empty((131072, 16, 8, 128), device="meta"))  # 2^31 - 1
    assert offsets_fit_int32(torch.empty((131071, 16, 8, 128), device="meta"))  # 2^31 - 16,385
    # a half of a [2, ...] cache: its strides, not the whole cache's size
    assert offsets_fit_int32(torch.empty((2, 65536, 16, 8, 128), device="meta")[1])
    # strided views count their strides, not their sizes: 2^16 blocks, every fourth of 2^18
    # (largest offset 65,535 x 65,536 + 16,383 > 2^31), every other of 2^17 (2^31 - 16,385)
    assert not offsets_fit_int32(torch.empty((262144, 16, 8, 128), device="meta")[::4])
    assert offsets_fit_int32(torch.empty((131072, 16, 8, 128), device="meta")[::2])
    assert offsets_fit_int32(torch.empty((0, 16, 8, 128), device="meta"))


@pytest.mark.parametrize("causal", [True, False])
def test_prefill_int64_offsets_equal_int32(kernel_device, monkeypatch, causal):
    """The 64-bit address path (caches past 2^31 elements a half) against the 32-bit one every
    small test takes: bitwise equal, and equal to the reference (mixed causal batch; the
    non-causal launch with key splits and log-sum-exps)."""
    case = make_case(MIXED, block_size=3, device=kernel_device, write_new=True, seed=41)
    m = case["meta"]
    if causal:
        kw, outs = {}, []
    else:
        rows, heads, dim = case["q"].shape
        kw, outs = dict(causal=False, kv_splits=2), []
    for fits in (True, False):
        monkeypatch.setattr(triton_prefill, "offsets_fit_int32", lambda half, f=fits: f)
        if causal:
            outs.append(run_prefill(case))
        else:
            out = torch.full((2, rows, heads, dim), float("nan"), device=kernel_device)
            lse = torch.full((2, rows, heads), float("nan"), device=kernel_device)
            paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor,
                                    m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                    out, lse=lse, **kw)
            outs.append(torch.cat((out.flatten(), lse.flatten())))
    assert torch.equal(outs[0].nan_to_num(7.0), outs[1].nan_to_num(7.0))
    if causal:
        assert_rows_close(outs[1], reference(case), rows_of(case, lambda ql: ql > 0),
                          TOL[torch.float32])


def test_prefill_argument_errors():
    case = make_case([(0, 3)], block_size=2, write_new=True)
    m = case["meta"]
    with pytest.raises(ConfigError, match="num_tokens"):
        paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor,
                                m.query_start_loc, m.seq_lens, 1, case["scale"],
                                poisoned_out(case), num_tokens=-1)
    with pytest.raises(ConfigError, match="int32"):
        paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor.long(),
                                m.query_start_loc, m.seq_lens, 1, case["scale"],
                                poisoned_out(case))
    with pytest.raises(ConfigError, match="block_m"):
        PrefillConfig(block_m=8)


# ---- native GPU


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 1, 48, 256])
@pytest.mark.parametrize("config", [
    None,  # the default
    PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=4, pack_heads=1),
    PrefillConfig(block_m=64, block_n=64, num_warps=8, num_stages=3, pack_heads=2),
    PrefillConfig(block_m=32, block_n=128, num_warps=4, num_stages=3, pack_heads=2),
], ids=["default", "m64p1", "m64p2", "m32n128p2"])
def test_prefill_gpu_bf16(block_size, config):
    reqs = [(0, 700), (1000, 300), (5, 1), (129, 128), (0, 2048), (3000, 17), (63, 65)]
    case = make_case(reqs, block_size=block_size, num_heads=16, num_kv_heads=8, head_dim=128,
                     dtype=torch.bfloat16, device="cuda", write_new=True, pad_tokens=5,
                     padded_reqs=2, seed=block_size)
    out = run_prefill(case, config=config)
    assert_rows_close(out, reference(case), rows_of(case, lambda ql: ql > 0),
                      TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("heads,dtype,head_dim", [((8, 8), torch.float16, 128),
                                                  ((32, 4), torch.bfloat16, 64),
                                                  ((8, 2), torch.float32, 128)])
def test_prefill_gpu_gqa_dtypes(heads, dtype, head_dim):
    case = make_case([(0, 300), (500, 77), (9, 1)], block_size=16, num_heads=heads[0],
                     num_kv_heads=heads[1], head_dim=head_dim, dtype=dtype, device="cuda",
                     write_new=True, seed=7)
    out = run_prefill(case)
    assert_rows_close(out, reference(case), rows_of(case, lambda ql: ql > 0), TOL[dtype])


@pytest.mark.gpu
def test_varlen_fresh_prefill_gpu():
    case = make_case([(0, 300), (0, 1), (0, 1025), (0, 64)], block_size=16, num_heads=16,
                     num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
                     write_new=True, pad_tokens=4, seed=8)
    if not varlen_available(case["q"]):
        pytest.skip("this torch has no torch.nn.attention.varlen")
    m = case["meta"]
    out = poisoned_out(case)
    varlen_prefill_attention(case["q"], case["k"], case["v"], m.query_start_loc,
                             m.num_actual_tokens, m.max_query_len, case["scale"], out)
    assert_rows_close(out, reference(case), rows_of(case, lambda ql: ql > 0),
                      TOL[torch.bfloat16])
    assert torch.isnan(out[-4:].cpu()).all()
