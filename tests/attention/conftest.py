"""The attention unit tests poison every cache slot no request has written with NaN, so a
kernel that reads one shows it. cuDNN's paged launch (``paged_prefill="auto"``'s pick where the
frontend is installed) reads whole pages and masks the unwritten tail after the product, so it
needs finite slots (the runner zero-fills its caches): here a backend built with the default
therefore takes the Triton prefill kernel, and ``test_cudnn_paged.py`` tests the cuDNN path on
caches whose owned pages are zero where unwritten."""

import pytest


@pytest.fixture(autouse=True)
def _triton_paged_prefill_by_default(request, monkeypatch):
    if request.module.__name__.endswith("test_cudnn_paged"):
        return
    import pagedkv.attention.triton_backend as tb

    monkeypatch.setattr(tb, "AUTO_PAGED_PREFILL", "triton")
