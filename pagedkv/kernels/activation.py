"""SiLU-gated activation of the MLP (Triton): ``out = silu(gate) * up`` for ``x = [gate | up]``.

``x [T, 2I]`` (last dimension contiguous, any row stride) -> ``out [T, I]`` in ``x``'s dtype;
``silu(g) = g / (1 + exp(-g))``. Math in float32 after the loads, one rounding at the store (as
``torch.compile``'s fused kernel does; the eager torch twin rounds after the SiLU and after the
product, so bf16 results may differ from it by about one bf16 ulp).

Grid ``(T, ceil(I / BLOCK))``: each program reads ``BLOCK`` gate and ``BLOCK`` up values of one
row (2-D addressing, no integer division per element) and writes ``BLOCK`` outputs. Inductor's
generated kernel for the same expression reached about 1 TB/s on the H200 at 256 x 6144 and
8192 x 6144 bf16 (W1 profile, 4.6 / 120 us); this one is a plain streaming copy.

Split-K partials (``silu_and_mul_partials``): ``x [S, T, 2I]`` float32, the ``S`` partial
products of the gate/up projection (``pagedkv.kernels.splitk_gemm``), summed over ``S`` in
float32 after the loads, then the same activation, stored in the model's dtype: the split-K
GEMM's reduce and the activation in one launch (the same kernel, ``SPLITS`` partials a row;
``S = 1`` of a 2-D ``x`` is the plain activation).

``silu_and_mul_op`` is registered as the custom op ``pagedkv::silu_and_mul``
(``torch.library.triton_op``), so ``torch.compile`` regions keep it as one kernel launch inside
their graphs; on a CUDA tensor it launches the Triton kernel, on any other device it runs the
torch twin (bitwise the eager expression ``F.silu(gate) * up``). No host syncs: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton

from pagedkv.errors import ConfigError
from pagedkv.kernels._common import use_triton

_BLOCK = 1024


@triton.jit
def silu_mul(gate, up):
    """``silu(gate) * up`` of float32 values: the activation's one formula."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_kernel(x_ptr, x_s0, x_split, out_ptr, o_s0, num_rows, inter,
                         BLOCK: tl.constexpr, SPLITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * x_s0 + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_s0 + inter + cols, mask=ok, other=0.0).to(tl.float32)
    for s in tl.static_range(1, SPLITS):  # the further split-K partials, summed in float32
        base = x_ptr + s * x_split + row * x_s0
        gate += tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        up += tl.load(base + inter + cols, mask=ok, other=0.0).to(tl.float32)
    out = silu_mul(gate, up)
    tl.store(out_ptr + row * o_s0 + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


def _check(x: torch.Tensor, out: torch.Tensor | None) -> int:
    fn = "silu_and_mul"
    if x.dim() != 2 or x.shape[1] % 2:
        raise ConfigError(f"{fn}: x must be [T, 2 * I], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"{fn}: x must be bf16/fp16/fp32, got {x.dtype}")
    if x.shape[1] and x.stride(1) != 1:
        raise ConfigError(f"{fn}: x's last dimension must be contiguous")
    inter = x.shape[1] // 2
    if out is not None:
        if out.shape != (x.shape[0], inter) or out.dtype != x.dtype or out.device != x.device:
            raise ConfigError(f"{fn}: out must be [{x.shape[0]}, {inter}] {x.dtype} on {x.device}, "
                              f"got {tuple(out.shape)} {out.dtype} on {out.device}")
        if inter and out.stride(1) != 1:
            raise ConfigError(f"{fn}: out's last dimension must be contiguous")
    return inter


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Plain torch twin: ``F.silu(gate) * up`` in ``x``'s dtype (the eager expression)."""
    _check(x, None)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of ``x = [gate | up]`` with the Triton kernel (CUDA tensors, or any
    tensor under the Triton interpreter); otherwise the torch twin."""
    inter = _check(x, out)
    if not use_triton(_silu_and_mul_kernel, x):
        res = silu_and_mul_ref(x)
        if out is None:
            return res
        out.copy_(res)
        return out
    if out is None:
        out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    if x.shape[0] and inter:
        _launch(_silu_and_mul_kernel, x.unsqueeze(0), out)
    return out


@triton_op("pagedkv::silu_and_mul", mutates_args={})
def silu_and_mul_op(x: torch.Tensor) -> torch.Tensor:
    """``silu_and_mul`` as a custom op that ``torch.compile`` can trace (one launch inside a
    compiled graph); on a non-CUDA tensor the torch twin."""
    if x.device.type != "cuda":
        return silu_and_mul_ref(x)
    inter = _check(x, None)
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    if x.shape[0] and inter:
        _launch(wrap_triton(_silu_and_mul_kernel), x.unsqueeze(0), out)
    return out


def _launch(kernel, parts: torch.Tensor, out: torch.Tensor) -> None:
    """One launch over ``parts [S, T, 2I]`` (S >= 1; rows ``T``) into ``out [T, I]``."""
    splits, rows, width = parts.shape
    inter = width // 2
    kernel[(rows, triton.cdiv(inter, _BLOCK))](
        parts, parts.stride(1), parts.stride(0), out, out.stride(0), rows, inter,
        BLOCK=_BLOCK, SPLITS=splits, num_warps=4)


def _check_partials(parts: torch.Tensor, dtype: torch.dtype) -> int:
    fn = "silu_and_mul_partials"
    if parts.dim() != 3 or parts.shape[0] < 1 or parts.shape[2] % 2:
        raise ConfigError(f"{fn}: partials must be [S >= 1, T, 2 * I], got shape "
                          f"{tuple(parts.shape)}")
    if parts.dtype != torch.float32:
        raise ConfigError(f"{fn}: partials must be float32 (split-K partials), got {parts.dtype}")
    if parts.shape[2] and parts.stride(2) != 1:
        raise ConfigError(f"{fn}: the partials' last dimension must be contiguous")
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ConfigError(f"{fn}: the output dtype must be bf16/fp16/fp32, got {dtype}")
    return parts.shape[2] // 2


def silu_and_mul_partials_ref(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Plain torch twin of :func:`silu_and_mul_partials`: the float32 sum of the partials, the
    activation in float32, one rounding to ``dtype``."""
    _check_partials(parts, dtype)
    gate, up = parts.sum(0).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(dtype)


def silu_and_mul_partials(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``silu(gate) * up`` of ``sum(parts, 0) = [gate | up]`` (``parts [S, T, 2I]`` float32:
    the split-K partials of the gate/up projection) in ``dtype``, with the Triton kernel (CUDA
    tensors, or any tensor under the Triton interpreter); otherwise the torch twin."""
    inter = _check_partials(parts, dtype)
    if not use_triton(_silu_and_mul_kernel, parts):
        return silu_and_mul_partials_ref(parts, dtype)
    out = torch.empty((parts.shape[1], inter), dtype=dtype, device=parts.device)
    if parts.shape[1] and inter:
        _launch(_silu_and_mul_kernel, parts, out)
    return out


@triton_op("pagedkv::silu_and_mul_partials", mutates_args={})
def silu_and_mul_partials_op(parts: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``silu_and_mul_partials`` as a custom op (one launch inside a compiled graph); on a
    non-CUDA tensor the torch twin."""
    if parts.device.type != "cuda":
        return silu_and_mul_partials_ref(parts, dtype)
    inter = _check_partials(parts, dtype)
    out = torch.empty((parts.shape[1], inter), dtype=dtype, device=parts.device)
    if parts.shape[1] and inter:
        _launch(wrap_triton(_silu_and_mul_kernel), parts, out)
    return out


__all__ = ["silu_and_mul", "silu_and_mul_op", "silu_and_mul_partials", "silu_and_mul_partials_op",
           "silu_and_mul_partials_ref", "silu_and_mul_ref"]
