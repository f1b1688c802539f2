"""Fixtures for engine tests: tiny checkpoints (built once per session) and transformers
references computed once per module (helpers live in ``engine_helpers``)."""

import os

import pytest
from engine_helpers import HFReference

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    return os.environ.get("PAGEDKV_TEST_CACHE") or str(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache):
    from pagedkv.models.tiny import build_tiny_checkpoint

    def make(family: str, **options) -> str:
        return build_tiny_checkpoint(family, tiny_cache, **options)

    return make


_HF: dict = {}


@pytest.fixture(scope="module")
def hf_ref():
    def get(path: str) -> HFReference:
        if path not in _HF:
            _HF[path] = HFReference(path)
        return _HF[path]

    yield get
    _HF.clear()


