"""The fused LM head + greedy argmax (``pagedkv.kernels.lm_head_argmax``) against its torch twin
and against the unfused path (the product, then ``argmax``): by hand (ties, signed zeros, a NaN
row), on random inputs read through poisoned strides and slices (interpreted on CPU, native on
the GPU), a property test over small integers (exact products: ties everywhere), the
chunking by hand, the argument checks."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import pagedkv.kernels.lm_head_argmax as lha
from pagedkv.errors import ConfigError
from pagedkv.kernels.lm_head_argmax import (
    INTERPRET_CONFIG, LMHeadArgmaxConfig, chunking, config_for, lm_head_argmax,
    lm_head_argmax_ref)

NAN = float("nan")
MANY_CHUNKS = LMHeadArgmaxConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1,
                                 programs_per_sm=64.0)


def test_by_hand_ties_signed_zeros_and_a_nan_row():
    # hidden = the identity: logits[r] = weight[:, r], so the rows below are the weight's columns
    rows = [
        [1.0, 3.0, 3.0, 2.0, -1.0],      # tie: the first 3 -> 1
        [-5.0, -1.0, -2.0, -1.0, -7.0],  # all negative, tie -> 1
        [0.0, -0.0, -1.0, -0.0, -2.0],   # +0 and -0 equal -> 0
        [-0.0, 0.0, -1.0, -2.0, 0.0],    # -> 0
    ]
    want = [1, 1, 0, 0]
    for dtype in (torch.float32, torch.float16):
        w = torch.tensor(rows, dtype=dtype).t().contiguous()  # [V=5, K=4]
        h = torch.eye(4, dtype=dtype)
        for cfg in (None, MANY_CHUNKS):
            assert lm_head_argmax(h, w, cfg).tolist() == want, (dtype, cfg)
        assert lm_head_argmax_ref(h, w).tolist() == want
        h[2, 1] = NAN  # a NaN in a row's hidden state: every logit NaN, the first wins
        assert lm_head_argmax(h, w).tolist() == [1, 1, 0, 0]
        assert lm_head_argmax_ref(h, w).tolist() == [1, 1, 0, 0]


def test_config_for_and_chunking_by_hand():
    assert config_for(1) is config_for(16) and config_for(16).block_m == 16
    assert config_for(17).block_m == 64 and config_for(64).block_m == 64
    assert config_for(65) is config_for(256) and config_for(1000) is config_for(256)
    cfg = LMHeadArgmaxConfig(block_m=64, block_n=128, programs_per_sm=2.0)
    # 151,936 columns = 1,187 tiles of 128; 264 programs wanted at one row tile:
    # cdiv(1187, 264) = 5 tiles a chunk -> 238 chunks
    assert chunking(64, 151936, 132, cfg) == (238, 5)
    # two row tiles: 132 chunks wanted -> 9 tiles a chunk -> 132 chunks
    assert chunking(128, 151936, 132, cfg) == (132, 9)
    assert chunking(3, 100, 132, cfg) == (1, 1)  # one tile
    assert chunking(1, 1000, 2, LMHeadArgmaxConfig(block_n=16, programs_per_sm=3.0)) == (6, 11)


def _poisoned_inputs(M, V, K, dtype, seed):
    """Random hidden rows and weight, read through views whose neighbours are NaN: hidden
    rows of stride K + 5 (columns past K NaN) with NaN rows after M, the weight the first V
    rows of a buffer whose rows past V are NaN. Returns (views, clean copies)."""
    g = torch.Generator().manual_seed(seed)
    hb = torch.full((M + 3, K + 5), NAN)
    hb[:M, :K] = torch.randn(M, K, generator=g)
    wb = torch.full((V + 7, K), NAN)
    wb[:V] = torch.randn(V, K, generator=g)
    h, w = hb.to(dtype)[:M, :K], wb.to(dtype)[:V]
    return h, w, h.contiguous(), w.contiguous()


def _check_close_argmax(got, h, w):
    """``got`` is the twin's answer wherever the twin's top two logits differ by more than
    the accumulation-order noise, and a maximal logit everywhere."""
    logits = h.double() @ w.double().t()
    top2 = logits.topk(min(2, logits.shape[1]), dim=-1).values
    ref = lm_head_argmax_ref(h, w)
    picked = logits.gather(1, got[:, None])[:, 0]
    scale = logits.abs().amax(-1).clamp_min(1.0)
    tol = (1e-2 if h.dtype == torch.float16 else 1e-5) * scale
    assert torch.all(picked >= top2[:, 0] - tol), (got, ref)
    if top2.shape[1] == 2:
        clear = (top2[:, 0] - top2[:, 1]) > tol
        assert got[clear].tolist() == ref[clear].tolist()


@pytest.mark.parametrize("M,V,K", [(1, 1, 16), (5, 33, 24), (17, 100, 48), (40, 257, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_random_poisoned_views_match_the_twin(M, V, K, dtype):
    h, w, hc, wc = _poisoned_inputs(M, V, K, dtype, seed=M * 1000 + V + K)
    for cfg in (None, MANY_CHUNKS):
        got = lm_head_argmax(h, w, cfg)
        assert got.dtype == torch.int64 and got.shape == (M,)
        _check_close_argmax(got, hc, wc)


def test_no_rows():
    w = torch.randn(10, 16)
    assert lm_head_argmax(torch.zeros(0, 16), w).shape == (0,)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_property_small_integers_exact(data):
    """Entries in {-2..2}: every product is an exact integer in float32 and float16, so the
    kernel must give the twin's (torch's first-maximum) answer exactly, ties everywhere."""
    M = data.draw(st.integers(1, 20))
    V = data.draw(st.integers(1, 90))
    K = data.draw(st.sampled_from([16, 32, 40]))
    dtype = data.draw(st.sampled_from([torch.float32, torch.float16]))
    seed = data.draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-2, 3, (M, K), generator=g).to(dtype)
    w = torch.randint(-2, 3, (V, K), generator=g).to(dtype)
    want = (h.float() @ w.float().t()).argmax(-1).tolist()
    assert lm_head_argmax_ref(h, w).tolist() == want
    cfg = data.draw(st.sampled_from([None, MANY_CHUNKS, INTERPRET_CONFIG]))
    assert lm_head_argmax(h, w, cfg).tolist() == want


def test_bad_arguments():
    w = torch.randn(10, 16)
    with pytest.raises(ConfigError):
        lm_head_argmax(torch.zeros(16), w)
    with pytest.raises(ConfigError):
        lm_head_argmax(torch.zeros(2, 8), w)  # K mismatch
    with pytest.raises(ConfigError):
        lm_head_argmax(torch.zeros(2, 16, dtype=torch.float16), w)  # dtypes differ
    with pytest.raises(ConfigError):
        lm_head_argmax(torch.zeros(2, 16, dtype=torch.int32), w.int())
    with pytest.raises(ConfigError):
        lm_head_argmax(torch.zeros(16, 2).t(), w)  # columns not contiguous
    with pytest.raises(ConfigError):
        lm_head_argmax(torch.zeros(2, 16), torch.zeros(0, 16))
    with pytest.raises(ConfigError):
        LMHeadArgmaxConfig(block_n=48)
    with pytest.raises(ConfigError):
        LMHeadArgmaxConfig(programs_per_sm=0)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 64, 100, 160, 256])
def test_model_shape_on_gpu(rows):
    """Qwen3's LM head (151,936 x 1,024, bf16) on the GPU: a maximal logit in every row, the
    unfused path's token (cuBLAS's bf16 logits, then argmax) in nearly every row (they may
    differ where two logits round to neighbouring bf16 values in one accumulation order and
    to one value in the other), and the twin's answer wherever the top two differ clearly."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(rows)
    h = torch.randn(rows, 1024, device="cuda", generator=g).bfloat16()
    w = (torch.randn(151936, 1024, device="cuda", generator=g) * 0.05).bfloat16()
    got = lm_head_argmax(h, w)
    logits = h.float() @ w.float().t()
    top2 = logits.topk(2, dim=-1).values
    picked = logits.gather(1, got[:, None])[:, 0]
    ulp = top2[:, 0].abs() * 2 ** -7  # two bf16 ulps
    assert torch.all(picked >= top2[:, 0] - ulp)
    clear = (top2[:, 0] - top2[:, 1]) > ulp
    assert got[clear].tolist() == lm_head_argmax_ref(h, w)[clear].tolist()
    assert lha.fused_applies(h, w) == (rows <= lha.FUSED_MAX_ROWS)
    unfused = torch.nn.functional.linear(h, w).argmax(-1)
    assert (got == unfused).float().mean().item() >= 0.98
    # strided rows and a vocabulary slice: same answer as contiguous copies
    hb = torch.randn(rows, 1100, device="cuda", generator=g).bfloat16()
    view = hb[:, :1024]
    assert lm_head_argmax(view, w[:150000]).tolist() == lm_head_argmax(
        view.contiguous(), w[:150000].contiguous()).tolist()


