"""GPT-OSS over the paged KV cache.

What differs from the generic decoder (``decoder.py``), as transformers' ``GptOssForCausalLM``
computes it:

* attention layers alternate between a sliding window (``layer_types``
  ``"sliding_attention"``, window ``sliding_window``) and full attention, so the model has two
  KV-cache specs and the engine one hybrid pool of two groups (the decoder's
  ``kv_cache_specs`` / ``attention_layout`` per layer window);
* attention sinks: every attention layer has ``sinks [num_heads]``, one learned logit per
  query head that joins the softmax denominator; the layer hands them to the backend with its
  call (``AttentionBackend.forward(..., sinks=)``), which passes them to the paged kernels;
* q/k/v and o projections with biases (``attention_bias``), YaRN RoPE (the decoder's
  ``RotaryEmbedding``, cos/sin scaled by YaRN's attention factor);
* RMSNorms computed wholly in float32 (``rms_norm_fp32``: transformers keeps them in float32);
* every layer's MLP is the sparse block of ``moe.py`` with GPT-OSS's options: a router with a
  bias, top-k then softmax (``route_topk_softmax``), experts with biases, gate/up rows
  interleaved, the clamped SwiGLU; the same fused-MoE kernels (CUDA) and twin (elsewhere).

Eager layers (``EagerDecoderForCausalLM``: no compiled regions, no fused KV-write kernel).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.backend import AttentionBackend
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import Attention, attention_hf_entries
from pagedkv.models.eager_decoder import EagerDecoderForCausalLM
from pagedkv.models.layers import RMSNorm, rms_norm_fp32
from pagedkv.models.moe import SparseMoeBlock
from pagedkv.models.rotary import apply_rotary


class GptOssRMSNorm(RMSNorm):
    """RMSNorm in float32 throughout, rounded once (``rms_norm_fp32``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_fp32(x, self.weight, self.eps)


class GptOssAttention(Attention):
    """The decoder's attention (fused QKV with biases, o_proj with bias, RoPE) plus the layer's
    attention sinks, passed to the backend with every call."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__(cfg, layer_idx, dtype=dtype, device=device)
        self.sinks = nn.Parameter(torch.empty(cfg.num_attention_heads, dtype=dtype, device=device),
                                  requires_grad=False)

    def forward(self, hidden, cos, sin, kv_cache, plan, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(self.layer_idx, q, k, v, kv_cache, plan, self.scale, sinks=self.sinks)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


class GptOssLayer(nn.Module):
    """``h += attn(input_norm(h))``, then ``h += moe(post_attention_norm(h))``."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = GptOssRMSNorm(h, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = GptOssAttention(cfg, layer_idx, dtype=dtype, device=device)
        self.post_attention_layernorm = GptOssRMSNorm(h, cfg.rms_norm_eps, dtype=dtype,
                                                      device=device)
        self.mlp = SparseMoeBlock(h, cfg.moe, cfg.family, dtype=dtype, device=device)
        self.sliding_window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None

    def forward(self, hidden, cos, sin, kv_cache, plan, backend: AttentionBackend) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, plan,
                                         backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def hf_entries(self, prefix: str) -> dict:
        """This layer's Hugging Face tensors (``prefix`` = ``model.layers.{i}.``)."""
        attn = self.self_attn
        m = {prefix + "input_layernorm.weight": (self.input_layernorm.weight, None),
             prefix + "post_attention_layernorm.weight": (self.post_attention_layernorm.weight, None),
             prefix + "self_attn.sinks": (attn.sinks, None)}
        m.update(attention_hf_entries(prefix, attn.qkv_proj, attn.o_proj))
        m.update(self.mlp.hf_entries(prefix, "fused"))
        return m


class GptOssForCausalLM(EagerDecoderForCausalLM):
    """GPT-OSS over a paged KV cache (see the module docstring); the engine-facing interface of
    :class:`EagerDecoderForCausalLM` (KV specs and plans per layer window, logits, weights,
    random init); the layers pass their sinks with each attention call."""

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if config.moe is None or not config.attn_sinks:
            raise ValueError(f"{config.architecture} is not a GPT-OSS config (MoE with sinks)")
        super().__init__(config, backend=backend, dtype=dtype, device=device)
        self.norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                  device=device)

    def make_layer(self, config: ModelArchConfig, layer_idx: int, *, dtype, device) -> GptOssLayer:
        return GptOssLayer(config, layer_idx, dtype=dtype, device=device)


__all__ = ["GptOssAttention", "GptOssForCausalLM", "GptOssLayer", "GptOssRMSNorm"]
