"""causal_conv1d (Triton) against its torch twin on random varlen batches with poisoned
buffers (CPU through the interpreter, natively on the GPU), and the twin against transformers'
formulation (``Conv1d(padding=W-1)[..., :L]`` for a fresh prompt, the rolling W-entry state for
decode); chunked prefill continued from the state equals the whole prompt."""

import pytest
import torch
import torch.nn.functional as F

from pagedkv.errors import ConfigError
from pagedkv.kernels.causal_conv1d import causal_conv1d, causal_conv1d_ref


def _case(device, dtype, lens, w, dim, seed, pad_rows=(), init=None):
    g = torch.Generator().manual_seed(seed)
    n = len(lens)
    t = sum(lens)
    x = torch.randn(t, dim, generator=g).to(dtype).to(device)
    weight = torch.randn(dim, w, generator=g).to(dtype).to(device)
    bias = torch.randn(dim, generator=g).to(dtype).to(device)
    slots = n + 3
    state = torch.randn(slots, w - 1, dim, generator=g).to(dtype).to(device)
    qsl = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    perm = torch.randperm(slots, generator=g)[:n]
    idx = torch.tensor([-1 if i in pad_rows else int(perm[i]) for i in range(n)],
                       dtype=torch.int32, device=device)
    if init is None:
        init = torch.rand(n, generator=g) < 0.5
    return x, state, weight, bias, qsl, idx, init.to(device)


@pytest.mark.parametrize("w", [2, 3, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lens,pad", [([1, 1, 1, 1], ()), ([5, 1, 0, 9, 2], (1,)),
                                       ([17], ()), ([3, 4], (0, 1))])
def test_kernel_equals_twin(kernel_device, w, dtype, lens, pad):
    dim = 200 if kernel_device == "cuda" else 40
    x, state, weight, bias, qsl, idx, init = _case(kernel_device, dtype, lens, w, dim, 7,
                                                   pad_rows=pad)
    s1, s2 = state.clone(), state.clone()
    out1 = torch.full_like(x, float("nan"))
    out2 = torch.full_like(x, float("nan"))
    causal_conv1d(x, s1, weight, bias, qsl, idx, init, "silu", out=out1)
    causal_conv1d_ref(x, s2, weight, bias, qsl, idx, init, "silu", out=out2)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out1, out2, equal_nan=True, **tol)
    torch.testing.assert_close(s1, s2, **tol)
    # padded rows: outputs untouched (NaN), states untouched
    q = qsl.tolist()
    for r in pad:
        assert torch.isnan(out1[q[r]:q[r + 1]]).all()
    untouched = set(range(state.shape[0])) - {i for i in idx.tolist() if i >= 0}
    for s in untouched:
        assert torch.equal(s1[s], state[s])


