"""The runner's async-output piece: steps enqueued but not collected yet.

A step's sampled ids stay on the device until :meth:`AsyncOutputs.collect` (the step's one
device -> host sync): on CUDA they are copied without blocking into one of two pinned host
buffers, with one CUDA event each (a step's copy may still be read while the next step is
enqueued). With async scheduling step k is enqueued before step k-1 is collected: rows of
step k whose first token is the one step k-1 sampled get a placeholder in the batch's token
count (:meth:`add_pending_tokens`, so input preparation accepts them), and after input
preparation step k-1's sampled ids are written into step k's input ids on the device
(:meth:`fill_pending_inputs`). :meth:`collect` then writes the tokens into the batch's token
table (over the placeholder) and the request states, in the order the steps were enqueued.
At most one step may be in flight uncollected when another is enqueued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

from pagedkv.core.output import ModelRunnerOutput
from pagedkv.errors import InvariantError
from pagedkv.sampling.sampler import LogprobsTensors


@dataclass
class SampledLogprobs:
    """Logprobs of one sampled token: ``token_ids[0]``/``logprobs[0]`` are the sampled token,
    then the request's top ``k`` alternatives, most likely first; ``rank`` is the sampled
    token's rank (1 = most likely)."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class RunnerOutput(ModelRunnerOutput):
    """``ModelRunnerOutput`` plus, for requests that asked for logprobs and sampled this step,
    their :class:`SampledLogprobs` (``None`` when nobody asked)."""

    logprobs: dict[str, SampledLogprobs] | None = None


class StepHandle:
    """One enqueued step (``ModelRunner.execute_model_async``): the rows it ran, which of them
    sampled, and where the sampled ids are (device tensor, host copy, completion event).
    ``version``: the runner's batch version when it was enqueued (rows still valid while it
    is unchanged). ``positions``: the token position each sampled token takes."""

    __slots__ = ("req_ids", "index", "n", "version", "rows", "sampled_req_ids", "positions",
                 "sampled", "host", "event", "logprobs", "want_logprobs")

    def __init__(self, req_ids: list[str], index: dict[str, int], n: int, version: int, *,
                 rows: np.ndarray | None = None, sampled_req_ids: list[str] | None = None,
                 positions: np.ndarray | None = None, sampled: torch.Tensor | None = None,
                 host: torch.Tensor | None = None, event: Any = None,
                 logprobs: LogprobsTensors | None = None,
                 want_logprobs: list[int | None] | None = None) -> None:
        self.req_ids = req_ids
        self.index = index
        self.n = n
        self.version = version
        self.rows = rows
        self.sampled_req_ids = sampled_req_ids or []
        self.positions = positions
        self.sampled = sampled
        self.host = host
        self.event = event
        self.logprobs = logprobs
        self.want_logprobs = want_logprobs

    @classmethod
    def empty(cls) -> "StepHandle":
        return cls([], {}, 0, -1)

    @property
    def num_sampled(self) -> int:
        return len(self.sampled_req_ids)


