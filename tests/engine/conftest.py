"""Fixtures for engine tests: transformers references computed once per module (helpers live
in ``engine_helpers``; the tiny checkpoints come from the root conftest)."""

import pytest
from engine_helpers import HFReference

transformers = pytest.importorskip("transformers")

_HF: dict = {}


@pytest.fixture(scope="module")
def hf_ref():
    def get(path: str) -> HFReference:
        if path not in _HF:
            _HF[path] = HFReference(path)
        return _HF[path]

    yield get
    _HF.clear()
