"""pagedkv: a correct, fast, inspectable paged KV-cache index layer, and an LLM engine on it.

The control plane (``pagedkv.core``) is pure Python + numpy; the data plane
(``pagedkv.worker``, ``pagedkv.kernels``) uses torch and Triton.

User API (vLLM-shaped)::

    from pagedkv import LLM, SamplingParams

The names below load lazily, so importing the control plane never imports torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagedkv.engine.llm",
    "LLMEngine": "pagedkv.engine.llm_engine",
    "SamplingParams": "pagedkv.sampling.params",
    "EngineConfig": "pagedkv.config",
    "RequestOutput": "pagedkv.engine.outputs",
    "CompletionOutput": "pagedkv.engine.outputs",
    "RequestMetrics": "pagedkv.engine.outputs",
    "Logprob": "pagedkv.engine.outputs",
}


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'pagedkv' has no attribute {name!r}")
    return getattr(import_module(module), name)


def __dir__():
    return sorted([*globals(), *_EXPORTS])


__all__ = ["__version__", *_EXPORTS]
