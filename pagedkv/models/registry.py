"""Architecture name (``config.json`` ``architectures``) -> model class."""

from __future__ import annotations

from pagedkv.errors import UnsupportedArchitectureError
from pagedkv.models.config import FAMILIES, SUPPORTED_ARCHITECTURES
from pagedkv.models.decoder import DecoderForCausalLM
from pagedkv.models.bamba import BambaForCausalLM
from pagedkv.models.deepseek_v3 import DeepseekV3ForCausalLM
from pagedkv.models.deepseek_v32 import DeepseekV32ForCausalLM
from pagedkv.models.deepseek_v4 import DeepseekV4ForCausalLM
from pagedkv.models.falcon_h1 import FalconH1ForCausalLM
from pagedkv.models.cohere2 import Cohere2ForCausalLM
from pagedkv.models.gemma import GemmaForCausalLM
from pagedkv.models.gpt_oss import GptOssForCausalLM
from pagedkv.models.jamba import JambaForCausalLM
from pagedkv.models.moe_decoder import MoeForCausalLM
from pagedkv.models.qwen3_next import Qwen3NextForCausalLM


def _model_class(arch: str) -> type[DecoderForCausalLM]:
    if FAMILIES[arch].dsv4:
        return DeepseekV4ForCausalLM
    if FAMILIES[arch].cohere:  # Cohere2: parallel block, RoPE on sliding layers only
        return Cohere2ForCausalLM
    if FAMILIES[arch].gemma:
        return GemmaForCausalLM
    if FAMILIES[arch].indexer:
        return DeepseekV32ForCausalLM
    if FAMILIES[arch].mamba == "bamba":
        return BambaForCausalLM
    if FAMILIES[arch].mamba == "falcon_h1":
        return FalconH1ForCausalLM
    if FAMILIES[arch].mamba == "jamba":
        return JambaForCausalLM
    if FAMILIES[arch].mla:
        return DeepseekV3ForCausalLM
    if FAMILIES[arch].linear_attn:
        return Qwen3NextForCausalLM
    if FAMILIES[arch].attn_sinks:  # GPT-OSS: sinks, MoE with biases
        return GptOssForCausalLM
    if FAMILIES[arch].moe:
        return MoeForCausalLM
    return DecoderForCausalLM


# one generic decoder for the Llama-like families; Gemma 2 / 3 have their own layers; the
# mixture-of-experts families (Qwen3-MoE, Mixtral) the decoder's layers with sparse MLPs;
# DeepSeek-V3 its latent-attention layers; Qwen3-Next its Gated-DeltaNet and gated attention
# layers
MODEL_REGISTRY: dict[str, type[DecoderForCausalLM]] = {
    arch: _model_class(arch) for arch in SUPPORTED_ARCHITECTURES
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
