"""``AsyncLLM``: an ``LLMEngine`` stepping in its own thread, with an ``async`` front.

The engine is single-threaded: every call into it (add, abort, step) happens on the engine
thread. The asyncio side validates a request (tokenization included: read-only), then hands it
over through a command queue; the engine thread drains commands before each step, steps while
any request is unfinished (with async scheduling the step in flight is collected when the last
one finishes) and sleeps on an event, without spinning, when nothing is left. Each request's
outputs go to its own ``asyncio.Queue``, all of a step's outputs in one
``loop.call_soon_threadsafe`` (one wake-up of the event loop per step, not one per request);
``generate`` is an async iterator over them. Outputs are cumulative, so a consumer that fell
behind by several steps gets only the newest one (the others are skipped: nothing is lost, and
a loaded server sends fewer, larger deltas instead of falling further behind).

Aborts (a client that disconnects, a cancelled task, ``abort``) are commands too: the engine
thread finishes the request at once (its blocks are free before the next step). An exception
inside a step is not fatal: ``LLMEngine.recover`` leaves the engine consistent, the requests it
aborted get the error, ``failed_steps`` counts it, and the thread goes on serving.

``max_waiting``: with a limit, a request arriving while that many are waiting (queued in the
scheduler or not handed over yet) is refused with ``EngineOverloadedError`` (HTTP 503).
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from pagedkv.engine.outputs import RequestOutput
from pagedkv.errors import PagedKVError

_STOP = object()


class EngineOverloadedError(PagedKVError):
    """Too many requests are waiting (``AsyncLLM(max_waiting=...)``); retry later."""


class EngineDeadError(PagedKVError):
    """The engine thread is not running (shut down); no request can be served."""


class RequestFailedError(PagedKVError):
    """A step failed while this request was in it (the engine recovered; see the message)."""


@dataclass
class _Stream:
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    finished: bool = False


class RequestStream:
    """One submitted request's outputs: ``async for out in stream``. Leaving the iteration
    before the final output (a disconnect, a cancelled task) or :meth:`close` aborts it."""

    def __init__(self, llm: "AsyncLLM", stream: _Stream, added) -> None:
        self.request_id = stream.request_id
        self._llm, self._stream, self._added = llm, stream, added

    def __aiter__(self):
        return self._iter()

    async def _iter(self):
        stream = self._stream
        try:
            await self._added  # raises what add_request raised
            q = stream.queue
            while True:
                item = await q.get()
                # cumulative outputs: skip to the newest one queued (an error or the final
                # output ends the skipping; both are delivered)
                while not q.empty() and not isinstance(item, BaseException) and not item.finished:
                    item = q.get_nowait()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    stream.finished = True
                    return
        finally:
            self.close()

    def close(self) -> None:
        """Abort the request unless it finished (a no-op afterwards)."""
        if not self._stream.finished:
            self._stream.finished = True
            self._llm.abort(self.request_id)


class AsyncLLM:
    """See the module docstring. ``engine``: a built ``LLMEngine`` (``LLM(...).engine``);
    ``on_step``: called on the engine thread after every step with ``(engine, outputs)``
    (metrics)."""

    def __init__(self, engine, *, max_waiting: int | None = None,
                 on_step: Callable[[Any, list[RequestOutput]], None] | None = None) -> None:
        self.engine = engine
        self.max_waiting = max_waiting
        self.on_step = on_step
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._pending_adds = 0
        self._lock = threading.Lock()
        self.failed_steps = 0
        self.accepting = True
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()

    # ----- life cycle ----------------------------------------------------------------------
    def start(self) -> "AsyncLLM":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pagedkv-engine", daemon=True)
            self._thread.start()
        return self

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopped.is_set()

    def stop_accepting(self) -> None:
        """New requests are refused from now on (graceful shutdown)."""
        self.accepting = False

    async def drain(self, timeout: float) -> bool:
        """Wait until no request is in flight, at most ``timeout`` seconds; True if drained."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                busy = bool(self._streams) or self._pending_adds
            if not busy:
                return True
            await asyncio.sleep(0.02)
        return False

    def shutdown(self) -> None:
        """Abort whatever still runs, stop the engine thread and wait for it."""
        self.accepting = False
        with self._lock:
            rids = list(self._streams)
        for rid in rids:
            self.abort(rid)
        self._commands.put((_STOP,))
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)

    # ----- requests ------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return self.engine.scheduler.num_waiting + self._pending_adds

    def submit(self, prompt, params=None, request_id: str | None = None) -> "RequestStream":
        """Validate a request and hand it to the engine thread; returns its output stream.
        Bad input (``InvalidRequestError``), overload (``EngineOverloadedError``) and a stopped
        engine raise here, before anything is queued."""
        if not self.accepting:
            raise EngineOverloadedError("the server is shutting down; retry elsewhere")
        if not self.is_running:
            raise EngineDeadError("the engine thread is not running")
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(
                f"{self.num_waiting()} requests are waiting (limit {self.max_waiting}); retry later")
        validated = self.engine.validate(prompt, params)  # typed errors before anything queues
        rid = request_id or f"req-{next(self._ids)}"
        loop = asyncio.get_running_loop()
        stream = _Stream(rid, loop, asyncio.Queue())
        added = loop.create_future()
        with self._lock:
            if rid in self._streams:
                from pagedkv.errors import InvalidRequestError

                raise InvalidRequestError(f"request id {rid!r} is in use")
            self._streams[rid] = stream
            self._pending_adds += 1
        self._commands.put(("add", rid, validated, added))
        self._wake.set()
        return RequestStream(self, stream, added)

    async def generate(self, prompt, params=None, request_id: str | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they are produced (cumulative ``RequestOutput`` objects;
        the last has ``finished``); see :meth:`submit`. Leaving the iteration early aborts
        the request."""
        async for out in self.submit(prompt, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        """Finish ``request_id`` now (thread-safe; a no-op for unknown or finished ids)."""
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ----- the engine thread ---------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                if self._drain_commands():
                    break
                if engine.has_unfinished_requests() or engine.scheduler.has_requests():
                    self._step(engine.step)
                    if not engine.has_unfinished_requests():
                        self._step(engine.flush)  # async scheduling: the step in flight
                else:
                    self._wake.wait()
                    self._wake.clear()
        finally:
            self._stopped.set()
            with self._lock:
                streams = list(self._streams.values())
                self._streams.clear()
            for st in streams:
                self._deliver(st, EngineDeadError("the engine stopped"))

    def _drain_commands(self) -> bool:
        """Apply queued adds and aborts; True when asked to stop."""
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return False
            kind = cmd[0]
            if kind is _STOP:
                return True
            if kind == "add":
                _, rid, validated, fut = cmd
                with self._lock:
                    self._pending_adds -= 1
                    stream = self._streams.get(rid)
                if stream is None:  # aborted before it was added
                    self._resolve(fut, None)
                    continue
                try:
                    self.engine.add_request(None, None, request_id=rid, _validated=validated)
                except BaseException as e:  # noqa: BLE001 - handed to the waiting request
                    with self._lock:
                        self._streams.pop(rid, None)
                    self._resolve(fut, e)
                    continue
                self._resolve(fut, None)
            elif kind == "abort":
                rid = cmd[1]
                with self._lock:
                    stream = self._streams.pop(rid, None)
                if stream is not None:
                    self.engine.abort(rid)
                    self.engine.release(rid)

    def _resolve(self, fut, error) -> None:
        def done():
            if not fut.done():
                if error is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(error)
        fut.get_loop().call_soon_threadsafe(done)

    def _step(self, fn) -> None:
        engine = self.engine
        try:
            outs = fn()
        except Exception as e:  # a failed step: recover, fail the requests it took down
            self.failed_steps += 1
            with self._lock:
                rids = list(self._streams)
            aborted = engine.recover()
            gone = set(aborted) | {rid for rid in rids if rid not in engine._requests}
            for rid in gone:
                with self._lock:
                    stream = self._streams.pop(rid, None)
                if stream is not None:
                    self._deliver(stream, RequestFailedError(
                        f"the engine step failed ({type(e).__name__}: {e}); the request was aborted"))
            return
        if self.on_step is not None:
            self.on_step(engine, outs)
        if not outs:
            return
        by_loop: dict = {}
        streams = self._streams
        with self._lock:
            for out in outs:
                stream = streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del streams[out.request_id]
                by_loop.setdefault(stream.loop, []).append((stream.queue, out))
        for loop, items in by_loop.items():
            self._call(loop, _put_all, items)

    @classmethod
    def _deliver(cls, stream: _Stream, item) -> None:
        cls._call(stream.loop, stream.queue.put_nowait, item)

    @staticmethod
    def _call(loop, fn, arg) -> None:
        try:
            loop.call_soon_threadsafe(fn, arg)
        except RuntimeError:  # the loop is closed: nobody listens any more
            pass


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)


__all__ = ["AsyncLLM", "EngineDeadError", "EngineOverloadedError", "RequestFailedError",
           "RequestStream"]
