"""selective_scan / selective_scan_update (Mamba-1, Triton) against their torch twins on random
varlen batches with NaN-poisoned outputs and strided state views (CPU through the interpreter,
natively on the GPU): lengths across chunk boundaries, PAD_SLOT_ID rows and unused slots
untouched; the twins against transformers' Mamba-1 math (``mamba_selective_scan`` with a final
state, ``mamba_selective_state_update``); the scan against the decode step token by token;
chunked prefill split anywhere equals the whole prompt; typed errors."""

import pytest
import torch
from kernel_helpers import check_state_rows, prefill_pieces, rel_close, to, varlen_state_batch

from pagedkv.errors import ConfigError
from pagedkv.kernels.selective_scan import (
    selective_scan,
    selective_scan_ref,
    selective_scan_update,
    selective_scan_update_ref,
)


def _case(device, dtype, lens, dim, ds, seed, pad=(), init=None, realistic=False):
    """A varlen batch. x, dt, z, B and C are views into one wider projection buffer (as the
    mixer's splits give them); the state is a strided view into a wider pool (slot stride
    larger than D * N, as the engine's shared pages are)."""
    g = torch.Generator().manual_seed(seed)
    n, t = len(lens), sum(lens)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    slots = n + 3
    pool = r(slots, dim * ds + 5).float()
    width = 3 * dim + 2 * ds + 3
    proj = r(t, width).to(dtype)
    if realistic:  # Mamba-1's ranges: A = -[1..N] per channel, softplus(dt) in [1e-3, 0.1]
        A = -torch.arange(1, ds + 1, dtype=torch.float32)[None].expand(dim, ds).contiguous()
        dt_init = torch.exp(torch.rand(dim, generator=g) * (torch.log(torch.tensor(0.1))
                                                            - torch.log(torch.tensor(1e-3)))
                            + torch.log(torch.tensor(1e-3)))
        dt_bias = dt_init + torch.log(-torch.expm1(-dt_init))
        proj[:, dim:2 * dim] = (0.1 * r(t, dim)).to(dtype)
    else:
        A = -torch.exp(r(dim, ds))
        dt_bias = r(dim)
    D = r(dim)
    qsl, idx, init = varlen_state_batch(g, lens, slots, pad=pad, init=init)
    pool, proj, A, dt_bias, D, qsl, idx, init = to(device, pool, proj, A, dt_bias, D, qsl, idx, init)
    state = pool[:, :dim * ds].view(slots, dim, ds)
    x, dt, z = proj[:, :dim], proj[:, dim:2 * dim], proj[:, 2 * dim:3 * dim]
    B = proj[:, 3 * dim:3 * dim + ds]
    C = proj[:, 3 * dim + ds:3 * dim + 2 * ds]
    return state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init


def _clone_state(state):
    """A copy with the same strided layout (a view into a copy of its pool)."""
    pool = state.as_strided((state.shape[0], state.stride(0)), (state.stride(0), 1)).clone()
    return pool[:, :state.shape[1] * state.shape[2]].view(state.shape)


