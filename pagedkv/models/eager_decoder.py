"""A decoder whose layers are whole eager modules: the common frame of families with their own
layer structure (GPT-OSS, Cohere2); :class:`EagerLayers`, what every model with eager layers
says to the engine (also Bamba, DeepSeek-V3, Gemma, Qwen3-Next).

Each layer is called as ``layer(hidden, cos, sin, kv_cache, plan, backend) -> hidden`` (the
residual adds inside) and names its Hugging Face tensors with ``layer.hf_entries(prefix)``; the
model keeps the decoder's engine-facing interface (embeddings, final norm, logits, RoPE, KV
specs and plans per layer window, random init) without compiled regions or the fused KV-write
kernel.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from pagedkv.attention.backend import AttentionBackend
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import DecoderForCausalLM


class EagerLayers:
    """A :class:`DecoderForCausalLM` (listed after this among the bases) whose layers stay
    eager: no compiled regions, no fused KV-write kernel."""

    def fused_kv_write_usable(self, kv_cache) -> bool:
        return False

    def compile_regions(self, **kwargs) -> bool:
        """No compiled regions: the layers stay eager."""
        return False

    @property
    def compiled(self) -> bool:
        return False


class EagerDecoderForCausalLM(EagerLayers, DecoderForCausalLM):
    """See the module docstring; a subclass gives ``make_layer`` (and its final norm)."""

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        super().__init__(config, backend=backend, dtype=dtype, device=device)
        self.fuse_kv_write = False  # the layers call the backend themselves

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], attn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm (see ``DecoderForCausalLM``)."""
        self.check_inputs(input_ids, positions, kv_caches)
        attn = self.step_attention(attn)
        cos, sin = self._rope(positions, None)
        hidden = F.embedding(input_ids, self.embed_tokens)
        for layer, kv_cache, plan in zip(self.layers, kv_caches, attn.plans):
            hidden = layer(hidden, cos, sin, kv_cache, plan, self.attn_backend)
        return self.norm(hidden)

    def hf_weight_map(self, layout: str | None = None) -> dict:
        """The checkpoint's tensors (one layout): embeddings, final norm, lm_head unless tied,
        each layer's ``hf_entries``."""
        m = {"model.embed_tokens.weight": (self.embed_tokens, None),
             "model.norm.weight": (self.norm.weight, None)}
        if self.lm_head is not None:
            m["lm_head.weight"] = (self.lm_head, None)
        for i, layer in enumerate(self.layers):
            m.update(layer.hf_entries(f"model.layers.{i}."))
        return m


__all__ = ["EagerDecoderForCausalLM", "EagerLayers"]
