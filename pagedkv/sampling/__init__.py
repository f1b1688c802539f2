"""Sampling: request parameters, the batched sampler, incremental detokenization.

``SamplingParams`` and the detokenizer import no torch; the sampler names load torch on first
use (``from pagedkv.sampling import Sampler``).
"""

from pagedkv.sampling.detokenizer import DetokenizerStep, IncrementalDetokenizer
from pagedkv.sampling.params import SamplingParams

_TORCH_NAMES = {
    "Sampler": "pagedkv.sampling.sampler",
    "SamplerOutput": "pagedkv.sampling.sampler",
    "LogprobsTensors": "pagedkv.sampling.sampler",
    "SamplingMetadata": "pagedkv.sampling.metadata",
    "make_generator": "pagedkv.sampling.metadata",
}


def __getattr__(name: str):
    module = _TORCH_NAMES.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv.sampling' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["SamplingParams", "IncrementalDetokenizer", "DetokenizerStep", *_TORCH_NAMES]
