"""The gated delta rule kernels (recurrent decode, chunked varlen prefill) against their torch
twins on random batches with poisoned outputs (CPU through the interpreter, natively on the
GPU); the twins and kernels against transformers' Qwen3-Next ``torch_recurrent_gated_delta_rule``
and ``torch_chunk_gated_delta_rule``; the chunked kernel against the decode kernel token by
token; chunked prefill split anywhere equals the whole; a tiny Qwen3NextGatedDeltaNet forward
through causal_conv1d and the chunked kernel."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import check_state_rows, prefill_pieces, rel_close, to, varlen_state_batch

from pagedkv.errors import ConfigError
from pagedkv.kernels.gated_delta_rule import (
    chunk_gated_delta_rule,
    chunk_gated_delta_rule_ref,
    recurrent_gated_delta_rule,
    recurrent_gated_delta_rule_ref,
)


def _case(device, dtype, lens, hk, hv, kd, vd, seed, pad=(), init=None, l2=True,
          a_max=2.0):
    """Tokens of ``lens`` sequences; q/k/v are views into one projection buffer (as the mixer's
    split gives them); g and beta as the model computes them."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lens)
    t = sum(lens)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    slots = n + 3
    state = r(slots, hv, kd, vd).float() * 0.3
    width = 2 * hk * kd + hv * vd + 5
    proj = r(t, width)
    if not l2:  # keep |k| near 1 so the un-normalised delta rule stays bounded
        proj[:, :2 * hk * kd] *= kd ** -0.5
    proj = proj.to(dtype)
    A = torch.rand(hv, generator=gen) * (a_max - 0.01) + 0.01
    dt_bias = r(hv)
    g = -A * F.softplus(r(t, hv) + dt_bias)
    beta = torch.sigmoid(r(t, hv))
    qsl, idx, init = varlen_state_batch(gen, lens, slots, pad=pad, init=init)
    state, proj, g, beta, idx, qsl, init = to(device, state, proj, g, beta, idx, qsl, init)
    q = proj[:, :hk * kd].view(t, hk, kd)
    k = proj[:, hk * kd:2 * hk * kd].view(t, hk, kd)
    v = proj[:, 2 * hk * kd:2 * hk * kd + hv * vd].view(t, hv, vd)
    return state, q, k, v, g, beta, qsl, idx, init


def _hf():
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )
    return torch_recurrent_gated_delta_rule, torch_chunk_gated_delta_rule


def _quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


# ---------------------------------------------------------------------------------------------
# Decode (recurrent)

DECODE_SHAPES = [(1, 1, 16, 16), (2, 4, 16, 24), (1, 3, 8, 5), (1, 2, 32, 40)]  # hk hv K V


@pytest.mark.parametrize("shape", DECODE_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("l2", [True, False])
def test_recurrent_kernel_equals_twin(kernel_device, shape, dtype, l2):
    hk, hv, kd, vd = shape
    n = 5
    state, q, k, v, g, beta, _, idx, _ = _case(kernel_device, dtype, [1] * n, hk, hv, kd, vd,
                                               3, pad=(1, 4), l2=l2)
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(v, float("nan"))
    o2 = torch.full_like(v, float("nan"))
    for scale in (None, 0.3):  # two steps on the same slots
        recurrent_gated_delta_rule(s1, q, k, v, g, beta, idx, scale=scale, use_qk_l2norm=l2,
                                   out=o1)
        recurrent_gated_delta_rule_ref(s2, q, k, v, g, beta, idx, scale=scale,
                                       use_qk_l2norm=l2, out=o2)
        tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3,
                                                                             rtol=2e-3)
        torch.testing.assert_close(o1, o2, equal_nan=True, **tol)
        torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)
    check_state_rows(state, s1, o1, torch.arange(n + 1, dtype=torch.int32), idx)


