"""Paged attention over FP8 (e4m3) KV caches: the decode and prefill kernels against the torch
twin on the same quantized caches (interpreted on CPU with fp32 / fp16 queries; natively on a
GPU), the twin against attention over the dequantized cache, the backends end to end (the
writer quantizes, attention dequantizes), and the size of the quantization error.

Cases come from ``test_triton_cases.make_case`` (NaN in every slot nobody may read); the FP8
cache is the case's float32 cache quantized (its NaN slots stay NaN codes: the interpreter
decodes them as 480, a GPU as NaN, so a stray read shows either way)."""

import pytest
import torch
from test_triton_cases import make_case, poisoned_out, rows_of

from pagedkv.attention.torch_ref import TorchRefBackend, paged_attention_ref
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.attention.backend import AttentionLayout
from pagedkv.attention.triton_decode import paged_decode_attention, paged_decode_attention_ref
from pagedkv.attention.triton_prefill import paged_prefill_attention
from pagedkv.errors import ConfigError
from pagedkv.kernels.fp8_kv import dequantize_ref, quantize_fp8_ref
from pagedkv.kernels.reshape_and_cache import reshape_and_cache_ref

F8 = torch.float8_e4m3fn
TOL = {torch.float32: 2e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def fp8_case(reqs, *, k_scale=1.0, v_scale=1.0, dtype=torch.float32, **kw):
    """``make_case`` (float32 cache, every position written) with its cache quantized to FP8;
    queries in ``dtype``. Adds ``cache32`` (the unquantized cache) and the scales."""
    case = make_case(reqs, write_new=True, **kw)
    cache32 = case["cache"]
    cache = torch.empty(cache32.shape, dtype=F8, device=cache32.device)
    cache[0] = quantize_fp8_ref(cache32[0], k_scale, F8)
    cache[1] = quantize_fp8_ref(cache32[1], v_scale, F8)
    case.update(cache=cache, cache32=cache32, k_scale=k_scale, v_scale=v_scale,
                q=case["q"].to(dtype))
    return case


def twin(case, **kw):
    """The torch twin on the FP8 cache (float32 queries), on the CPU."""
    return paged_attention_ref(case["q"].float(), case["cache"], case["meta"], case["scale"],
                               k_scale=case["k_scale"], v_scale=case["v_scale"], **kw).cpu()


def assert_served_close(out, ref, rows, dtype):
    idx = torch.tensor(rows, dtype=torch.int64)
    got = out.float().cpu()[idx]
    assert not torch.isnan(got).any(), "a served row was not written"
    torch.testing.assert_close(got, ref[idx], atol=TOL[dtype], rtol=TOL[dtype])


def test_twin_is_attention_over_the_dequantized_cache():
    case = fp8_case([(13, 1), (0, 4), (21, 3)], block_size=4, k_scale=0.5, v_scale=2.0, seed=1)
    deq = torch.stack([dequantize_ref(case["cache"][0], 0.5), dequantize_ref(case["cache"][1], 2.0)])
    want = paged_attention_ref(case["q"], deq, case["meta"], case["scale"])
    torch.testing.assert_close(twin(case), want, atol=1e-6, rtol=1e-6)
    # the scales matter: with 1.0 the result differs
    other = paged_attention_ref(case["q"], case["cache"], case["meta"], case["scale"])
    assert (other - want).abs().max() > 0.1


def test_quantization_error_is_small():
    """Against attention over the unquantized cache: e4m3 keeps 3 mantissa bits, so outputs of
    unit-variance K / V move by a few percent at most."""
    case = fp8_case([(40, 1), (0, 9), (70, 2)], block_size=16, seed=2)
    exact = paged_attention_ref(case["q"], case["cache32"], case["meta"], case["scale"])
    err = (twin(case) - exact).abs()
    rel = err.max() / exact.abs().max()
    print(f"\nFP8 KV (scale 1) attention error vs float32 cache: max abs {err.max():.4f}, "
          f"relative to the largest output {rel:.4f}")
    assert 0 < rel < 0.05


# block sizes 3 / 16, GQA 2, contexts across tiles and blocks
DECODES = [(0, 1), (4, 1), (15, 1), (31, 1), (47, 1), (63, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)], ids=["s1", "s05_2"])
@pytest.mark.parametrize("block_size,num_splits", [(3, 3), (16, 1), (16, None)])
def test_decode_kernel_matches_twin(kernel_device, dtype, scales, block_size, num_splits):
    case = fp8_case(DECODES, block_size=block_size, k_scale=scales[0], v_scale=scales[1],
                    dtype=dtype, device=kernel_device, seed=block_size)
    m = case["meta"]
    out = poisoned_out(case)
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, num_splits=num_splits,
                           k_scale=scales[0], v_scale=scales[1])
    assert_served_close(out, twin(case), rows_of(case, lambda ql: ql == 1), dtype)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_bf16_query_over_fp8_cache_runs_in_fp16(kernel_device, kernel):
    """A bf16 query over an FP8 cache: the kernels cast the query to fp16 (``Q_FP16``); the
    output is the twin's (the attention of the dequantized cache in fp32) within bf16's
    tolerance, on rows of every kind."""
    reqs = DECODES if kernel == "decode" else [(0, 20), (9, 7), (3, 1), (0, 1)]
    case = fp8_case(reqs, block_size=16, k_scale=0.5, v_scale=2.0, dtype=torch.bfloat16,
                    device=kernel_device, seed=11)
    m = case["meta"]
    out = poisoned_out(case)
    fn = paged_decode_attention if kernel == "decode" else paged_prefill_attention
    fn(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens,
       m.num_reqs, case["scale"], out, k_scale=0.5, v_scale=2.0)
    rows = rows_of(case, (lambda ql: ql == 1) if kernel == "decode" else (lambda ql: ql > 0))
    assert_served_close(out, twin(case), rows, torch.bfloat16)