def test_twin_matches_transformers_formulation():
    torch.manual_seed(0)
    dim, w, lens = 12, 4, [6, 3]
    x, state, weight, bias, qsl, idx, _ = _case("cpu", torch.float32, lens, w, dim, 1)
    init = torch.tensor([False, False])
    out = causal_conv1d_ref(x, state, weight, bias, qsl, idx, init, "silu")
    conv = torch.nn.Conv1d(dim, dim, w, groups=dim, padding=w - 1, bias=True)
    conv.weight.data = weight[:, None, :].clone()
    conv.bias.data = bias.clone()
    q = qsl.tolist()
    for b in range(2):
        seq = x[q[b]:q[b + 1]]
        want = F.silu(conv(seq.T[None])[..., :seq.shape[0]])[0].T
        torch.testing.assert_close(out[q[b]:q[b + 1]], want, atol=1e-5, rtol=1e-5)
        # transformers' cache: the last W inputs (zero-padded); ours: the newest W - 1
        hf_state = F.pad(seq.T, (w - seq.shape[0], 0)) if seq.shape[0] < w else seq.T[:, -w:]
        torch.testing.assert_close(state[int(idx[b])], hf_state.T[1:])
    # decode: transformers rolls its W-entry state and takes sum(state * w) + b
    b0 = int(idx[0])
    hf = torch.cat([torch.zeros(1, dim), state[b0]], 0).T.clone()  # [D, W]; oldest unused
    tok = torch.randn(1, dim)
    hf = torch.roll(hf, -1, dims=-1)
    hf[:, -1] = tok[0]
    want = F.silu((hf * weight).sum(-1) + bias)
    got = causal_conv1d_ref(tok, state, weight, bias, torch.tensor([0, 1], dtype=torch.int32),
                            torch.tensor([b0], dtype=torch.int32), torch.tensor([True]), "silu")
    torch.testing.assert_close(got[0], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("split", [1, 3, 5])
def test_chunked_prefill_continues_from_the_state(kernel_device, split):
    dim, w, n = 24, 4, 9
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, dim, generator=g).to(kernel_device)
    weight = torch.randn(dim, w, generator=g).to(kernel_device)
    bias = torch.randn(dim, generator=g).to(kernel_device)
    one = lambda m: torch.tensor([0, m], dtype=torch.int32, device=kernel_device)  # noqa: E731
    idx = torch.tensor([0], dtype=torch.int32, device=kernel_device)
    whole_state = torch.zeros(1, w - 1, dim, device=kernel_device)
    whole = causal_conv1d(x, whole_state, weight, bias, one(n), idx,
                          torch.tensor([False], device=kernel_device))
    st = torch.full((1, w - 1, dim), float("nan"), device=kernel_device)  # never read fresh
    a = causal_conv1d(x[:split].contiguous(), st, weight, bias, one(split), idx,
                      torch.tensor([False], device=kernel_device))
    b = causal_conv1d(x[split:].contiguous(), st, weight, bias, one(n - split), idx,
                      torch.tensor([True], device=kernel_device))
    torch.testing.assert_close(torch.cat([a, b]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(st, whole_state)


def test_bad_arguments_are_typed_errors():
    x = torch.zeros(3, 8)
    ok = dict(conv_state=torch.zeros(2, 3, 8), weight=torch.zeros(8, 4), bias=None,
              query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
              state_indices=torch.tensor([0], dtype=torch.int32),
              has_initial_state=torch.tensor([False]))
    with pytest.raises(ConfigError, match="W in 2..4"):
        causal_conv1d(x, **{**ok, "weight": torch.zeros(8, 5)})
    with pytest.raises(ConfigError, match="conv_state must be"):
        causal_conv1d(x, **{**ok, "conv_state": torch.zeros(2, 4, 8)})
    with pytest.raises(ConfigError, match="query_start_loc"):
        causal_conv1d(x, **{**ok, "query_start_loc": torch.tensor([0, 1, 3], dtype=torch.int32)})
    with pytest.raises(ConfigError, match="activation"):
        causal_conv1d(x, **ok, activation="gelu")


def test_strided_per_sequence_vectors(kernel_device):
    """A column of ``MambaMetadata.state_indices`` (``[rows, 1 + spec_blocks]``) and strided
    ``query_start_loc`` / ``has_initial_state`` views: the kernel follows them as the twin
    does (it used to read them densely: the second row took the first row's spare column)."""
    x, state, weight, bias, qsl, idx, init = _case(kernel_device, torch.float32, [3, 4, 2], 4,
                                                   40, 11, init=torch.tensor([True, False, True]))
    wide = torch.stack([idx, idx.flip(0) + 100], dim=1)  # spare columns: garbage slots
    qsl2 = torch.stack([qsl, qsl * 0 - 7], dim=1)[:, 0]
    init2 = torch.stack([init, ~init], dim=1)[:, 0]
    assert wide[:, 0].stride(0) == 2 and qsl2.stride(0) == 2 and init2.stride(0) == 2
    s1, s2 = state.clone(), state.clone()
    out1 = causal_conv1d(x, s1, weight, bias, qsl2, wide[:, 0], init2, "silu")
    out2 = causal_conv1d_ref(x, s2, weight, bias, qsl, idx, init, "silu")
    torch.testing.assert_close(out1, out2, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)
