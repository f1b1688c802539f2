"""The engine in its own process: what ``pagedkv serve`` runs by default.

In one process the HTTP side (event loop, JSON, one server-sent event per delta for every
stream) and the engine's host loop share one interpreter lock, and at saturation the HTTP side
takes a large share of it from the engine (measured on the H200: W1 served at 42% of the
offline rate). Here the engine runs in a child process (a fresh interpreter,
``python -m pagedkv.entrypoints.engine_core``, so CUDA initializes cleanly there and the
caller's ``__main__`` is never re-imported; it connects back over an authenticated local
socket, ``multiprocessing.connection``) and the server process keeps only the front:

- the front validates and tokenizes a request itself (:func:`validate_request` with the
  checkpoint's tokenizer and the engine's vocabulary and context, both reported by the child
  when it is ready), then sends ``("add", id, validated)`` down a pipe;
- the child (:func:`engine_main`) applies commands between steps, steps while anything is
  unfinished, blocks on the pipe (no spinning) when idle, and after every step sends one
  message: the step's :class:`~pagedkv.engine.outputs.OutputDelta` tuples (only what each
  request gained: new token ids, new text, new logprobs, times) and the engine's gauges for the
  metrics (:func:`~pagedkv.entrypoints.metrics.engine_gauges`);
- a reader thread in the front hands each message to the event loop with one
  ``call_soon_threadsafe``; there each delta is appended to its request's stream (and wakes
  its reader); the reader folds what arrived into the request's cumulative state and gets one
  ``RequestOutput`` snapshot per read (the same objects the in-process ``AsyncLLM`` yields, so
  the OpenAI layer serves both alike; a reader that lagged several steps gets one snapshot).

Aborts (a disconnect) are commands; the child frees the blocks at once. A step that raises is
recovered in the child (``LLMEngine.recover``) and the requests it took down get
``RequestFailedError``. If the child dies, every open stream gets ``EngineDeadError`` and
``is_running`` turns False (``/health`` answers 503). The child ignores SIGINT/SIGTERM (the
front decides when it stops) and exits when the pipe closes, so it never outlives the server.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedkv.engine.outputs import CompletionOutput, OutputDelta, RequestMetrics, RequestOutput
from pagedkv.entrypoints.async_llm import (
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestStream,
)
from pagedkv.errors import ConfigError, InvalidRequestError, PagedKVError


@dataclass(frozen=True)
class EngineSpec:
    """What the engine process builds: a checkpoint directory (``model``) or a named shape
    with random weights (``shape``, served with the synthetic word-level tokenizer), with
    ``LLM``'s arguments; ``options`` are :class:`~pagedkv.config.EngineConfig` fields."""

    model: str | None = None
    shape: str | None = None
    dtype: str = "auto"
    device: str | None = None
    attention_backend: str = "auto"
    tokenizer: Any = "auto"
    options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.model is None) == (self.shape is None):
            raise ConfigError("an EngineSpec names a checkpoint directory or a shape (one of them)")
        from pagedkv.config import EngineConfig

        EngineConfig.from_options(**self.options)  # bad options fail here, before a process

    def build_llm(self):
        from pagedkv.engine.llm import LLM

        if self.shape is not None:
            return LLM.from_shape(self.shape, dtype=self.dtype, device=self.device,
                                  attention_backend=self.attention_backend,
                                  tokenizer="synthetic", **self.options)
        return LLM(self.model, dtype=self.dtype, device=self.device,
                   attention_backend=self.attention_backend, tokenizer=self.tokenizer,
                   **self.options)

    def load_front(self, vocab_size: int):
        """``(tokenizer, chat template or None)`` for the front process (no weights)."""
        if self.shape is not None:
            from pagedkv.models.tokenizer import synthetic_tokenizer

            return synthetic_tokenizer(vocab_size), None
        from pagedkv.errors import ChatTemplateError
        from pagedkv.models.chat_template import ChatTemplate
        from pagedkv.models.tokenizer import load_tokenizer

        tok = load_tokenizer(self.model, self.tokenizer)
        tdir = (os.fspath(self.tokenizer) if isinstance(self.tokenizer, (str, os.PathLike))
                and self.tokenizer != "auto" else self.model)
        try:
            template = ChatTemplate.from_dir(tdir)
        except ChatTemplateError:
            template = None
        return tok, template


