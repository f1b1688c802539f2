"""Programmatic dependent launch (PDL) for this package's Triton kernels on Hopper and newer.

A kernel launched with PDL (``launch_pdl=True``) may be started by the GPU before the kernel
ahead of it on the stream has finished: as soon as every program of that kernel has executed
``griddepcontrol.launch_dependents`` (or exited). Inside a CUDA graph the launch attribute
becomes a programmatic edge. What that buys: the launch latency and the start of the next
kernel's programs overlap the previous kernel's tail, instead of a gap of about a microsecond
between every two kernels of a decode step.

The contract every kernel here keeps (``pdl_prologue``, its first statement): it waits
(``griddepcontrol.wait``: every prerequisite grid completed and its memory visible) before it
reads or writes any global memory, then lets its own dependents launch. So a PDL launch never
reads a value its predecessor has not written, nor overwrites one the predecessor still reads;
a kernel after it that is launched without PDL (cuBLAS, an inductor kernel) waits for its
completion as usual. Both instructions are no-ops in a kernel launched without PDL. One
exception, by design: the fused decode chain's kernels first ask the L2 for their weight lines
(:func:`prefetch_weights_l2`: ``prefetch.global.L2``, constant data no kernel writes, nothing
loaded into the program), so a small GEMM's weight stream overlaps the tail of the kernel ahead.

The switch: ``PDL_ENABLED`` (environment ``PAGEDKV_PDL``, "1" on, "0" off, the default);
launches use PDL only on CUDA devices of compute capability 9.0 or more, never under the
Triton interpreter (which has no inline assembly). With it on, ``compile_regions`` also turns
on inductor's own PDL code generation (``torch._inductor.config.triton.enable_pdl``, where the
installed torch has it) for the compiled regions' kernels; cuBLAS GEMMs launch without it.

Measured on the H200 (BENCHMARKS.md, tenth session; ``bench/bench_pdl_gpu.py``): about 1.2 us
off every boundary between two of these kernels with the early trigger (decode B1/L8192 18.2
-> 17.0 us; 28 layers of fused write + decode 35-56 us a step), half of that with the exit
trigger; the early trigger costs a balanced one-wave decode launch 7 us (B64/L2048: the next
kernel's programs are placed while this one's hold the multiprocessors). W1 end to end was not
faster (-8% and +3% in two leases): hence off by default.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from pagedkv.errors import ConfigError

PDL_ENABLED = os.environ.get("PAGEDKV_PDL", "0") == "1"
# where a kernel lets its dependents launch: "early" (right after its wait: the next kernel's
# programs become resident while this one runs) or "exit" (implicitly, as its programs exit:
# only the launch latency overlaps)
PDL_TRIGGER = os.environ.get("PAGEDKV_PDL_TRIGGER", "early")
_TRIGGERS = {"early": 1, "exit": 2}  # the kernels' PDL constexpr (pdl_prologue)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return tuple(torch.cuda.get_device_capability(index))


def pdl_supported(device: torch.device) -> bool:
    """CUDA device of compute capability 9.0 or newer (Hopper: ``griddepcontrol``)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= (9, 0)


def use_pdl(kernel, device: torch.device) -> bool:
    """Whether a launch of ``kernel`` on ``device`` takes PDL now (the switch, the device, a
    compiled kernel)."""
    return PDL_ENABLED and not isinstance(kernel, InterpretedFunction) and pdl_supported(device)


def pdl_launch_args(kernel, device: torch.device) -> dict:
    """The keyword arguments of a launch: ``PDL`` (the kernel's constexpr: 0 off, 1 wait and
    trigger early, 2 wait only; ``PDL_TRIGGER``) and, when on, ``launch_pdl=True``; a kernel
    compiled with ``PDL > 0`` is always launched with the attribute and the other way round."""
    if use_pdl(kernel, device):
        if PDL_TRIGGER not in _TRIGGERS:
            raise ConfigError(f"PAGEDKV_PDL_TRIGGER must be one of {sorted(_TRIGGERS)}, got "
                              f"{PDL_TRIGGER!r}")
        return {"PDL": _TRIGGERS[PDL_TRIGGER], "launch_pdl": True}
    return {"PDL": 0}


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """First statement of a PDL-capable kernel (``PDL`` > 0): wait for the previous grid's
    completion and memory; with ``PDL == 1`` then allow the next kernel to launch (module
    docstring); ``PDL == 2`` leaves that to the programs' exit."""
    if PDL > 0:
        tl.extra.cuda.gdc_wait()
        if PDL == 1:
            tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def prefetch_weights_l2(rows, k0, k_end, LINES: tl.constexpr, ELEMS_PER_LINE: tl.constexpr,
                        PDL: tl.constexpr):
    """Before a PDL kernel's wait (``PDL`` > 0; nothing otherwise): ask the L2 for the weight
    lines this program will read: rows ``rows`` (``[R]`` pointers to each row's first
    element), columns ``[k0, k_end)``, one ``prefetch.global.L2`` a 128-byte line
    (``ELEMS_PER_LINE`` elements; ``LINES``, a power of two, covers the span). Weights are
    constant, never written by an earlier kernel, so touching them before the wait keeps the
    contract above; no register or shared memory is written. The point: a small decode GEMM's
    weight stream starts while the kernel ahead of it still runs, instead of after its last
    program exits (the fused decode chain's kernels: ``qkv_rope_cache``, ``gate_up_silu``,
    ``splitk_residual``). Compiled only for a GPU (inline PTX; the interpreter never has
    ``PDL`` > 0)."""
    if PDL > 0:
        cols = k0 + tl.arange(0, LINES) * ELEMS_PER_LINE
        ptrs = rows[:, None] + tl.where(cols < k_end, cols, k0)[None, :]
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def prefetch_lines(span: int, element_size: int) -> tuple[int, int]:
    """``(LINES, ELEMS_PER_LINE)`` of :func:`prefetch_weights_l2` for a span of ``span``
    columns of ``element_size``-byte elements (128-byte lines)."""
    per_line = max(1, 128 // element_size)
    lines = max(1, -(-span // per_line))
    return 1 << (lines - 1).bit_length(), per_line


def pdl_chain_args(kernel, x: torch.Tensor, span: int) -> dict:
    """The launch keywords of a fused decode-chain kernel: :func:`pdl_launch_args`, and with
    PDL on the weight prefetch's ``PF_LINES`` / ``PF_EPL`` for a span of ``span`` columns of
    ``x``'s element size."""
    args = pdl_launch_args(kernel, x.device)
    if args["PDL"]:
        args["PF_LINES"], args["PF_EPL"] = prefetch_lines(span, x.element_size())
    return args


__all__ = ["PDL_ENABLED", "pdl_chain_args", "pdl_launch_args", "pdl_prologue", "pdl_supported",
           "prefetch_lines", "prefetch_weights_l2", "use_pdl"]
