"""selective_state_update (Triton) against its torch twin on random poisoned batches (CPU
through the interpreter, natively on the GPU), and the twin against transformers' Bamba /
Mamba-2 decode formula written out step by step."""

import math

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.kernels.selective_state_update import (
    selective_state_update,
    selective_state_update_ref,
)


def _case(device, dtype, n, nh, hd, ds, ng, seed, pad=()):
    g = torch.Generator().manual_seed(seed)
    slots = n + 2
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    state = r(slots, nh, hd, ds).float().to(device)
    x = r(n, nh, hd).to(dtype).to(device)
    dt = r(n, nh).to(dtype).to(device)
    dt_bias = r(nh).float().to(device)
    A = -torch.exp(r(nh)).float().to(device)
    B = r(n, ng, ds).to(dtype).to(device)
    C = r(n, ng, ds).to(dtype).to(device)
    D = r(nh).float().to(device)
    perm = torch.randperm(slots, generator=g)[:n].tolist()
    idx = torch.tensor([-1 if i in pad else perm[i] for i in range(n)], dtype=torch.int32,
                       device=device)
    return state, x, dt, dt_bias, A, B, C, D, idx


@pytest.mark.parametrize("shape", [(3, 4, 8, 16, 2), (5, 6, 5, 12, 3), (1, 2, 16, 64, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_twin(kernel_device, shape, dtype):
    n, nh, hd, ds, ng = shape
    state, x, dt, dt_bias, A, B, C, D, idx = _case(kernel_device, dtype, n, nh, hd, ds, ng, 5,
                                                   pad=(1,) if n > 2 else ())
    s1, s2 = state.clone(), state.clone()
    o1 = torch.full_like(x, float("nan"))
    o2 = torch.full_like(x, float("nan"))
    for kw in (dict(), dict(dt_min=0.01, dt_max=0.5)):
        selective_state_update(s1, x, dt, dt_bias, A, B, C, D, idx, out=o1, **kw)
        selective_state_update_ref(s2, x, dt, dt_bias, A, B, C, D, idx, out=o2, **kw)
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=5e-3, rtol=5e-3)
        torch.testing.assert_close(o1, o2, equal_nan=True, **tol)
        torch.testing.assert_close(s1, s2, atol=1e-4, rtol=1e-4)
    used = {i for i in idx.tolist() if i >= 0}
    for s in range(state.shape[0]):
        if s not in used:
            assert torch.equal(s1[s], state[s])  # padded rows and other slots untouched
    for b, i in enumerate(idx.tolist()):
        if i < 0:
            assert torch.isnan(o1[b]).all()


def test_twin_matches_the_bamba_decode_formula():
    n, nh, hd, ds, ng = 2, 4, 3, 5, 2
    state, x, dt, dt_bias, A, B, C, D, idx = _case("cpu", torch.float32, n, nh, hd, ds, ng, 9)
    before = state.clone()
    y = selective_state_update_ref(state, x, dt, dt_bias, A, B, C, D, idx)
    per = nh // ng
    for b in range(n):
        s = int(idx[b])
        for h in range(nh):
            g = h // per
            d = math.log1p(math.exp(float(dt[b, h] + dt_bias[h])))
            da = math.exp(d * float(A[h]))
            want_state = before[s, h] * da + d * x[b, h][:, None] * B[b, g][None, :]
            torch.testing.assert_close(state[s, h], want_state, atol=1e-5, rtol=1e-5)
            want_y = want_state @ C[b, g] + D[h] * x[b, h]
            torch.testing.assert_close(y[b, h], want_y, atol=1e-5, rtol=1e-5)


def test_bad_arguments_are_typed_errors():
    state, x, dt, dt_bias, A, B, C, D, idx = _case("cpu", torch.float32, 2, 4, 3, 5, 2, 1)
    with pytest.raises(ConfigError, match="multiple of ngroups"):
        selective_state_update(state, x, dt, dt_bias, A, B[:, :1].expand(2, 3, 5).contiguous(),
                               C[:, :1].expand(2, 3, 5).contiguous(), D, idx)
    with pytest.raises(ConfigError, match="dt must be"):
        selective_state_update(state, x, dt[:, :2], dt_bias, A, B, C, D, idx)
    with pytest.raises(ConfigError, match="state_indices"):
        selective_state_update(state, x, dt, dt_bias, A, B, C, D, idx[:1])
