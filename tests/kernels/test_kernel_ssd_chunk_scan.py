"""ssd_chunk_scan (Triton) against its torch twin on random varlen batches with poisoned
outputs (CPU through the interpreter, natively on the GPU); the twin against transformers'
Bamba / Mamba-2 chunk form (``mamba2_chunk_scan`` with initial and final states) and against
the decode kernel's twin applied token by token; chunked prefill split anywhere equals the
whole prompt."""

import math

import pytest
import torch
from kernel_helpers import check_state_rows, prefill_pieces, rel_close, to, varlen_state_batch

from pagedkv.errors import ConfigError
from pagedkv.kernels.selective_state_update import selective_state_update_ref
from pagedkv.kernels.ssd_chunk_scan import ssd_chunk_scan, ssd_chunk_scan_ref


def _case(device, dtype, lens, nh, hd, ds, ng, seed, pad=(), init=None, realistic=False):
    """A varlen batch; x and dt are views into one wider projection buffer (as the mixer's
    in_proj split gives them), B and C too."""
    g = torch.Generator().manual_seed(seed)
    n, t = len(lens), sum(lens)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    slots = n + 3
    state = r(slots, nh, hd, ds).float()
    width = nh * hd + nh + 2 * ng * ds + 3
    proj = r(t, width).to(dtype)
    if realistic:  # Mamba-2's initialisation ranges: A in -[1, 16], softplus(dt) in [1e-3, 0.1]
        A = -torch.exp(torch.rand(nh, generator=g) * math.log(16.0))
        dt_init = torch.exp(torch.rand(nh, generator=g) * (math.log(0.1) - math.log(1e-3))
                            + math.log(1e-3))
        dt_bias = dt_init + torch.log(-torch.expm1(-dt_init))
    else:
        A = -torch.exp(r(nh))
        dt_bias = r(nh)
    D = r(nh)
    qsl, idx, init = varlen_state_batch(g, lens, slots, pad=pad, init=init)
    state, proj, A, dt_bias, D, qsl, idx, init = to(device, state, proj, A, dt_bias, D, qsl, idx, init)
    x = proj[:, :nh * hd].view(t, nh, hd)
    dt = proj[:, nh * hd:nh * hd + nh]
    o = nh * hd + nh
    B = proj[:, o:o + ng * ds].view(t, ng, ds)
    C = proj[:, o + ng * ds:o + 2 * ng * ds].view(t, ng, ds)
    return state, x, dt, dt_bias, A, B, C, D, qsl, idx, init


