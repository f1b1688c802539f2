"""Mamba-2 decode: one selective-state-space step per sequence, on the request's state slot.

For sequence ``b`` (state slot ``s = state_indices[b]``) and head ``h`` (group
``g = h // (nheads / ngroups)``), with ``dt' = softplus(dt[b, h] + dt_bias[h])`` clamped to
``[dt_min, dt_max]`` (``dt_softplus``; else ``dt + dt_bias`` as given), the state
``S = state[s, h] [headdim, dstate]`` becomes

    ``S <- S * exp(dt' * A[h]) + dt' * x[b, h][:, None] * B[b, g][None, :]``

and the output is ``y[b, h] = S @ C[b, g] + D[h] * x[b, h]`` (transformers' Bamba / Mamba-2
``torch_forward`` decode branch; the gate ``z`` is applied by the model's gated RMSNorm after).
``A`` is the per-head scalar ``-exp(A_log)``. ``PAD_SLOT_ID`` (-1) rows are skipped (no read,
no write; outputs left as they are). Math in float32; the state keeps its dtype (float32 in
the engine), ``y`` takes ``x``'s.

Layout: ``state [S, nheads, headdim, dstate]``, ``x [N, nheads, headdim]``, ``dt [N, nheads]``,
``B``/``C [N, ngroups, dstate]``, ``A``/``D``/``dt_bias [nheads]``, ``state_indices [N]``.
Grid ``(N, nheads, ceil(headdim / BLOCK_P))``: a program updates a ``BLOCK_P x dstate`` tile
of one head's state (dstate up to 256 in one tile).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import PAD_SLOT_ID, next_pow2, use_triton

_BLOCK_P = 16


@triton.jit
def _ssu_kernel(state_ptr, st_s0, st_s1, st_s2, x_ptr, x_s0, x_s1, dt_ptr, dt_s0, dtb_ptr,
                a_ptr, b_ptr, b_s0, b_s1, c_ptr, c_s0, c_s1, d_ptr, out_ptr, o_s0, o_s1,
                idx_ptr, headdim, dstate, heads_per_group, dt_min, dt_max,
                SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot >= 0:
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        p_ok = p < headdim
        n_ok = n < dstate
        g = h // heads_per_group
        b64 = b.to(tl.int64)
        dt = tl.load(dt_ptr + b64 * dt_s0 + h).to(tl.float32)
        if HAS_DT_BIAS:
            dt += tl.load(dtb_ptr + h).to(tl.float32)
        if SOFTPLUS:
            dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        a = tl.load(a_ptr + h).to(tl.float32)
        da = tl.exp(dt * a)
        x = tl.load(x_ptr + b64 * x_s0 + h * x_s1 + p, mask=p_ok, other=0.0).to(tl.float32)
        bv = tl.load(b_ptr + b64 * b_s0 + g * b_s1 + n, mask=n_ok, other=0.0).to(tl.float32)
        cv = tl.load(c_ptr + b64 * c_s0 + g * c_s1 + n, mask=n_ok, other=0.0).to(tl.float32)
        tile = p_ok[:, None] & n_ok[None, :]
        sp = state_ptr + slot * st_s0 + h * st_s1 + p[:, None] * st_s2 + n[None, :]
        s = tl.load(sp, mask=tile, other=0.0).to(tl.float32)
        s = s * da + (dt * x)[:, None] * bv[None, :]
        tl.store(sp, s.to(state_ptr.dtype.element_ty), mask=tile)
        y = tl.sum(s * cv[None, :], axis=1)
        if HAS_D:
            y += tl.load(d_ptr + h).to(tl.float32) * x
        tl.store(out_ptr + b64 * o_s0 + h * o_s1 + p, y.to(out_ptr.dtype.element_ty), mask=p_ok)


def _check(state, x, dt, dt_bias, A, B, C, D, state_indices, out):
    fn = "selective_state_update"
    if state.dim() != 4:
        raise ConfigError(f"{fn}: state must be [S, nheads, headdim, dstate], got {tuple(state.shape)}")
    _, nh, hd, ds = state.shape
    n = x.shape[0] if x.dim() == 3 else -1
    if x.dim() != 3 or x.shape[1:] != (nh, hd):
        raise ConfigError(f"{fn}: x must be [N, nheads={nh}, headdim={hd}], got {tuple(x.shape)}")
    if dt.shape != (n, nh):
        raise ConfigError(f"{fn}: dt must be [N={n}, nheads={nh}], got {tuple(dt.shape)}")
    if B.dim() != 3 or B.shape[0] != n or B.shape[2] != ds or C.shape != B.shape:
        raise ConfigError(f"{fn}: B and C must be [N={n}, ngroups, dstate={ds}], got "
                          f"{tuple(B.shape)} and {tuple(C.shape)}")
    ng = B.shape[1]
    if ng < 1 or nh % ng:
        raise ConfigError(f"{fn}: nheads {nh} must be a multiple of ngroups {ng}")
    for name, v in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if v is not None and v.shape != (nh,):
            raise ConfigError(f"{fn}: {name} must be [nheads={nh}], got {tuple(v.shape)}")
    if state_indices.shape != (n,):
        raise ConfigError(f"{fn}: state_indices must be [N={n}], got {tuple(state_indices.shape)}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ConfigError(f"{fn}: out must be like x {tuple(x.shape)} {x.dtype}")
    for name, v in (("state", state), ("x", x), ("B", B), ("C", C), ("out", out), ("dt", dt)):
        if v is not None and v.numel() and v.stride(-1) != 1:
            raise ConfigError(f"{fn}: {name}'s last dimension must be contiguous")
    if ds > 256:
        raise ConfigError(f"{fn}: dstate {ds} > 256 is not supported")
    return nh // ng


def selective_state_update_ref(state, x, dt, dt_bias, A, B, C, D, state_indices, *,
                               dt_softplus: bool = True, dt_min: float = 0.0,
                               dt_max: float = math.inf, out=None):
    """Plain torch twin of :func:`selective_state_update` (same signature and effects)."""
    per = _check(state, x, dt, dt_bias, A, B, C, D, state_indices, out)
    if out is None:
        out = torch.empty_like(x)
    for b, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        d = dt[b].float() + (dt_bias.float() if dt_bias is not None else 0.0)
        if dt_softplus:
            d = torch.nn.functional.softplus(d)
        d = d.clamp(dt_min, dt_max)  # [nheads]
        bb = B[b].float().repeat_interleave(per, dim=0)  # [nheads, dstate]
        cc = C[b].float().repeat_interleave(per, dim=0)
        xb = x[b].float()  # [nheads, headdim]
        s = state[slot].float()
        s = s * torch.exp(d * A.float())[:, None, None] + (d[:, None] * xb)[..., None] * bb[:, None, :]
        state[slot] = s.to(state.dtype)
        y = (s * cc[:, None, :]).sum(-1)
        if D is not None:
            y = y + D.float()[:, None] * xb
        out[b] = y.to(out.dtype)
    return out


def selective_state_update(state, x, dt, dt_bias, A, B, C, D, state_indices, *,
                           dt_softplus: bool = True, dt_min: float = 0.0,
                           dt_max: float = math.inf, out=None):
    """See the module docstring; returns ``out`` (new unless given). The Triton kernel on
    CUDA tensors (or under the interpreter), else the torch twin."""
    per = _check(state, x, dt, dt_bias, A, B, C, D, state_indices, out)
    if not use_triton(_ssu_kernel, x):
        return selective_state_update_ref(state, x, dt, dt_bias, A, B, C, D, state_indices,
                                          dt_softplus=dt_softplus, dt_min=dt_min,
                                          dt_max=dt_max, out=out)
    if out is None:
        out = torch.empty_like(x)
    n, nh, hd = x.shape
    ds = state.shape[3]
    if n == 0:
        return out
    grid = (n, nh, triton.cdiv(hd, _BLOCK_P))
    _ssu_kernel[grid](
        state, state.stride(0), state.stride(1), state.stride(2), x, x.stride(0), x.stride(1),
        dt, dt.stride(0), dt_bias if dt_bias is not None else A, A, B, B.stride(0), B.stride(1),
        C, C.stride(0), C.stride(1), D if D is not None else A, out, out.stride(0),
        out.stride(1), state_indices, hd, ds, per, float(dt_min),
        float(dt_max) if math.isfinite(dt_max) else 3.0e38,
        SOFTPLUS=dt_softplus, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        BLOCK_P=_BLOCK_P, BLOCK_N=max(16, next_pow2(ds)))
    return out


__all__ = ["selective_state_update", "selective_state_update_ref"]
