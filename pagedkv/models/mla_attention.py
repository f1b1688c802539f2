"""The multi-head latent attention layer of DeepSeek-V3 (projections, RoPE, the MLA backend).

As transformers' ``DeepseekV3Attention`` (config in ``MlaConfig``), for packed tokens
``x [T, hidden]``:

* queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (or ``q_proj(x)`` without
  ``q_lora_rank``), per head ``[q_nope | q_pe]``;
* latent: ``kv_a_proj_with_mqa(x) = [c | k_pe]``, ``c`` RMS-normed by ``kv_a_layernorm``
  (eps 1e-6 as transformers' default, like ``q_a_layernorm``);
* RoPE on ``q_pe`` and ``k_pe`` only. With ``rope_interleave`` (DeepSeek's checkpoints) the
  rope dimensions come in pairs ``(x0, x1), (x2, x3) ...``: transformers rotates each pair and
  writes the results in halves (``[x0', x2', ... | x1', x3', ...]``), which is the halves
  rotation of the de-interleaved vector ``[x0, x2, ... | x1, x3, ...]``: that is what runs here
  (same expression, same rounding). Queries and keys get the same permutation, so their dot
  products are those of the checkpoint's layout;
* the backend (``pagedkv.attention.mla``) writes ``[c | k_pe]`` into the latent cache and
  attends; ``o_proj`` of its ``[T, H, v_head_dim]`` output.

The layer's :class:`MLAWeights` are views of ``kv_b_proj.weight``.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.backend import AttentionPlan
from pagedkv.attention.mla import MLABackend, MLAWeights
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.layers import Linear, RMSNorm
from pagedkv.models.rotary import apply_rotary


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """``[x0, x1, x2, x3, ...] -> [x0, x2, ... | x1, x3, ...]`` along the last dimension."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        m = cfg.mla
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.kv_lora_rank = m.kv_lora_rank
        self.qk_nope_head_dim = m.qk_nope_head_dim
        self.qk_rope_head_dim = m.qk_rope_head_dim
        self.v_head_dim = m.v_head_dim
        self.rope_interleave = m.rope_interleave
        self.scale = cfg.attn_scale
        h, n, bias = cfg.hidden_size, cfg.num_attention_heads, m.attention_bias
        kw = dict(dtype=dtype, device=device)
        if m.q_lora_rank is None:
            self.q_proj = Linear(h, n * m.qk_head_dim, bias=False, **kw)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = Linear(h, m.q_lora_rank, bias=bias, **kw)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.norm_eps, **kw)
            self.q_b_proj = Linear(m.q_lora_rank, n * m.qk_head_dim, bias=False, **kw)
        self.kv_a_proj_with_mqa = Linear(h, m.latent_dim, bias=bias, **kw)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.norm_eps, **kw)
        self.kv_b_proj = Linear(m.kv_lora_rank, n * (m.qk_nope_head_dim + m.v_head_dim),
                                bias=False, **kw)
        self.o_proj = Linear(n * m.v_head_dim, h, bias=bias, **kw)

    @property
    def mla_weights(self) -> MLAWeights:
        return MLAWeights(self.kv_b_proj.weight, self.num_heads, self.qk_nope_head_dim,
                          self.qk_rope_head_dim, self.v_head_dim)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rotary(deinterleave(x) if self.rope_interleave else x, cos, sin)

    def query_lora(self, x: torch.Tensor) -> torch.Tensor | None:
        """``q_a_layernorm(q_a_proj(x))`` ``[T, q_lora_rank]``, the query LoRA's latent (None
        with a plain ``q_proj``); DeepSeek-V3.2's indexer reads it too."""
        if self.q_proj is not None:
            return None
        return self.q_a_layernorm(self.q_a_proj(x))

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                q_resid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q [T, H, nope + rope], latent [T, L + R])`` of ``x [T, hidden]``: what the
        backend attends with and writes into the latent cache (``q_resid``: the
        :meth:`query_lora` of ``x`` when the caller has it)."""
        t = x.shape[0]
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.query_lora(x) if q_resid is None else q_resid)
        q = q.view(t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q = torch.cat([q_nope, self._rope(q_pe, cos, sin)], dim=-1)
        latent = torch.cat([c, self._rope(k_pe.unsqueeze(1), cos, sin).squeeze(1)], dim=-1)
        return q, latent

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: torch.Tensor, plan: AttentionPlan, backend: MLABackend) -> torch.Tensor:
        q, latent = self.project(x, cos, sin)
        out = backend.forward(self.layer_idx, q, latent, kv_cache, plan, self.scale,
                              self.mla_weights)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_head_dim))

    def hf_entries(self, prefix: str) -> dict:
        """This layer's Hugging Face tensors (``prefix`` = ``model.layers.{i}.self_attn.``)."""
        m = {}
        for name in ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            mod = getattr(self, name)
            if mod is not None:
                m.update(mod.hf_entries(prefix + name))
        for name in ("q_a_layernorm", "kv_a_layernorm"):
            mod = getattr(self, name)
            if mod is not None:
                m[f"{prefix}{name}.weight"] = (mod.weight, None)
        return m


__all__ = ["MLAttention", "deinterleave"]
