"""Mamba-1: the selective scan over a varlen batch (prefill chunks) and its single-step form
(decode), each sequence on its state slot.

For sequence ``b`` (tokens ``query_start_loc[b]:query_start_loc[b+1]``, state slot
``s = state_indices[b]``), channel ``d`` and state entry ``n``, with
``dt'_t = softplus(dt[t, d] + dt_bias[d])`` (``dt_softplus``; else ``dt + dt_bias`` as given),
the recurrence is

    ``h[d, n] <- exp(dt'_t * A[d, n]) * h[d, n] + dt'_t * B[t, n] * x[t, d]``
    ``y[t, d]  = (sum_n C[t, n] * h[d, n] + D[d] * x[t, d]) * silu(z[t, d])``

from ``h = ssm_state[s]`` when ``has_initial_state[b]`` (a later prefill chunk, a prefix hit
resuming from a checkpoint), else zeros (a fresh prompt); the state after the sequence's last
token is written back (a sequence without tokens writes its start state: unchanged, or
zeros). ``A = -exp(A_log)`` is per channel and state entry (Mamba-1; Mamba-2's ``A`` is one
scalar per head, see ``ssd_chunk_scan``), ``B``/``C`` are shared by all channels. This is
transformers' ``MambaMixer`` / ``JambaMambaMixer`` scan (``mamba_selective_scan`` with
``delta_bias``, ``delta_softplus``, ``D`` and ``z``; Jamba's RMSNorms of dt, B and C come
before, in the model) and its decode step (``mamba_selective_state_update``). ``z`` None: no
gate; ``D`` None: no skip term. ``PAD_SLOT_ID`` (-1) rows are skipped: no state read or
written, their outputs left as they are. Math in float32; the state keeps its dtype (float32
in the engine), ``y`` takes ``x``'s.

Layout (token-major, the mixer's projections as they come; any row stride, the last dimension
contiguous): ``ssm_state [S, D, N]`` (transformers' ``[intermediate_size, ssm_state_size]``
per slot; the slot stride is free: a view into a shared pool), ``x``/``dt``/``z [T, D]``,
``B``/``C [T, N]``, ``A [D, N]``, ``D``/``dt_bias [D]``, ``query_start_loc [N + 1]``,
``state_indices [N]``, ``has_initial_state [N]`` (bool).

One kernel serves both entry points. Grid ``(N, ceil(D / BLOCK_D))``: a program holds a
``BLOCK_D x dstate`` tile of one sequence's state in registers and walks the sequence's
tokens in order, ``chunk_size`` at a time: each chunk is unrolled at compile time (the loads
of a chunk's tokens do not depend on the state, so they issue ahead of the recurrence), lanes
past the sequence's end get ``dt' = 0`` (no decay, no input) and store nothing.

* :func:`selective_scan` (prefill): the varlen batch as above.
* :func:`selective_scan_update` (decode): one token per sequence (``x [N, D]``, row ``b`` is
  sequence ``b``), always continuing from the slot; the same kernel compiled with a chunk of
  one token and no ``query_start_loc``: exactly one recurrence step per program, nothing
  masked away, no host-side ``arange`` for the token offsets (CUDA-graph friendly). A separate
  single-step kernel would repeat the same body; a decode batch through :func:`selective_scan`
  gives the same numbers with ``chunk_size - 1`` masked steps per program.

The torch twins (``*_ref``) are the plain token-by-token recurrence; ``chunk_size`` only
shapes the kernel's work, never the result.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import (
    INDEX_DTYPES,
    KV_DTYPES,
    PAD_SLOT_ID,
    check_same_device,
    check_tensor,
    next_pow2,
    start_state,
    use_triton,
    varlen_state_rows,
)

DEFAULT_CHUNK_SIZE = 16
_CHUNK_SIZES = (1, 2, 4, 8, 16, 32)
_MAX_DSTATE = 256
_TILE = 2048  # state elements per program (BLOCK_D x BLOCK_N)


@triton.jit
def _selective_scan_kernel(state_ptr, st_s0, st_s1, x_ptr, x_s0, dt_ptr, dt_s0, dtb_ptr,
                           a_ptr, a_s0, b_ptr, b_s0, c_ptr, c_s0, d_ptr, z_ptr, z_s0,
                           out_ptr, o_s0, qsl_ptr, idx_ptr, init_ptr, dim, dstate,
                           VARLEN: tl.constexpr, SOFTPLUS: tl.constexpr, HAS_D: tl.constexpr,
                           HAS_Z: tl.constexpr, HAS_DT_BIAS: tl.constexpr,
                           CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    seq = tl.program_id(0)
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    if slot >= 0:
        d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        d_ok = d < dim
        n_ok = n < dstate
        tile = d_ok[:, None] & n_ok[None, :]
        if VARLEN:
            start = tl.load(qsl_ptr + seq).to(tl.int64)
            end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
            init = tl.load(init_ptr + seq) != 0
        else:  # one token per sequence, continuing from the slot
            start = seq.to(tl.int64)
            end = start + 1
            init = start >= 0
        # scalar predicates enter the masks through block comparisons (a scalar broadcast
        # into a block mask is rejected by triton >= 3.9)
        d_init = d < tl.where(init, dim, 0)
        sp = state_ptr + slot * st_s0 + d[:, None] * st_s1 + n[None, :]
        h = tl.load(sp, mask=d_init[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        a = tl.load(a_ptr + d[:, None] * a_s0 + n[None, :], mask=tile, other=0.0).to(tl.float32)
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_DT_BIAS:
            bias = tl.load(dtb_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        skip = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_D:
            skip = tl.load(d_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
        t0 = start
        while t0 < end:  # (the interpreter cannot iterate range() over runtime scalars)
            for i in tl.static_range(CHUNK):
                t = t0 + i
                m_d = d < tl.where(t < end, dim, 0)
                m_n = n < tl.where(t < end, dstate, 0)
                xt = tl.load(x_ptr + t * x_s0 + d, mask=m_d, other=0.0).to(tl.float32)
                dt = tl.load(dt_ptr + t * dt_s0 + d, mask=m_d, other=0.0).to(tl.float32) + bias
                if SOFTPLUS:
                    dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(dt)), dt)
                dt = tl.where(m_d, dt, 0.0)
                bt = tl.load(b_ptr + t * b_s0 + n, mask=m_n, other=0.0).to(tl.float32)
                ct = tl.load(c_ptr + t * c_s0 + n, mask=m_n, other=0.0).to(tl.float32)
                h = h * tl.exp(dt[:, None] * a) + (dt * xt)[:, None] * bt[None, :]
                y = tl.sum(h * ct[None, :], axis=1) + skip * xt
                if HAS_Z:
                    zt = tl.load(z_ptr + t * z_s0 + d, mask=m_d, other=0.0).to(tl.float32)
                    y = y * (zt / (1.0 + tl.exp(-zt)))
                tl.store(out_ptr + t * o_s0 + d, y.to(out_ptr.dtype.element_ty), mask=m_d)
            t0 += CHUNK
        tl.store(sp, h.to(state_ptr.dtype.element_ty), mask=tile)


# ---------------------------------------------------------------------------------------------
# Argument checks (host metadata only)

_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_common(fn, ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, out):
    """Shapes, dtypes, strides of the arguments both entry points share; returns ``(T, dim,
    dstate)``."""
    check_tensor(fn, "ssm_state", ssm_state, dtypes=KV_DTYPES, ndim=3, contiguous_last=True)
    _, dim, ds = ssm_state.shape
    for name, v in (("x", x), ("dt", dt), ("z", z), ("out", out)):
        if v is not None:
            check_tensor(fn, name, v, dtypes=KV_DTYPES, ndim=2, contiguous_last=True)
    t = x.shape[0]
    for name, v in (("x", x), ("dt", dt), ("z", z)):
        if v is not None and v.shape != (t, dim):
            raise ConfigError(f"{fn}: {name} must be [T={t}, D={dim}] (D from ssm_state "
                              f"[S, D, N]), got {tuple(v.shape)}")
    for name, v in (("B", B), ("C", C)):
        check_tensor(fn, name, v, dtypes=KV_DTYPES, ndim=2, contiguous_last=True)
        if v.shape != (t, ds):
            raise ConfigError(f"{fn}: {name} must be [T={t}, N={ds}], got {tuple(v.shape)}")
    check_tensor(fn, "A", A, dtypes=_PARAM_DTYPES, ndim=2, contiguous_last=True)
    if A.shape != (dim, ds):
        raise ConfigError(f"{fn}: A must be [D={dim}, N={ds}], got {tuple(A.shape)}")
    for name, v in (("D", D), ("dt_bias", dt_bias)):
        if v is not None:
            check_tensor(fn, name, v, dtypes=_PARAM_DTYPES, ndim=1, contiguous_last=True)
            if v.shape != (dim,):
                raise ConfigError(f"{fn}: {name} must be [D={dim}], got {tuple(v.shape)}")
    check_tensor(fn, "state_indices", state_indices, dtypes=INDEX_DTYPES, ndim=1,
                 contiguous_last=True)
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ConfigError(f"{fn}: out must be like x {tuple(x.shape)} {x.dtype}, got "
                          f"{tuple(out.shape)} {out.dtype}")
    if not 1 <= ds <= _MAX_DSTATE:
        raise ConfigError(f"{fn}: dstate {ds} must be in 1..{_MAX_DSTATE}")
    return t, dim, ds


def _check_scan(ssm_state, x, dt, dt_bias, A, B, C, D, z, query_start_loc, state_indices,
                has_initial_state, chunk_size, out):
    fn = "selective_scan"
    _check_common(fn, ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, out)
    n = state_indices.shape[0]
    check_tensor(fn, "query_start_loc", query_start_loc, dtypes=INDEX_DTYPES, ndim=1,
                 contiguous_last=True)
    check_tensor(fn, "has_initial_state", has_initial_state, dtypes=(torch.bool,), ndim=1)
    if query_start_loc.shape != (n + 1,) or has_initial_state.shape != (n,):
        raise ConfigError(f"{fn}: query_start_loc must be [N+1] and has_initial_state [N] for "
                          f"N={n} state indices, got {tuple(query_start_loc.shape)} and "
                          f"{tuple(has_initial_state.shape)}")
    if isinstance(chunk_size, bool) or chunk_size not in _CHUNK_SIZES:
        raise ConfigError(f"{fn}: chunk_size must be one of {_CHUNK_SIZES}, got {chunk_size!r}")
    check_same_device(fn, ssm_state=ssm_state, x=x, dt=dt, dt_bias=dt_bias, A=A, B=B, C=C,
                      D=D, z=z, query_start_loc=query_start_loc, state_indices=state_indices,
                      has_initial_state=has_initial_state, out=out)


def _check_update(ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, out):
    fn = "selective_scan_update"
    t, _, _ = _check_common(fn, ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, out)
    if state_indices.shape != (t,):
        raise ConfigError(f"{fn}: one token per sequence: state_indices must be [N={t}], got "
                          f"{tuple(state_indices.shape)}")
    check_same_device(fn, ssm_state=ssm_state, x=x, dt=dt, dt_bias=dt_bias, A=A, B=B, C=C,
                      D=D, z=z, state_indices=state_indices, out=out)


# ---------------------------------------------------------------------------------------------
# Torch twins: the token-by-token recurrence, all channels of a token at once.


def _recur(h, x, dt, dt_bias, A, B, C, D, z, dt_softplus):
    """Advance ``h [D, N]`` (float32) over the tokens ``x/dt/z [L, D]``, ``B/C [L, N]``;
    returns (``y [L, D]`` float32, the state)."""
    d = dt.float() + (dt_bias.float() if dt_bias is not None else 0.0)
    if dt_softplus:
        d = torch.nn.functional.softplus(d)
    xs = x.float()
    decay = torch.exp(d[:, :, None] * A.float()[None])  # [L, D, N]
    inp = (d * xs)[:, :, None] * B.float()[:, None, :]
    cs = C.float()
    ys = torch.empty_like(xs)
    for i in range(xs.shape[0]):
        h = decay[i] * h + inp[i]
        ys[i] = h @ cs[i]
    if D is not None:
        ys = ys + D.float() * xs
    if z is not None:
        ys = ys * torch.nn.functional.silu(z.float())
    return ys, h


def selective_scan_ref(ssm_state, x, dt, dt_bias, A, B, C, D, z, query_start_loc,
                       state_indices, has_initial_state, *, dt_softplus: bool = True,
                       chunk_size: int = DEFAULT_CHUNK_SIZE, out=None):
    """Plain torch twin of :func:`selective_scan` (same signature and effects)."""
    _check_scan(ssm_state, x, dt, dt_bias, A, B, C, D, z, query_start_loc, state_indices,
                has_initial_state, chunk_size, out)
    if out is None:
        out = torch.empty_like(x)
    for _, slot, s, e, init in varlen_state_rows(query_start_loc, state_indices,
                                                 has_initial_state):
        h = start_state(ssm_state, slot, init)
        if e > s:
            y, h = _recur(h, x[s:e], dt[s:e], dt_bias, A, B[s:e], C[s:e], D,
                          None if z is None else z[s:e], dt_softplus)
            out[s:e] = y.to(out.dtype)
        ssm_state[slot] = h.to(ssm_state.dtype)
    return out


def selective_scan_update_ref(ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, *,
                              dt_softplus: bool = True, out=None):
    """Plain torch twin of :func:`selective_scan_update` (same signature and effects)."""
    _check_update(ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, out)
    if out is None:
        out = torch.empty_like(x)
    for b, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        r = slice(b, b + 1)
        y, h = _recur(ssm_state[slot].float(), x[r], dt[r], dt_bias, A, B[r], C[r], D,
                      None if z is None else z[r], dt_softplus)
        out[r] = y.to(out.dtype)
        ssm_state[slot] = h.to(ssm_state.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Launchers


def _launch(ssm_state, x, dt, dt_bias, A, B, C, D, z, qsl, state_indices, init, out, *,
            varlen: bool, dt_softplus: bool, chunk: int):
    n = state_indices.shape[0]
    _, dim, ds = ssm_state.shape
    if n == 0 or dim == 0:
        return
    block_n = max(16, next_pow2(ds))
    block_d = max(16, min(64, next_pow2(dim), _TILE // block_n))
    grid = (n, triton.cdiv(dim, block_d))
    _selective_scan_kernel[grid](
        ssm_state, ssm_state.stride(0), ssm_state.stride(1), x, x.stride(0), dt, dt.stride(0),
        dt_bias if dt_bias is not None else A, A, A.stride(0), B, B.stride(0), C, C.stride(0),
        D if D is not None else A, z if z is not None else x, (z if z is not None else x).stride(0),
        out, out.stride(0), qsl, state_indices, init, dim, ds,
        VARLEN=varlen, SOFTPLUS=dt_softplus, HAS_D=D is not None, HAS_Z=z is not None,
        HAS_DT_BIAS=dt_bias is not None, CHUNK=chunk, BLOCK_D=block_d, BLOCK_N=block_n,
        num_warps=4 if block_d * block_n <= 1024 else 8)


def selective_scan(ssm_state, x, dt, dt_bias, A, B, C, D, z, query_start_loc, state_indices,
                   has_initial_state, *, dt_softplus: bool = True,
                   chunk_size: int = DEFAULT_CHUNK_SIZE, out=None):
    """See the module docstring; returns ``out`` (new unless given). The Triton kernel on
    CUDA tensors (or under the interpreter), else the torch twin."""
    _check_scan(ssm_state, x, dt, dt_bias, A, B, C, D, z, query_start_loc, state_indices,
                has_initial_state, chunk_size, out)
    if not use_triton(_selective_scan_kernel, x):
        return selective_scan_ref(ssm_state, x, dt, dt_bias, A, B, C, D, z, query_start_loc,
                                  state_indices, has_initial_state, dt_softplus=dt_softplus,
                                  chunk_size=chunk_size, out=out)
    if out is None:
        out = torch.empty_like(x)
    _launch(ssm_state, x, dt, dt_bias, A, B, C, D, z, query_start_loc, state_indices,
            has_initial_state.to(torch.int8), out, varlen=True, dt_softplus=dt_softplus,
            chunk=chunk_size)
    return out


def selective_scan_update(ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, *,
                          dt_softplus: bool = True, out=None):
    """See the module docstring (one token per sequence); returns ``out`` (new unless given).
    The Triton kernel on CUDA tensors (or under the interpreter), else the torch twin."""
    _check_update(ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, out)
    if not use_triton(_selective_scan_kernel, x):
        return selective_scan_update_ref(ssm_state, x, dt, dt_bias, A, B, C, D, z,
                                         state_indices, dt_softplus=dt_softplus, out=out)
    if out is None:
        out = torch.empty_like(x)
    _launch(ssm_state, x, dt, dt_bias, A, B, C, D, z, state_indices, state_indices,
            state_indices, out, varlen=False, dt_softplus=dt_softplus, chunk=1)
    return out


__all__ = ["DEFAULT_CHUNK_SIZE", "selective_scan", "selective_scan_ref", "selective_scan_update",
           "selective_scan_update_ref"]
