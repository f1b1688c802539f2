"""Bamba: Mamba-2 mixer layers with full attention on a few layers, over the paged KV cache and
per-request state slots.

As transformers' ``BambaForCausalLM``: each layer computes ``h += mixer(input_norm(h))`` then
``h += mlp(pre_ff_norm(h))``, the mixer the layer's Mamba-2 mixer (``mamba2_mixer.Mamba2Mixer``,
``model.layers.{i}.mamba``) or, on ``attn_layer_indices``, attention (the decoder's
``Attention``, ``model.layers.{i}.self_attn``, RoPE on the first half of each head:
``MambaConfig.rotary_dim``). The MLP is the SiLU-gated one (``feed_forward``); the final norm
is ``model.final_layernorm``.

Engine interface: ``kv_cache_specs`` lists the cache layers in layer order, a
``FullAttentionSpec`` (``model.layers.{i}.self_attn``, KV in the model dtype) per attention
layer and a ``MambaSpec`` (``model.layers.{i}.mamba``: conv state ``(d_conv - 1, conv_dim)`` in
the model dtype, SSM state ``(num_heads, head_dim, d_state)`` float32) per mixer; ``forward``
takes ``kv_caches[k]`` (a KV tensor, or the ``(conv, ssm)`` state views of a state layer) and
``attn.plans[k]`` (the backend's plan, or the group's ``MambaMetadata``) per cache layer.
Falcon-H1 (``falcon_h1.py``) reuses the model with layers holding both a mixer and attention.
Layers stay eager (no compiled regions, no fused KV-write kernel).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from pagedkv.attention.backend import AttentionBackend, StepAttention
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import Attention, DecoderForCausalLM, attention_hf_entries
from pagedkv.models.eager_decoder import EagerLayers
from pagedkv.models.layers import GatedMLP, RMSNorm
from pagedkv.models.mamba2_mixer import Mamba2Mixer
from pagedkv.models.rotary import RotaryEmbedding


class BambaLayer(nn.Module):
    """One layer: its token mixer (a Mamba-2 mixer or attention), the gated MLP, two norms."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        mc, h, eps = cfg.mamba, cfg.hidden_size, cfg.rms_norm_eps
        kw = dict(dtype=dtype, device=device)
        self.input_layernorm = RMSNorm(h, eps, **kw)
        self.pre_ff_layernorm = RMSNorm(h, eps, **kw)
        self.feed_forward = GatedMLP(h, cfg.intermediate_size, bias=cfg.mlp_bias, **kw)
        self.mamba = Mamba2Mixer(h, mc, eps, **kw) if mc.has_mixer(layer_idx) else None
        self.self_attn = (self.make_attention(cfg, layer_idx, **kw)
                          if mc.has_attention(layer_idx) else None)
        # this layer's cache layers, in the order of its kv_caches / plans entries
        self.cache_kinds = tuple(k for k in ("mamba", "self_attn") if getattr(self, k) is not None)

    def make_attention(self, cfg: ModelArchConfig, layer_idx: int, **kw) -> nn.Module:
        return Attention(cfg, layer_idx, **kw)

    def mix(self, x, cos, sin, caches: Sequence, plans: Sequence, backend) -> torch.Tensor:
        """The token mixer's output for the normed input ``x``."""
        if self.mamba is not None:
            return self.mamba(x, caches[0], plans[0])
        return self.self_attn(x, cos, sin, caches[0], plans[0], backend)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.feed_forward(x)

    def forward(self, hidden, cos, sin, caches: Sequence, plans: Sequence,
                backend: AttentionBackend) -> torch.Tensor:
        hidden = hidden + self.mix(self.input_layernorm(hidden), cos, sin, caches, plans, backend)
        return hidden + self.mlp(self.pre_ff_layernorm(hidden))

    def hf_entries(self, prefix: str, layout: str | None = None) -> dict:
        """This layer's Hugging Face tensors (``prefix`` = ``model.layers.{i}.``; ``layout``:
        the checkpoint layout of the feed-forward, see :meth:`feed_forward_hf_entries`)."""
        m = {prefix + "input_layernorm.weight": (self.input_layernorm.weight, None),
             prefix + "pre_ff_layernorm.weight": (self.pre_ff_layernorm.weight, None)}
        m.update(self.feed_forward_hf_entries(prefix, layout))
        if self.mamba is not None:
            m.update(self.mamba.hf_entries(prefix + "mamba."))
        if self.self_attn is not None:
            m.update(attention_hf_entries(prefix, self.self_attn.qkv_proj, self.self_attn.o_proj))
        return m

    def feed_forward_hf_entries(self, prefix: str, layout: str | None = None) -> dict:
        """The gated MLP's tensors (``feed_forward.{gate,up,down}_proj``; one layout)."""
        return self.feed_forward.hf_entries(prefix + "feed_forward")


