"""What the server tests share: a uvicorn server running an app in a thread on a free port of
127.0.0.1, and the chat template of the tiny checkpoint (conftest.py's ``model_dir``)."""

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