# --------------------------------------------------------------------------------------------
# the child


def engine_main(spec: EngineSpec, conn) -> None:
    """The engine process: build the engine, report ``("ready", info)``, then serve commands
    and step until ``("stop",)`` or the pipe closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        llm = spec.build_llm()
    except BaseException as e:  # noqa: BLE001 - reported to the front, which raises it
        conn.send(("dead", f"the engine could not start: {type(e).__name__}: {e}"))
        return
    engine = llm.engine
    conn.send(("ready", dict(
        vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
        default_params=engine.default_sampling_params(), sizing=llm.kv_cache_sizing.describe(),
        model_name=llm.model_name, num_blocks=engine.scheduler.kv_cache_config.num_blocks,
        pid=os.getpid())))
    try:
        _EngineCore(engine, conn).run()
    except (EOFError, OSError, BrokenPipeError):  # the front went away
        pass


class _EngineCore:
    def __init__(self, engine, conn) -> None:
        self.engine, self.conn = engine, conn
        self.failed_steps = 0
        self._next_scan = 0.0

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            if not self._busy():
                conn.poll(None)  # idle: wait for a command
            while conn.poll(0):
                if self._apply(conn.recv()):
                    return
            if self._busy():
                self._step()

    def _busy(self) -> bool:
        e = self.engine
        return e.has_unfinished_requests() or e.scheduler.has_requests()

    def _apply(self, cmd) -> bool:
        kind = cmd[0]
        engine = self.engine
        if kind == "add":
            _, rid, validated = cmd
            try:
                engine.add_request(None, None, request_id=rid, _validated=validated)
            except Exception as e:  # noqa: BLE001 - the request's error, sent to its stream
                self.conn.send(("add_failed", rid, type(e).__name__, str(e)))
        elif kind == "abort":
            rid = cmd[1]
            engine.abort(rid)
            engine.release(rid)
        elif kind == "stats":
            self.conn.send(("stats", cmd[1], self._gauges(scan=True)))
        elif kind == "stop":
            return True
        return False

    def _gauges(self, scan: bool) -> dict:
        from pagedkv.entrypoints.metrics import engine_gauges

        g = engine_gauges(self.engine, scan_groups=scan, failed_steps=self.failed_steps)
        sched = self.engine.scheduler
        g["free_blocks"] = sched.kv_cache_manager.num_free_blocks
        g["num_blocks"] = sched.kv_cache_config.num_blocks
        g["unfinished"] = self.engine.has_unfinished_requests()
        return g

    def _step(self) -> None:
        engine = self.engine
        try:
            outs = engine.step(deltas=True)
            if not engine.has_unfinished_requests():
                outs = outs + engine.flush(deltas=True)
        except Exception as e:  # noqa: BLE001 - recovered; the requests it took down fail
            self.failed_steps += 1
            before = set(engine._requests)
            aborted = engine.recover()
            gone = sorted(set(aborted) | (before - set(engine._requests)))
            self.conn.send(("failed", gone, f"{type(e).__name__}: {e}"))
            return
        now = time.monotonic()
        scan = now >= self._next_scan
        if scan:
            self._next_scan = now + 0.5
        if outs or scan:
            self.conn.send(("outs", outs, self._gauges(scan)))


# --------------------------------------------------------------------------------------------
# the front


class EngineFront:
    """What the OpenAI layer reads of the engine in the front process: its tokenizer,
    vocabulary size and context length, and request validation."""

    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, default_params) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self._default_params = default_params

    def default_sampling_params(self):
        import copy

        return copy.copy(self._default_params)

    def validate(self, prompt, params):
        from pagedkv.engine.validation import validate_request

        if params is None:
            params = self.default_sampling_params()
        return validate_request(prompt, params, tokenizer=self.tokenizer,
                                vocab_size=self.vocab_size, max_model_len=self.max_model_len)


class _DeltaStream:
    """A request's stream in the front: the step deltas (or an error) its consumer has not read
    yet, the future the consumer waits on, and the cumulative output the deltas are folded
    into when it reads. The reader's work per delta is an append (and a wake-up); the fold and
    the ``RequestOutput`` snapshot happen once per read, however many steps the consumer
    lagged (a lagging stream skips to its newest cumulative output, as ``AsyncLLM``'s do)."""

    __slots__ = ("request_id", "prompt", "prompt_token_ids", "metrics", "token_ids", "text",
                 "logprobs", "num_tokens", "pending", "waiter", "finished")

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 arrival_time: float) -> None:
        self.request_id = request_id
        self.prompt, self.prompt_token_ids = prompt, prompt_token_ids
        self.metrics = RequestMetrics(arrival_time=arrival_time,
                                      num_prompt_tokens=len(prompt_token_ids))
        self.token_ids: list[int] = []
        self.text = ""
        self.logprobs: list | None = None
        self.num_tokens = 0  # tokens received, unread ones included
        self.pending: list = []  # OutputDelta tuples or one exception
        self.waiter: asyncio.Future | None = None
        self.finished = False  # the consumer is done with it (RequestStream.close)

    def push(self, item) -> None:
        """On the loop: a delta or an exception for the consumer."""
        self.pending.append(item)
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                w.set_result(None)

    def fold(self, deltas: list) -> RequestOutput:
        """Add ``deltas`` (in step order) to the cumulative output; its snapshot."""
        toks = self.token_ids
        texts = []
        for d in deltas:
            toks.extend(d[1])
            if d[2]:
                texts.append(d[2])
            if d[3] is not None:
                if self.logprobs is None:
                    self.logprobs = []
                self.logprobs.extend(d[3])
        if texts:
            self.text += texts[0] if len(texts) == 1 else "".join(texts)
        (_, _, _, _, cum, reason, stop_reason, t_sched, t_first, t_last, t_fin,
         cached, preempted) = deltas[-1]
        m = self.metrics
        m.first_scheduled_time, m.first_token_time = t_sched, t_first
        m.last_token_time, m.finished_time = t_last, t_fin
        m.num_cached_tokens, m.num_preemptions = cached, preempted
        m.num_generated_tokens = len(toks)
        comp = CompletionOutput(0, self.text, list(toks), cum,
                                None if self.logprobs is None else list(self.logprobs),
                                reason, stop_reason)
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, [comp],
                             reason is not None, m)