@pytest.mark.parametrize("l2", [True, False])
def test_recurrent_twin_and_kernel_match_transformers(l2):
    recurrent_hf, _ = _hf()
    hk, hv, kd, vd, n = 2, 4, 16, 8, 3
    state, q, k, v, g, beta, _, idx, _ = _case("cpu", torch.float32, [1] * n, hk, hv, kd, vd,
                                               5, l2=l2)
    want, want_state = _quiet(recurrent_hf, q[:, None], k[:, None], v[:, None], g[:, None],
                              beta[:, None], initial_state=state[idx.long()],
                              output_final_state=True, use_qk_l2norm_in_kernel=l2)
    for fn in (recurrent_gated_delta_rule_ref, recurrent_gated_delta_rule):
        s = state.clone()
        o = fn(s, q, k, v, g, beta, idx, use_qk_l2norm=l2)
        torch.testing.assert_close(o, want[:, 0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(s[idx.long()], want_state, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Prefill (chunked)

LENS = [[0, 1, 15, 16, 17, 33, 70, 5], [70], [3, 0, 0, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("lens", LENS)
def test_chunk_kernel_equals_twin(kernel_device, dtype, chunk, lens):
    hk, hv, kd, vd = (2, 4, 48, 40) if kernel_device == "cuda" else (1, 2, 16, 12)
    pad = (2, 5) if len(lens) > 4 else ((0,) if len(lens) == 4 else ())
    state, q, k, v, g, beta, qsl, idx, init = _case(kernel_device, dtype, lens, hk, hv, kd, vd,
                                                    17 + chunk, pad=pad)
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(v, float("nan"))
    o2 = torch.full_like(v, float("nan"))
    chunk_gated_delta_rule(s1, q, k, v, g, beta, qsl, idx, init, chunk_size=chunk, out=o1)
    chunk_gated_delta_rule_ref(s2, q, k, v, g, beta, qsl, idx, init, out=o2)
    check_state_rows(state, s1, o1, qsl, idx)
    if kernel_device == "cuda" and dtype != torch.float32:  # TF32 products on the GPU
        ok = ~torch.isnan(o2)
        rel_close(o1[ok], o2[ok], 5e-3, "o")
        rel_close(s1, s2, 5e-3, "state")
        return
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(o1, o2, equal_nan=True, **tol)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("options", [dict(use_qk_l2norm=False), dict(scale=0.7),
                                     dict(strong_decay=True)])
def test_chunk_kernel_equals_twin_options(kernel_device, options):
    options = dict(options)
    strong = options.pop("strong_decay", False)
    lens = [20, 0, 37]
    state, q, k, v, g, beta, qsl, idx, init = _case(
        kernel_device, torch.float32, lens, 2, 2, 16, 40, 9, init=[True, True, False],
        l2=options.get("use_qk_l2norm", True), a_max=16.0 if strong else 2.0)
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(v, float("nan"))
    o2 = torch.full_like(v, float("nan"))
    chunk_gated_delta_rule(s1, q, k, v, g, beta, qsl, idx, init, chunk_size=16, out=o1,
                           **options)
    chunk_gated_delta_rule_ref(s2, q, k, v, g, beta, qsl, idx, init, out=o2, **options)
    torch.testing.assert_close(o1, o2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
    # the empty sequence with an initial state keeps it
    assert torch.equal(s1[int(idx[1])], state[int(idx[1])])


@pytest.mark.parametrize("hk,hv", [(1, 1), (2, 4)])
def test_chunk_twin_and_kernel_match_transformers(hk, hv):
    """transformers' chunked and recurrent torch functions (one sequence per call, the slot's
    state as initial_state when has_initial_state, output_final_state) equal the twin and the
    kernel."""
    recurrent_hf, chunk_hf = _hf()
    lens, kd, vd = [1, 23, 40], 16, 8
    state, q, k, v, g, beta, qsl, idx, init = _case("cpu", torch.float32, lens, hk, hv, kd, vd,
                                                    21, init=[False, True, True])
    s_ref, s_ker = state.clone(), state.clone()
    o_ref = chunk_gated_delta_rule_ref(s_ref, q, k, v, g, beta, qsl, idx, init)
    o_ker = chunk_gated_delta_rule(s_ker, q, k, v, g, beta, qsl, idx, init, chunk_size=16)
    bounds = qsl.tolist()
    for b in range(len(lens)):
        sl = slice(bounds[b], bounds[b + 1])
        slot = int(idx[b])
        args = (q[sl][None], k[sl][None], v[sl][None], g[sl][None], beta[sl][None])
        kw = dict(initial_state=state[slot][None] if init[b] else None, output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        for fn, extra in ((chunk_hf, dict(chunk_size=16)), (recurrent_hf, {})):
            want, want_state = _quiet(fn, *args, **kw, **extra)
            for o, s in ((o_ref, s_ref), (o_ker, s_ker)):
                torch.testing.assert_close(o[sl], want[0], atol=1e-4, rtol=1e-4)
                torch.testing.assert_close(s[slot], want_state[0], atol=1e-4, rtol=1e-4)


def test_chunk_kernel_equals_the_decode_kernel_token_by_token(kernel_device):
    lens, hk, hv, kd, vd = [9, 20], 2, 4, 16, 8
    state, q, k, v, g, beta, qsl, idx, init = _case(kernel_device, torch.float32, lens, hk, hv,
                                                    kd, vd, 4, init=[True, False])
    s_chunk = state.clone()
    o_chunk = chunk_gated_delta_rule(s_chunk, q, k, v, g, beta, qsl, idx, init, chunk_size=16)
    s_dec = state.clone()
    s_dec[int(idx[1])] = 0.0  # a fresh prompt starts from zeros
    bounds = qsl.tolist()
    for b in range(len(lens)):
        for t in range(bounds[b], bounds[b + 1]):
            o = recurrent_gated_delta_rule(s_dec, q[t:t + 1], k[t:t + 1], v[t:t + 1],
                                           g[t:t + 1], beta[t:t + 1], idx[b:b + 1])
            torch.testing.assert_close(o_chunk[t], o[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_chunk, s_dec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cuts", [(1,), (16, 17), (5, 40, 41, 64)])
def test_chunked_prefill_split_anywhere_equals_the_whole(kernel_device, cuts):
    lens = [70, 45]
    state, q, k, v, g, beta, qsl, idx, init = _case(kernel_device, torch.float32, lens, 1, 2,
                                                    16, 8, 8, init=[False, True])
    s_whole = state.clone()
    o_whole = chunk_gated_delta_rule(s_whole, q, k, v, g, beta, qsl, idx, init, chunk_size=16)
    s_part = state.clone()
    o_part = torch.full_like(v, float("nan"))
    for piece, rows, sub_qsl in prefill_pieces(qsl, lens, cuts):
        sub_init = init if piece == 0 else torch.ones_like(init)
        o = chunk_gated_delta_rule(s_part, q[rows].contiguous(), k[rows].contiguous(),
                                   v[rows].contiguous(), g[rows].contiguous(),
                                   beta[rows].contiguous(), sub_qsl, idx, sub_init,
                                   chunk_size=16)
        o_part[rows] = o
    torch.testing.assert_close(o_part, o_whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_part, s_whole, atol=1e-4, rtol=1e-4)


def test_qwen3_next_gated_deltanet_forward_through_the_kernels():
    """A tiny transformers Qwen3NextGatedDeltaNet with random weights: its forward over two
    prompts equals in_proj -> causal_conv1d -> chunk_gated_delta_rule (kernel) -> its gated
    norm -> out_proj over the same prompts as one varlen batch (fresh prompts: the NaN-filled
    slots are never read, only written)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    from pagedkv.kernels.causal_conv1d import causal_conv1d

    torch.manual_seed(0)
    cfg = Qwen3NextConfig(hidden_size=16, linear_num_key_heads=2, linear_num_value_heads=4,
                          linear_key_head_dim=16, linear_value_head_dim=8,
                          linear_conv_kernel_dim=4, num_hidden_layers=1, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=8, intermediate_size=32,
                          vocab_size=32, num_experts=0)
    mixer = Qwen3NextGatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for prm in mixer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.5)
        mixer.A_log.copy_(torch.rand(4) * 2.0)
    lens = [21, 7]
    prompts = [torch.randn(1, n, 16) for n in lens]
    hk, hv, kd, vd = 2, 4, 16, 8
    with torch.no_grad():
        want = torch.cat([_quiet(mixer, p)[0] for p in prompts])
        hs = torch.cat([p[0] for p in prompts])
        tlen = hs.shape[0]
        qh, kh, vh, z, b, a = mixer.fix_query_key_value_ordering(
            mixer.in_proj_qkvz(hs)[None], mixer.in_proj_ba(hs)[None])
        mixed = torch.cat([x.reshape(tlen, -1) for x in (qh[0], kh[0], vh[0])], -1)
        qsl = torch.tensor([0, lens[0], tlen], dtype=torch.int32)
        idx = torch.tensor([2, 0], dtype=torch.int32)
        fresh = torch.zeros(2, dtype=torch.bool)
        conv_state = torch.full((3, 3, mixer.conv_dim), float("nan"))
        mixed = causal_conv1d(mixed.contiguous(), conv_state,
                              mixer.conv1d.weight[:, 0].contiguous(), None, qsl, idx, fresh,
                              "silu")
        q, k, v = mixed.split([hk * kd, hk * kd, hv * vd], -1)
        beta = b[0].sigmoid()
        g = -mixer.A_log.float().exp() * F.softplus(a[0].float() + mixer.dt_bias)
        state = torch.full((3, hv, kd, vd), float("nan"))
        o = chunk_gated_delta_rule(state, q.reshape(tlen, hk, kd), k.reshape(tlen, hk, kd),
                                   v.reshape(tlen, hv, vd), g, beta.contiguous(), qsl, idx,
                                   fresh, chunk_size=16)
        o = mixer.norm(o.reshape(-1, vd), z[0].reshape(-1, vd)).reshape(tlen, -1)
        got = mixer.out_proj(o)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert not torch.isnan(state[[0, 2]]).any()


def test_bad_arguments_are_typed_errors():
    state, q, k, v, g, beta, qsl, idx, init = _case("cpu", torch.float32, [3, 2], 2, 4, 16, 8,
                                                    1)
    args = [state, q, k, v, g, beta, qsl, idx, init]
    with pytest.raises(ConfigError, match="multiple of HK"):
        q3 = torch.zeros(5, 3, 16)
        chunk_gated_delta_rule(state, q3, q3, v, g, beta, qsl, idx, init)
    with pytest.raises(ConfigError, match="g must be"):
        chunk_gated_delta_rule(state, q, k, v, g[:, :2], beta, qsl, idx, init)
    with pytest.raises(ConfigError, match="query_start_loc"):
        chunk_gated_delta_rule(state, q, k, v, g, beta, qsl[:2], idx, init)
    with pytest.raises(ConfigError, match="chunk_size"):
        chunk_gated_delta_rule(*args, chunk_size=256)
    with pytest.raises(ConfigError, match="share a dtype"):
        chunk_gated_delta_rule(state, q.half(), k.half(), v, g, beta, qsl, idx, init)
    with pytest.raises(ConfigError, match="one token per sequence"):
        recurrent_gated_delta_rule(state, q, k, v, g, beta, idx)
    with pytest.raises(ConfigError, match="v must be"):
        recurrent_gated_delta_rule(state, q[:2], k[:2], v[:2, :, :4], g[:2], beta[:2], idx)


# ---------------------------------------------------------------------------------------------
# Native GPU tests at Qwen3-Next's shape (16 key heads, 32 value heads, 128 x 128 state).


@pytest.mark.gpu
@pytest.mark.parametrize("lens,init", [([2048], [False]),
                                       ([700, 1, 0, 1000, 347], [True, False, True, True, False])])
@pytest.mark.parametrize("chunk", [32, 64])
def test_gpu_chunk_qwen3_next_shape_bf16(lens, init, chunk):
    state, q, k, v, g, beta, qsl, idx, init = _case("cuda", torch.bfloat16, lens, 16, 32, 128,
                                                    128, 5, init=init, a_max=16.0)
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(v, float("nan"))
    o2 = torch.full_like(v, float("nan"))
    chunk_gated_delta_rule(s1, q, k, v, g, beta, qsl, idx, init, chunk_size=chunk, out=o1)
    chunk_gated_delta_rule_ref(s2, q, k, v, g, beta, qsl, idx, init, out=o2)
    assert not torch.isnan(o1).any()
    rel_close(o1, o2, 2e-2, "o")
    rel_close(s1, s2, 5e-3, "state")
    check_state_rows(state, s1, o1, qsl, idx)


@pytest.mark.gpu
def test_gpu_chunk_fp32_equals_twin():
    state, q, k, v, g, beta, qsl, idx, init = _case("cuda", torch.float32, [513, 64, 1200], 16,
                                                    32, 128, 128, 6, init=[True, False, True])
    s1, s2 = state.clone(), state.clone()
    o1 = chunk_gated_delta_rule(s1, q, k, v, g, beta, qsl, idx, init)
    o2 = chunk_gated_delta_rule_ref(s2, q, k, v, g, beta, qsl, idx, init)
    rel_close(o1, o2, 1e-4, "o")
    rel_close(s1, s2, 1e-4, "state")


@pytest.mark.gpu
def test_gpu_recurrent_qwen3_next_shape_bf16():
    n = 256
    state, q, k, v, g, beta, _, idx, _ = _case("cuda", torch.bfloat16, [1] * n, 16, 32, 128,
                                               128, 7, pad=(3, 100, 255), a_max=16.0)
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(v, float("nan"))
    o2 = torch.full_like(v, float("nan"))
    recurrent_gated_delta_rule(s1, q, k, v, g, beta, idx, out=o1)
    recurrent_gated_delta_rule_ref(s2, q, k, v, g, beta, idx, out=o2)
    ok = ~torch.isnan(o2)
    rel_close(o1[ok], o2[ok], 1e-2, "o")
    rel_close(s1, s2, 1e-5, "state")
    check_state_rows(state, s1, o1, torch.arange(n + 1, dtype=torch.int32), idx)


def test_strided_per_sequence_vectors(kernel_device):
    """Both kernels follow strided ``state_indices`` (a column of ``MambaMetadata``'s
    ``[rows, 1 + spec_blocks]`` indices), ``query_start_loc`` and ``has_initial_state`` as the
    twins do (they used to read them densely: the second row took the first row's spare
    column)."""
    state, q, k, v, g, beta, qsl, idx, init = _case(kernel_device, torch.float32, [5, 1, 3],
                                                    1, 2, 16, 16, 13, init=[True, False, True])
    wide = torch.stack([idx, idx.flip(0) + 100], dim=1)
    qsl2 = torch.stack([qsl, qsl * 0 - 7], dim=1)[:, 0]
    init2 = torch.stack([init, ~init], dim=1)[:, 0]
    s1, s2 = state.clone(), state.clone()
    o1 = chunk_gated_delta_rule(s1, q, k, v, g, beta, qsl2, wide[:, 0], init2, chunk_size=16)
    o2 = chunk_gated_delta_rule_ref(s2, q, k, v, g, beta, qsl, idx, init, chunk_size=16)
    rel_close(o1, o2, 1e-4, "chunk outputs")
    rel_close(s1, s2, 1e-4, "chunk states")
    n = idx.shape[0]
    s1, s2 = state.clone(), state.clone()
    o1 = recurrent_gated_delta_rule(s1, q[:n], k[:n], v[:n], g[:n], beta[:n], wide[:, 0])
    o2 = recurrent_gated_delta_rule_ref(s2, q[:n], k[:n], v[:n], g[:n], beta[:n], idx)
    rel_close(o1, o2, 1e-4, "decode outputs")
    rel_close(s1, s2, 1e-4, "decode states")
