"""Where pagedkv keeps what it builds or converts once per machine (the demo's checkpoints).

``$PAGEDKV_CACHE``, else ``$PAGEDKV_CACHE_DIR``, else ``~/.cache/pagedkv``. Each kind of
artifact lives in its own subdirectory (``tiny/``, ``smollm2-135m-instruct/``).
"""

from __future__ import annotations

import os


def cache_root() -> str:
    """The cache root directory (not created here)."""
    root = os.environ.get("PAGEDKV_CACHE") or os.environ.get("PAGEDKV_CACHE_DIR")
    return root or os.path.join(os.path.expanduser("~"), ".cache", "pagedkv")


__all__ = ["cache_root"]
