"""Fixtures for model tests: tiny checkpoints (built once per session) and HF references."""

import os

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """Tiny models run fastest single-threaded (and the test machine's cores are shared);
    the previous setting is restored after each module."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """Where tiny checkpoints are built: $PAGEDKV_TEST_CACHE when set (reused across runs),
    else a session temporary directory."""
    return os.environ.get("PAGEDKV_TEST_CACHE") or str(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache):
    """``tiny_dir(family, **TinySpec options) -> checkpoint path`` (built once)."""
    from pagedkv.models.tiny import build_tiny_checkpoint

    def make(family: str, **options) -> str:
        return build_tiny_checkpoint(family, tiny_cache, **options)

    return make