@pytest.mark.skipif(not __import__("triton").__version__.startswith("3.6."),
                    reason="compiled with the Triton version the H200 runs (3.6)")
@pytest.mark.parametrize("bucket", sorted(lha.CONFIGS))
def test_configs_compile_for_sm90_pipelined_without_spills(bucket):
    """Every launch config of ``CONFIGS`` compiles for the H200 (sm_90, on the CPU: a fresh
    process without TRITON_INTERPRET) into one software-pipelined loop (its copies kept in
    flight: an async wait with num > 0) that spills nothing. With the inner dimension not
    specialized the loads were 2-byte and unpipelined; with a loop over column tiles around
    the K loop the pipeline drained at every tile (two loops)."""
    import json
    import os
    import subprocess
    import sys

    c = lha.CONFIGS[bucket]
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    cfg = f"{c.block_m},{c.block_n},{c.block_k},{c.num_warps},{c.num_stages}"
    res = subprocess.run([sys.executable, "-m", "pagedkv.tools.sm90_report", "lm-head-argmax",
                          cfg, "--json", "--sass"], capture_output=True, text=True, env=env,
                         timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["loops"] == 1 and rep["local"] == 0 and rep["waits"][0] > 0, rep
    assert "LDG.E.U16" not in rep["sass_loads"], rep["sass_loads"]
