"""DeepSeek-V3.2 (DeepSeek sparse attention, DSA) over the paged latent and indexer caches.

DeepSeek-V3 (``deepseek_v3.py``: its layers, MoE, RoPE, weights) with a lightning indexer in
every attention layer, as transformers' ``DeepseekV32ForCausalLM``:

* the indexer (:class:`Indexer`, ``IndexerConfig``): query heads ``wq_b(q_resid)`` from the
  query LoRA's latent ``q_resid = q_a_layernorm(q_a_proj(x))`` (``n_heads x head_dim``), one
  key ``k_norm(wk(x))`` per token (a LayerNorm with bias, eps 1e-6), RoPE with the model's
  cos/sin on the first ``qk_rope_head_dim`` dimensions of both, in halves (not interleaved,
  unlike the MLA rope parts), per-head weights ``weights_proj(x) * n_heads ** -0.5``
  (``weights_proj`` kept in float32, as transformers' ``_keep_in_fp32_modules``; its input is
  cast to float32); score of a cached position ``j`` for token ``t``: ``sum_h w[t, h]
  relu(head_dim ** -0.5 * q[t, h] . k_j)`` in float32;
* each token attends (MLA, ``kv_lora_rank`` latents) to the ``index_topk`` positions of its
  request with the best scores among its causal context (all of them when it has fewer): the
  top-k becomes flat slots of the latent cache through the sparse index translation, and the
  sparse attention reads exactly those rows (``pagedkv.attention.mla_sparse``).

Engine interface: two cache layers per attention layer, in this order, ``model.layers.{i}.
self_attn`` (the latent, ``MLAAttentionSpec(head_size=kv_lora_rank + qk_rope_head_dim)``) and
``model.layers.{i}.self_attn.indexer`` (the indexer keys, ``MLAAttentionSpec(head_size=
index_head_dim)``, the model's dtype). Both are per-token MLA-like specs that differ only in
head size, so the planner puts them in one KV-cache group of ``UniformTypeKVCacheSpecs``, as
vLLM does: one block table and one slot mapping serve the latent and the indexer channel (a
prefix hit, a preemption, a zeroed block covers both), each layer keeping its own tensor
(the shared allocator gives the two geometries byte slots; kernels read caches by strides).
The model takes each cache from ``kv_caches[k]`` and its plan from ``attn.plans[k]``, ``k``
the cache layer's position in ``kv_cache_specs``; the indexer reads its plan's metadata and
the attention its own, so the two would also work in separate groups. An engine's attention
backend becomes its DSA counterpart (``dsa_backend_for``).

Differences from DeepSeek's published inference code, matched to transformers (the parity
reference): the indexer keys are cached in the model's dtype (DeepSeek quantizes them to fp8
with per-block scales and applies a Hadamard rotation to q and k before scoring, an orthogonal
map that leaves the dot products unchanged); scores are computed in float32 (DeepSeek: fp8
products). Checkpoints: as DeepSeek-V3 (per-expert or stacked experts; the MTP layers are
skipped). Layers stay eager.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.backend import AttentionBackend
from pagedkv.attention.mla import allocate_mla_kv_caches
from pagedkv.attention.mla_sparse import DSABackend, dsa_backend_for
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.deepseek_v3 import DeepseekV3ForCausalLM, DeepseekV3Layer
from pagedkv.models.layers import Linear
from pagedkv.models.mla_attention import MLAttention
from pagedkv.models.rotary import apply_rotary

INDEXER_NORM_EPS = 1e-6  # transformers' DeepseekV32Indexer.k_norm


class Indexer(nn.Module):
    """The lightning indexer's projections (see the module docstring)."""

    def __init__(self, cfg: ModelArchConfig, *, dtype=None, device=None):
        super().__init__()
        x = cfg.indexer
        self.n_heads, self.head_dim, self.topk, self.rope_dim = x.n_heads, x.head_dim, x.topk, x.rope_dim
        self.scale = x.head_dim ** -0.5
        kw = dict(dtype=dtype, device=device)
        self.wq_b = Linear(cfg.mla.q_lora_rank, x.n_heads * x.head_dim, bias=False, **kw)
        self.wk = Linear(cfg.hidden_size, x.head_dim, bias=False, **kw)
        self.k_norm_weight = nn.Parameter(torch.empty(x.head_dim, **kw), requires_grad=False)
        self.k_norm_bias = nn.Parameter(torch.empty(x.head_dim, **kw), requires_grad=False)
        self.weights_proj = Linear(cfg.hidden_size, x.n_heads, bias=False,
                                   dtype=torch.float32, device=device)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rope_dim
        return torch.cat([apply_rotary(x[..., :r], cos, sin), x[..., r:]], dim=-1)

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, H, D], k [T, D], weights [T, H] float32)`` of ``x [T, hidden]`` and the
        query LoRA latent ``q_resid [T, q_lora_rank]``."""
        t = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), cos, sin)
        k = F.layer_norm(self.wk(x), (self.head_dim,), self.k_norm_weight, self.k_norm_bias,
                         INDEXER_NORM_EPS)
        k = self._rope(k.unsqueeze(1), cos, sin).squeeze(1)
        w = self.weights_proj(x.to(torch.float32)) * self.n_heads ** -0.5
        return q, k, w

    def hf_entries(self, prefix: str) -> dict:
        """``prefix`` = ``model.layers.{i}.self_attn.indexer.``"""
        m = {}
        for name in ("wq_b", "wk", "weights_proj"):
            m.update(getattr(self, name).hf_entries(prefix + name))
        m[prefix + "k_norm.weight"] = (self.k_norm_weight, None)
        m[prefix + "k_norm.bias"] = (self.k_norm_bias, None)
        return m


class DeepseekV32Attention(MLAttention):
    """DeepSeek-V3's latent attention with the indexer's top-k as each token's context."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__(cfg, layer_idx, dtype=dtype, device=device)
        self.indexer = Indexer(cfg, dtype=dtype, device=device)

    # called as topk_hook(layer_idx, topk_indices) with each forward pass's selection when set
    # (tests and step checks; see DeepseekV32ForCausalLM.topk_hook)
    topk_hook = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                caches: Sequence[torch.Tensor], plans: Sequence, backend: DSABackend) -> torch.Tensor:
        """``caches`` / ``plans``: (latent, indexer) cache and plan of this layer."""
        latent_cache, index_cache = caches
        plan, index_plan = plans
        q_resid = self.query_lora(x)
        q, latent = self.project(x, cos, sin, q_resid)
        iq, ik, iw = self.indexer.project(x, q_resid, cos, sin)
        idx = self.indexer
        topk = backend.index_topk(iq, iw, ik, index_cache, index_plan, idx.topk, idx.scale)
        if self.topk_hook is not None:
            self.topk_hook(self.layer_idx, topk)
        out = backend.forward(self.layer_idx, q, latent, latent_cache, plan, self.scale,
                              self.mla_weights, topk)
        return self.o_proj(out.reshape(x.shape[0], self.num_heads * self.v_head_dim))

    def hf_entries(self, prefix: str) -> dict:
        m = super().hf_entries(prefix)
        m.update(self.indexer.hf_entries(prefix + "indexer."))
        return m