class AsyncOutputs:
    """Owns the enqueued-but-uncollected steps of one runner (``unrecorded``), the pinned
    host buffers and events their sampled ids come back through, and the async placeholders.
    ``batch`` / ``requests``: the runner's persistent batch and request states (the same
    objects for the runner's whole life)."""

    def __init__(self, batch, requests: dict, device: torch.device, max_num_seqs: int,
                 to_device: Callable[[np.ndarray], torch.Tensor]) -> None:
        self.batch = batch
        self.requests = requests
        self._to_device = to_device
        self.unrecorded: list[StepHandle] = []
        self._arange = np.arange(max_num_seqs + 1, dtype=np.int64)
        self._host_bufs = None
        self._events = None
        self._buf_i = 0
        if device.type == "cuda":
            self._host_bufs = [torch.empty(max_num_seqs, dtype=torch.int64, pin_memory=True)
                               for _ in range(2)]
            self._events = [torch.cuda.Event() for _ in range(2)]

    def in_flight(self) -> StepHandle | None:
        """The enqueued step not collected yet (async scheduling), or None; refuses a third."""
        if len(self.unrecorded) > 1:
            raise InvariantError("async-depth", "collect a step's output before enqueuing two more",
                                 pending=len(self.unrecorded))
        return self.unrecorded[0] if self.unrecorded else None

    def stage(self, sampled: torch.Tensor, m: int) -> tuple[torch.Tensor, Any]:
        """``(host tensor, event)`` the step's ``m`` sampled ids come back through: on CUDA a
        non-blocking copy into the next pinned buffer and its event; elsewhere the tensor."""
        if self._host_bufs is None:
            return sampled, None
        i = self._buf_i
        self._buf_i ^= 1
        host = self._host_bufs[i][:m]
        host.copy_(sampled, non_blocking=True)
        event = self._events[i]
        event.record()
        return host, event

    def push(self, handle: StepHandle) -> None:
        self.unrecorded.append(handle)

    def clear(self) -> None:
        self.unrecorded.clear()

    def collect(self, handle: StepHandle, batch_version: int) -> RunnerOutput:
        """Wait for ``handle``'s sampled tokens (the step's one device -> host sync), record
        them in the request states and the batch, and report them, in enqueue order."""
        if handle.num_sampled:
            if not self.unrecorded or self.unrecorded[0] is not handle:
                raise InvariantError("async-order", "collect each step's output once, in the order "
                                     "the steps were enqueued")
            self.unrecorded.pop(0)
        n = handle.n
        if n == 0:
            return RunnerOutput([], {}, [])
        if not handle.num_sampled:
            return RunnerOutput(handle.req_ids, handle.index, [[] for _ in range(n)])
        if handle.event is not None:
            handle.event.synchronize()
        ids_np = handle.host.numpy().copy()
        ids = ids_np.tolist()
        self._record(handle, ids_np, ids, batch_version)
        rows = handle.rows
        if rows is None:
            sampled = [[t] for t in ids]
        else:
            sampled = [[] for _ in range(n)]
            for r, t in zip(rows.tolist(), ids):
                sampled[r] = [t]
        logprobs = self._logprobs(handle) if handle.logprobs is not None else None
        return RunnerOutput(handle.req_ids, handle.index, sampled, logprobs)

    def _record(self, h: StepHandle, ids_np: np.ndarray, ids: list[int],
                batch_version: int) -> None:
        """Write the sampled tokens into the batch's token table (at their positions; in async
        mode over the placeholder the next step appended) and the request states."""
        batch = self.batch
        pos = h.positions
        if h.version == batch_version:  # rows unchanged since the step was enqueued
            rows = self._arange[: h.n] if h.rows is None else h.rows
        else:
            index = batch.req_id_to_index
            rows = np.fromiter((index.get(rid, -1) for rid in h.sampled_req_ids), np.int64,
                               count=len(h.sampled_req_ids))
            keep = rows >= 0
            if not keep.all():
                rows, pos, ids_np = rows[keep], pos[keep], ids_np[keep]
        if rows.size:
            nt = batch.num_tokens
            cur = nt[rows]
            if (pos > cur).any() or int(pos.max()) >= batch.max_model_len:
                raise InvariantError("sampled-position", "a sampled token does not follow its "
                                     "request's tokens", positions=pos[:5].tolist(),
                                     num_tokens=cur[:5].tolist())
            batch.token_ids_cpu[rows, pos] = ids_np
            nt[rows] = np.maximum(cur, pos + 1)
        requests = self.requests
        for rid, t in zip(h.sampled_req_ids, ids):
            st = requests.get(rid)
            if st is not None:
                st.output_token_ids.append(t)

    def add_pending_tokens(self, prev: StepHandle, n: int, batch_version: int):
        """Async scheduling: rows of this step whose first scheduled token is the token
        ``prev`` sampled (not on the host yet) get a placeholder in the batch's token count, so
        input preparation accepts them. Returns ``(rows, src)`` (rows of this step, indices into
        ``prev``'s sampled tokens) or None."""
        batch = self.batch
        if prev.version == batch_version:
            if prev.rows is None:
                rows = self._arange[:n]
                src = rows
            else:
                rows = prev.rows
                src = self._arange[: rows.size]
        else:
            index = batch.req_id_to_index
            found = np.fromiter((index.get(rid, -1) for rid in prev.sampled_req_ids), np.int64,
                                count=len(prev.sampled_req_ids))
            src = np.flatnonzero(found >= 0)
            rows = found[src]
        if rows.size == 0:
            return None
        pos = prev.positions[src]
        nt = batch.num_tokens
        if not (np.array_equal(nt[rows], pos)
                and np.array_equal(batch.num_computed_tokens_cpu[rows], pos)):
            raise InvariantError("async-placeholder", "a request with a token in flight is not "
                                 "scheduled from that token's position",
                                 positions=pos[:5].tolist(), num_tokens=nt[rows][:5].tolist())
        nt[rows] = pos + 1
        return rows, src

    def fill_pending_inputs(self, prev: StepHandle, pending, nsched: np.ndarray,
                            num_tokens: int, n: int, ids_gpu: torch.Tensor) -> None:
        """Write ``prev``'s sampled tokens (device) into this step's input ids (``ids_gpu``,
        device), after input preparation and before the forward pass reads them."""
        rows, src = pending
        if num_tokens == n and rows.size == n and prev.num_sampled == n and (
                rows is src or (np.array_equal(rows, self._arange[:n])
                                and np.array_equal(src, self._arange[:n]))):
            ids_gpu[:n].copy_(prev.sampled)
            return
        starts = np.cumsum(nsched, dtype=np.int64) - nsched
        dst = self._to_device(starts[rows])
        src_t = self._to_device(src)
        ids_gpu.index_copy_(0, dst, prev.sampled.index_select(0, src_t).to(ids_gpu.dtype))

    def _logprobs(self, h: StepHandle) -> dict[str, SampledLogprobs]:
        token_ids, values, ranks = h.logprobs.tolists()
        result: dict[str, SampledLogprobs] = {}
        for j, rid in enumerate(h.sampled_req_ids):
            k = h.want_logprobs[j]
            if k is None:
                continue
            result[rid] = SampledLogprobs(token_ids[j][: k + 1], values[j][: k + 1], ranks[j])
        return result


__all__ = ["AsyncOutputs", "RunnerOutput", "SampledLogprobs", "StepHandle"]