def test_fp8_cache_gets_the_fp8_decode_config():
    from pagedkv.attention.triton_decode import (DecodeConfig, FP8_DECODE_CONFIG,
                                                 INTERPRET_DECODE_CONFIG, default_decode_config)
    cuda = torch.device("cuda")
    assert default_decode_config(cuda, torch.float8_e4m3fn) == FP8_DECODE_CONFIG
    assert FP8_DECODE_CONFIG.tile_n == 128
    # the launch policies measured on bf16 only stay off for FP8 caches (the balanced rule
    # by the length fraction alone, as measured there)
    assert FP8_DECODE_CONFIG.balanced_max_excess is None and not FP8_DECODE_CONFIG.flat_split
    assert default_decode_config(cuda, torch.bfloat16) == DecodeConfig()
    assert default_decode_config(cuda) == DecodeConfig()
    assert default_decode_config(torch.device("cpu"), torch.float8_e4m3fn) == INTERPRET_DECODE_CONFIG


def test_decode_kernel_window_sinks_lse(kernel_device):
    """The FP8 path composes with a sliding window, attention sinks and the lse output."""
    case = fp8_case([(30, 1), (9, 1), (50, 1)], block_size=4, k_scale=0.7, v_scale=1.3,
                    device=kernel_device, seed=5, sliding_window=12)
    m = case["meta"]
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0], device=kernel_device)
    out, lse = poisoned_out(case), torch.full(case["q"].shape[:2], float("nan"),
                                              device=kernel_device)
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, num_splits=2,
                           sliding_window=12, sinks=sinks, lse=lse, k_scale=0.7, v_scale=1.3)
    ref_lse = torch.empty(case["q"].shape[:2])
    ref = twin(case, sliding_window=12, sinks=sinks, lse=ref_lse)
    assert_served_close(out, ref, [0, 1, 2], torch.float32)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=2e-4, rtol=2e-4)
    # the twin of the launcher agrees as well
    out2 = poisoned_out(case)
    paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out2,
                               sliding_window=12, sinks=sinks, k_scale=0.7, v_scale=1.3)
    assert_served_close(out2, ref, [0, 1, 2], torch.float32)


