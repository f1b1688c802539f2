"""The gated delta rule (Qwen3-Next's linear attention, "Gated DeltaNet") on per-sequence state
slots: a recurrent kernel for decode (one token per sequence) and a chunked kernel for prefill
(a varlen batch, each sequence continuing from its slot or starting from zeros).

Per value head ``h`` (query/key head ``hk = h // (HV / HK)``: each q/k head serves
``HV / HK`` consecutive value heads), token ``t`` with ``q_t``, ``k_t`` (``[K]``; L2-normalised
as ``x * rsqrt(sum(x^2) + 1e-6)`` when ``use_qk_l2norm``), ``v_t`` (``[V]``), log decay
``g_t <= 0`` and write strength ``beta_t``, the state ``S [K, V]`` evolves as

    ``S <- exp(g_t) S``
    ``S <- S + k_t (beta_t (v_t - S^T k_t))^T``     (the delta rule: correct what S predicts)
    ``o_t = S^T (scale * q_t)``                      (``scale`` defaults to ``K ** -0.5``)

exactly as transformers' ``torch_recurrent_gated_delta_rule`` (``g`` and ``beta`` as the
model computes them: ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``; the
gated RMSNorm with ``z`` comes after). ``PAD_SLOT_ID`` (-1) rows are skipped: no state read or
written, outputs left as they are. Math in float32; the state keeps its dtype (float32 in the
engine), ``o`` takes ``v``'s.

Layout: ``state [S, HV, K, V]``, ``q``/``k [T, HK, K]``, ``v [T, HV, V]``,
``g``/``beta [T, HV]``, ``state_indices [N]``; the chunked form adds ``query_start_loc [N+1]``
(int32) and ``has_initial_state [N]`` (bool: continue from the slot, else zeros; a sequence
without tokens writes its start state back), the recurrent form takes one token per sequence
(``T = N``) and always continues from the slot. The per-sequence vectors (``state_indices``,
``query_start_loc``, ``has_initial_state``) may be strided views (a column of
``MambaMetadata.state_indices``).

:func:`recurrent_gated_delta_rule`: grid ``(N, HV, ceil(V / BLOCK_V))``, one ``K x BLOCK_V``
state tile per program (K up to 256 in one tile).

:func:`chunk_gated_delta_rule`: grid ``(N, HV, ceil(V / BLOCK_V))``; a program walks one
sequence's chunks of ``chunk_size`` tokens in order, holding its state tile in registers. With
the in-chunk cumulative log decay ``c_i = sum_{j<=i} g_j`` and ``Gamma_ij = exp(c_i - c_j)``
(``i >= j``), a chunk is the WY / UT form of the same recurrence:

    ``A = strict_lower(beta_i (k_i . k_j) Gamma_ij)``, ``T = (I + A)^-1`` (forward substitution)
    ``U = T (beta * (V - exp(c) * (K S)))``          (the deltas the chunk writes)
    ``O = (exp(c) * Q) S + lower(Q K^T * Gamma) U``
    ``S <- exp(c_last) S + (exp(c_last - c) * K)^T U``

Padded lanes of the last chunk get ``g = 0``, ``beta = 0`` and zero q/k/v (no effect). Matrix
products take float32 operands: exact (``ieee``) for float32 inputs, TF32 otherwise. The torch
twins (``*_ref``) are the plain token-by-token recurrence; ``chunk_size`` only shapes the
kernel's work, never the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import PAD_SLOT_ID, next_pow2, use_triton

DEFAULT_CHUNK_SIZE = 64
_MAX_DIM = 256
_L2_EPS = 1e-6


@triton.jit
def _load_qk(ptr, rows, r_ok, s0, hk, s1, kk, k_ok, L2NORM: tl.constexpr):
    """``[len(rows), BLOCK_K]`` float32 rows of q or k for key head ``hk`` (zeros outside)."""
    x = tl.load(ptr + rows[:, None] * s0 + hk * s1 + kk[None, :],
                mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
    if L2NORM:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, 1) + 1e-6))[:, None]
    return x


@triton.jit
def _gdr_recurrent_kernel(state_ptr, st_s0, st_s1, st_s2, q_ptr, q_s0, q_s1, k_ptr, k_s0, k_s1,
                          v_ptr, v_s0, v_s1, g_ptr, g_s0, beta_ptr, beta_s0, out_ptr, o_s0,
                          o_s1, idx_ptr, kdim, vdim, v_per_k, scale,
                          L2NORM: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(idx_ptr + b).to(tl.int64)
    if slot >= 0:
        vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        kk = tl.arange(0, BLOCK_K)
        v_ok = vv < vdim
        k_ok = kk < kdim
        hk = h // v_per_k
        b64 = b.to(tl.int64)
        q = tl.load(q_ptr + b64 * q_s0 + hk * q_s1 + kk, mask=k_ok, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + b64 * k_s0 + hk * k_s1 + kk, mask=k_ok, other=0.0).to(tl.float32)
        if L2NORM:
            q = q * (1.0 / tl.sqrt(tl.sum(q * q, 0) + 1e-6))
            k = k * (1.0 / tl.sqrt(tl.sum(k * k, 0) + 1e-6))
        q = q * scale
        v = tl.load(v_ptr + b64 * v_s0 + h * v_s1 + vv, mask=v_ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b64 * g_s0 + h).to(tl.float32)
        beta = tl.load(beta_ptr + b64 * beta_s0 + h).to(tl.float32)
        tile = k_ok[:, None] & v_ok[None, :]
        sp = state_ptr + slot * st_s0 + h * st_s1 + kk[:, None] * st_s2 + vv[None, :]
        s = tl.load(sp, mask=tile, other=0.0).to(tl.float32) * tl.exp(g)
        delta = (v - tl.sum(s * k[:, None], 0)) * beta
        s += k[:, None] * delta[None, :]
        tl.store(sp, s.to(state_ptr.dtype.element_ty), mask=tile)
        o = tl.sum(s * q[:, None], 0)
        tl.store(out_ptr + b64 * o_s0 + h * o_s1 + vv, o.to(out_ptr.dtype.element_ty), mask=v_ok)


@triton.jit
def _gdr_chunk_kernel(state_ptr, st_s0, st_s1, st_s2, q_ptr, q_s0, q_s1, k_ptr, k_s0, k_s1,
                      v_ptr, v_s0, v_s1, g_ptr, g_s0, beta_ptr, beta_s0, out_ptr, o_s0, o_s1,
                      qsl_ptr, idx_ptr, init_ptr, kdim, vdim, v_per_k, scale,
                      L2NORM: tl.constexpr, PREC: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr):
    seq = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    if slot >= 0:
        vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        kk = tl.arange(0, BLOCK_K)
        r = tl.arange(0, CHUNK)
        v_ok = vv < vdim
        k_ok = kk < kdim
        hk = h // v_per_k
        start = tl.load(qsl_ptr + seq).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
        init = tl.load(init_ptr + seq) != 0
        # the scalar `init` enters the mask through a block comparison (a scalar predicate
        # broadcast into a block mask is rejected by triton >= 3.9)
        k_init = kk < tl.where(init, kdim, 0)
        tile = k_ok[:, None] & v_ok[None, :]
        sp = state_ptr + slot * st_s0 + h * st_s1 + kk[:, None] * st_s2 + vv[None, :]
        s = tl.load(sp, mask=k_init[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
        causal = r[:, None] >= r[None, :]
        strict = r[:, None] > r[None, :]
        eye = tl.where(r[:, None] == r[None, :], 1.0, 0.0)
        t0 = start
        while t0 < end:  # (the interpreter cannot iterate range() over runtime scalars)
            t = t0 + r
            t_ok = t < end
            g = tl.load(g_ptr + t * g_s0 + h, mask=t_ok, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + t * beta_s0 + h, mask=t_ok, other=0.0).to(tl.float32)
            c = tl.cumsum(g, 0)
            c_last = tl.sum(g, 0)
            qc = _load_qk(q_ptr, t, t_ok, q_s0, hk, q_s1, kk, k_ok, L2NORM) * scale
            kc = _load_qk(k_ptr, t, t_ok, k_s0, hk, k_s1, kk, k_ok, L2NORM)
            vc = tl.load(v_ptr + t[:, None] * v_s0 + h * v_s1 + vv[None, :],
                         mask=t_ok[:, None] & v_ok[None, :], other=0.0).to(tl.float32)
            gamma = tl.where(causal, tl.exp(tl.where(causal, c[:, None] - c[None, :], 0.0)), 0.0)
            a = tl.where(strict, tl.dot(kc, tl.trans(kc), input_precision=PREC) * gamma, 0.0)
            a = a * beta[:, None]
            # T = (I + A)^-1 by forward substitution: T_i = e_i - sum_{j<i} A_ij T_j
            tri = eye
            for i in range(1, CHUNK):
                a_row = tl.sum(tl.where(r[:, None] == i, a, 0.0), 0)  # row i of A (0 at j >= i)
                t_row = tl.sum(a_row[:, None] * tri, 0)
                tri = tl.where(r[:, None] == i, tri - t_row[None, :], tri)
            ec = tl.exp(c)
            rhs = beta[:, None] * (vc - ec[:, None] * tl.dot(kc, s, input_precision=PREC))
            u = tl.dot(tri, rhs, input_precision=PREC)  # [CHUNK, BLOCK_V]
            p = tl.dot(qc, tl.trans(kc), input_precision=PREC) * gamma
            o = tl.dot(qc * ec[:, None], s, input_precision=PREC)
            o += tl.dot(p, u, input_precision=PREC)
            tl.store(out_ptr + t[:, None] * o_s0 + h * o_s1 + vv[None, :],
                     o.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & v_ok[None, :])
            kd = kc * tl.exp(c_last - c)[:, None]
            s = s * tl.exp(c_last) + tl.dot(tl.trans(kd), u, input_precision=PREC)
            t0 += CHUNK
        tl.store(sp, s.to(state_ptr.dtype.element_ty), mask=tile)


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check(fn, state, q, k, v, g, beta, state_indices, scale, out):
    for name, x in (("state", state), ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                    ("state_indices", state_indices)):
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if state.dim() != 4:
        raise ConfigError(f"{fn}: state must be [S, HV, K, V], got {tuple(state.shape)}")
    _, hv, kd, vd = state.shape
    t = v.shape[0] if v.dim() == 3 else -1
    if v.dim() != 3 or v.shape[1:] != (hv, vd):
        raise ConfigError(f"{fn}: v must be [T, HV={hv}, V={vd}], got {tuple(v.shape)}")
    if q.dim() != 3 or q.shape[0] != t or q.shape[2] != kd or k.shape != q.shape:
        raise ConfigError(f"{fn}: q and k must be [T={t}, HK, K={kd}], got {tuple(q.shape)} "
                          f"and {tuple(k.shape)}")
    hk = q.shape[1]
    if hk < 1 or hv % hk:
        raise ConfigError(f"{fn}: HV {hv} value heads must be a multiple of HK {hk} key heads")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise ConfigError(f"{fn}: q, k and v must share a dtype, got {q.dtype}, {k.dtype}, "
                          f"{v.dtype}")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (t, hv):
            raise ConfigError(f"{fn}: {name} must be [T={t}, HV={hv}], got {tuple(x.shape)}")
    if state_indices.dim() != 1 or state_indices.dtype not in (torch.int32, torch.int64):
        raise ConfigError(f"{fn}: state_indices must be a 1-D int32/int64 tensor, got "
                          f"{tuple(state_indices.shape)} {state_indices.dtype}")
    if kd > _MAX_DIM or kd < 1:
        raise ConfigError(f"{fn}: key head dim {kd} must be in 1..{_MAX_DIM}")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
        raise ConfigError(f"{fn}: scale must be a float or None, got {type(scale).__name__}")
    if out is not None and (out.shape != v.shape or out.dtype != v.dtype):
        raise ConfigError(f"{fn}: out must be like v {tuple(v.shape)} {v.dtype}")
    for name, x in (("state", state), ("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta),
                    ("out", out)):
        if x is not None and x.numel() and x.stride(-1) != 1:
            raise ConfigError(f"{fn}: {name}'s last dimension must be contiguous")
    return hv // hk, float(kd ** -0.5 if scale is None else scale)


def _check_devices(fn, *tensors):
    devs = {x.device for x in tensors if x is not None}
    if len(devs) != 1:
        raise ConfigError(f"{fn}: all tensors must be on one device, got "
                          f"{sorted(map(str, devs))}")


def _check_recurrent(state, q, k, v, g, beta, state_indices, scale, out):
    fn = "recurrent_gated_delta_rule"
    per, scale = _check(fn, state, q, k, v, g, beta, state_indices, scale, out)
    if state_indices.shape[0] != v.shape[0]:
        raise ConfigError(f"{fn}: one token per sequence: state_indices must be [N={v.shape[0]}]"
                          f", got {tuple(state_indices.shape)}")
    _check_devices(fn, state, q, k, v, g, beta, state_indices, out)
    return per, scale


def _check_chunk(state, q, k, v, g, beta, query_start_loc, state_indices, has_initial_state,
                 scale, chunk_size, out):
    fn = "chunk_gated_delta_rule"
    per, scale = _check(fn, state, q, k, v, g, beta, state_indices, scale, out)
    n = state_indices.shape[0]
    for name, x in (("query_start_loc", query_start_loc),
                    ("has_initial_state", has_initial_state)):
        if not isinstance(x, torch.Tensor):
            raise ConfigError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if (query_start_loc.shape != (n + 1,) or has_initial_state.shape != (n,)
            or query_start_loc.dtype not in (torch.int32, torch.int64)):
        raise ConfigError(f"{fn}: query_start_loc must be int32/int64 [N+1] and "
                          f"has_initial_state [N] for N={n} state indices, got "
                          f"{tuple(query_start_loc.shape)} and {tuple(has_initial_state.shape)}")
    if (isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 16
            or chunk_size > 128 or chunk_size & (chunk_size - 1)):
        raise ConfigError(f"{fn}: chunk_size must be 16, 32, 64 or 128, got {chunk_size!r}")
    _check_devices(fn, state, q, k, v, g, beta, query_start_loc, state_indices,
                   has_initial_state, out)
    return per, scale


# ---------------------------------------------------------------------------------------------
# Torch twins: the token-by-token recurrence, all heads of a token at once.


def _l2(x):
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2_EPS)


def _recur(s, q, k, v, g, beta, per, scale, l2):
    """Advance state ``s [HV, K, V]`` (float32) over tokens ``q/k [L, HK, K]``, ``v [L, HV, V]``,
    ``g/beta [L, HV]``; returns (outputs ``[L, HV, V]`` float32, the state)."""
    q = q.float().repeat_interleave(per, dim=1)
    k = k.float().repeat_interleave(per, dim=1)
    if l2:
        q, k = _l2(q), _l2(k)
    q = q * scale
    v, g, beta = v.float(), g.float(), beta.float()
    o = torch.empty_like(v)
    for i in range(v.shape[0]):
        s = s * torch.exp(g[i])[:, None, None]
        delta = (v[i] - (s * k[i][:, :, None]).sum(1)) * beta[i][:, None]  # [HV, V]
        s = s + k[i][:, :, None] * delta[:, None, :]
        o[i] = (s * q[i][:, :, None]).sum(1)
    return o, s


def recurrent_gated_delta_rule_ref(state, q, k, v, g, beta, state_indices, *, scale=None,
                                   use_qk_l2norm: bool = True, out=None):
    """Plain torch twin of :func:`recurrent_gated_delta_rule` (same signature and effects)."""
    per, scale = _check_recurrent(state, q, k, v, g, beta, state_indices, scale, out)
    if out is None:
        out = torch.empty_like(v)
    for b, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        o, s = _recur(state[slot].float(), q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1],
                      beta[b:b + 1], per, scale, use_qk_l2norm)
        state[slot] = s.to(state.dtype)
        out[b] = o[0].to(out.dtype)
    return out


def chunk_gated_delta_rule_ref(state, q, k, v, g, beta, query_start_loc, state_indices,
                               has_initial_state, *, scale=None, use_qk_l2norm: bool = True,
                               chunk_size: int = DEFAULT_CHUNK_SIZE, out=None):
    """Plain torch twin of :func:`chunk_gated_delta_rule` (same signature and effects)."""
    per, scale = _check_chunk(state, q, k, v, g, beta, query_start_loc, state_indices,
                              has_initial_state, scale, chunk_size, out)
    if out is None:
        out = torch.empty_like(v)
    qsl = query_start_loc.tolist()
    init = has_initial_state.tolist()
    for b, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        lo, hi = qsl[b], qsl[b + 1]
        s = (state[slot].float() if init[b]
             else torch.zeros(state.shape[1:], dtype=torch.float32, device=v.device))
        o, s = _recur(s, q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], per, scale,
                      use_qk_l2norm)
        out[lo:hi] = o.to(out.dtype)
        state[slot] = s.to(state.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Launchers


def _block_v(vd: int, cap: int) -> int:
    return max(16, min(cap, next_pow2(vd)))


def recurrent_gated_delta_rule(state, q, k, v, g, beta, state_indices, *, scale=None,
                               use_qk_l2norm: bool = True, out=None):
    """Decode: one token per sequence on its state slot (see the module docstring); returns
    ``out`` (new unless given). The Triton kernel on CUDA tensors (or under the
    interpreter), else the torch twin."""
    per, sc = _check_recurrent(state, q, k, v, g, beta, state_indices, scale, out)
    if not use_triton(_gdr_recurrent_kernel, v):
        return recurrent_gated_delta_rule_ref(state, q, k, v, g, beta, state_indices,
                                              scale=scale, use_qk_l2norm=use_qk_l2norm,
                                              out=out)
    if out is None:
        out = torch.empty_like(v)
    n = v.shape[0]
    _, hv, kd, vd = state.shape
    if n == 0 or hv == 0 or vd == 0:
        return out
    block_v = _block_v(vd, 32)
    grid = (n, hv, triton.cdiv(vd, block_v))
    _gdr_recurrent_kernel[grid](
        state, state.stride(0), state.stride(1), state.stride(2), q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), g, g.stride(0), beta,
        beta.stride(0), out, out.stride(0), out.stride(1), state_indices.contiguous(), kd, vd,
        per, sc,
        L2NORM=use_qk_l2norm, BLOCK_K=max(16, next_pow2(kd)), BLOCK_V=block_v)
    return out


def chunk_gated_delta_rule(state, q, k, v, g, beta, query_start_loc, state_indices,
                           has_initial_state, *, scale=None, use_qk_l2norm: bool = True,
                           chunk_size: int = DEFAULT_CHUNK_SIZE, out=None):
    """Prefill: a varlen batch of chunks on their state slots (see the module docstring);
    returns ``out`` (new unless given). The Triton kernel on CUDA tensors (or under the
    interpreter), else the torch twin."""
    per, sc = _check_chunk(state, q, k, v, g, beta, query_start_loc, state_indices,
                           has_initial_state, scale, chunk_size, out)
    if not use_triton(_gdr_chunk_kernel, v):
        return chunk_gated_delta_rule_ref(state, q, k, v, g, beta, query_start_loc,
                                          state_indices, has_initial_state, scale=scale,
                                          use_qk_l2norm=use_qk_l2norm, chunk_size=chunk_size,
                                          out=out)
    if out is None:
        out = torch.empty_like(v)
    n = state_indices.shape[0]
    _, hv, kd, vd = state.shape
    if n == 0 or hv == 0 or vd == 0:
        return out
    block_v = _block_v(vd, 32)
    grid = (n, hv, triton.cdiv(vd, block_v))
    _gdr_chunk_kernel[grid](
        state, state.stride(0), state.stride(1), state.stride(2), q, q.stride(0), q.stride(1),
        k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), g, g.stride(0), beta,
        beta.stride(0), out, out.stride(0), out.stride(1), query_start_loc.contiguous(),
        state_indices.contiguous(), has_initial_state.to(torch.int8).contiguous(), kd, vd,
        per, sc,
        L2NORM=use_qk_l2norm, PREC="ieee" if v.dtype == torch.float32 else "tf32",
        CHUNK=chunk_size, BLOCK_K=max(16, next_pow2(kd)), BLOCK_V=block_v,
        num_warps=4 if kd <= 64 else 8)
    return out


__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "chunk_gated_delta_rule",
    "chunk_gated_delta_rule_ref",
    "recurrent_gated_delta_rule",
    "recurrent_gated_delta_rule_ref",
]
