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