def test_scale_errors():
    case = fp8_case([(4, 1)], block_size=4)
    m = case["meta"]
    for bad in (0.0, -2.0, float("inf"), torch.tensor(1.0)):
        with pytest.raises(ConfigError, match="k_scale"):
            paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                                   m.query_start_loc, m.seq_lens, 1, 1.0, poisoned_out(case),
                                   k_scale=bad)
        with pytest.raises(ConfigError, match="v_scale"):
            paged_attention_ref(case["q"], case["cache"], m, 1.0, v_scale=bad)


# mixed batches: fresh prefills, chunks with context, decodes, across blocks and tiles
MIXED = [(0, 7), (20, 9), (5, 1), (33, 17), (0, 1), (48, 3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)], ids=["s1", "s05_2"])
@pytest.mark.parametrize("block_size", [3, 16])
def test_prefill_kernel_matches_twin(kernel_device, dtype, scales, block_size):
    case = fp8_case(MIXED, block_size=block_size, k_scale=scales[0], v_scale=scales[1],
                    dtype=dtype, device=kernel_device, seed=10 + block_size, pad_tokens=2,
                    padded_reqs=1)
    m = case["meta"]
    out = poisoned_out(case)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out, skip_decode=True,
                            k_scale=scales[0], v_scale=scales[1])
    assert_served_close(out, twin(case), rows_of(case, lambda ql: ql > 1), dtype)
    rest = rows_of(case, lambda ql: ql == 1) + list(range(out.shape[0] - 2, out.shape[0]))
    assert torch.isnan(out.float().cpu()[rest]).all(), "decode / padding rows were written"


def test_prefill_kernel_window_and_noncausal_lse(kernel_device):
    case = fp8_case([(25, 6), (3, 12)], block_size=4, k_scale=0.8, v_scale=1.5,
                    device=kernel_device, seed=12, sliding_window=7)
    m = case["meta"]
    out = poisoned_out(case)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out, sliding_window=7,
                            k_scale=0.8, v_scale=1.5)
    assert_served_close(out, twin(case, sliding_window=7), list(range(18)), torch.float32)
    # cascade's prefix: every row against all keys of a request, with the log-sum-exp
    case = fp8_case([(25, 6), (3, 12)], block_size=4, k_scale=0.8, v_scale=1.5,
                    device=kernel_device, seed=12)
    m = case["meta"]
    out, lse = poisoned_out(case), torch.full(case["q"].shape[:2], float("nan"),
                                              device=kernel_device)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out, causal=False, lse=lse,
                            k_scale=0.8, v_scale=1.5)
    ref_lse = torch.empty(case["q"].shape[:2])
    ref = twin(case, causal=False, lse=ref_lse)
    assert_served_close(out, ref, list(range(18)), torch.float32)
    torch.testing.assert_close(lse.cpu(), ref_lse, atol=2e-4, rtol=2e-4)


@pytest.mark.parametrize("backend", ["triton", "torch_ref"])
def test_backend_writes_quantized_and_attends(kernel_device, backend):
    """One layer of a mixed step through a backend: the step's K/V written into the FP8 cache
    (quantized by the scales), then attention over it; the cache equals the torch writer's
    bit for bit and the output the twin's over that cache."""
    case = make_case(MIXED, block_size=4, device=kernel_device, seed=13, pad_tokens=3,
                     padded_reqs=1)
    cache = torch.empty(case["cache"].shape, dtype=F8, device=kernel_device)
    cache[0] = quantize_fp8_ref(case["cache"][0], 0.6, F8)  # the context; NaN elsewhere
    cache[1] = quantize_fp8_ref(case["cache"][1], 1.4, F8)
    m = case["meta"]
    n = int(m.num_actual_tokens)
    want_cpu = cache.cpu()  # the torch writer's result, on the CPU
    reshape_and_cache_ref(case["k"].cpu(), case["v"].cpu(), want_cpu[0], want_cpu[1],
                          m.slot_mapping[:n].cpu(), 0.6, 1.4)
    be = TritonAttentionBackend() if backend == "triton" else TorchRefBackend()
    plan = be.plan(m, AttentionLayout.of(case["q"], cache))
    out = be.forward(0, case["q"], case["k"], case["v"], cache, plan, case["scale"],
                     k_scale=0.6, v_scale=1.4)
    assert torch.equal(cache.cpu().view(torch.uint8), want_cpu.view(torch.uint8))
    ref = paged_attention_ref(case["q"].cpu(), want_cpu, m, case["scale"], k_scale=0.6,
                              v_scale=1.4)
    rows = rows_of(case, lambda ql: ql > 0)
    assert_served_close(out, ref, rows, torch.float32)
    assert (out.cpu()[len(rows):] == 0).all()  # padding rows are zero


