"""Model definitions and Hugging Face checkpoint loading.

``pagedkv.models.config`` is torch-free; the other modules import torch. The names below are
resolved lazily so that importing the config does not import torch.
"""

from importlib import import_module

_EXPORTS = {
    "ModelArchConfig": "config",
    "RopeConfig": "config",
    "SUPPORTED_ARCHITECTURES": "config",
    "load_model_config": "config",
    "shape_config": "config",
    "DecoderForCausalLM": "decoder",
    "get_model_class": "registry",
    "supported_architectures": "registry",
    "LoadedCheckpoint": "loader",
    "load_checkpoint": "loader",
    "load_model": "loader",
    "Tokenizer": "tokenizer",
    "build_tiny_checkpoint": "tiny",
    "PagedHarness": "harness",
    "ChatTemplate": "chat_template",
    "render_chat": "chat_template",
    "smollm2_dir": "smollm2",
}


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'pagedkv.models' has no attribute {name!r}")
    return getattr(import_module(f"pagedkv.models.{mod}"), name)


__all__ = sorted(_EXPORTS)
