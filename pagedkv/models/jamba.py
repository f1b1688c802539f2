"""Jamba: Mamba-1 mixer layers with attention every ``attn_layer_period``-th layer and
mixture-of-experts MLPs every ``expert_layer_period``-th layer, over the paged KV cache and
per-request state slots.

As transformers' ``JambaForCausalLM``: each layer computes ``h += mixer(input_norm(h))`` then
``h += ff(pre_ff_norm(h))``. The mixer is the layer's Mamba-1 mixer
(``mamba_mixer.MambaMixer``, ``model.layers.{i}.mamba``) or, on the attention layers
(``MambaConfig.layer_types``), attention without positional embeddings (:class:`JambaAttention`:
the decoder's q/k/v/o projections and paged attention, no RoPE, ``model.layers.{i}.self_attn``).
The feed-forward (``feed_forward``) is the sparse block (``moe.py``: softmax top-k, the top-k
probabilities not renormalized, in the model dtype; router ``feed_forward.router``) on the
layers ``MoeConfig.sparse_layers`` marks, else the SiLU-gated MLP. The final norm is
``model.final_layernorm``.

Engine interface: Bamba's (``bamba.BambaForCausalLM``): ``kv_cache_specs`` lists the cache
layers in layer order, a ``FullAttentionSpec`` per attention layer and a ``MambaSpec``
(``model.layers.{i}.mamba``: conv state ``(d_conv - 1, intermediate_size)`` in the model dtype,
SSM state ``(intermediate_size, d_state)`` float32) per mixer; ``forward`` takes
``kv_caches[k]`` and ``attn.plans[k]`` (the backend's plan, or a ``MambaMetadata``) per cache
layer. Checkpoints: ``save_pretrained``'s per-expert names or the stacked experts layout. Layers
stay eager (no compiled regions, no fused KV-write kernel).
"""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.attention.backend import AttentionBackend
from pagedkv.errors import ConfigError
from pagedkv.models.bamba import BambaForCausalLM, BambaLayer
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import Attention, DecoderForCausalLM
from pagedkv.models.layers import GatedMLP, RMSNorm
from pagedkv.models.mamba_mixer import MambaMixer
from pagedkv.models.moe import LAYOUTS, SparseMoeBlock


class JambaAttention(Attention):
    """The decoder's attention (fused q/k/v projection, ``o_proj``, the backend's paged
    attention, GQA) without RoPE: Jamba's attention layers see positions only through the
    mixers' recurrence."""

    def forward(self, hidden, cos, sin, kv_cache, plan, backend) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden)
        out = backend.forward(self.layer_idx, q, k, v, kv_cache, plan, self.scale)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


class JambaLayer(BambaLayer):
    """One layer: its token mixer (a Mamba-1 mixer or attention), the sparse block or the gated
    MLP, two norms (Bamba's layer otherwise: ``mix``, ``forward``)."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        nn.Module.__init__(self)
        mc, h, eps = cfg.mamba, cfg.hidden_size, cfg.rms_norm_eps
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(h, eps, **kw)
        self.pre_ff_layernorm = RMSNorm(h, eps, **kw)
        self.sparse = cfg.moe.sparse_layers[layer_idx]
        self.feed_forward = (SparseMoeBlock(h, cfg.moe, cfg.family, **kw) if self.sparse
                             else GatedMLP(h, cfg.intermediate_size, bias=False, **kw))
        self.mamba = MambaMixer(h, mc, eps, **kw) if mc.has_mixer(layer_idx) else None
        self.self_attn = (self.make_attention(cfg, layer_idx, **kw)
                          if mc.has_attention(layer_idx) else None)
        self.cache_kinds = tuple(k for k in ("mamba", "self_attn") if getattr(self, k) is not None)

    def make_attention(self, cfg: ModelArchConfig, layer_idx: int, **kw) -> nn.Module:
        return JambaAttention(cfg, layer_idx, **kw)

    def feed_forward_hf_entries(self, prefix: str, layout: str | None = None) -> dict:
        """The sparse block's tensors in ``layout`` (default per expert), or the gated MLP's
        (Bamba's layer names the rest: ``hf_entries``)."""
        if self.sparse:
            return self.feed_forward.hf_entries(prefix, layout or LAYOUTS[0])
        return super().feed_forward_hf_entries(prefix, layout)


class JambaForCausalLM(BambaForCausalLM):
    """Jamba (see the module docstring); Bamba's engine-facing interface with Jamba's layers,
    no RoPE, both MoE checkpoint layouts."""

    layer_class = JambaLayer

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if config.mamba is None or not config.mamba.mamba1 or config.moe is None:
            raise ConfigError(f"{config.architecture} needs a Mamba-1 mixer config (MambaConfig "
                              "variant 'jamba') and an MoE config")
        super().__init__(config, backend=backend, dtype=dtype, device=device)

    def _rope(self, positions: torch.Tensor, seq_lens: torch.Tensor | None):
        """No rotary embedding: the attention layers ignore ``cos``/``sin``."""
        return None, None

    # ---- weights
    def hf_weight_map(self, layout: str | None = None) -> dict:
        m = DecoderForCausalLM.hf_weight_map(self, layout)
        m["model.final_layernorm.weight"] = m.pop("model.norm.weight")
        return m

    def hf_weight_layouts(self) -> dict[str, dict]:
        """``per_expert`` (``save_pretrained``'s and the hub's names) and ``fused`` (stacked
        expert tensors), see ``pagedkv.models.moe``."""
        return {layout: self.hf_weight_map(layout) for layout in LAYOUTS}

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> "JambaForCausalLM":
        """As the decoder's (matrices and conv kernels ~ N(0, std), other vectors 1, biases 0),
        with the mixers' ``A_log`` and ``D`` as transformers initialises them."""
        super().init_random_weights(seed, std)
        for layer in self.layers:
            if layer.mamba is not None:
                layer.mamba.init_state_space()
        return self


__all__ = ["JambaAttention", "JambaForCausalLM", "JambaLayer"]