LENS = [[0, 1, 15, 16, 17, 33, 70, 5], [70], [3, 0, 0, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunk", [16, 64])
@pytest.mark.parametrize("lens", LENS)
def test_kernel_equals_twin(kernel_device, dtype, chunk, lens):
    nh, hd, ds, ng = (8, 24, 40, 2) if kernel_device == "cuda" else (4, 8, 16, 2)
    pad = (2, 5) if len(lens) > 4 else ((0,) if len(lens) == 4 else ())
    state, x, dt, dt_bias, A, B, C, D, qsl, idx, init = _case(
        kernel_device, dtype, lens, nh, hd, ds, ng, 11 + chunk, pad=pad)
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(x, float("nan"))
    o2 = torch.full_like(x, float("nan"))
    ssd_chunk_scan(s1, x, dt, dt_bias, A, B, C, D, qsl, idx, init, chunk_size=chunk, out=o1)
    ssd_chunk_scan_ref(s2, x, dt, dt_bias, A, B, C, D, qsl, idx, init, out=o2)
    check_state_rows(state, s1, o1, qsl, idx)
    if kernel_device == "cuda" and dtype != torch.float32:
        # TF32 products on the GPU: relative to the largest value (a CPU emulation of TF32
        # rounding of the kernel's products measured <= 1e-3 for y and 4e-4 for the state)
        ok = ~torch.isnan(o2)
        rel_close(o1[ok], o2[ok], 5e-3, "y")
        rel_close(s1, s2, 2e-3, "state")
        return
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(o1, o2, equal_nan=True, **tol)
    torch.testing.assert_close(s1, s2, **tol)


@pytest.mark.parametrize("options", [
    dict(dt_min=0.05, dt_max=0.5),
    dict(dt_softplus=False, dt_min=0.0, dt_max=0.3),
    dict(no_d=True, no_bias=True),
])
def test_kernel_equals_twin_options(kernel_device, options):
    options = dict(options)
    no_d, no_bias = options.pop("no_d", False), options.pop("no_bias", False)
    lens = [20, 0, 37]
    state, x, dt, dt_bias, A, B, C, D, qsl, idx, init = _case(
        kernel_device, torch.float32, lens, 3, 40, 12, 1, 3, init=[True, True, False])
    if no_d:
        D = None
    if no_bias:
        dt_bias = None
    if not options.get("dt_softplus", True):
        dt = dt.abs()
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(x, float("nan"))
    o2 = torch.full_like(x, float("nan"))
    ssd_chunk_scan(s1, x, dt, dt_bias, A, B, C, D, qsl, idx, init, chunk_size=16, out=o1,
                   **options)
    ssd_chunk_scan_ref(s2, x, dt, dt_bias, A, B, C, D, qsl, idx, init, out=o2, **options)
    torch.testing.assert_close(o1, o2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
    # the empty sequence with an initial state keeps it; a fresh empty one would be zeros
    assert torch.equal(s1[int(idx[1])], state[int(idx[1])])


def _hf_chunk_scan():
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan
    return mamba2_chunk_scan


@pytest.mark.parametrize("ng", [1, 2])
def test_twin_and_kernel_match_transformers_chunk_form(ng):
    """transformers' Bamba chunk form (batch of one per sequence, initial_states from the slot
    when has_initial_state, return_final_states) equals the twin and the kernel."""
    mamba2_chunk_scan = _hf_chunk_scan()
    lens, nh, hd, ds = [1, 23, 40], 4, 6, 10
    state, x, dt, dt_bias, A, B, C, D, qsl, idx, init = _case(
        "cpu", torch.float32, lens, nh, hd, ds, ng, 21, init=[False, True, True])
    s_ref, s_ker = state.clone(), state.clone()
    y_ref = ssd_chunk_scan_ref(s_ref, x, dt, dt_bias, A, B, C, D, qsl, idx, init,
                               dt_min=0.001, dt_max=2.0)
    y_ker = ssd_chunk_scan(s_ker, x, dt, dt_bias, A, B, C, D, qsl, idx, init, chunk_size=16,
                           dt_min=0.001, dt_max=2.0)
    q = qsl.tolist()
    for b in range(len(lens)):
        sl = slice(q[b], q[b + 1])
        slot = int(idx[b])
        y_hf, final = mamba2_chunk_scan(
            x[sl][None], dt[sl][None], A, B[sl][None], C[sl][None], chunk_size=16, D=D,
            dt_bias=dt_bias, initial_states=state[slot][None] if init[b] else None,
            dt_softplus=True, dt_limit=(0.001, 2.0), return_final_states=True)
        torch.testing.assert_close(y_ref[sl], y_hf[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s_ref[slot], final[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y_ker[sl], y_hf[0], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s_ker[slot], final[0], atol=1e-4, rtol=1e-4)


def test_twin_matches_the_decode_step_token_by_token():
    """Prefill through the chunk scan == selective_state_update applied to each token."""
    lens, nh, hd, ds, ng = [9, 4], 6, 5, 8, 3
    state, x, dt, dt_bias, A, B, C, D, qsl, idx, init = _case(
        "cpu", torch.float32, lens, nh, hd, ds, ng, 4, init=[True, False])
    s_scan = state.clone()
    y_scan = ssd_chunk_scan_ref(s_scan, x, dt, dt_bias, A, B, C, D, qsl, idx, init,
                                dt_min=0.01, dt_max=1.5)
    s_dec = state.clone()
    q = qsl.tolist()
    for b in range(len(lens)):
        slot = idx[b:b + 1]
        if not init[b]:
            s_dec[int(slot)] = 0.0
        for t in range(q[b], q[b + 1]):
            y = selective_state_update_ref(s_dec, x[t:t + 1], dt[t:t + 1], dt_bias, A,
                                           B[t:t + 1], C[t:t + 1], D, slot, dt_min=0.01,
                                           dt_max=1.5)
            torch.testing.assert_close(y_scan[t], y[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_scan, s_dec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cuts", [(1,), (16, 17), (5, 40, 41, 64)])
def test_chunked_prefill_split_anywhere_equals_the_whole(kernel_device, cuts):
    """Two sequences prefilled in pieces (each later piece continues from the slot, as the
    scheduler's chunked prefill runs them) give the outputs and states of one call."""
    lens = [70, 45]
    nh, hd, ds, ng = 4, 8, 16, 1
    state, x, dt, dt_bias, A, B, C, D, qsl, idx, init = _case(
        kernel_device, torch.float32, lens, nh, hd, ds, ng, 8, init=[False, True])
    s_whole = state.clone()
    y_whole = ssd_chunk_scan(s_whole, x, dt, dt_bias, A, B, C, D, qsl, idx, init,
                             chunk_size=16)
    s_part = state.clone()
    y_part = torch.full_like(x, float("nan"))
    for piece, rows, sub_qsl in prefill_pieces(qsl, lens, cuts):
        sub_init = init if piece == 0 else torch.ones_like(init)
        y = ssd_chunk_scan(s_part, x[rows].contiguous(), dt[rows].contiguous(), dt_bias, A,
                           B[rows].contiguous(), C[rows].contiguous(), D, sub_qsl, idx,
                           sub_init, chunk_size=16)
        y_part[rows] = y
    torch.testing.assert_close(y_part, y_whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_part, s_whole, atol=1e-4, rtol=1e-4)


def test_bad_arguments_are_typed_errors():
    state, x, dt, dt_bias, A, B, C, D, qsl, idx, init = _case(
        "cpu", torch.float32, [3, 2], 4, 3, 5, 2, 1)
    args = [state, x, dt, dt_bias, A, B, C, D, qsl, idx, init]

    def call(i, v, **kw):
        a = list(args)
        a[i] = v
        ssd_chunk_scan(*a, **kw)

    with pytest.raises(ConfigError, match="multiple of ngroups"):
        b3 = B[:, :1].expand(5, 3, 5).contiguous()
        ssd_chunk_scan(state, x, dt, dt_bias, A, b3, b3, D, qsl, idx, init)
    with pytest.raises(ConfigError, match="dt must be"):
        call(2, dt[:, :2])
    with pytest.raises(ConfigError, match="query_start_loc"):
        call(8, qsl[:2])
    with pytest.raises(ConfigError, match="chunk_size"):
        ssd_chunk_scan(*args, chunk_size=48)
    with pytest.raises(ConfigError, match="x must be"):
        call(1, x[..., :2])
    with pytest.raises(ConfigError, match="dstate"):
        s = torch.zeros(5, 4, 3, 300)
        bb = torch.zeros(5, 2, 300)
        ssd_chunk_scan(s, x, dt, dt_bias, A, bb, bb, D, qsl, idx, init)


# ---------------------------------------------------------------------------------------------
# Native GPU tests at a realistic shape (bf16 inputs, float32 state).


@pytest.mark.gpu
@pytest.mark.parametrize("lens,init", [([2048], [False]),
                                       ([700, 1, 0, 1000, 347], [True, False, True, True, False])])
@pytest.mark.parametrize("chunk", [64, 128])
def test_gpu_realistic_shape_bf16(lens, init, chunk):
    nh, hd, ds, ng = 64, 64, 128, 1
    state, x, dt, dt_bias, A, B, C, D, qsl, idx, init = _case(
        "cuda", torch.bfloat16, lens, nh, hd, ds, ng, 5, init=init, realistic=True)
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(x, float("nan"))
    o2 = torch.full_like(x, float("nan"))
    ssd_chunk_scan(s1, x, dt, dt_bias, A, B, C, D, qsl, idx, init, chunk_size=chunk, out=o1)
    ssd_chunk_scan_ref(s2, x, dt, dt_bias, A, B, C, D, qsl, idx, init, out=o2)
    assert not torch.isnan(o1).any()
    rel_close(o1, o2, 2e-2, "y")
    torch.testing.assert_close(o1.float(), o2.float(), atol=2e-2 * o2.float().abs().max().item(),
                               rtol=2e-2)
    rel_close(s1, s2, 5e-3, "state")
    check_state_rows(state, s1, o1, qsl, idx)


@pytest.mark.gpu
def test_gpu_realistic_shape_fp32_groups():
    nh, hd, ds, ng = 32, 64, 128, 4
    lens = [513, 64, 1200]
    state, x, dt, dt_bias, A, B, C, D, qsl, idx, init = _case(
        "cuda", torch.float32, lens, nh, hd, ds, ng, 6, init=[True, False, True],
        realistic=True)
    s1, s2 = state.clone(), state.clone()
    o1 = ssd_chunk_scan(s1, x, dt, dt_bias, A, B, C, D, qsl, idx, init)
    o2 = ssd_chunk_scan_ref(s2, x, dt, dt_bias, A, B, C, D, qsl, idx, init)
    rel_close(o1, o2, 1e-4, "y")
    rel_close(s1, s2, 1e-4, "state")


def test_bamba_mixer_forward_through_the_kernels():
    """A tiny transformers BambaMixer with random weights: its forward over a batch of prompts
    equals in_proj -> causal_conv1d -> ssd_chunk_scan (kernel) -> its gated norm -> out_proj
    over the same prompts as one varlen batch (fresh prompts: the NaN-filled conv and SSM
    slots are never read, only written)."""
    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaMixer

    from pagedkv.kernels.causal_conv1d import causal_conv1d

    torch.manual_seed(0)
    cfg = BambaConfig(hidden_size=16, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
                      mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                      intermediate_size=32, vocab_size=32, time_step_limit=(0.01, 5.0))
    mixer = BambaMixer(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for prm in mixer.parameters():
            prm.copy_(torch.randn_like(prm) * 0.5)
        mixer.A_log.copy_(torch.rand(4) * 2.0)
    lens = [21, 7]
    prompts = [torch.randn(1, n, 16) for n in lens]
    with torch.no_grad():
        want = [mixer(p) for p in prompts]
        hs = torch.cat([p[0] for p in prompts])
        proj = mixer.in_proj(hs)
        inter, conv_dim, nh = mixer.intermediate_size, mixer.conv_dim, mixer.num_heads
        gate, xbc, dt = proj.split([inter, conv_dim, nh], dim=-1)
        qsl = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
        idx = torch.tensor([1, 0], dtype=torch.int32)
        fresh = torch.zeros(2, dtype=torch.bool)
        conv_state = torch.full((2, 3, conv_dim), float("nan"))
        xbc = causal_conv1d(xbc.contiguous(), conv_state, mixer.conv1d.weight[:, 0].contiguous(),
                            mixer.conv1d.bias, qsl, idx, fresh, "silu")
        gs = mixer.n_groups * mixer.ssm_state_size
        x, B, C = xbc.split([inter, gs, gs], dim=-1)
        ssm_state = torch.full((2, nh, mixer.head_dim, mixer.ssm_state_size), float("nan"))
        y = ssd_chunk_scan(ssm_state, x.reshape(-1, nh, mixer.head_dim), dt, mixer.dt_bias,
                           -torch.exp(mixer.A_log.float()), B.reshape(-1, mixer.n_groups, 16),
                           C.reshape(-1, mixer.n_groups, 16), mixer.D, qsl, idx, fresh,
                           dt_min=0.01, dt_max=5.0, chunk_size=16)
        got = mixer.out_proj(mixer.norm(y.reshape(-1, inter), gate))
    torch.testing.assert_close(got, torch.cat([w[0] for w in want]), atol=1e-4, rtol=1e-4)
    assert not torch.isnan(ssm_state).any()