class BambaForCausalLM(EagerLayers, DecoderForCausalLM):
    """Bamba (see the module docstring); the engine-facing interface of
    :class:`DecoderForCausalLM` with state layers among its cache layers."""

    layer_class: type[BambaLayer] = BambaLayer

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        nn.Module.__init__(self)
        if config.mamba is None:
            raise ConfigError(f"{config.architecture} has no Mamba-2 mixer config")
        from pagedkv.attention.torch_ref import TorchRefBackend

        self.config = config
        self.dtype = dtype
        self.attn_backend = backend if backend is not None else TorchRefBackend()
        h, kw = config.hidden_size, dict(dtype=dtype, device=device)
        self.embed_tokens = nn.Parameter(torch.empty(config.vocab_size, h, **kw),
                                         requires_grad=False)
        self.layers = nn.ModuleList(self.layer_class(config, i, **kw)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps, **kw)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, h, **kw), requires_grad=False)
        self.rotary = RotaryEmbedding(config.mamba.rotary_dim, config.rope,
                                      config.max_position_embeddings, device=device)
        self.fuse_kv_write = False
        # (layer index, "mamba" | "self_attn") of each kv_caches / plans entry
        self.cache_layers = tuple((i, kind) for i, layer in enumerate(self.layers)
                                  for kind in layer.cache_kinds)
        # each layer's [start, end) of the kv_caches / plans entries
        ends = [0]
        for layer in self.layers:
            ends.append(ends[-1] + len(layer.cache_kinds))
        self._cache_slices = tuple(zip(ends[:-1], ends[1:]))

    # ---- the engine's interface
    def kv_cache_specs(self, block_size: int) -> dict:
        """The cache layers in order (see the module docstring). The ``MambaSpec``'s block
        size is whatever the engine makes of it: the mixers never read it."""
        from pagedkv.core.spec import FullAttentionSpec, MambaSpec

        cfg, mc, dtype = self.config, self.config.mamba, str(self.dtype).removeprefix("torch.")
        full = FullAttentionSpec(block_size=block_size, num_kv_heads=cfg.num_key_value_heads,
                                 head_size=cfg.head_dim, dtype=dtype)
        state = MambaSpec(block_size=block_size, shapes=(mc.conv_state_shape, mc.ssm_state_shape),
                          dtypes=(dtype, "float32"))
        return {f"model.layers.{i}.{kind}": state if kind == "mamba" else full
                for i, kind in self.cache_layers}

    def step_attention(self, attn) -> StepAttention:
        """The runner's :class:`StepAttention` (a plan per cache layer: the backend's for the
        attention layers, a ``MambaMetadata`` for the state layers); a bare metadata object
        cannot say where the states live."""
        if not isinstance(attn, StepAttention):
            raise InvalidRequestError(
                f"{self.config.architecture} needs a StepAttention with one plan per cache layer "
                f"(a MambaMetadata for each mixer), got {type(attn).__name__}")
        return attn

    def check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: Sequence) -> None:
        """Flat ``[T]`` ids and positions, one cache per cache layer."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise InvalidRequestError(
                f"input_ids and positions must both be flat [T] tensors, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
        if len(kv_caches) != len(self.cache_layers):
            raise InvalidRequestError(
                f"expected one cache per cache layer ({len(self.cache_layers)}: "
                f"kv_cache_specs), got {len(kv_caches)}")

    def allocate_kv_caches(self, num_blocks: int, block_size: int, *,
                           dtype: torch.dtype | None = None,
                           device: str | torch.device | None = None,
                           fill: float | None = 0.0) -> list:
        """Per cache layer, unshared (``allocate_layer_caches``): an attention layer's KV
        tensor ``[2, num_blocks, block_size, Hkv, D]``, a state layer's ``(conv [num_blocks,
        d_conv - 1, conv_dim], ssm [num_blocks, H, P, N] float32)``; the KV and the conv state
        in the model dtype."""
        return self.allocate_spec_caches(num_blocks, block_size, dtype=dtype, device=device,
                                         fill=fill)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: Sequence,
                attn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm (see the module docstring)."""
        return self.forward_layer_modules(input_ids, positions, kv_caches, attn)

    def layer_caches(self, i: int, kv_caches: Sequence, plans: Sequence) -> tuple:
        """Layer ``i``'s cache layers: its entries of ``kv_caches`` and ``plans``, in
        ``cache_kinds`` order."""
        a, b = self._cache_slices[i]
        return kv_caches[a:b], plans[a:b]

    # ---- weights
    def hf_weight_map(self, layout: str | None = None) -> dict:
        m = {"model.embed_tokens.weight": (self.embed_tokens, None),
             "model.final_layernorm.weight": (self.norm.weight, None)}
        if self.lm_head is not None:
            m["lm_head.weight"] = (self.lm_head, None)
        for i, layer in enumerate(self.layers):
            m.update(layer.hf_entries(f"model.layers.{i}.", layout))
        return m


__all__ = ["BambaForCausalLM", "BambaLayer"]
