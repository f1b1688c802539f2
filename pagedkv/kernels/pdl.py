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
completion as usual. Both instructions are no-ops in a kernel launched without PDL.

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


__all__ = ["PDL_ENABLED", "pdl_launch_args", "pdl_prologue", "pdl_supported", "use_pdl"]