LENS = [[0, 1, 15, 16, 17, 33, 40, 5], [47], [3, 0, 0, 2]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("chunk", [1, 4, 16])
@pytest.mark.parametrize("lens", LENS)
def test_kernel_equals_twin(kernel_device, dtype, chunk, lens):
    dim, ds = (160, 16) if kernel_device == "cuda" else (40, 12)  # two channel blocks, one partial
    pad = (2, 5) if len(lens) > 4 else ((0,) if len(lens) == 4 else ())
    state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init = _case(
        kernel_device, dtype, lens, dim, ds, 11 + chunk, pad=pad)
    s1, s2 = _clone_state(state), _clone_state(state)
    assert s1.stride() == state.stride() and not s1.is_contiguous()
    o1 = torch.full_like(x, float("nan"))
    o2 = torch.full_like(x, float("nan"))
    selective_scan(s1, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init, chunk_size=chunk, out=o1)
    selective_scan_ref(s2, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init, out=o2)
    check_state_rows(state, s1, o1, qsl, idx)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(o1, o2, equal_nan=True, **tol)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
    # the pool's bytes between the slots' states (the page padding) are never written
    gap = lambda s: s.as_strided((s.shape[0], 5), (s.stride(0), 1), s.shape[1] * s.shape[2])  # noqa: E731
    assert torch.equal(gap(s1), gap(state))


@pytest.mark.parametrize("options", [
    dict(no_z=True),
    dict(no_d=True, no_bias=True),
    dict(dt_softplus=False),
])
def test_kernel_equals_twin_options(kernel_device, options):
    options = dict(options)
    no_z, no_d, no_bias = (options.pop(k, False) for k in ("no_z", "no_d", "no_bias"))
    lens = [20, 0, 37]
    state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init = _case(
        kernel_device, torch.float32, lens, 24, 8, 3, init=[True, True, False])
    z = None if no_z else z
    D = None if no_d else D
    dt_bias = None if no_bias else dt_bias
    if not options.get("dt_softplus", True):  # dt + bias used as given: keep it positive
        dt, dt_bias = dt.abs(), dt_bias.abs()
    s1, s2 = _clone_state(state), _clone_state(state)
    o1 = torch.full_like(x, float("nan"))
    o2 = torch.full_like(x, float("nan"))
    selective_scan(s1, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init, chunk_size=8, out=o1,
                   **options)
    selective_scan_ref(s2, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init, out=o2, **options)
    torch.testing.assert_close(o1, o2, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
    # the empty sequence with an initial state keeps it; the fresh one (row 2) starts at zeros
    assert torch.equal(s1[int(idx[1])], state[int(idx[1])])


def test_empty_fresh_sequence_writes_zeros(kernel_device):
    state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init = _case(
        kernel_device, torch.float32, [3, 0], 16, 4, 9, init=[True, False])
    s = _clone_state(state)
    selective_scan(s, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init)
    assert torch.equal(s[int(idx[1])], torch.zeros_like(s[int(idx[1])]))
    assert not torch.equal(s[int(idx[0])], state[int(idx[0])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_update_kernel_equals_twin(kernel_device, dtype):
    n, dim, ds = 7, 40, 12
    state, x, dt, dt_bias, A, B, C, D, z, _, idx, _ = _case(
        kernel_device, dtype, [1] * n, dim, ds, 5, pad=(1, 4))
    s1, s2 = _clone_state(state), _clone_state(state)
    o1 = torch.full_like(x, float("nan"))
    o2 = torch.full_like(x, float("nan"))
    selective_scan_update(s1, x, dt, dt_bias, A, B, C, D, z, idx, out=o1)
    selective_scan_update_ref(s2, x, dt, dt_bias, A, B, C, D, z, idx, out=o2)
    qsl = torch.arange(n + 1, dtype=torch.int32)
    check_state_rows(state, s1, o1, qsl, idx)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
    torch.testing.assert_close(o1, o2, equal_nan=True, **tol)
    torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
    # a decode batch through the varlen kernel (one token per row, states present) is the same
    s3 = _clone_state(state)
    o3 = torch.full_like(x, float("nan"))
    selective_scan(s3, x, dt, dt_bias, A, B, C, D, z, qsl.to(x.device), idx,
                   torch.ones(n, dtype=torch.bool, device=x.device), out=o3)
    torch.testing.assert_close(o3, o1, equal_nan=True, **tol)
    torch.testing.assert_close(s3, s1, atol=1e-5, rtol=1e-5)


# ---- the twins against transformers' Mamba-1 math


def _hf():
    from transformers.models.jamba.modeling_jamba import (
        mamba_selective_scan,
        mamba_selective_state_update,
    )
    return mamba_selective_scan, mamba_selective_state_update


@pytest.mark.parametrize("with_z", [True, False])
def test_twin_matches_transformers_scan(with_z):
    """transformers' scan (channel-major ``[1, D, L]``, zero initial state, ``delta_bias``,
    ``delta_softplus``, ``return_last_state``) per sequence == the twin on the varlen batch (and
    the kernel, interpreted on CPU)."""
    mamba_selective_scan, _ = _hf()
    lens, dim, ds = [1, 23, 9], 10, 6
    state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init = _case(
        "cpu", torch.float32, lens, dim, ds, 21, init=[False, False, False])
    z = z if with_z else None
    s_ref, s_ker = _clone_state(state), _clone_state(state)
    y_ref = selective_scan_ref(s_ref, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init)
    y_ker = selective_scan(s_ker, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init, chunk_size=8)
    q = qsl.tolist()
    for b in range(len(lens)):
        sl = slice(q[b], q[b + 1])
        tr = lambda v: v[sl].T[None]  # noqa: E731  [1, C, L]
        y_hf, final = mamba_selective_scan(tr(x), tr(dt), A, tr(B), tr(C), D=D,
                                           z=None if z is None else tr(z), delta_bias=dt_bias,
                                           delta_softplus=True, return_last_state=True)
        slot = int(idx[b])
        for y, s in ((y_ref, s_ref), (y_ker, s_ker)):
            torch.testing.assert_close(y[sl], y_hf[0].T, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(s[slot], final[0], atol=1e-5, rtol=1e-5)


def test_update_twin_matches_transformers_state_update():
    """transformers' decode step (batch of sequences, state in place) == the twin's."""
    _, mamba_selective_state_update = _hf()
    n, dim, ds = 4, 12, 5
    state, x, dt, dt_bias, A, B, C, D, z, _, idx, _ = _case("cpu", torch.float32, [1] * n, dim,
                                                            ds, 13)
    s_ref = _clone_state(state)
    y_ref = selective_scan_update_ref(s_ref, x, dt, dt_bias, A, B, C, D, z, idx)
    rows = idx.long()
    s_hf = state[rows].clone()
    y_hf = mamba_selective_state_update(s_hf, x, dt, A, B, C, D, z=z, dt_bias=dt_bias,
                                        dt_softplus=True)
    torch.testing.assert_close(y_ref, y_hf, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_ref[rows], s_hf, atol=1e-6, rtol=1e-6)


def test_scan_equals_the_decode_step_token_by_token(kernel_device):
    """Prefill through the scan == the decode kernel applied to each token in turn."""
    lens, dim, ds = [9, 4], 20, 8
    state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init = _case(
        kernel_device, torch.float32, lens, dim, ds, 4, init=[True, False])
    s_scan = _clone_state(state)
    y_scan = selective_scan(s_scan, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init)
    s_dec = _clone_state(state)
    q = qsl.tolist()
    for b in range(len(lens)):
        slot = idx[b:b + 1]
        if not init[b]:
            s_dec[int(slot)] = 0.0
        for t in range(q[b], q[b + 1]):
            r = slice(t, t + 1)
            y = selective_scan_update(s_dec, x[r], dt[r], dt_bias, A, B[r], C[r], D, z[r], slot)
            torch.testing.assert_close(y_scan[r], y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_scan, s_dec, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cuts", [(1,), (16, 17), (5, 31, 32, 33)])
def test_chunked_prefill_split_anywhere_equals_the_whole(kernel_device, cuts):
    """Two sequences prefilled in pieces (each later piece continues from the slot, as the
    scheduler's chunked prefill runs them) give the outputs and states of one call."""
    lens = [45, 38]
    dim, ds = 24, 8
    state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init = _case(
        kernel_device, torch.float32, lens, dim, ds, 8, init=[False, True])
    s_whole = _clone_state(state)
    y_whole = selective_scan(s_whole, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init)
    s_part = _clone_state(state)
    y_part = torch.full_like(x, float("nan"))
    for piece, rows, sub_qsl in prefill_pieces(qsl, lens, cuts):
        sub_init = init if piece == 0 else torch.ones_like(init)
        y_part[rows] = selective_scan(s_part, x[rows], dt[rows], dt_bias, A, B[rows], C[rows], D,
                                      z[rows], sub_qsl, idx, sub_init, chunk_size=16)
    torch.testing.assert_close(y_part, y_whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s_part, s_whole, atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_typed_errors():
    state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init = _case(
        "cpu", torch.float32, [3, 2], 8, 4, 1)
    args = [state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init]

    def call(i, v, fn=selective_scan, **kw):
        a = list(args)
        a[i] = v
        fn(*a, **kw)

    with pytest.raises(ConfigError, match="dt must be"):
        call(2, dt[:, :3])
    with pytest.raises(ConfigError, match="A must be"):
        call(4, A[:, :2].contiguous())
    with pytest.raises(ConfigError, match="B must be"):
        call(5, B[:, :3])
    with pytest.raises(ConfigError, match="z must be"):
        call(8, z[:4])
    with pytest.raises(ConfigError, match="query_start_loc"):
        call(9, qsl[:2])
    with pytest.raises(ConfigError, match="has_initial_state"):
        call(11, init.to(torch.int32))
    with pytest.raises(ConfigError, match="chunk_size"):
        selective_scan(*args, chunk_size=64)
    with pytest.raises(ConfigError, match="contiguous"):
        call(1, x.T.contiguous().T)
    with pytest.raises(ConfigError, match="dstate"):
        s = torch.zeros(5, 8, 300)
        bb = torch.zeros(5, 300)
        selective_scan(s, x, dt, dt_bias, torch.zeros(8, 300), bb, bb, D, z, qsl, idx, init)
    with pytest.raises(ConfigError, match="one token per sequence"):
        selective_scan_update(state, x, dt, dt_bias, A, B, C, D, z, idx)
    with pytest.raises(ConfigError, match="out must be like x"):
        selective_scan(*args, out=torch.empty(5, 8, dtype=torch.float16))


# ---------------------------------------------------------------------------------------------
# Native GPU tests at Jamba's shape (d_inner 8192, d_state 16; bf16 inputs, float32 state).


@pytest.mark.gpu
@pytest.mark.parametrize("lens,init", [([2048], [False]),
                                       ([700, 1, 0, 1000, 347], [True, False, True, True, False])])
@pytest.mark.parametrize("chunk", [16, 32])
def test_gpu_jamba_shape_bf16(lens, init, chunk):
    dim, ds = 8192, 16
    state, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init = _case(
        "cuda", torch.bfloat16, lens, dim, ds, 5, init=init, realistic=True)
    s1, s2 = _clone_state(state), _clone_state(state)
    o1 = torch.full_like(x, float("nan"))
    o2 = torch.full_like(x, float("nan"))
    selective_scan(s1, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init, chunk_size=chunk, out=o1)
    selective_scan_ref(s2, x, dt, dt_bias, A, B, C, D, z, qsl, idx, init, out=o2)
    assert not torch.isnan(o1).any()
    rel_close(o1, o2, 2e-2, "y")
    rel_close(s1, s2, 1e-4, "state")
    check_state_rows(state, s1, o1, qsl, idx)


@pytest.mark.gpu
def test_gpu_update_in_a_cuda_graph():
    """The decode kernel captured in a CUDA graph (padded rows -1) and replayed twice equals
    two eager twin steps."""
    n, dim, ds = 64, 8192, 16
    state, x, dt, dt_bias, A, B, C, D, z, _, idx, _ = _case(
        "cuda", torch.bfloat16, [1] * n, dim, ds, 7, pad=tuple(range(48, 64)), realistic=True)
    out = torch.full_like(x, float("nan"))
    selective_scan_update(state, x, dt, dt_bias, A, B, C, D, z, idx, out=out)  # warm up
    s_ref = _clone_state(state)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        selective_scan_update(state, x, dt, dt_bias, A, B, C, D, z, idx, out=out)
    for _ in range(2):
        graph.replay()
        want = selective_scan_update_ref(s_ref, x, dt, dt_bias, A, B, C, D, z, idx)
    torch.cuda.synchronize()
    rel_close(out[:48], want[:48], 2e-2, "y")
    rel_close(state, s_ref, 1e-4, "state")