def _quantized(cache32, k_scale, v_scale):
    cache = torch.empty(cache32.shape, dtype=F8, device=cache32.device)
    cache[0] = quantize_fp8_ref(cache32[0], k_scale, F8)
    cache[1] = quantize_fp8_ref(cache32[1], v_scale, F8)
    return cache


@pytest.mark.parametrize("decode_only", [True, False])
def test_cascade_over_fp8_cache_equals_plain(kernel_device, decode_only):
    """Cascade attention (prefix split over keys, suffix, merge) over an FP8 cache equals the
    plain Triton path and the twin; both wrote the same quantized K/V."""
    from test_cascade_backend import ALWAYS, make_shared_case

    reqs = [(5, 1), (9, 1), (0, 1), (13, 1)] if decode_only else [(5, 1), (9, 4), (0, 1), (13, 3)]
    case = make_shared_case(reqs, shared_blocks=3, block_size=4, device=kernel_device, seed=3)
    cache = _quantized(case["cache"], 0.7, 1.3)
    m = case["meta"]
    outs, caches = [], []
    for be in (TritonAttentionBackend(cascade=ALWAYS), TritonAttentionBackend(cascade=None)):
        c = cache.clone()
        plan = be.plan(m, AttentionLayout.of(case["q"], c))
        assert plan.cascade == (be.cascade is not None)
        outs.append(be.forward(0, case["q"], case["k"], case["v"], c, plan, case["scale"],
                               k_scale=0.7, v_scale=1.3).cpu())
        caches.append(c.cpu())
    assert torch.equal(caches[0].view(torch.uint8), caches[1].view(torch.uint8))
    n = case["n"]
    ref = paged_attention_ref(case["q"].cpu(), caches[0], m, case["scale"], k_scale=0.7,
                              v_scale=1.3)
    assert not torch.isnan(outs[0][:n]).any()
    torch.testing.assert_close(outs[0][:n], outs[1][:n], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(outs[0][:n], ref[:n], atol=2e-4, rtol=2e-4)


# ---- native GPU: bf16 queries, FP8 caches at the Qwen3-0.6B head shape


@pytest.mark.gpu
@pytest.mark.parametrize("scales", [(1.0, 1.0), (0.5, 2.0)], ids=["s1", "s05_2"])
def test_fp8_kernels_gpu_bf16_qwen3_shape(scales):
    torch.manual_seed(0)
    ctx = [int(x) for x in torch.randint(1, 3000, (29,))] + [8191, 1, 15, 16, 17]
    case = fp8_case([(c, 1) for c in ctx], block_size=16, num_heads=16, num_kv_heads=8,
                    head_dim=128, dtype=torch.bfloat16, device="cuda", seed=1,
                    k_scale=scales[0], v_scale=scales[1])
    m = case["meta"]
    ref = twin(case)
    for splits in (None, 1, 8):
        out = poisoned_out(case)
        paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                               m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"], out,
                               num_splits=splits, k_scale=scales[0], v_scale=scales[1])
        assert_served_close(out, ref, list(range(len(ctx))), torch.bfloat16)
    reqs = [(0, 700), (1000, 300), (5, 1), (129, 128), (0, 2048), (3000, 17)]
    case = fp8_case(reqs, block_size=16, num_heads=16, num_kv_heads=8, head_dim=128,
                    dtype=torch.bfloat16, device="cuda", seed=2, k_scale=scales[0],
                    v_scale=scales[1])
    m = case["meta"]
    out = poisoned_out(case)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out, k_scale=scales[0],
                            v_scale=scales[1])
    assert_served_close(out, twin(case), rows_of(case, lambda ql: ql > 0), torch.bfloat16)
