"""CpuGpuBuffer: a host staging tensor paired with a device mirror.

The host copy (``.cpu``, with the numpy view ``.np``) is where the worker writes; the device
copy (``.gpu``) is what kernels read. ``copy_to_gpu(n)`` moves the first ``n`` rows with a
non-blocking copy.

On a CUDA device the host copy is pinned (when ``pin_memory`` is set), so the copy is truly
asynchronous. A pinned staging buffer must not be written while such a copy may still be
reading it (design rule 7): ``copy_to_gpu`` records a CUDA event, and ``wait_for_copy()``
(called by every writer in ``pagedkv.worker`` before it touches ``.np``) waits for it. The
wait costs one attribute check when no copy is pending.

On a CPU-only machine ``.gpu`` is a *separate* CPU tensor, so "device rows beyond the
committed ones keep their old values" stays observable and testable.
"""

from __future__ import annotations

import numpy as np
import torch

from pagedkv.errors import ConfigError


class CpuGpuBuffer:
    """``.cpu`` (host, pinned on CUDA), ``.np`` (numpy view of ``.cpu``), ``.gpu`` (device).

    Both copies start zero-filled.
    """

    def __init__(
        self,
        *size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        pin_memory: bool = False,
    ) -> None:
        if not size or any((not isinstance(s, int)) or s < 0 for s in size):
            raise ConfigError(f"CpuGpuBuffer needs non-negative int sizes, got {size!r}")
        self.device = torch.device(device)
        pin = bool(pin_memory) and self.device.type == "cuda" and torch.cuda.is_available()
        self.cpu = torch.zeros(*size, dtype=dtype, device="cpu", pin_memory=pin)
        self.np: np.ndarray = self.cpu.numpy()
        # A separate tensor even when the device is the CPU: copies stay real copies.
        self.gpu = torch.zeros(*size, dtype=dtype, device=self.device)
        self._pending: torch.cuda.Event | None = None

    @property
    def shape(self) -> torch.Size:
        return self.cpu.shape

    def copy_to_gpu(self, n: int | None = None, columns: slice | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows (all when None) host -> device, non-blocking.

        ``columns`` optionally restricts a 2-D copy to a column range. Returns the device
        view of the copied region.
        """
        if n is None:
            src, dst = self.cpu, self.gpu
        else:
            if not 0 <= n <= self.cpu.shape[0]:
                raise ConfigError(
                    f"copy_to_gpu(n={n}) outside [0, {self.cpu.shape[0]}]: the buffer has "
                    f"{self.cpu.shape[0]} rows"
                )
            src, dst = self.cpu[:n], self.gpu[:n]
        if columns is not None:
            src, dst = src[:, columns], dst[:, columns]
        dst.copy_(src, non_blocking=True)
        if self.device.type == "cuda" and self.cpu.is_pinned():
            ev = torch.cuda.Event()
            ev.record()
            self._pending = ev
        return dst

    def copy_to_cpu(self, n: int | None = None) -> torch.Tensor:
        """Copy the first ``n`` rows device -> host (blocking). Returns the host view."""
        self.wait_for_copy()
        if n is None:
            self.cpu.copy_(self.gpu)
            return self.cpu
        self.cpu[:n].copy_(self.gpu[:n])
        return self.cpu[:n]

    def wait_for_copy(self) -> None:
        """Block until the last non-blocking copy out of the pinned host copy has finished.

        Call before writing ``.np``/``.cpu``. A no-op on CPU devices and when nothing is
        pending.
        """
        ev = self._pending
        if ev is not None:
            ev.synchronize()
            self._pending = None