class _DeltaRequestStream(RequestStream):
    """``RequestStream`` over a :class:`_DeltaStream`: one snapshot per read of everything
    that arrived since the last one; an error ends it (raised), so does the final output."""

    async def _iter(self):
        st = self._stream
        try:
            loop = asyncio.get_running_loop()
            while True:
                if not st.pending:
                    st.waiter = fut = loop.create_future()
                    await fut
                items, st.pending = st.pending, []
                for item in items:
                    if isinstance(item, BaseException):
                        raise item
                out = st.fold(items)
                yield out
                if out.finished:
                    st.finished = True
                    return
        finally:
            self.close()


class EngineCoreClient:
    """The front of an engine process, with ``AsyncLLM``'s interface (``submit``,
    ``generate``, ``abort``, ``start``, ``stop_accepting``, ``drain``, ``shutdown``,
    ``num_waiting``, ``is_running``, ``failed_steps``, ``engine``).

    ``start_process()`` spawns the child and waits until its engine is built (raising what the
    child could not build); ``start()`` (in the event loop) attaches the loop and starts the
    reader thread. ``on_step(gauges, items)`` runs on the loop after every step message
    (metrics: :meth:`~pagedkv.entrypoints.metrics.ServingMetrics.observe_deltas`; ``items``:
    ``(OutputDelta, arrival time, prompt tokens, tokens so far)`` per delta).
    ``max_waiting``: refuse requests (``EngineOverloadedError``) while this many have produced
    no token yet. ``engine_module``: the module the child runs (``python -m MODULE
    ADDRESS``); another one must speak the same pipe protocol (a stand-in engine for the
    front's CPU benchmark, ``bench/synthetic_engine.py``)."""

    def __init__(self, spec: EngineSpec, *, max_waiting: int | None = None,
                 on_step: Callable[[dict, list[tuple]], None] | None = None,
                 start_timeout: float = 600.0,
                 engine_module: str = "pagedkv.entrypoints.engine_core") -> None:
        self.spec = spec
        self.engine_module = engine_module
        self.max_waiting = max_waiting
        self.on_step = on_step
        self.start_timeout = start_timeout
        self.engine: EngineFront | None = None
        self.tokenizer = None
        self.chat_template = None
        self.info: dict = {}
        self.failed_steps = 0
        self.accepting = True
        self.last_gauges: dict = {}
        self._streams: dict[str, _DeltaStream] = {}
        self._ids = itertools.count()
        self._proc = None
        self._conn = None
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: threading.Thread | None = None
        self._dead: str | None = None
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._stats_ids = itertools.count()

    # ----- life cycle ----------------------------------------------------------------------
    def start_process(self) -> "EngineCoreClient":
        """Start the engine process and wait until its engine is built."""
        if self._proc is not None:
            return self
        from multiprocessing.connection import Listener

        key = secrets.token_bytes(32)
        sock_dir = tempfile.mkdtemp(prefix="pagedkv-engine-")
        address = os.path.join(sock_dir, "engine.sock")
        listener = Listener(address, family="AF_UNIX", authkey=key)
        env = dict(os.environ, PAGEDKV_ENGINE_AUTHKEY=key.hex())
        # the child imports this very pagedkv, installed or not
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", self.engine_module, address],
            env=env, stdin=subprocess.DEVNULL)
        accepted: list = []

        def accept():
            try:
                accepted.append(listener.accept())
            except Exception as e:  # noqa: BLE001 - reported below
                accepted.append(e)

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        end = time.monotonic() + self.start_timeout
        try:
            while t.is_alive() and time.monotonic() < end and self._proc.poll() is None:
                t.join(0.05)
            if not accepted or isinstance(accepted[0], Exception):
                self._kill()
                raise EngineDeadError(
                    "the engine process did not connect (exit code "
                    f"{self._proc.poll()}): {accepted[0] if accepted else 'timed out'}")
        finally:
            listener.close()
            try:
                os.rmdir(sock_dir)
            except OSError:
                pass
        conn = self._conn = accepted[0]
        conn.send(self.spec)
        while not conn.poll(0.1):
            if self._proc.poll() is not None or time.monotonic() > end:
                self._kill()
                raise EngineDeadError(
                    f"the engine process exited while starting (exit code {self._proc.poll()})")
        try:
            kind, payload = conn.recv()
        except EOFError:
            self._kill()
            raise EngineDeadError("the engine process exited while starting") from None
        if kind != "ready":
            self._kill()
            raise EngineDeadError(str(payload))
        self.info = payload
        self.tokenizer, self.chat_template = self.spec.load_front(payload["vocab_size"])
        self.engine = EngineFront(self.tokenizer, payload["vocab_size"], payload["max_model_len"],
                                  payload["default_params"])
        return self

    def start(self) -> "EngineCoreClient":
        """In the event loop: start the process if needed, attach the loop, start the reader."""
        self.start_process()
        if self._reader is None:
            self._loop = asyncio.get_running_loop()
            self._reader = threading.Thread(target=self._read, name="pagedkv-engine-reader",
                                            daemon=True)
            self._reader.start()
        return self

    @property
    def is_running(self) -> bool:
        return self._proc is not None and self._dead is None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def stop_accepting(self) -> None:
        self.accepting = False

    async def drain(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if not self._streams:
                return True
            if not self.is_running:
                return False
            await asyncio.sleep(0.02)
        return False

    def shutdown(self) -> None:
        """Abort what still runs, stop the engine process and wait for it (killed after 30 s)."""
        self.accepting = False
        for rid in list(self._streams):
            self.abort(rid)
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            try:
                self._send(("stop",))
            except (OSError, EOFError, BrokenPipeError):
                pass
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait(timeout=10)
        if self._conn is not None:
            try:
                self._conn.close()
            except OSError:
                pass

    # ----- requests ------------------------------------------------------------------------
    def num_waiting(self) -> int:
        return sum(1 for st in self._streams.values() if not st.num_tokens)

    def submit(self, prompt, params=None, request_id: str | None = None) -> RequestStream:
        if not self.accepting:
            raise EngineOverloadedError("the server is shutting down; retry elsewhere")
        if not self.is_running or self._loop is None:
            raise EngineDeadError(self._dead or "the engine process is not running")
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise EngineOverloadedError(
                f"{self.num_waiting()} requests are waiting (limit {self.max_waiting}); retry later")
        text, ids, params = validated = self.engine.validate(prompt, params)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self._streams:
            raise InvalidRequestError(f"request id {rid!r} is in use")
        stream = _DeltaStream(rid, text, ids, time.monotonic())
        self._streams[rid] = stream
        try:
            self._send(("add", rid, validated))
        except (OSError, EOFError, BrokenPipeError):
            del self._streams[rid]
            raise EngineDeadError("the engine process is not running") from None
        return _DeltaRequestStream(self, stream, None)

    async def generate(self, prompt, params=None, request_id: str | None = None):
        async for out in self.submit(prompt, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        if self._streams.pop(request_id, None) is None:
            return
        try:
            self._send(("abort", request_id))
        except (OSError, EOFError, BrokenPipeError):
            pass

    async def engine_stats(self, timeout: float = 10.0) -> dict:
        """The engine's gauges now (free blocks included), asked of the engine process."""
        k = next(self._stats_ids)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[k] = fut
        self._send(("stats", k))
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats_waiters.pop(k, None)

    def _send(self, msg) -> None:
        with self._send_lock:
            self._conn.send(msg)

    # ----- messages from the engine process ------------------------------------------------
    def _read(self) -> None:
        conn, loop = self._conn, self._loop
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                code = self._proc.poll() if self._proc is not None else None
                msg = ("dead", f"the engine process exited (exit code {code})")
            try:
                loop.call_soon_threadsafe(self._on_message, msg)
            except RuntimeError:  # the loop is closed
                return
            if msg[0] == "dead":
                return

    def _on_message(self, msg) -> None:
        kind = msg[0]
        if kind == "outs":
            _, deltas, gauges = msg
            self.last_gauges = gauges
            streams = self._streams
            items = [] if self.on_step is not None else None
            for d in deltas:
                st = streams.get(d[0])
                if st is None:  # aborted meanwhile
                    continue
                n = st.num_tokens = st.num_tokens + len(d[1])
                if d[5] is not None:  # finished
                    del streams[d[0]]
                st.push(d)
                if items is not None:
                    items.append((d, st.metrics.arrival_time, len(st.prompt_token_ids), n))
            if items is not None:
                self.on_step(gauges, items)
        elif kind == "failed":
            _, rids, message = msg
            self.failed_steps += 1
            for rid in rids:
                st = self._streams.pop(rid, None)
                if st is not None:
                    st.push(RequestFailedError(
                        f"the engine step failed ({message}); the request was aborted"))
        elif kind == "add_failed":
            _, rid, name, message = msg
            st = self._streams.pop(rid, None)
            if st is not None:
                st.push(PagedKVError(f"{name}: {message}"))
        elif kind == "stats":
            fut = self._stats_waiters.get(msg[1])
            if fut is not None and not fut.done():
                fut.set_result(msg[2])
        elif kind == "dead":
            self._dead = msg[1]
            for rid in list(self._streams):
                self._streams.pop(rid).push(EngineDeadError(msg[1]))
            for fut in self._stats_waiters.values():
                if not fut.done():
                    fut.set_exception(EngineDeadError(msg[1]))


def _child_main(address: str, main: Callable[[EngineSpec, Any], None] = engine_main) -> None:
    """``python -m pagedkv.entrypoints.engine_core ADDRESS``: connect to the front, receive
    the ``EngineSpec``, run ``main(spec, conn)`` (:func:`engine_main`)."""
    from multiprocessing.connection import Client

    key = bytes.fromhex(os.environ.pop("PAGEDKV_ENGINE_AUTHKEY"))
    conn = Client(address, family="AF_UNIX", authkey=key)
    try:
        spec = conn.recv()
    except EOFError:
        return
    main(spec, conn)


if __name__ == "__main__":
    _child_main(sys.argv[1])


__all__ = ["EngineCoreClient", "EngineFront", "EngineSpec", "engine_main"]
