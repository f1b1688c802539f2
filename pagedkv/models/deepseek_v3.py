"""DeepSeek-V3 over the paged latent cache: MLA attention, dense then mixture-of-experts MLPs.

As transformers' ``DeepseekV3ForCausalLM``: each layer computes ``h += attn(input_norm(h))``
(``mla_attention.MLAttention``) then ``h += mlp(post_norm(h))``, the MLP the dense gated MLP for
the first ``first_k_dense_replace`` layers and the sparse block after them (``moe.py``:
DeepSeek's sigmoid group-limited routing with ``e_score_correction_bias``, stacked experts,
shared experts added). RoPE (default or YaRN, ``rotary.py``) covers the ``qk_rope_head_dim``
parts; the softmax scale carries YaRN's ``mscale_all_dim`` factor (``ModelArchConfig.attn_scale``).

Engine interface, as the other families': every layer caches one latent vector per token in
an ``MLAAttentionSpec(num_kv_heads=1, head_size=kv_lora_rank + qk_rope_head_dim)`` group (one
group: every layer has the same spec), KV tensors ``[num_blocks, block_size, latent_dim]``;
an engine's attention backend is replaced by its MLA counterpart (``mla_backend_for``).
Checkpoints: ``save_pretrained``'s per-expert names or the stacked experts layout; the
multi-token-prediction layers of DeepSeek's hub checkpoints (``model.layers.{L + i}``,
``num_nextn_predict_layers``) are not used (the loader skips them). Layers stay eager (no
compiled regions, no fused KV-write kernel).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagedkv.attention.backend import AttentionBackend, AttentionLayout
from pagedkv.attention.mla import MLABackend, allocate_mla_kv_caches, mla_backend_for
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import DecoderForCausalLM
from pagedkv.models.eager_decoder import EagerLayers
from pagedkv.models.layers import GatedMLP, RMSNorm
from pagedkv.models.mla_attention import MLAttention
from pagedkv.models.moe import LAYOUTS, SparseMoeBlock
from pagedkv.models.rotary import RotaryEmbedding


class DeepseekV3Layer(nn.Module):
    attn_class = MLAttention  # the attention layer (DeepSeek-V3.2 subclasses it)

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = self.attn_class(cfg, layer_idx, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.sparse = cfg.moe.sparse_layers[layer_idx]
        if self.sparse:
            # DeepSeek-V3's expert names (also those of DeepSeek-V3.2)
            self.mlp = SparseMoeBlock(h, cfg.moe, "deepseek_v3", dtype=dtype, device=device)
        else:
            self.mlp = GatedMLP(h, cfg.intermediate_size, bias=False, dtype=dtype, device=device)

    def forward(self, hidden, cos, sin, kv_cache, plan, backend: MLABackend) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, plan,
                                         backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def hf_entries(self, prefix: str, layout: str) -> dict:
        m = {prefix + "input_layernorm.weight": (self.input_layernorm.weight, None),
             prefix + "post_attention_layernorm.weight": (self.post_attention_layernorm.weight, None)}
        m.update(self.self_attn.hf_entries(prefix + "self_attn."))
        if self.sparse:
            m.update(self.mlp.hf_entries(prefix, layout))
        else:
            m.update(self.mlp.hf_entries(prefix + "mlp"))
        return m


class DeepseekV3ForCausalLM(EagerLayers, DecoderForCausalLM):
    """DeepSeek-V3 (see the module docstring); the engine-facing interface of
    :class:`DecoderForCausalLM` (KV specs per layer, plans, logits, weights, random init)."""

    # the decoder layer (DeepSeek-V3.2 subclasses it)
    layer_class = DeepseekV3Layer

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        nn.Module.__init__(self)
        if config.mla is None or config.moe is None:
            raise ValueError(f"{config.architecture} needs a latent-attention and an MoE config")
        from pagedkv.attention.mla_torch_ref import TorchRefMLABackend

        self.config = config
        self.dtype = dtype
        self.attn_backend = mla_backend_for(backend) if backend is not None else TorchRefMLABackend()
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(self.layer_class(config, i, dtype=dtype, device=device)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False)
        self.rotary = RotaryEmbedding(config.mla.qk_rope_head_dim, config.rope,
                                      config.max_position_embeddings, device=device)
        self.fuse_kv_write = False

    # ---- the engine's interface
    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Install ``backend``'s multi-head latent attention counterpart (``mla_backend_for``)."""
        self.attn_backend = mla_backend_for(backend)

    def attention_layout(self, spec=None) -> AttentionLayout:
        """Every layer: ``num_attention_heads`` query heads over one latent KV head of
        ``kv_lora_rank + qk_rope_head_dim``."""
        cfg = self.config
        return AttentionLayout(cfg.num_attention_heads, 1, cfg.mla.latent_dim, self.dtype,
                               self.device)

    def kv_cache_specs(self, block_size: int) -> dict:
        """Each layer's ``MLAAttentionSpec`` (one latent head of ``latent_dim``, the model's
        dtype), keyed by the runner's layer names."""
        from pagedkv.core.spec import MLAAttentionSpec

        spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                head_size=self.config.mla.latent_dim,
                                dtype=str(self.dtype).removeprefix("torch."))
        return {f"model.layers.{i}.self_attn": spec for i in range(len(self.layers))}

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, self.config.mla.latent_dim)

    def allocate_kv_caches(self, num_blocks: int, block_size: int, *, dtype: torch.dtype | None = None,
                           device: str | torch.device | None = None,
                           fill: float | None = 0.0) -> list[torch.Tensor]:
        return allocate_mla_kv_caches(len(self.layers), num_blocks, block_size,
                                      self.config.mla.latent_dim, dtype=dtype or self.dtype,
                                      device=device or self.device, fill=fill)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], attn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm (``forward_layer_modules``; the
        layer's cache: ``layer_caches``, DeepSeek-V3.2's a pair, latent and indexer keys)."""
        return self.forward_layer_modules(input_ids, positions, kv_caches, attn)

    # ---- weights
    def hf_weight_map(self, layout: str | None = None) -> dict:
        layout = layout or LAYOUTS[0]
        m = {"model.embed_tokens.weight": (self.embed_tokens, None),
             "model.norm.weight": (self.norm.weight, None)}
        if self.lm_head is not None:
            m["lm_head.weight"] = (self.lm_head, None)
        for i, layer in enumerate(self.layers):
            m.update(layer.hf_entries(f"model.layers.{i}.", layout))
        return m

    def hf_weight_layouts(self) -> dict[str, dict]:
        """``per_expert`` (``save_pretrained``'s names) and ``fused`` (stacked expert
        tensors), see ``pagedkv.models.moe``."""
        return {layout: self.hf_weight_map(layout) for layout in LAYOUTS}


__all__ = ["DeepseekV3ForCausalLM", "DeepseekV3Layer"]
