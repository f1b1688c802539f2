"""Qwen3-Next: Gated-DeltaNet linear-attention layers beside gated full-attention layers, with
mixture-of-experts MLPs, over the paged KV cache and per-request state slots.

As transformers' ``Qwen3NextForCausalLM``: each layer computes ``h += mixer(input_norm(h))``
then ``h += mlp(post_norm(h))``. The mixer is, by ``LinearAttnConfig.layer_types``, either
the Gated-DeltaNet (``gated_deltanet.GatedDeltaNet``, ``model.layers.{i}.linear_attn``) or
full attention with an output gate (``GatedAttention``, ``model.layers.{i}.self_attn``:
``q_proj`` gives per head ``[q | gate]``; (1 + w) RMSNorms of q and k; RoPE on the first
``rotary_dim`` dimensions of each head; the attention output times ``sigmoid(gate)`` before
``o_proj``). The MLP is the sparse block (``moe.py``: softmax top-k, a shared expert scaled by
its sigmoid gate) on the layers ``MoeConfig.sparse_layers`` marks (``decoder_sparse_step``,
``mlp_only_layers``), else the dense gated MLP. Every RMSNorm but the mixer's gated one
multiplies by ``1 + w`` in float32 (``GemmaRMSNorm``).

Engine interface: ``kv_cache_specs`` lists the layers in order, a ``FullAttentionSpec``
(``model.layers.{i}.self_attn``) for each attention layer and a ``MambaSpec``
(``model.layers.{i}.linear_attn``: conv state ``(W - 1, conv_dim)`` in the model dtype,
recurrent state ``(HV, K, V)`` float32) for each linear-attention layer; ``forward`` takes
``kv_caches[k]`` (a KV tensor, or the ``(conv, recurrent)`` state tensors of a state layer)
and ``attn.plans[k]`` (the backend's plan, or a ``MambaMetadata``) per layer. Checkpoints:
``save_pretrained``'s per-expert names or the stacked experts layout; the
multi-token-prediction weights of the hub checkpoints (``mtp.*``) are not used (the loader
skips them). Layers stay eager (no compiled regions, no fused KV-write kernel).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagedkv.attention.backend import AttentionBackend, AttentionLayout, StepAttention
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import DecoderForCausalLM, attention_hf_entries
from pagedkv.models.eager_decoder import EagerLayers
from pagedkv.models.gated_deltanet import GatedDeltaNet
from pagedkv.models.gemma import GemmaRMSNorm
from pagedkv.models.layers import GatedMLP, Linear, MergedLinear
from pagedkv.models.moe import LAYOUTS, SparseMoeBlock
from pagedkv.models.rotary import RotaryEmbedding, apply_rotary


class GatedAttention(nn.Module):
    """Qwen3-Next's full attention (HF module ``model.layers.{i}.self_attn``)."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = d = cfg.head_dim
        self.scale = d ** -0.5
        kw = dict(dtype=dtype, device=device)
        # q_proj's rows: per head [q (D) | gate (D)]
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": 2 * cfg.q_size, "k": cfg.kv_size,
                                                       "v": cfg.kv_size},
                                     bias=cfg.qkv_bias, **kw)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, **kw)
        self.q_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, **kw)
        self.k_norm = GemmaRMSNorm(d, cfg.rms_norm_eps, **kw)

    def forward(self, x, cos, sin, kv_cache, plan, backend: AttentionBackend) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.split_sizes, dim=-1)
        q, gate = q.view(t, h, 2 * d).split([d, d], dim=-1)
        q = apply_rotary(self.q_norm(q), cos, sin)
        k = apply_rotary(self.k_norm(k.view(t, hkv, d)), cos, sin)
        out = backend.forward(self.layer_idx, q, k, v.view(t, hkv, d), kv_cache, plan, self.scale)
        out = out.reshape(t, h * d) * torch.sigmoid(gate.reshape(t, h * d))
        return self.o_proj(out)

    def hf_entries(self, prefix: str) -> dict:
        return attention_hf_entries(prefix, self.qkv_proj, self.o_proj, self.q_norm, self.k_norm)


