"""Fixtures for model tests: tiny checkpoints (built once per session) and HF references."""

import os

import pytest


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
