"""The cyclic garbage collector around an engine's life.

An engine builds hundreds of thousands of long-lived Python objects at start-up (the block pool's
blocks and free queue, the model's modules and parameters, CUDA graphs). A full collection of
the cyclic GC walks every tracked object, so with them in the heap a collection that happens to
run inside a step costs tens of milliseconds (measured: ~95 ms, twice per run, inside
``update_from_output`` with 1024 running requests). As vLLM's engine core does after start-up,
:func:`freeze_after_startup` collects once and moves everything that survived into the
permanent generation, where collections no longer look.

Freezing alone moves the cost instead of removing it: CPython runs a full collection when the
objects promoted since the last one exceed a quarter of the long-lived (unfrozen) ones, and
after a freeze those are few, so full collections of the live requests' objects come several
times as often (measured on the CPU bench's decode1024 trace: 8 full collections of ~17 ms in
one replay, p99 step 13-15 ms, against 7 of ~30 ms and p99 25-28 ms unfrozen). So
:func:`freeze_after_startup` also raises the third GC threshold from CPython's default 10 to
``FULL_COLLECTION_THRESHOLD`` (100: ten times fewer full collections; 2 in that replay, p99
4.3-4.7 ms, max 4.6-5.5 ms), unless the application set its own thresholds.

Frozen objects are never collected by the cyclic GC, and an engine's objects form cycles (the
runner and its graph manager point at each other), so a dropped engine would keep its device
memory forever. :func:`release_frozen` undoes the freeze (everything frozen becomes collectable
again), collects, and freezes what is still alive: ``LLM`` calls it when it is deleted or shut
down, so a second engine in the same process (a notebook) finds the first one's memory free.
"""

from __future__ import annotations

import gc


# CPython's default thresholds (what an application that never tuned the GC has)
_DEFAULT_THRESHOLDS = (700, 10, 10)
FULL_COLLECTION_THRESHOLD = 100


def freeze_after_startup() -> None:
    """Collect, then freeze every surviving object, and make full collections rarer (see the
    module docstring). No-op while the GC is disabled: an application that manages the GC
    itself is left alone; thresholds it tuned are kept."""
    if not gc.isenabled():
        return
    gc.collect()
    gc.freeze()
    t0, t1, t2 = gc.get_threshold()
    if (t0, t1, t2) == _DEFAULT_THRESHOLDS:
        gc.set_threshold(t0, t1, FULL_COLLECTION_THRESHOLD)


def release_frozen() -> None:
    """Make the frozen objects collectable again, collect the garbage among them, freeze what
    survives (see the module docstring). Safe to call from a finalizer."""
    if not gc.isenabled():
        return
    gc.unfreeze()
    gc.collect()
    gc.freeze()


__all__ = ["FULL_COLLECTION_THRESHOLD", "freeze_after_startup", "release_frozen"]