class Qwen3NextLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        h = cfg.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.linear = cfg.linear_attn.is_linear(layer_idx)
        self.input_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps, **kw)
        self.post_attention_layernorm = GemmaRMSNorm(h, cfg.rms_norm_eps, **kw)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg, layer_idx, **kw)
        else:
            self.self_attn = GatedAttention(cfg, layer_idx, **kw)
        self.sparse = cfg.moe.sparse_layers[layer_idx]
        if self.sparse:
            self.mlp = SparseMoeBlock(h, cfg.moe, cfg.family, **kw)
        else:
            self.mlp = GatedMLP(h, cfg.intermediate_size, bias=False, **kw)

    def forward(self, hidden, cos, sin, cache, plan, backend) -> torch.Tensor:
        x = self.input_layernorm(hidden)
        if self.linear:
            hidden = hidden + self.linear_attn(x, cache, plan)
        else:
            hidden = hidden + self.self_attn(x, cos, sin, cache, plan, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def hf_entries(self, prefix: str, layout: str | None = None) -> dict:
        """This layer's Hugging Face tensors (``prefix`` = ``model.layers.{i}.``), the experts
        in ``layout`` (``pagedkv.models.moe.LAYOUTS``; default the per-expert names)."""
        layout = layout or LAYOUTS[0]
        m = {prefix + "input_layernorm.weight": (self.input_layernorm.weight, None),
             prefix + "post_attention_layernorm.weight": (self.post_attention_layernorm.weight, None)}
        if self.linear:
            m.update(self.linear_attn.hf_entries(prefix + "linear_attn."))
        else:
            m.update(self.self_attn.hf_entries(prefix))
        m.update(self.mlp.hf_entries(prefix, layout) if self.sparse
                 else self.mlp.hf_entries(prefix + "mlp"))
        return m


class Qwen3NextForCausalLM(EagerLayers, DecoderForCausalLM):
    """Qwen3-Next (see the module docstring); the engine-facing interface of
    :class:`DecoderForCausalLM` with state layers among its cache layers."""

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if config.linear_attn is None or config.moe is None:
            raise ConfigError(f"{config.architecture} needs a linear-attention and an MoE config")
        super().__init__(config, backend=backend, dtype=dtype, device=device)
        # the (1 + w) final norm; RoPE over the rotary part of the heads
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype,
                                 device=device)
        self.rotary = RotaryEmbedding(config.linear_attn.rotary_dim, config.rope,
                                      config.max_position_embeddings, device=device)
        self.fuse_kv_write = False

    def make_layer(self, config: ModelArchConfig, layer_idx: int, *, dtype, device):
        return Qwen3NextLayer(config, layer_idx, dtype=dtype, device=device)

    # ---- the engine's interface
    def kv_cache_specs(self, block_size: int) -> dict:
        """The cache layers in layer order: ``model.layers.{i}.self_attn`` -> a
        ``FullAttentionSpec`` (KV in the model dtype), ``model.layers.{i}.linear_attn`` -> a
        ``MambaSpec`` of (conv state in the model dtype, recurrent state float32)."""
        from pagedkv.core.spec import FullAttentionSpec, MambaSpec

        cfg, dtype = self.config, str(self.dtype).removeprefix("torch.")
        full = FullAttentionSpec(block_size=block_size, num_kv_heads=cfg.num_key_value_heads,
                                 head_size=cfg.head_dim, dtype=dtype)
        out = {}
        for i, layer in enumerate(self.layers):
            if layer.linear:
                out[f"model.layers.{i}.linear_attn"] = MambaSpec(
                    block_size=block_size, shapes=layer.linear_attn.state_shapes(),
                    dtypes=(dtype, "float32"))
            else:
                out[f"model.layers.{i}.self_attn"] = full
        return out

    def attention_layout(self, spec=None) -> AttentionLayout:
        cfg = self.config
        return AttentionLayout(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                               self.dtype, self.device)

    def step_attention(self, attn) -> StepAttention:
        """The runner's :class:`StepAttention` (a plan per cache layer: the backend's for the
        attention layers, a ``MambaMetadata`` for the state layers); a bare metadata object
        cannot plan the state layers."""
        if not isinstance(attn, StepAttention):
            raise InvalidRequestError(
                "Qwen3-Next needs a StepAttention with one plan per cache layer (a MambaMetadata "
                "for each linear-attention layer), got " + type(attn).__name__)
        return attn

    def allocate_kv_caches(self, num_blocks: int, block_size: int, *,
                           dtype: torch.dtype | None = None,
                           device: str | torch.device | None = None,
                           fill: float | None = 0.0) -> list:
        """Per cache layer, unshared (``allocate_layer_caches``): an attention layer's KV
        tensor, a state layer's ``(conv [num_blocks, W - 1, conv_dim] in the model dtype,
        recurrent [num_blocks, HV, K, V] float32)``."""
        return self.allocate_spec_caches(num_blocks, block_size, dtype=dtype, device=device,
                                         fill=fill)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence, attn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm (see the module docstring)."""
        return self.forward_layer_modules(input_ids, positions, kv_caches, attn)

    # ---- weights
    def hf_weight_layouts(self) -> dict[str, dict]:
        """``per_expert`` (``save_pretrained``'s names) and ``fused`` (stacked expert
        tensors), see ``pagedkv.models.moe``."""
        return {layout: self.hf_weight_map(layout) for layout in LAYOUTS}

    @torch.no_grad()
    def finish_loading(self) -> "Qwen3NextForCausalLM":
        """After the weights are in: the float32 ``1 + w`` factors of the (1 + w) norms."""
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.refresh()
        return self

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> "Qwen3NextForCausalLM":
        """As the decoder's (matrices and conv kernels ~ N(0, std), other vectors 1, biases
        and ``dt_bias`` 0), with the (1 + w) norms' ``w`` 0 (factor 1) and ``A_log`` 0
        (decay ``exp(-softplus(a))`` per token)."""
        super().init_random_weights(seed, std)
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.weight.zero_()
            elif isinstance(m, GatedDeltaNet):
                m.A_log.zero_()
        return self.finish_loading()


__all__ = ["GatedAttention", "Qwen3NextForCausalLM", "Qwen3NextLayer"]
