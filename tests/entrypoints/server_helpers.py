"""What the server tests share: a uvicorn server running an app in a thread on a free port of
127.0.0.1, the real ``pagedkv serve`` command in a subprocess (``ServeProcess``), and the chat
template of the tiny checkpoint (conftest.py's ``model_dir``)."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


class ThreadedServer:
    """``app`` served by uvicorn in a daemon thread; ``url`` once it listens; ``stop()``."""

    def __init__(self, app, start_timeout: float = 10.0):
        import uvicorn

        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0,
                                                    log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        end = time.monotonic() + start_timeout
        while not self.server.started and time.monotonic() < end:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """``python -m pagedkv serve ARGS --port P --log-level warning`` on a free port of
    127.0.0.1 (one torch thread), its output in a temporary file (``output()``); ``url`` once
    ``/health`` answers (the test fails with the output if the process exits first or
    ``start_timeout`` passes). ``stop()``: SIGTERM, then the exit status. A context manager
    whose exit kills what still runs."""

    def __init__(self, args, start_timeout: float = 120.0):
        import httpx
        import pytest

        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log, self._text = tempfile.TemporaryFile("w+"), ""
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pagedkv", "serve", *map(str, args), "--port", str(port),
             "--log-level", "warning"],
            stdout=self._log, stderr=subprocess.STDOUT, text=True, env=env)
        end = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > end:
                self.__exit__()
                pytest.fail(f"the server did not come up (exit code {self.proc.returncode}):\n"
                            + self._text)
            time.sleep(0.1)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        if not self._log.closed:
            self._log.seek(0)
            self._text = self._log.read()
        return self._text

    def stop(self, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        self.output()
        self._log.close()


def streamed_events(url: str, path: str, body: dict) -> list[dict]:
    """The server-sent events of one streamed request, raw over HTTP, each checked to be
    ``data: `` + exactly ``json.dumps`` of its JSON (default separators, ASCII escapes) + a
    blank line; their dicts (``[DONE]`` last, as the string)."""
    import json

    import httpx

    events = []
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = b"".join(r.iter_raw()).decode("ascii")  # ensure_ascii: the wire is ASCII
    parts = raw.split("\n\n")
    assert parts[-1] == "" and parts[-2] == "data: [DONE]", parts[-3:]
    for part in parts[:-2]:
        assert part.startswith("data: "), part
        data = json.loads(part[6:])
        assert part == "data: " + json.dumps(data), part  # the exact encoding
        events.append(data)
    events.append("[DONE]")
    return events


CHUNK_KEYS = ["id", "object", "created", "model", "choices"]
TEXT_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason"]
CHAT_CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason"]


def check_stream_format(events: list, *, chat: bool, n: int, include_usage: bool) -> dict:
    """The OpenAI chunk format, field by field and in order: one id / created / model for all
    chunks, chat's role chunks first, choices of the right keys (``stop_reason`` only on a
    choice's finishing chunk, which is its last), the usage chunk last when asked for.
    Returns per index ``{"text", "finish_reason", "stop_reason", "logprobs": [chunks']}``."""
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = None
    if include_usage:
        usage = chunks.pop()
        assert list(usage) == CHUNK_KEYS + ["usage"] and usage["choices"] == []
        assert list(usage["usage"]) == ["prompt_tokens", "completion_tokens", "total_tokens"]
    object_ = "chat.completion.chunk" if chat else "text_completion"
    first = chunks[0]
    out = {i: {"text": "", "finish_reason": None, "stop_reason": None, "logprobs": [],
               "role": None} for i in range(n)}
    for k, c in enumerate(chunks):
        assert list(c) == CHUNK_KEYS, c
        assert (c["id"], c["object"], c["created"], c["model"]) == (
            first["id"], object_, first["created"], first["model"]), (c, first)
        assert len(c["choices"]) == 1, c
        ch = c["choices"][0]
        o = out[ch["index"]]
        assert o["finish_reason"] is None, "a chunk after the choice's finishing chunk"
        keys = (CHAT_CHOICE_KEYS if chat else TEXT_CHOICE_KEYS) + (
            ["stop_reason"] if ch["finish_reason"] else [])
        assert list(ch) == keys, ch
        if chat:
            d = ch["delta"]
            if k < n:  # the role chunks
                assert d == {"role": "assistant", "content": ""} and ch["index"] == k
                assert list(d) == ["role", "content"]
                o["role"] = "assistant"
                continue
            assert d == {} or list(d) == ["content"], d
            o["text"] += d.get("content", "")
        else:
            o["text"] += ch["text"]
        if ch["logprobs"] is not None:
            o["logprobs"].append(ch["logprobs"])
        o["finish_reason"] = ch["finish_reason"]
        if ch["finish_reason"]:
            o["stop_reason"] = ch["stop_reason"]
    assert all(o["finish_reason"] for o in out.values()), (out, events)
    if usage is not None:
        out["usage"] = usage["usage"]
    return out


WIRE_BODIES = [
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 12, "temperature": 0,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": "The block table", "max_tokens": 10, "n": 2,
                         "temperature": 0.8, "seed": 7, "logprobs": 2, "echo": True,
                         "ignore_eos": True}),
    ("/v1/completions", {"prompt": "Prefix caching", "max_tokens": 16, "temperature": 0,
                         "stop": ["e", "a"]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi \u00e9\u4e2d"}],
                              "max_tokens": 8, "n": 2, "temperature": 0.7, "seed": 3,
                              "logprobs": True, "top_logprobs": 2, "ignore_eos": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}],
                              "max_tokens": 6, "temperature": 0}),
]


def _close(a, b) -> bool:
    """Equal, floats within 1e-4 (a logprob's last digits depend on the batch it ran in)."""
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-4 * max(1.0, abs(a))
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def check_streamed_equals_unstreamed(url: str) -> None:
    """Each of WIRE_BODIES streamed (with and without usage) against the same request
    unstreamed: the exact chunk format (:func:`check_stream_format`), and the same text,
    finish and stop reasons, logprobs and usage."""
    import httpx

    for path, body in WIRE_BODIES:
        chat = path.endswith("chat/completions")
        n = body.get("n", 1)
        full = httpx.post(url + path, json={**body, "model": "tiny"}, timeout=60).json()
        for include_usage in (False, True):
            extra = {"stream_options": {"include_usage": True}} if include_usage else {}
            events = streamed_events(url, path, {**body, "model": "tiny", "stream": True,
                                                 **extra})
            got = check_stream_format(events, chat=chat, n=n, include_usage=include_usage)
            for ch in full["choices"]:
                g = got[ch["index"]]
                text = ch["message"]["content"] if chat else ch["text"]
                assert g["text"] == text, (path, body)
                assert (g["finish_reason"], g["stop_reason"]) == (
                    ch["finish_reason"], ch["stop_reason"]), (g, ch, body)
                if ch["logprobs"] is None:
                    assert g["logprobs"] == [], g
                elif chat:
                    assert _close([x for lp in g["logprobs"] for x in lp["content"]],
                                  ch["logprobs"]["content"]), (g, ch)
                else:
                    for key in ("tokens", "token_logprobs", "top_logprobs"):
                        assert _close([x for lp in g["logprobs"] for x in lp[key]],
                                      ch["logprobs"][key]), (key, g, ch)
            if include_usage:
                assert got["usage"] == full["usage"], (got, full)
