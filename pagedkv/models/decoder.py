"""One generic decoder-only transformer for the Llama, Qwen2, Qwen3 and Mistral families.

The families differ only by flags of ``ModelArchConfig``: q/k/v bias (Qwen2; Llama and Qwen3
with ``attention_bias``), o_proj bias, MLP bias (Llama ``mlp_bias``), per-head q/k RMSNorm
before RoPE (Qwen3), tied embeddings, RoPE scaling.

Inputs are flat packed tokens of a mixed batch (``input_ids [T]``, ``positions [T]`` int64),
one KV cache per layer and an attention-metadata object; attention goes through an
``AttentionBackend``. ``forward`` returns hidden states ``[T, hidden]``;
``compute_logits(hidden, indices)`` projects only the rows that get sampled.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.backend import AttentionBackend, AttentionMetadataLike
from pagedkv.attention.kv_cache import allocate_kv_caches
from pagedkv.attention.torch_ref import TorchRefBackend
from pagedkv.errors import InvalidRequestError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.layers import GatedMLP, Linear, QKVProjection, RMSNorm
from pagedkv.models.rotary import RotaryEmbedding, apply_rotary, tokens_seq_lens


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = QKVProjection(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            bias=cfg.qkv_bias, dtype=dtype, device=device,
        )
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, device=device)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadataLike,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(self.layer_idx, q, k, v, kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(cfg, layer_idx, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype, device=device)

    def forward(self, hidden, cos, sin, kv_cache, metadata, backend) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DecoderForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 / Mistral causal LM over a paged KV cache."""

    def __init__(
        self,
        config: ModelArchConfig,
        *,
        backend: AttentionBackend | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.attn_backend: AttentionBackend = backend if backend is not None else TorchRefBackend()
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, dtype=dtype, device=device) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(
                torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False
            )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope, config.max_position_embeddings, device=device
        )

    # ---- properties
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.attn_backend = backend

    # ---- forward
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn_metadata: AttentionMetadataLike,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for packed tokens ``input_ids [T]``
        at ``positions [T]``; writes each layer's K/V into ``kv_caches[layer]``."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise InvalidRequestError(
                f"input_ids and positions must both be flat [T] tensors, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != len(self.layers):
            raise InvalidRequestError(
                f"expected one KV cache per layer ({len(self.layers)}), got {len(kv_caches)}"
            )
        seq_lens = tokens_seq_lens(attn_metadata, input_ids.shape[0]) if self.rotary.is_dynamic else None
        cos, sin = self.rotary(positions, seq_lens)
        hidden = F.embedding(input_ids, self.embed_tokens)
        backend = self.attn_backend
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden = layer(hidden, cos, sin, kv_cache, attn_metadata, backend)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None,
                       *, widen: bool = True) -> torch.Tensor:
        """Float32 logits ``[len(indices), vocab]`` for the rows ``indices`` of ``hidden`` (all
        rows when ``None``). The projection runs in the model dtype, then widens
        (``widen=False``: the model-dtype logits, e.g. for an argmax, which the exact widening
        does not change)."""
        if indices is not None:
            if not isinstance(indices, torch.Tensor):
                indices = torch.tensor(list(indices), dtype=torch.int64)
            hidden = hidden.index_select(0, indices.to(device=hidden.device, dtype=torch.int64))
        logits = F.linear(hidden, self.lm_head_weight)
        return logits.to(torch.float32) if widen else logits

    # ---- KV cache helpers
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, *, dtype: torch.dtype | None = None,
        device: str | torch.device | None = None, fill: float | None = 0.0,
    ) -> list[torch.Tensor]:
        return allocate_kv_caches(
            self.config.num_hidden_layers, num_blocks, block_size,
            self.config.num_key_value_heads, self.config.head_dim,
            dtype=dtype or self.dtype, device=device or self.device, fill=fill,
        )

    # ---- weights
    def hf_weight_map(self) -> dict[str, tuple[nn.Parameter, tuple[int, int] | None]]:
        """Hugging Face tensor name -> (parameter, row range ``(start, rows)`` or ``None`` for the
        whole parameter). Exactly the tensors a checkpoint of this architecture must provide."""
        m: dict[str, tuple[nn.Parameter, tuple[int, int] | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, None),
            "model.norm.weight": (self.norm.weight, None),
        }
        if self.lm_head is not None:
            m["lm_head.weight"] = (self.lm_head, None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            m[p + "input_layernorm.weight"] = (layer.input_layernorm.weight, None)
            m[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm.weight, None)
            for name in ("q", "k", "v"):
                m[p + f"self_attn.{name}_proj.weight"] = (attn.qkv_proj.weight, attn.qkv_proj.shards[name])
                if attn.qkv_proj.bias is not None:
                    m[p + f"self_attn.{name}_proj.bias"] = (attn.qkv_proj.bias, attn.qkv_proj.shards[name])
            m[p + "self_attn.o_proj.weight"] = (attn.o_proj.weight, None)
            if attn.o_proj.bias is not None:
                m[p + "self_attn.o_proj.bias"] = (attn.o_proj.bias, None)
            if attn.q_norm is not None:
                m[p + "self_attn.q_norm.weight"] = (attn.q_norm.weight, None)
                m[p + "self_attn.k_norm.weight"] = (attn.k_norm.weight, None)
            for name in ("gate", "up"):
                m[p + f"mlp.{name}_proj.weight"] = (mlp.gate_up_proj.weight, mlp.gate_up_proj.shards[name])
                if mlp.gate_up_proj.bias is not None:
                    m[p + f"mlp.{name}_proj.bias"] = (mlp.gate_up_proj.bias, mlp.gate_up_proj.shards[name])
            m[p + "mlp.down_proj.weight"] = (mlp.down_proj.weight, None)
            if mlp.down_proj.bias is not None:
                m[p + "mlp.down_proj.bias"] = (mlp.down_proj.bias, None)
        return m

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> "DecoderForCausalLM":
        """Deterministic random weights (benchmarks by shape): matrices ~ N(0, std), norms 1,
        biases 0. Each parameter draws from its own generator on its own device (fast for
        large shapes; values depend on the device type)."""
        for i, (name, p) in enumerate(self.named_parameters()):
            if p.dim() >= 2:
                gen = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
                vals = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=p.device)
                p.copy_(vals.mul_(std).to(p.dtype))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
        return self


__all__ = ["Attention", "DecoderForCausalLM", "DecoderLayer"]
