"""Mixture-of-experts causal LMs on full (or sliding-window) attention: Qwen3-MoE and Mixtral.

The generic decoder's layers (``decoder.py``: attention with Qwen3's q/k norms where the family
has them, RMSNorms, RoPE, the fused q/k-norm + RoPE + KV-write path) with the sparse block
(``moe.py``) as the MLP of the layers ``MoeConfig.sparse_layers`` marks; the other layers keep
the dense gated MLP (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``). One model class
for both families: they differ only in their config (routing, checkpoint names).

Each layer computes ``hidden += attn(input_norm(hidden))`` then ``hidden += mlp(post_norm(
hidden))`` as transformers does. No compiled regions yet (the layers stay eager).

A tensor-parallel shard (``tp`` set, ``pagedkv.distributed.shard_moe``): the embedding and the
dense layers' regions as the dense decoder's shard (``tp.embed``, ``tp.regions``); a sparse
layer's :meth:`MoeDecoderLayer.post_moe` sums its row-parallel products over the ranks
(``reduce``): ``o_proj`` over the rank's heads, the block over the rank's columns of every
expert, each once, before the bias and the residual add.
"""

from __future__ import annotations

from functools import partial
from typing import Sequence

import torch

from pagedkv.attention.backend import AttentionBackend
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import (
    DecoderForCausalLM,
    DecoderLayer,
    _row_linear,
    attention_hf_entries,
    pre_attention,
    residual_add,
)
from pagedkv.models.layers import rms_norm
from pagedkv.models.moe import LAYOUTS, SparseMoeBlock
from pagedkv.models.rotary import tokens_seq_lens


class MoeDecoderLayer(DecoderLayer):
    """A decoder layer whose MLP is the sparse block (``self.mlp``: :class:`SparseMoeBlock`)."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__(cfg, layer_idx, dtype=dtype, device=device,
                         mlp=SparseMoeBlock(cfg.hidden_size, cfg.moe, cfg.family, dtype=dtype,
                                            device=device))

    def post_args(self) -> tuple:
        """The weights :meth:`post_moe` takes."""
        o, ln = self.self_attn.o_proj, self.post_attention_layernorm
        return (o.weight, o.bias, ln.weight, ln.eps)

    def post_moe(self, hidden, attn_out, o_weight, o_bias, ln_weight, eps, reduce=None):
        """``hidden += o_proj(attn_out)``, post-attention RMSNorm, the sparse block. Returns
        ``(hidden, moe_out)`` (the caller adds ``moe_out``, as after the dense MLP).

        ``reduce`` (a tensor-parallel shard's ``TPGroup.all_reduce``): ``o_proj`` and the
        block are row-parallel, their partial outputs summed over the ranks (``o_proj``'s
        before its bias)."""
        hidden = residual_add(hidden, _row_linear(attn_out.reshape(hidden.shape[0], -1),
                                                  o_weight, o_bias, reduce))
        out = self.mlp(rms_norm(hidden, ln_weight, eps))
        return hidden, out if reduce is None else reduce(out)

    def forward_split(self, hidden, delta, cos, sin, kv_cache, plan, backend,
                      pre=pre_attention, post=None, pre_qkv=None):
        """As the dense layer's, with ``post`` (:meth:`post_moe`'s signature; default
        :meth:`post_moe`) after attention."""
        return super().forward_split(hidden, delta, cos, sin, kv_cache, plan, backend, pre,
                                     self.post_moe if post is None else post, pre_qkv)

    def hf_entries(self, prefix: str, layout: str | None = None) -> dict:
        attn = self.self_attn
        m = {prefix + "input_layernorm.weight": (self.input_layernorm.weight, None),
             prefix + "post_attention_layernorm.weight": (self.post_attention_layernorm.weight, None)}
        m.update(attention_hf_entries(prefix, attn.qkv_proj, attn.o_proj, attn.q_norm, attn.k_norm))
        m.update(self.mlp.hf_entries(prefix, layout or LAYOUTS[0]))
        return m


class MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE / Mixtral over a paged KV cache; the engine-facing interface of
    :class:`DecoderForCausalLM` (KV specs per layer, plans, logits, weights, random init)."""

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if config.moe is None:
            raise ValueError(f"{config.architecture} has no mixture-of-experts config")
        super().__init__(config, backend=backend, dtype=dtype, device=device)

    def make_layer(self, config: ModelArchConfig, layer_idx: int, *, dtype, device):
        if config.moe.sparse_layers[layer_idx]:
            return MoeDecoderLayer(config, layer_idx, dtype=dtype, device=device)
        return DecoderLayer(config, layer_idx, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], attn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm (see ``DecoderForCausalLM``); the
        fused q/k-norm + RoPE + KV-write kernel when the backend allows it."""
        self.check_inputs(input_ids, positions, kv_caches)
        attn = self.step_attention(attn)
        seq_lens = tokens_seq_lens(attn.metadata, input_ids.shape[0]) if self.rotary.is_dynamic else None
        cos, sin = self._rope(positions, seq_lens)
        hidden = self.embed(input_ids)
        # the dense layers' regions (a shard's: with the all-reduces); a sparse layer's own
        # post_moe, with the shard's all-reduce
        pre, post, pre_qkv, _ = self._regions
        reduce = None if self.tp is None else self.tp.all_reduce
        if not self.fused_kv_write_usable(kv_caches[0]):
            pre_qkv = None
        delta = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            layer_post = post
            if isinstance(layer, MoeDecoderLayer):
                layer_post = layer.post_moe if reduce is None else partial(layer.post_moe,
                                                                           reduce=reduce)
            hidden, delta = layer.forward_split(hidden, delta, cos, sin, kv_cache, attn.plans[i],
                                                self.attn_backend, pre, layer_post, pre_qkv)
        return self.norm(residual_add(hidden, delta))

    def compile_regions(self, **kwargs) -> bool:
        """No compiled regions for the MoE models yet: the layers stay eager."""
        return False

    @property
    def compiled(self) -> bool:
        return False

    def hf_weight_layouts(self) -> dict[str, dict]:
        """``per_expert`` (``save_pretrained``'s and the hub's names) and ``fused``
        (transformers' stacked expert tensors), see ``pagedkv.models.moe``."""
        return {layout: self.hf_weight_map(layout) for layout in LAYOUTS}


__all__ = ["MoeDecoderLayer", "MoeForCausalLM"]
