"""Gemma 2 and Gemma 3 (text) causal LMs over the paged KV cache.

What differs from the generic decoder (``decoder.py``), as transformers' modeling code does it:

* RMSNorm multiplies by ``1 + w`` in float32 before rounding to the model dtype (the factor is
  kept as a float32 buffer, so bf16 weights lose nothing);
* sandwich norms: ``h += post_attention_norm(attn(input_norm(h)))`` and
  ``h += post_feedforward_norm(mlp(pre_feedforward_norm(h)))``;
* GeGLU MLP (``gelu_pytorch_tanh(gate) * up``); embeddings scaled by ``sqrt(hidden)`` (rounded
  to the model dtype first);
* attention scale ``query_pre_attn_scalar ** -0.5``; attention logits soft-capped
  (``attn_logit_softcapping``, Gemma 2: 50) and the final logits too
  (``final_logit_softcapping``, Gemma 2: 30);
* interleaved layers: sliding-window layers (``layer_types``; Gemma 2 every other layer, Gemma 3
  five of six) beside full-attention ones, so the model has two KV-cache specs and the engine
  one hybrid pool of several groups; each layer's window and soft cap reach the attention
  backend through its group's plan (``attention_layout``);
* Gemma 3: per-head q/k RMSNorms (``1 + w`` too) and two RoPEs: ``rope_parameters
  ["full_attention"]`` for the global layers, ``["sliding_attention"]`` (base 10,000) for the
  local ones.

One plain-tensor layer path (no compiled regions, no fused KV-write kernel yet).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.backend import AttentionBackend, AttentionLayout
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import DecoderForCausalLM, attention_hf_entries
from pagedkv.models.eager_decoder import EagerLayers
from pagedkv.models.layers import Linear, MergedLinear, QKVProjection, gated_mlp_hf_entries
from pagedkv.models.rotary import RotaryEmbedding, apply_rotary


class GemmaRMSNorm(nn.Module):
    """``x / rms(x) * (1 + w)`` in float32, rounded to ``x``'s dtype. ``weight`` holds the
    checkpoint's ``w``; the float32 factor ``1 + w`` is refreshed by :meth:`refresh`."""

    def __init__(self, dim: int, eps: float, *, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)
        self.register_buffer("factor", torch.ones(dim, dtype=torch.float32, device=device),
                             persistent=False)

    @torch.no_grad()
    def refresh(self) -> None:
        self.factor.copy_(1.0 + self.weight.float())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.factor).to(x.dtype)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        h = cfg.hidden_size
        norm = lambda d: GemmaRMSNorm(d, cfg.rms_norm_eps, dtype=dtype, device=device)  # noqa: E731
        self.input_layernorm = norm(h)
        self.post_attention_layernorm = norm(h)
        self.pre_feedforward_layernorm = norm(h)
        self.post_feedforward_layernorm = norm(h)
        self.qkv_proj = QKVProjection(h, cfg.num_attention_heads, cfg.num_key_value_heads,
                                      cfg.head_dim, bias=cfg.qkv_bias, dtype=dtype, device=device)
        self.o_proj = Linear(cfg.q_size, h, bias=cfg.o_bias, dtype=dtype, device=device)
        self.q_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.k_norm = norm(cfg.head_dim) if cfg.qk_norm else None
        self.gate_up_proj = MergedLinear(h, {"gate": cfg.intermediate_size, "up": cfg.intermediate_size},
                                         bias=False, dtype=dtype, device=device)
        self.down_proj = Linear(cfg.intermediate_size, h, bias=False, dtype=dtype, device=device)
        self.sliding_window = cfg.layer_windows[layer_idx] if cfg.layer_windows else None
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim ** -0.5

    def forward(self, hidden, cos, sin, kv_cache, plan, backend: AttentionBackend) -> torch.Tensor:
        q, k, v = self.qkv_proj(self.input_layernorm(hidden))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(self.layer_idx, q, k, v, kv_cache, plan, self.scale)
        out = self.o_proj(out.reshape(hidden.shape[0], -1))
        hidden = hidden + self.post_attention_layernorm(out)
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(hidden)).chunk(2, dim=-1)
        mlp = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return hidden + self.post_feedforward_layernorm(mlp)


