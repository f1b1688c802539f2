"""Falcon-H1: a Mamba-2 mixer and attention side by side in every layer, with muP multipliers,
over the paged KV cache and per-request state slots.

As transformers' ``FalconH1ForCausalLM``: embeddings times ``embedding_multiplier``; each layer
computes, from ``x = input_norm(h)``,

    ``h += ssm_out_multiplier * mamba(x) + attention_out_multiplier * attn(attention_in_multiplier * x)``

(the mixer, ``mamba2_mixer.Mamba2Mixer``, scales its own input by ``ssm_in_multiplier`` and
``in_proj``'s output by the muP vector of ``ssm_multipliers``; attention multiplies its keys by
``key_multiplier`` before RoPE, which covers the whole head) then
``h += down_multiplier * down(up(y) * silu(gate_multiplier * gate(y)))`` with
``y = pre_ff_norm(h)`` (``mlp_multipliers``); the logits are times ``lm_head_multiplier``.
``mamba_rms_norm`` chooses the mixer's gate (see ``MambaConfig``).

Every layer has two cache layers, ``model.layers.{i}.mamba`` (a ``MambaSpec``) then
``model.layers.{i}.self_attn`` (a ``FullAttentionSpec``); the rest of the engine interface is
Bamba's (``bamba.BambaForCausalLM``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from pagedkv.models.bamba import BambaForCausalLM, BambaLayer
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import Attention
from pagedkv.models.layers import silu_and_mul
from pagedkv.models.rotary import apply_rotary


class FalconH1Attention(Attention):
    """The decoder's attention with its keys times ``key_multiplier`` (before RoPE)."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__(cfg, layer_idx, dtype=dtype, device=device)
        self.key_multiplier = cfg.mamba.key_multiplier

    def forward(self, hidden, cos, sin, kv_cache, plan, backend) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(self.layer_idx, q, k, v, kv_cache, plan, self.scale)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


class FalconH1Layer(BambaLayer):
    """A hybrid layer: mixer and attention in parallel, the multipliers of the module
    docstring."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__(cfg, layer_idx, dtype=dtype, device=device)
        self.mc = cfg.mamba

    def make_attention(self, cfg: ModelArchConfig, layer_idx: int, **kw):
        return FalconH1Attention(cfg, layer_idx, **kw)

    def mix(self, x, cos, sin, caches: Sequence, plans: Sequence, backend) -> torch.Tensor:
        mc = self.mc
        ssm = self.mamba(x, caches[0], plans[0])
        if mc.ssm_out_multiplier != 1.0:
            ssm = ssm * mc.ssm_out_multiplier
        if mc.attention_in_multiplier != 1.0:
            x = x * mc.attention_in_multiplier
        attn = self.self_attn(x, cos, sin, caches[1], plans[1], backend)
        if mc.attention_out_multiplier != 1.0:
            attn = attn * mc.attention_out_multiplier
        return ssm + attn

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        ff = self.feed_forward
        gate_mul, down_mul = self.mc.mlp_multipliers
        gate_up = ff.gate_up_proj(x)
        if gate_mul == 1.0:
            act = silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = up * F.silu(gate * gate_mul)
        out = ff.down_proj(act)
        return out if down_mul == 1.0 else out * down_mul


class FalconH1ForCausalLM(BambaForCausalLM):
    """Falcon-H1 (see the module docstring)."""

    layer_class = FalconH1Layer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        mul = self.config.mamba.embedding_multiplier
        return hidden if mul == 1.0 else hidden * mul

    def compute_logits(self, hidden: torch.Tensor, indices=None, *, widen: bool = True) -> torch.Tensor:
        """As the decoder's, times ``lm_head_multiplier`` (in the model dtype)."""
        logits = super().compute_logits(hidden, indices, widen=False)
        mul = self.config.mamba.lm_head_multiplier
        if mul != 1.0:
            logits = logits * mul
        return logits.to(torch.float32) if widen else logits


__all__ = ["FalconH1Attention", "FalconH1ForCausalLM", "FalconH1Layer"]
