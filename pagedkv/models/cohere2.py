"""Cohere2 (Command R7B / Command A) over the paged KV cache.

What differs from the generic decoder (``decoder.py``), as transformers' ``Cohere2ForCausalLM``
computes it:

* three sliding-window layers to one full-attention layer (``layer_types``, or
  ``sliding_window_pattern`` 4): two KV-cache specs, one hybrid pool of two groups; RoPE only on
  the sliding-window layers (the full layers see no positions but the causal mask);
* RoPE in interleaved pairs ``(x[2i], x[2i + 1])``, computed in float32. Here q and k are
  de-interleaved first (``[x0, x2, ... | x1, x3, ...]``, the same permutation for both, which
  leaves every ``q . k`` unchanged) and rotated in halves (``apply_rotary``); the sliding layers'
  caches hold keys in that order;
* a parallel block on one norm: ``h + attn(LN(h)) + mlp(LN(h))``; the norm is a LayerNorm
  without bias (mean-centred, in float32; ``CohereConfig.layer_norm_eps``), the final norm too;
* logits times ``logit_scale``; embeddings tied by default.

Eager layers (``EagerDecoderForCausalLM``: no compiled regions, no fused KV-write kernel).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.backend import AttentionBackend
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import attention_hf_entries
from pagedkv.models.eager_decoder import EagerDecoderForCausalLM
from pagedkv.models.layers import GatedMLP, Linear, QKVProjection, RMSNorm
from pagedkv.models.mla_attention import deinterleave
from pagedkv.models.rotary import apply_rotary


class CohereLayerNorm(RMSNorm):
    """``w * (x - mean) / sqrt(var + eps)`` in float32 (no bias), rounded to ``x``'s dtype (an
    RMSNorm's parameters, a LayerNorm's statistics)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), None,
                            self.eps).to(x.dtype)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Cohere's interleaved-pair RoPE of ``x [T, heads, D]``, on de-interleaved dimensions (see
    the module docstring), in float32, rounded once."""
    return apply_rotary(deinterleave(x).float(), cos, sin).to(x.dtype)


class Cohere2Layer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        h = cfg.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = CohereLayerNorm(h, cfg.cohere.layer_norm_eps, **kw)
        self.qkv_proj = QKVProjection(h, cfg.num_attention_heads, cfg.num_key_value_heads,
                                      cfg.head_dim, bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(cfg.q_size, h, bias=cfg.o_bias, **kw)
        self.mlp = GatedMLP(h, cfg.intermediate_size, bias=False, **kw)
        self.sliding_window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.scale = cfg.head_dim ** -0.5

    def forward(self, hidden, cos, sin, kv_cache, plan, backend: AttentionBackend) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        q, k, v = self.qkv_proj(x)
        if self.sliding_window is not None:  # RoPE on the sliding-window layers only
            q, k = rotate_interleaved(q, cos, sin), rotate_interleaved(k, cos, sin)
        attn = backend.forward(self.layer_idx, q, k, v, kv_cache, plan, self.scale)
        return hidden + self.o_proj(attn.reshape(hidden.shape[0], -1)) + self.mlp(x)

    def hf_entries(self, prefix: str) -> dict:
        m = {prefix + "input_layernorm.weight": (self.input_layernorm.weight, None)}
        m.update(attention_hf_entries(prefix, self.qkv_proj, self.o_proj))
        m.update(self.mlp.hf_entries(prefix + "mlp"))
        return m


class Cohere2ForCausalLM(EagerDecoderForCausalLM):
    """Cohere2 over a paged KV cache (see the module docstring); the engine-facing interface of
    :class:`EagerDecoderForCausalLM` (KV specs and plans per layer window, weights, random
    init); logits times ``logit_scale``."""

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if config.cohere is None:
            raise ValueError(f"{config.architecture} is not a Cohere2 config")
        super().__init__(config, backend=backend, dtype=dtype, device=device)
        self.norm = CohereLayerNorm(config.hidden_size, config.cohere.layer_norm_eps, dtype=dtype,
                                    device=device)

    def make_layer(self, config: ModelArchConfig, layer_idx: int, *, dtype, device) -> Cohere2Layer:
        return Cohere2Layer(config, layer_idx, dtype=dtype, device=device)

    def compute_logits(self, hidden: torch.Tensor, indices=None, *, widen: bool = True) -> torch.Tensor:
        """The decoder's logits times ``logit_scale`` (in the model dtype, as transformers)."""
        logits = super().compute_logits(hidden, indices, widen=False) * self.config.cohere.logit_scale
        return logits.to(torch.float32) if widen else logits


__all__ = ["Cohere2ForCausalLM", "Cohere2Layer", "CohereLayerNorm", "rotate_interleaved"]
