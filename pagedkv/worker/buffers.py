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

Strict mode (off by default; ``PAGEDKV_STRICT_STAGING=1`` in the environment, or
:func:`set_strict_staging`): every copy out of a buffer's host bytes (on any device, the CPU
included) makes the buffer's numpy views read-only until its ``wait_for_copy()``, which
simulates the in-flight copy of a GPU: a writer that skips the wait fails on the CPU at the
write itself, with numpy's ``ValueError: assignment destination is read-only``, where on a GPU
it would race the copy. Views sliced from ``.np`` while it is locked inherit the flag; views
kept across steps must be made through :meth:`CpuGpuBuffer.host_view` (so that the lock
reaches them). Writes through the torch tensor ``.cpu`` are not caught (numpy's flag does not
bind torch). Off, the cost is one module-global test per copy and per wait.

``StagingArea``: several 1-D staging arrays laid out in one host buffer and one device buffer,
each exposed as a ``CpuGpuBuffer`` of views, so that a step moves them all with ONE copy (each
copy has a fixed host cost: about 5 us to issue on the H200's host, 3-5 us on a CPU device).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np
import torch

from pagedkv.errors import ConfigError

_STRICT = os.environ.get("PAGEDKV_STRICT_STAGING", "") in ("1", "true", "True")


def strict_staging() -> bool:
    """Whether strict mode is on (see the module docstring)."""
    return _STRICT


def set_strict_staging(on: bool) -> bool:
    """Turn strict mode on or off for copies made from now on; returns the previous setting.
    Buffers locked by an earlier copy unlock at their ``wait_for_copy()`` either way."""
    global _STRICT
    prev, _STRICT = _STRICT, bool(on)
    return prev


def _lockable(host: torch.Tensor) -> np.ndarray:
    """A numpy view of ``host`` whose writeable flag can be turned off and on again (numpy
    refuses to turn it back on for the array ``Tensor.numpy()`` returns, whose base is the
    tensor; a view of that array keeps it as an always-writeable base)."""
    return host.numpy().view()


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
        self.np: np.ndarray = _lockable(self.cpu)
        # A separate tensor even when the device is the CPU: copies stay real copies.
        self.gpu = torch.zeros(*size, dtype=dtype, device=self.device)
        self._pending: torch.cuda.Event | None = None
        # strict mode: numpy arrays over the host bytes (bases before their views) and
        # whether a copy has locked them
        self._host_views: list[np.ndarray] = [self.np]
        self._locked = False

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
        self.note_copy()
        return dst

    def note_copy(self) -> None:
        """The host bytes were just handed to a copy (``copy_to_gpu``, or a caller's own
        path, e.g. a CPU device's numpy copy): on CUDA with pinned memory record the event
        ``wait_for_copy`` waits for; in strict mode lock the numpy views until then."""
        if self.device.type == "cuda" and self.cpu.is_pinned():
            ev = torch.cuda.Event()
            ev.record()
            self._pending = ev
        if _STRICT:
            for a in self._host_views:
                a.flags.writeable = False
            self._locked = True

    def host_view(self, index) -> np.ndarray:
        """``self.np[index]`` (a numpy view, basic indexing), locked with the buffer in strict
        mode: the way to make a view of the host bytes that outlives one step."""
        view = self.np[index]
        if view.base is None or not np.may_share_memory(view, self.np):
            raise ConfigError("host_view needs basic indexing (a view of the host bytes)")
        view.flags.writeable = self.np.flags.writeable
        self._host_views.append(view)
        return view

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
        if self._locked:
            self._unlock()

    def _unlock(self) -> None:
        for a in self._host_views:  # bases first: a view is writeable only over one
            a.flags.writeable = True
        self._locked = False


class _AreaField(CpuGpuBuffer):
    """A field of a ``StagingArea``: ``.cpu``/``.gpu`` are ``length`` elements of ``dtype`` at
    byte ``offset`` of the area's uint8 buffers; ``wait_for_copy`` also waits for the area's
    copy (it reads this field's host bytes)."""

    def __init__(self, raw: CpuGpuBuffer, offset: int, length: int, dtype: torch.dtype) -> None:
        size = torch.empty((), dtype=dtype).element_size()
        self.device = raw.device
        self.cpu = raw.cpu[offset: offset + length * size].view(dtype)
        self.np = _lockable(self.cpu)
        self.gpu = raw.gpu[offset: offset + length * size].view(dtype)
        self._pending = None
        self._raw = raw
        self._host_views = [self.np]
        self._locked = False
        raw._host_views.append(self.np)  # the area's copy locks this field too

    def wait_for_copy(self) -> None:
        self._raw.wait_for_copy()
        super().wait_for_copy()


class StagingArea:
    """1-D staging arrays in one host buffer (pinned on CUDA) and one device buffer.

    ``fields``: ``(name, length, dtype)`` in layout order; each starts at a 64-byte boundary.
    ``area[name]`` is a ``CpuGpuBuffer`` of views (write ``.np``, kernels read ``.gpu``).
    ``copy_to_gpu(used)`` moves, in one non-blocking copy, the bytes from the start of the
    area to the end of the last field's used rows: the rows each field uses, plus whatever
    lies between them (unused tails of earlier fields, written on the device as they are on
    the host: no kernel reads past the rows it is given). ``wait_for_copy()`` before writing.
    """

    ALIGN = 64

    def __init__(self, fields, *, device: torch.device | str, pin_memory: bool = False) -> None:
        self._layout: dict[str, tuple[int, int, int]] = {}
        end = 0
        for name, length, dtype in fields:
            if name in self._layout or not isinstance(length, int) or length < 0:
                raise ConfigError(f"StagingArea: bad or repeated field {name!r} (length {length!r})")
            size = torch.empty((), dtype=dtype).element_size()
            off = -(-end // self.ALIGN) * self.ALIGN
            self._layout[name] = (off, length, size)
            end = off + length * size
        self.nbytes = end
        self._raw = CpuGpuBuffer(max(end, 1), dtype=torch.uint8, device=device, pin_memory=pin_memory)
        self._fields = {name: _AreaField(self._raw, off, length, dtype)
                        for (name, length, dtype), (off, _, _) in zip(fields, self._layout.values())}
        # CPU device: copy through numpy views (a cold torch slice + copy costs tens of us)
        self._host_pair = ((self._raw.np, self._raw.gpu.numpy())
                           if self._raw.device.type == "cpu" else None)

    def __getitem__(self, name: str) -> CpuGpuBuffer:
        return self._fields[name]

    def copy_to_gpu(self, used: Mapping[str, int]) -> None:
        """One non-blocking copy covering ``used[name]`` leading rows of each named field."""
        end = 0
        for name, n in used.items():
            off, length, size = self._layout[name]
            if not 0 <= n <= length:
                raise ConfigError(f"StagingArea.copy_to_gpu: {name} rows {n} outside [0, {length}]")
            end = max(end, off + n * size)
        if not end:
            return
        if self._host_pair is not None:
            src, dst = self._host_pair
            dst[:end] = src[:end]
            self._raw.note_copy()
        else:
            self._raw.copy_to_gpu(end)

    def wait_for_copy(self) -> None:
        self._raw.wait_for_copy()