class GemmaForCausalLM(EagerLayers, DecoderForCausalLM):
    """Gemma 2 / Gemma 3 text over a paged KV cache (see the module docstring). Shares the
    engine-facing interface of :class:`DecoderForCausalLM` (KV specs per layer, plans per layer,
    logits of the sampled rows, weight map, random init)."""

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        nn.Module.__init__(self)
        from pagedkv.attention.torch_ref import TorchRefBackend

        self.config = config
        self.dtype = dtype
        self.attn_backend = backend if backend is not None else TorchRefBackend()
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(GemmaLayer(config, i, dtype=dtype, device=device)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope, config.max_position_embeddings,
                                      device=device)
        self.local_rotary = None if config.local_rope is None else RotaryEmbedding(
            config.head_dim, config.local_rope, config.max_position_embeddings, device=device)
        # sqrt(hidden) rounded to the model dtype, on the model's device (no host tensor in
        # the forward: CUDA graphs capture it)
        self.register_buffer("embed_scale", torch.tensor(config.embed_scale, dtype=dtype,
                                                         device=device), persistent=False)
        self.fuse_kv_write = False

    # ---- the engine's interface
    def attention_layout(self, spec=None) -> AttentionLayout:
        """As the decoder's, plus the attention logit soft cap of every Gemma layer."""
        cfg = self.config
        return AttentionLayout(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                               self.dtype, self.device,
                               sliding_window=getattr(spec, "sliding_window", None),
                               logits_soft_cap=cfg.attn_logit_softcap)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], attn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm (see ``DecoderForCausalLM``)."""
        attn = self.step_attention(attn)
        plans = attn.plans
        cos, sin = self._rope(self.rotary, positions)
        local = cos, sin
        if self.local_rotary is not None:
            local = self._rope(self.local_rotary, positions)
        hidden = F.embedding(input_ids, self.embed_tokens) * self.embed_scale
        backend = self.attn_backend
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            c, s = local if layer.sliding_window is not None else (cos, sin)
            hidden = layer(hidden, c, s, kv_cache, plans[i], backend)
        return self.norm(hidden)

    def _rope(self, rotary: RotaryEmbedding, positions: torch.Tensor):
        cos, sin = rotary(positions)
        return cos.to(self.dtype), sin.to(self.dtype)

    def compute_logits(self, hidden: torch.Tensor, indices=None, *, widen: bool = True) -> torch.Tensor:
        """Logits of the rows ``indices`` (all when None), soft-capped by
        ``final_logit_softcapping`` (Gemma 2) in float32; float32 out (``widen`` is accepted
        for the runner's greedy fast path and ignored: the cap needs the float32 values)."""
        if indices is not None:
            if not isinstance(indices, torch.Tensor):
                indices = torch.as_tensor(indices, dtype=torch.int64, device=hidden.device)
            hidden = hidden.index_select(0, indices.to(hidden.device))
        logits = F.linear(hidden, self.lm_head_weight).float()
        cap = self.config.final_logit_softcap
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    @torch.no_grad()
    def finish_loading(self) -> "GemmaForCausalLM":
        """After the weights are in: the float32 ``1 + w`` factors of every norm."""
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.refresh()
        return self

    # ---- weights
    def hf_weight_map(self) -> dict:
        m = {"model.embed_tokens.weight": (self.embed_tokens, None),
             "model.norm.weight": (self.norm.weight, None)}
        if self.lm_head is not None:
            m["lm_head.weight"] = (self.lm_head, None)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for name in ("input_layernorm", "post_attention_layernorm",
                         "pre_feedforward_layernorm", "post_feedforward_layernorm"):
                m[p + f"{name}.weight"] = (getattr(layer, name).weight, None)
            m.update(attention_hf_entries(p, layer.qkv_proj, layer.o_proj, layer.q_norm,
                                          layer.k_norm))
            m.update(gated_mlp_hf_entries(p + "mlp", layer.gate_up_proj, layer.down_proj))
        return m

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> "GemmaForCausalLM":
        """As the decoder's (matrices ~ N(0, std)), with every norm's ``w`` 0 (factor 1)."""
        super().init_random_weights(seed, std)
        for m in self.modules():
            if isinstance(m, GemmaRMSNorm):
                m.weight.zero_()
        return self.finish_loading()


__all__ = ["GemmaForCausalLM", "GemmaLayer", "GemmaRMSNorm"]
