"""A progress bar for long ``generate`` runs: tqdm when it is installed, else a plain text bar
on stderr, redrawn at most a few times per second."""

from __future__ import annotations

import importlib.util
import sys
import time


class ProgressBar:
    """``update(done, tokens)``: requests finished and output tokens so far; ``close()``."""

    def __init__(self, total: int, desc: str = "generate", enabled: bool = True, stream=None,
                 min_interval: float = 0.25, width: int = 30, use_tqdm: bool | None = None) -> None:
        self.total = total
        self.enabled = enabled and total > 0
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval = min_interval
        self.width = width
        self.desc = desc
        self._start = time.monotonic()
        self._last = 0.0
        self._done = 0
        self._tqdm = None
        if use_tqdm is None:
            use_tqdm = importlib.util.find_spec("tqdm") is not None
        if self.enabled and use_tqdm:
            from tqdm import tqdm

            self._tqdm = tqdm(total=total, desc=desc, unit="req", file=self.stream, dynamic_ncols=True)

    def update(self, done: int, tokens: int) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        rate = tokens / max(now - self._start, 1e-9)
        if self._tqdm is not None:
            if done > self._done:
                self._tqdm.update(done - self._done)
            self._tqdm.set_postfix_str(f"{rate:,.0f} tok/s", refresh=False)
            self._done = done
            return
        self._done = done
        if now - self._last < self.min_interval and done < self.total:
            return
        self._last = now
        filled = int(self.width * done / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        self.stream.write(f"\r{self.desc} [{bar}] {done}/{self.total} requests, "
                          f"{tokens} tokens, {rate:,.0f} tok/s, {now - self._start:.1f}s")
        self.stream.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._tqdm is not None:
            self._tqdm.close()
            return
        self.stream.write("\n")
        self.stream.flush()


__all__ = ["ProgressBar"]
