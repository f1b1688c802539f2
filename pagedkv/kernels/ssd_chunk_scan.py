"""Mamba-2 prefill: the chunked selective scan (SSD) over a varlen batch, each sequence
continuing from (or starting fresh in) its state slot.

For sequence ``b`` (tokens ``query_start_loc[b]:query_start_loc[b+1]``, state slot
``s = state_indices[b]``) and head ``h`` (group ``g = h // (nheads / ngroups)``), with
``dt'_t = softplus(dt[t, h] + dt_bias[h])`` clamped to ``[dt_min, dt_max]`` (``dt_softplus``;
else ``dt + dt_bias`` clamped), the exact recurrence is

    ``H_t = exp(dt'_t * A[h]) * H_{t-1} + dt'_t * x[t, h][:, None] * B[t, g][None, :]``
    ``y[t, h] = H_t @ C[t, g] + D[h] * x[t, h]``

from ``H_{-1} = ssm_state[s, h]`` when ``has_initial_state[b]`` (a later chunk of a chunked
prefill, a prefix hit resuming from a saved state), else zeros (a fresh prompt); the state
after the sequence's last token is written back to the slot (a sequence with no tokens writes
its start state: unchanged, or zeros). ``A`` is the per-head scalar ``-exp(A_log)``. This is
transformers' Bamba / Mamba-2 chunk form (``mamba2_chunk_scan``, ``initial_states``,
``return_final_states``); the gate ``z`` is applied by the model's gated RMSNorm after.
``PAD_SLOT_ID`` (-1) rows are skipped: no state read or written, their outputs left as they
are. Math in float32; the state keeps its dtype (float32 in the engine), ``y`` takes ``x``'s.

Layout: ``ssm_state [S, nheads, headdim, dstate]``, ``x [T, nheads, headdim]``,
``dt [T, nheads]``, ``B``/``C [T, ngroups, dstate]``, ``A``/``D``/``dt_bias [nheads]``,
``query_start_loc [N + 1]`` (int32), ``state_indices [N]``, ``has_initial_state [N]`` (bool).

The kernel (grid ``(N, nheads, ceil(headdim / BLOCK_P))``) walks one sequence's chunks of
``chunk_size`` tokens in order, holding a ``BLOCK_P x dstate`` tile of the head's state in
registers. With the in-chunk cumulative log decay ``a_l = sum_{j<=l} dt'_j A`` a chunk is

    ``y_l = sum_{s<=l} exp(a_l - a_s) dt'_s (C_l . B_s) x_s   (intra-chunk, the segsum form)``
    ``    + exp(a_l) H_prev @ C_l + D x_l                     (the state entering the chunk)``
    ``H   = exp(a_last) H_prev + sum_s exp(a_last - a_s) dt'_s x_s B_s^T  (state passing)``

as four matrix products per chunk (``C B^T``, ``M x``, ``C H^T``, ``(w x)^T B``). Padded
lanes of the last chunk get ``dt' = 0`` (no decay, no input). Matrix products take float32
operands: exact (``ieee``) when the inputs are float32, TF32 otherwise (exact for bf16/fp16
inputs in ``C B^T``; at least as precise as casting to the 16-bit input type elsewhere).

The torch twin :func:`ssd_chunk_scan_ref` is the plain token-by-token recurrence (slow,
exact); ``chunk_size`` only shapes the kernel's work, never the result.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import PAD_SLOT_ID, next_pow2, use_triton

DEFAULT_CHUNK_SIZE = 64
_MAX_DSTATE = 256


@triton.jit
def _ssd_chunk_scan_kernel(state_ptr, st_s0, st_s1, st_s2, x_ptr, x_s0, x_s1, dt_ptr, dt_s0,
                           dtb_ptr, a_ptr, b_ptr, b_s0, b_s1, c_ptr, c_s0, c_s1, d_ptr,
                           out_ptr, o_s0, o_s1, qsl_ptr, idx_ptr, init_ptr, headdim, dstate,
                           heads_per_group, dt_min, dt_max,
                           SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr,
                           HAS_DT_BIAS: tl.constexpr, PREC: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    if slot >= 0:
        p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        q = tl.arange(0, CHUNK)
        p_ok = p < headdim
        n_ok = n < dstate
        g = h // heads_per_group
        start = tl.load(qsl_ptr + seq).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
        init = tl.load(init_ptr + seq) != 0
        # the scalar `init` enters the mask through a block comparison (a scalar predicate
        # broadcast into a block mask is rejected by triton >= 3.9)
        p_init = p < tl.where(init, headdim, 0)
        tile = p_ok[:, None] & n_ok[None, :]
        sp = state_ptr + slot * st_s0 + h * st_s1 + p[:, None] * st_s2 + n[None, :]
        hs = tl.load(sp, mask=p_init[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        a_h = tl.load(a_ptr + h).to(tl.float32)
        bias = 0.0
        if HAS_DT_BIAS:
            bias = tl.load(dtb_ptr + h).to(tl.float32)
        d_h = 0.0
        if HAS_D:
            d_h = tl.load(d_ptr + h).to(tl.float32)
        causal = q[:, None] >= q[None, :]
        t0 = start
        while t0 < end:  # (the interpreter cannot iterate range() over runtime scalars)
            t = t0 + q
            t_ok = t < end
            dt = tl.load(dt_ptr + t * dt_s0 + h, mask=t_ok, other=0.0).to(tl.float32) + bias
            if SOFTPLUS:
                dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
            dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
            dt = tl.where(t_ok, dt, 0.0)
            acs = tl.cumsum(dt * a_h, 0)  # [CHUNK] cumulative log decay, <= 0, non-increasing
            a_last = tl.sum(dt * a_h, 0)
            xq = tl.load(x_ptr + t[:, None] * x_s0 + h * x_s1 + p[None, :],
                         mask=t_ok[:, None] & p_ok[None, :], other=0.0).to(tl.float32)
            qn = t_ok[:, None] & n_ok[None, :]
            bq = tl.load(b_ptr + t[:, None] * b_s0 + g * b_s1 + n[None, :], mask=qn,
                         other=0.0).to(tl.float32)
            cq = tl.load(c_ptr + t[:, None] * c_s0 + g * c_s1 + n[None, :], mask=qn,
                         other=0.0).to(tl.float32)
            # intra-chunk: M[l, s] = (C_l . B_s) exp(a_l - a_s) dt_s for s <= l
            cb = tl.dot(cq, tl.trans(bq), input_precision=PREC)
            seg = tl.where(causal, acs[:, None] - acs[None, :], 0.0)
            m = tl.where(causal, cb * tl.exp(seg), 0.0) * dt[None, :]
            y = tl.dot(m, xq, input_precision=PREC)
            # the state entering the chunk, decayed to each position
            y += tl.dot(cq, tl.trans(hs), input_precision=PREC) * tl.exp(acs)[:, None]
            y += d_h * xq
            tl.store(out_ptr + t[:, None] * o_s0 + h * o_s1 + p[None, :],
                     y.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & p_ok[None, :])
            # state passing to the next chunk
            w = dt * tl.exp(a_last - acs)
            hs = hs * tl.exp(a_last) + tl.dot(tl.trans(xq * w[:, None]), bq,
                                              input_precision=PREC)
            t0 += CHUNK
        tl.store(sp, hs.to(state_ptr.dtype.element_ty), mask=tile)


def _check(ssm_state, x, dt, dt_bias, A, B, C, D, query_start_loc, state_indices,
           has_initial_state, chunk_size, out):
    fn = "ssd_chunk_scan"
    for name, v in (("ssm_state", ssm_state), ("x", x), ("dt", dt), ("A", A), ("B", B),
                    ("C", C), ("query_start_loc", query_start_loc),
                    ("state_indices", state_indices), ("has_initial_state", has_initial_state)):
        if not isinstance(v, torch.Tensor):
            raise ConfigError(f"{fn}: {name} must be a torch.Tensor, got {type(v).__name__}")
    if ssm_state.dim() != 4:
        raise ConfigError(f"{fn}: ssm_state must be [S, nheads, headdim, dstate], got "
                          f"{tuple(ssm_state.shape)}")
    _, nh, hd, ds = ssm_state.shape
    t = x.shape[0] if x.dim() == 3 else -1
    if x.dim() != 3 or x.shape[1:] != (nh, hd):
        raise ConfigError(f"{fn}: x must be [T, nheads={nh}, headdim={hd}], got "
                          f"{tuple(x.shape)}")
    if dt.shape != (t, nh):
        raise ConfigError(f"{fn}: dt must be [T={t}, nheads={nh}], got {tuple(dt.shape)}")
    if B.dim() != 3 or B.shape[0] != t or B.shape[2] != ds or C.shape != B.shape:
        raise ConfigError(f"{fn}: B and C must be [T={t}, ngroups, dstate={ds}], got "
                          f"{tuple(B.shape)} and {tuple(C.shape)}")
    ng = B.shape[1]
    if ng < 1 or nh % ng:
        raise ConfigError(f"{fn}: nheads {nh} must be a multiple of ngroups {ng}")
    for name, v in (("A", A), ("D", D), ("dt_bias", dt_bias)):
        if v is not None and v.shape != (nh,):
            raise ConfigError(f"{fn}: {name} must be [nheads={nh}], got {tuple(v.shape)}")
    n = state_indices.shape[0] if state_indices.dim() == 1 else -1
    if (n < 0 or query_start_loc.shape != (n + 1,) or has_initial_state.shape != (n,)):
        raise ConfigError(f"{fn}: state_indices must be [N], query_start_loc [N+1] and "
                          f"has_initial_state [N]; got {tuple(state_indices.shape)}, "
                          f"{tuple(query_start_loc.shape)}, {tuple(has_initial_state.shape)}")
    if query_start_loc.dtype not in (torch.int32, torch.int64) or state_indices.dtype not in (
            torch.int32, torch.int64):
        raise ConfigError(f"{fn}: query_start_loc and state_indices must be int32 or int64")
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16
            or chunk_size > 256 or chunk_size & (chunk_size - 1)):
        raise ConfigError(f"{fn}: chunk_size must be a power of two in 16..256, got "
                          f"{chunk_size!r}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ConfigError(f"{fn}: out must be like x {tuple(x.shape)} {x.dtype}")
    for name, v in (("ssm_state", ssm_state), ("x", x), ("B", B), ("C", C), ("out", out),
                    ("dt", dt)):
        if v is not None and v.numel() and v.stride(-1) != 1:
            raise ConfigError(f"{fn}: {name}'s last dimension must be contiguous")
    if ds > _MAX_DSTATE:
        raise ConfigError(f"{fn}: dstate {ds} > {_MAX_DSTATE} is not supported")
    devs = {v.device for v in (ssm_state, x, dt, dt_bias, A, B, C, D, query_start_loc,
                               state_indices, has_initial_state, out) if v is not None}
    if len(devs) != 1:
        raise ConfigError(f"{fn}: all tensors must be on one device, got "
                          f"{sorted(map(str, devs))}")
    return nh // ng


def ssd_chunk_scan_ref(ssm_state, x, dt, dt_bias, A, B, C, D, query_start_loc, state_indices,
                       has_initial_state, *, dt_softplus: bool = True, dt_min: float = 0.0,
                       dt_max: float = math.inf, chunk_size: int = DEFAULT_CHUNK_SIZE,
                       out=None):
    """Plain torch twin of :func:`ssd_chunk_scan` (same signature and effects): the
    token-by-token recurrence in float32, all heads of a token at once."""
    per = _check(ssm_state, x, dt, dt_bias, A, B, C, D, query_start_loc, state_indices,
                 has_initial_state, chunk_size, out)
    if out is None:
        out = torch.empty_like(x)
    qsl = query_start_loc.tolist()
    init = has_initial_state.tolist()
    a = A.float()
    for b, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        s, e = qsl[b], qsl[b + 1]
        h = (ssm_state[slot].float() if init[b]
             else torch.zeros(ssm_state.shape[1:], dtype=torch.float32, device=x.device))
        if e > s:
            d = dt[s:e].float() + (dt_bias.float() if dt_bias is not None else 0.0)
            if dt_softplus:
                d = torch.nn.functional.softplus(d)
            d = d.clamp(dt_min, dt_max)  # [L, nheads]
            decay = torch.exp(d * a)
            xs = x[s:e].float()
            bs = B[s:e].float().repeat_interleave(per, dim=1)  # [L, nheads, dstate]
            cs = C[s:e].float().repeat_interleave(per, dim=1)
            ys = torch.empty_like(xs)
            for i in range(e - s):
                h = (h * decay[i][:, None, None]
                     + (d[i][:, None] * xs[i])[..., None] * bs[i][:, None, :])
                ys[i] = (h * cs[i][:, None, :]).sum(-1)
            if D is not None:
                ys = ys + D.float()[:, None] * xs
            out[s:e] = ys.to(out.dtype)
        ssm_state[slot] = h.to(ssm_state.dtype)
    return out


def ssd_chunk_scan(ssm_state, x, dt, dt_bias, A, B, C, D, query_start_loc, state_indices,
                   has_initial_state, *, dt_softplus: bool = True, dt_min: float = 0.0,
                   dt_max: float = math.inf, chunk_size: int = DEFAULT_CHUNK_SIZE, out=None):
    """See the module docstring; returns ``out`` (new unless given). The Triton kernel on
    CUDA tensors (or under the interpreter), else the torch twin."""
    per = _check(ssm_state, x, dt, dt_bias, A, B, C, D, query_start_loc, state_indices,
                 has_initial_state, chunk_size, out)
    if not use_triton(_ssd_chunk_scan_kernel, x):
        return ssd_chunk_scan_ref(ssm_state, x, dt, dt_bias, A, B, C, D, query_start_loc,
                                  state_indices, has_initial_state, dt_softplus=dt_softplus,
                                  dt_min=dt_min, dt_max=dt_max, chunk_size=chunk_size,
                                  out=out)
    if out is None:
        out = torch.empty_like(x)
    n = state_indices.shape[0]
    _, nh, hd, ds = ssm_state.shape
    if n == 0 or nh == 0 or hd == 0:
        return out
    block_p = max(16, min(32, next_pow2(hd)))
    block_n = max(16, next_pow2(ds))
    grid = (n, nh, triton.cdiv(hd, block_p))
    _ssd_chunk_scan_kernel[grid](
        ssm_state, ssm_state.stride(0), ssm_state.stride(1), ssm_state.stride(2),
        x, x.stride(0), x.stride(1), dt, dt.stride(0), dt_bias if dt_bias is not None else A,
        A, B, B.stride(0), B.stride(1), C, C.stride(0), C.stride(1),
        D if D is not None else A, out, out.stride(0), out.stride(1), query_start_loc,
        state_indices, has_initial_state.to(torch.int8), hd, ds, per, float(dt_min),
        float(dt_max) if math.isfinite(dt_max) else 3.0e38,
        SOFTPLUS=dt_softplus, HAS_D=D is not None, HAS_DT_BIAS=dt_bias is not None,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", CHUNK=chunk_size,
        BLOCK_P=block_p, BLOCK_N=block_n, num_warps=4 if block_n <= 64 else 8)
    return out


__all__ = ["DEFAULT_CHUNK_SIZE", "ssd_chunk_scan", "ssd_chunk_scan_ref"]
