"""Architecture name (``config.json`` ``architectures``) -> model class."""

from __future__ import annotations

from pagedkv.errors import UnsupportedArchitectureError
from pagedkv.models.config import SUPPORTED_ARCHITECTURES
from pagedkv.models.decoder import DecoderForCausalLM
from pagedkv.models.gemma import GemmaForCausalLM

# one generic decoder for the Llama-like families; Gemma 2 / 3 have their own layers
MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    arch: GemmaForCausalLM if arch.startswith("Gemma") else DecoderForCausalLM
    for arch in SUPPORTED_ARCHITECTURES
}


def supported_architectures() -> list[str]:
    return list(MODEL_REGISTRY)


def get_model_class(architecture: str) -> type[DecoderForCausalLM]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} is not supported; supported architectures: "
            f"{', '.join(MODEL_REGISTRY)}"
        ) from None


__all__ = ["MODEL_REGISTRY", "get_model_class", "supported_architectures"]