class DeepseekV32Layer(DeepseekV3Layer):
    """DeepSeek-V3's layer with :class:`DeepseekV32Attention` (its cache and plan: pairs)."""

    attn_class = DeepseekV32Attention


class DeepseekV32ForCausalLM(DeepseekV3ForCausalLM):
    """DeepSeek-V3.2 (see the module docstring). ``topk_hook``: when set, called as
    ``topk_hook(layer_idx, topk_indices)`` with every layer's selection of every forward pass
    (tests and step checks; None in serving)."""

    layer_class = DeepseekV32Layer

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        if config.indexer is None:
            raise ConfigError(f"{config.architecture} needs an indexer config (index_n_heads, "
                              "index_head_dim, index_topk)")
        super().__init__(config, dtype=dtype, device=device)
        self.attn_backend = dsa_backend_for(backend) if backend is not None else DSABackend("ref")
        names = list(self.kv_cache_specs(16))
        self._cache_index = [(names.index(f"model.layers.{i}.self_attn"),
                              names.index(f"model.layers.{i}.self_attn.indexer"))
                             for i in range(len(self.layers))]

    @property
    def topk_hook(self):
        return self.layers[0].self_attn.topk_hook

    @topk_hook.setter
    def topk_hook(self, hook) -> None:
        for layer in self.layers:
            layer.self_attn.topk_hook = hook

    # ---- the engine's interface
    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Install ``backend``'s DeepSeek sparse attention counterpart (``dsa_backend_for``)."""
        self.attn_backend = dsa_backend_for(backend)

    def kv_cache_specs(self, block_size: int) -> dict:
        """Per attention layer ``i``: ``model.layers.{i}.self_attn`` (the latent) then
        ``model.layers.{i}.self_attn.indexer`` (the indexer keys), both ``MLAAttentionSpec``
        with one head, in the model's dtype."""
        from pagedkv.core.spec import MLAAttentionSpec

        dt = str(self.dtype).removeprefix("torch.")
        latent = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                  head_size=self.config.mla.latent_dim, dtype=dt)
        keys = MLAAttentionSpec(block_size=block_size, num_kv_heads=1,
                                head_size=self.config.indexer.head_dim, dtype=dt)
        out = {}
        for i in range(len(self.layers)):
            out[f"model.layers.{i}.self_attn"] = latent
            out[f"model.layers.{i}.self_attn.indexer"] = keys
        return out

    def allocate_kv_caches(self, num_blocks: int, block_size: int, *, dtype: torch.dtype | None = None,
                           device: str | torch.device | None = None,
                           fill: float | None = 0.0) -> list[torch.Tensor]:
        """One tensor per cache layer, in ``kv_cache_specs`` order (harnesses, profiling)."""
        n = len(self.layers)
        kw = dict(dtype=dtype or self.dtype, device=device or self.device, fill=fill)
        latents = allocate_mla_kv_caches(n, num_blocks, block_size, self.config.mla.latent_dim, **kw)
        keys = allocate_mla_kv_caches(n, num_blocks, block_size, self.config.indexer.head_dim, **kw)
        out: list = [None] * (2 * n)
        for i, (a, b) in enumerate(self._cache_index):
            out[a], out[b] = latents[i], keys[i]
        return out

    def check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: Sequence[torch.Tensor]) -> None:
        """As the decoder's, with two caches per layer (latent, indexer keys)."""
        if len(kv_caches) != 2 * len(self.layers):
            raise InvalidRequestError(
                f"expected two caches per layer (latent, indexer keys: {2 * len(self.layers)}), "
                f"got {len(kv_caches)}")
        super().check_inputs(input_ids, positions, kv_caches[: len(self.layers)])

    def layer_caches(self, i: int, kv_caches: Sequence[torch.Tensor], plans: Sequence) -> tuple:
        a, b = self._cache_index[i]
        return (kv_caches[a], kv_caches[b]), (plans[a], plans[b])


__all__ = ["DeepseekV32Attention", "DeepseekV32ForCausalLM", "DeepseekV32Layer", "Indexer"]
