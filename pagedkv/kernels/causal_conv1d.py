"""Causal depthwise conv1d with a cached state (the short convolution of Mamba / Mamba-2
mixers), over a varlen batch: prefill chunks and decode tokens in one launch.

For channel ``c`` with kernel ``w[c, 0..W-1]`` (``W`` in 2..4) and bias ``b[c]``, a sequence's
output at its token ``t`` is ``act(b + sum_k w[k] * xe[t + k])`` over the extended input
``xe = [h_0 .. h_{W-2}, x_0, x_1, ...]``, where ``h`` are the ``W - 1`` inputs before the chunk:
the request's conv state when ``has_initial_state`` (a later prefill chunk, a decode step, a
prefix hit resuming from a checkpoint), zeros otherwise (a fresh prompt: transformers'
``Conv1d(padding=W-1)[..., :L]``). ``act`` is SiLU (``activation="silu"``) or none. After the
call the state holds the last ``W - 1`` entries of ``xe`` (transformers keeps ``W`` entries,
the current token included; the newest ``W - 1`` of them are this state).

Layout: ``x [T, D]`` (token-major, the mixer's ``in_proj`` output slice), ``conv_state
[S, W - 1, D]`` (one row per state slot, channels contiguous so a program's loads coalesce),
``weight [D, W]``, ``bias [D]`` or None, ``query_start_loc [N + 1]`` (int32), ``state_indices
[N]`` (each sequence's state slot; ``PAD_SLOT_ID`` (-1) rows are skipped: nothing read or
written, their outputs left as they are: CUDA-graph padding), ``has_initial_state [N]`` (bool).
Results in ``x``'s dtype, math in float32.

Grid ``(N, ceil(D / BLOCK_D))``: one program per sequence and channel block walks the
sequence's tokens in order, keeping the last ``W - 1`` inputs in registers (decode: one token;
a prefill chunk: a sequential walk, parallel over channels). The torch twin
:func:`causal_conv1d_ref` does the same sequence by sequence.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import PAD_SLOT_ID, use_triton

_BLOCK_D = 128


@triton.jit
def _causal_conv1d_kernel(x_ptr, x_s0, state_ptr, st_s0, st_s1, w_ptr, w_s0, b_ptr, out_ptr,
                          o_s0, qsl_ptr, idx_ptr, init_ptr, dim,
                          W: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    ok = cols < dim
    slot = tl.load(idx_ptr + seq).to(tl.int64)
    if slot >= 0:
        start = tl.load(qsl_ptr + seq).to(tl.int64)
        end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
        init = tl.load(init_ptr + seq) != 0
        # the scalar `init` enters the masks through a block comparison (a scalar predicate
        # broadcast into a block mask is rejected by triton >= 3.9)
        ok_init = cols < tl.where(init, dim, 0)
        st = state_ptr + slot * st_s0 + cols
        w_last = tl.load(w_ptr + cols * w_s0 + (W - 1), mask=ok, other=0.0).to(tl.float32)
        w_2 = tl.load(w_ptr + cols * w_s0 + (W - 2), mask=ok, other=0.0).to(tl.float32)
        # history, newest last: h2 = x[t-1], h1 = x[t-2], h0 = x[t-3] (zeros when W is smaller)
        h2 = tl.load(st + (W - 2) * st_s1, mask=ok_init, other=0.0).to(tl.float32)
        h1 = tl.zeros([BLOCK_D], dtype=tl.float32)
        h0 = tl.zeros([BLOCK_D], dtype=tl.float32)
        w_3 = tl.zeros([BLOCK_D], dtype=tl.float32)
        w_4 = tl.zeros([BLOCK_D], dtype=tl.float32)
        if W >= 3:
            w_3 = tl.load(w_ptr + cols * w_s0 + (W - 3), mask=ok, other=0.0).to(tl.float32)
            h1 = tl.load(st + (W - 3) * st_s1, mask=ok_init, other=0.0).to(tl.float32)
        if W >= 4:
            w_4 = tl.load(w_ptr + cols * w_s0 + (W - 4), mask=ok, other=0.0).to(tl.float32)
            h0 = tl.load(st + (W - 4) * st_s1, mask=ok_init, other=0.0).to(tl.float32)
        bias = tl.zeros([BLOCK_D], dtype=tl.float32)
        if HAS_BIAS:
            bias = tl.load(b_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        t = start
        while t < end:  # (the interpreter cannot iterate range() over runtime scalars)
            xt = tl.load(x_ptr + t * x_s0 + cols, mask=ok, other=0.0).to(tl.float32)
            acc = bias + w_last * xt + w_2 * h2 + w_3 * h1 + w_4 * h0
            if SILU:
                acc = acc / (1.0 + tl.exp(-acc))
            tl.store(out_ptr + t * o_s0 + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)
            h0 = h1
            h1 = h2
            h2 = xt
            t += 1
        sty = state_ptr.dtype.element_ty
        tl.store(st + (W - 2) * st_s1, h2.to(sty), mask=ok)
        if W >= 3:
            tl.store(st + (W - 3) * st_s1, h1.to(sty), mask=ok)
        if W >= 4:
            tl.store(st + (W - 4) * st_s1, h0.to(sty), mask=ok)


def _check(x, conv_state, weight, bias, query_start_loc, state_indices, has_initial_state,
           activation, out):
    fn = "causal_conv1d"
    if x.dim() != 2:
        raise ConfigError(f"{fn}: x must be [T, D], got {tuple(x.shape)}")
    t, d = x.shape
    if weight.dim() != 2 or weight.shape[0] != d or not 2 <= weight.shape[1] <= 4:
        raise ConfigError(f"{fn}: weight must be [D={d}, W] with W in 2..4, got "
                          f"{tuple(weight.shape)}")
    if weight.stride(1) != 1:
        raise ConfigError(f"{fn}: weight's last dimension must be contiguous")
    w = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1:] != (w - 1, d):
        raise ConfigError(f"{fn}: conv_state must be [S, W-1={w - 1}, D={d}], got "
                          f"{tuple(conv_state.shape)}")
    if bias is not None and bias.shape != (d,):
        raise ConfigError(f"{fn}: bias must be [D={d}], got {tuple(bias.shape)}")
    n = state_indices.shape[0]
    if query_start_loc.shape != (n + 1,) or has_initial_state.shape != (n,):
        raise ConfigError(f"{fn}: query_start_loc must be [N+1], has_initial_state [N] for "
                          f"N={n} state indices")
    if activation not in (None, "silu"):
        raise ConfigError(f"{fn}: activation must be 'silu' or None, got {activation!r}")
    if out is not None and (out.shape != x.shape or out.dtype != x.dtype):
        raise ConfigError(f"{fn}: out must be like x {tuple(x.shape)} {x.dtype}")
    for name, v in (("x", x), ("conv_state", conv_state), ("out", out)):
        if v is not None and v.numel() and v.stride(-1) != 1:
            raise ConfigError(f"{fn}: {name}'s last dimension must be contiguous")
    devs = {v.device for v in (x, conv_state, weight, query_start_loc, state_indices,
                               has_initial_state, bias, out) if v is not None}
    if len(devs) != 1:
        raise ConfigError(f"{fn}: all tensors must be on one device, got {sorted(map(str, devs))}")
    return w


def causal_conv1d_ref(x, conv_state, weight, bias, query_start_loc, state_indices,
                      has_initial_state, activation="silu", out=None):
    """Plain torch twin of :func:`causal_conv1d` (same signature, same in-place effects)."""
    w = _check(x, conv_state, weight, bias, query_start_loc, state_indices, has_initial_state,
               activation, out)
    if out is None:
        out = torch.empty_like(x)
    qsl = query_start_loc.tolist()
    wt = weight.float()
    for b, slot in enumerate(state_indices.tolist()):
        if slot == PAD_SLOT_ID:
            continue
        s, e = qsl[b], qsl[b + 1]
        hist = (conv_state[slot].float() if bool(has_initial_state[b])
                else torch.zeros(w - 1, x.shape[1], dtype=torch.float32, device=x.device))
        xe = torch.cat([hist, x[s:e].float()], dim=0)  # [W-1+L, D]
        if e > s:
            windows = xe.unfold(0, w, 1)  # [L, D, W]
            y = (windows * wt).sum(-1)
            if bias is not None:
                y = y + bias.float()
            if activation == "silu":
                y = torch.nn.functional.silu(y)
            out[s:e] = y.to(out.dtype)
        conv_state[slot] = xe[xe.shape[0] - (w - 1):].to(conv_state.dtype)
    return out


def causal_conv1d(x, conv_state, weight, bias, query_start_loc, state_indices,
                  has_initial_state, activation="silu", out=None):
    """See the module docstring; returns ``out`` (new unless given). The Triton kernel on
    CUDA tensors (or under the interpreter), else the torch twin."""
    w = _check(x, conv_state, weight, bias, query_start_loc, state_indices, has_initial_state,
               activation, out)
    if not use_triton(_causal_conv1d_kernel, x):
        return causal_conv1d_ref(x, conv_state, weight, bias, query_start_loc, state_indices,
                                 has_initial_state, activation, out)
    if out is None:
        out = torch.empty_like(x)
    n, d = state_indices.shape[0], x.shape[1]
    if n == 0 or d == 0:
        return out
    grid = (n, triton.cdiv(d, _BLOCK_D))
    # the kernel reads the per-sequence vectors densely (a column of MambaMetadata's
    # [rows, 1 + spec_blocks] state indices is strided): no-ops for contiguous ones
    _causal_conv1d_kernel[grid](
        x, x.stride(0), conv_state, conv_state.stride(0), conv_state.stride(1), weight,
        weight.stride(0), bias if bias is not None else weight, out, out.stride(0),
        query_start_loc.contiguous(), state_indices.contiguous(),
        has_initial_state.to(torch.int8).contiguous(), d,
        W=w, HAS_BIAS=bias is not None, SILU=activation == "silu", BLOCK_D=_BLOCK_D)
    return out


__all__ = ["causal_conv1d", "causal_conv1d_ref"]
