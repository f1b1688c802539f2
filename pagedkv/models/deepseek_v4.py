"""DeepSeek-V4 over its paged channels: sliding-window latent attention in every layer,
compressed sparse (CSA) and heavily compressed (HCA) attention, mHC residual streams,
hash-routed and top-k MoE, as transformers' ``DeepseekV4ForCausalLM``.

A layer (``Dsv4Layer``): ``post, comb, x = attn_hc(streams)``; ``streams = mix(streams,
attn(input_layernorm(x)), post, comb)``; the same with ``ffn_hc`` and the MLP
(``deepseek_v4_moe.Dsv4MoE``); the model collapses the streams (``hc_head``) before the final
norm (``hyper_connections``). Norm weights, mHC, sinks and position biases stay float32; the
weighted norms multiply in float32 and round once (``rms_norm_fp32``).

Attention (``Dsv4Attention``, config in ``Dsv4Config``): ``q_res = q_a_norm(q_a_proj(x))``,
``q = unweighted_rms_norm(q_b_proj(q_res))`` per head, ``kv = kv_norm(kv_proj(x))`` the one
key = value head; RoPE (interleaved pairs, ``apply_rotary_interleaved_tail``) on the last
``rope_dim`` dimensions, with the "main" RoPE in sliding layers and the "compress" one in CSA /
HCA layers; each query attends (``pagedkv.attention.dsv4``) to its window's latents and its
layer's compressed entries with the layer's sinks, scale ``head_dim ** -0.5``; the output's
rope part is rotated back, then the grouped output projection (``o_a_proj`` per group of
heads, ``o_b_proj``).

The compressor (``Compressor``) of a CSA / HCA layer with ratio C: every token stores
``[kv_proj(x) | gate_proj(x) + position_bias[p % C]]`` (float32) in its state channel; the
token closing a group (``(p + 1) % C == 0``) pools the group's rows, per channel a softmax
over the gates weighting the kvs -- HCA: the C tokens of the group; CSA (two series in one
projection, ``[a | b]`` halves): the previous group's ``a`` halves and this group's ``b``
halves, 2C rows, the previous group absent (``-inf``) for the first -- then ``kv_norm`` and
RoPE at the group's first position, and writes the entry into the compressed channel (only
closing tokens have a compressed slot). A query at ``p`` sees entries ``w < (p + 1) // C``:
all of them (HCA) or the ``index_topk`` best by the lightning indexer (``Indexer``, CSA: its
own compressor at ``index_head_dim``, queries ``q_b_proj(q_res)`` with the compress RoPE,
scores ``sum_h w_h relu(q_h . k) / sqrt(index_head_dim)`` with ``w = weights_proj(x) /
sqrt(index_n_heads)``; ``mla_sparse.indexer_topk``, shared with DeepSeek-V3.2).

Engine interface: per layer ``i`` the cache layers (``kv_cache_specs``, in this order)
``model.layers.{i}.self_attn`` (the sliding-window latent, ``SlidingWindowMLASpec``), and for
CSA / HCA layers ``...self_attn.compressor`` (entries, ``MLAAttentionSpec(compress_ratio=C)``,
block size ``lcm(block_size, C)``), ``...self_attn.compressor.state`` (the compressor state,
float32, ``SlidingWindowMLASpec`` with window C for HCA, 2C for CSA), and for CSA
``...self_attn.compressor.indexer`` and ``...self_attn.compressor.indexer.state`` (the
indexer's). The backend (``Dsv4Backend``) gives the runner the DeepSeek-V4 metadata builders of
those specs (compressed slot mappings, window slot lists, top-k translation); ``forward`` takes
``kv_caches[k]`` / ``attn.plans[k]`` per cache layer. ``topk_hook(layer_idx, topk)``: called
with every CSA layer's selection (tests and step checks). Checkpoints: ``save_pretrained``'s
names (DeepSeek's ``attn`` / ``ffn`` / ``wq_a`` ...), transformers' module names, or the hub's
(no ``model.`` prefix); the multi-token-prediction weights (``mtp.*``) are skipped. FP8 / FP4
hub weights are not supported. Layers stay eager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.backend import AttentionBackend, AttentionLayout, StepAttention
from pagedkv.attention.dsv4 import Dsv4Backend, dsv4_backend_for, gather_slots
from pagedkv.attention.kv_cache import allocate_layer_caches
from pagedkv.attention.mla_sparse import indexer_topk, token_rows
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import DecoderForCausalLM
from pagedkv.models.deepseek_v4_moe import Dsv4MoE
from pagedkv.models.hyper_connections import HyperConnection, HyperHead, mix_streams
from pagedkv.models.layers import Linear, rms_norm_fp32, unweighted_rms_norm
from pagedkv.models.rotary import RotaryEmbedding, apply_rotary_interleaved_tail

LAYOUTS = ("original", "fused", "hub")
# per cache layer of an attention layer: its name suffix after model.layers.{i}.self_attn
CHANNELS = {"swa": "", "comp": ".compressor", "comp_state": ".compressor.state",
            "idx": ".compressor.indexer", "idx_state": ".compressor.indexer.state"}


def _f32(*shape, device=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)


@dataclass
class Dsv4Step:
    """What every layer of one forward pass shares: token positions (int64) and request rows
    (int32, -1 for padding), the longest request, both RoPEs' cos/sin at the positions, the
    compress RoPE itself (for entry positions), the backend and the model's ``topk_hook``."""

    positions: torch.Tensor
    req: torch.Tensor
    max_seq_len: int
    main: tuple[torch.Tensor, torch.Tensor]
    compress: tuple[torch.Tensor, torch.Tensor]
    compress_rotary: RotaryEmbedding
    backend: Dsv4Backend
    topk_hook: object = None


class Compressor(nn.Module):
    """One compressor (a CSA / HCA layer's, or its indexer's), see the module docstring:
    ``kv_proj`` / ``gate_proj`` ``[series * head_dim, hidden]``, ``position_bias [C, series *
    head_dim]`` and ``kv_norm [head_dim]`` (float32); ``series`` 2 (overlapping windows, CSA)
    or 1 (HCA)."""

    def __init__(self, hidden: int, head_dim: int, ratio: int, overlap: bool, eps: float, *,
                 dtype=None, device=None):
        super().__init__()
        self.head_dim, self.ratio, self.overlap, self.eps = head_dim, ratio, overlap, eps
        self.series = 2 if overlap else 1
        width = self.series * head_dim
        self.kv_proj = Linear(hidden, width, bias=False, dtype=dtype, device=device)
        self.gate_proj = Linear(hidden, width, bias=False, dtype=dtype, device=device)
        self.position_bias = _f32(ratio, width, device=device)
        self.kv_norm = _f32(head_dim, device=device)

    @property
    def window(self) -> int:
        """Tokens a closing token pools: 2C with overlapping windows, else C."""
        return self.series * self.ratio

    @property
    def state_width(self) -> int:
        """Floats per token in the state channel: ``[kv | score]``."""
        return 2 * self.series * self.head_dim

    def update(self, x: torch.Tensor, step: Dsv4Step, state_cache: torch.Tensor, state_md,
               comp_cache: torch.Tensor, comp_md) -> None:
        """Store the step's state rows, then pool and write the entries of its closing tokens
        (``comp_md.compressed_slot_mapping >= 0``). ``state_md``: the state channel's
        ``SlidingWindowMLAMetadata`` (its window slot lists), ``comp_md`` the entries'
        ``CompressedMLAMetadata``."""
        backend, c, d = step.backend, self.ratio, self.head_dim
        slots = comp_md.compressed_slot_mapping
        n = slots.shape[0]
        pos = step.positions[:n]
        score = self.gate_proj(x[:n]).to(torch.float32) + self.position_bias[pos % c]
        backend.write(torch.cat((self.kv_proj(x[:n]).to(torch.float32), score), dim=-1),
                      state_cache, state_md.slot_mapping[:n])
        closing = torch.nonzero(slots >= 0).squeeze(1)
        if closing.numel() == 0:
            return
        # the window's slots right-aligned: column k holds position p - window + 1 + k
        win = self.window
        lens = state_md.swa_lens[closing].to(torch.int64)
        src = torch.arange(win, device=x.device)[None, :] - (win - lens)[:, None]
        idx = state_md.swa_indices[closing].gather(1, src.clamp(min=0))
        rows, ok = gather_slots(state_cache, idx, src >= 0)
        kv, gate = rows[..., : self.series * d], rows[..., self.series * d:]
        if self.overlap:  # the previous group's first halves, then this group's second halves
            kv = torch.cat((kv[:, :c, :d], kv[:, c:, d:]), dim=1)
            gate = torch.cat((gate[:, :c, :d], gate[:, c:, d:]), dim=1)
        gate = gate.masked_fill(~ok.unsqueeze(-1), float("-inf"))
        kv = kv.to(x.dtype)
        pooled = (kv * torch.softmax(gate, dim=1).to(x.dtype)).sum(dim=1)
        entry = rms_norm_fp32(pooled, self.kv_norm, self.eps)
        cos, sin = step.compress_rotary(pos[closing] // c * c)
        backend.write(apply_rotary_interleaved_tail(entry, cos, sin), comp_cache, slots[closing])

    def hf_entries(self, prefix: str) -> dict:
        """``prefix`` = ``...self_attn.compressor.`` (or ``...compressor.indexer.``), fused names."""
        m = self.kv_proj.hf_entries(prefix + "kv_proj")
        m.update(self.gate_proj.hf_entries(prefix + "gate_proj"))
        m[prefix + "position_bias"] = (self.position_bias, None)
        m[prefix + "kv_norm.weight"] = (self.kv_norm, None)
        return m


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer (see the module docstring)."""

    def __init__(self, cfg: ModelArchConfig, ratio: int, *, dtype=None, device=None):
        super().__init__()
        x = cfg.dsv4
        self.n_heads, self.head_dim, self.topk, self.ratio = (x.index_n_heads, x.index_head_dim,
                                                              x.index_topk, ratio)
        self.compressor = Compressor(cfg.hidden_size, x.index_head_dim, ratio, True,
                                     cfg.rms_norm_eps, dtype=dtype, device=device)
        self.q_b_proj = Linear(x.q_lora_rank, x.index_n_heads * x.index_head_dim, bias=False,
                               dtype=dtype, device=device)
        self.weights_proj = Linear(cfg.hidden_size, x.index_n_heads, bias=False, dtype=dtype,
                                   device=device)

    def select(self, x: torch.Tensor, q_res: torch.Tensor, step: Dsv4Step, caches: dict,
               plans: dict) -> torch.Tensor:
        """Update the indexer's channels, then each token's top-k entries (int32 ``[T, K]``,
        request-local entry indices, -1 = none) among ``w < (p + 1) // C``."""
        idx_md = plans["idx"].metadata
        self.compressor.update(x, step, caches["idx_state"], plans["idx_state"].metadata,
                               caches["idx"], idx_md)
        t = x.shape[0]
        q = self.q_b_proj(q_res).view(t, self.n_heads, self.head_dim)
        q = apply_rotary_interleaved_tail(q, *step.compress)
        w = self.weights_proj(x).to(torch.float32) * self.n_heads ** -0.5
        last = ((step.positions + 1) // self.ratio - 1).to(torch.int32)
        return indexer_topk(q, w, caches["idx"], idx_md.block_table, step.req, last,
                            step.max_seq_len // self.ratio, self.topk, self.head_dim ** -0.5,
                            step.backend.use_kernels(q))

    def hf_entries(self, prefix: str) -> dict:
        """``prefix`` = ``...self_attn.compressor.indexer.``, fused names."""
        m = self.compressor.hf_entries(prefix)
        m.update(self.q_b_proj.hf_entries(prefix + "q_b_proj"))
        m.update(self.weights_proj.hf_entries(prefix + "scorer.weights_proj"))
        return m


class Dsv4Attention(nn.Module):
    """One layer's attention (HF module ``model.layers.{i}.self_attn``)."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        x = cfg.dsv4
        h, n, d = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.layer_idx, self.num_heads, self.head_dim, self.eps = layer_idx, n, d, cfg.rms_norm_eps
        self.o_groups, self.scale = x.o_groups, d ** -0.5
        self.ratio = x.compress_ratios[layer_idx]
        self.csa = x.is_csa(layer_idx)
        kw = dict(dtype=dtype, device=device)
        self.q_a_proj = Linear(h, x.q_lora_rank, bias=False, **kw)
        self.q_a_norm = _f32(x.q_lora_rank, device=device)
        self.q_b_proj = Linear(x.q_lora_rank, n * d, bias=False, **kw)
        self.kv_proj = Linear(h, d, bias=False, **kw)
        self.kv_norm = _f32(d, device=device)
        # o_a_proj: per group g, rows [g * o_lora_rank, (g + 1) * o_lora_rank) map the group's
        # n * d / o_groups inputs
        self.o_a_proj = Linear(n * d // x.o_groups, x.o_groups * x.o_lora_rank, bias=False, **kw)
        self.o_b_proj = Linear(x.o_groups * x.o_lora_rank, h, bias=False, **kw)
        self.sinks = _f32(n, device=device)
        self.compressor = Compressor(h, d, self.ratio, self.csa, cfg.rms_norm_eps, **kw) \
            if self.ratio else None
        self.indexer = Indexer(cfg, self.ratio, **kw) if self.csa else None

    @property
    def channels(self) -> tuple[str, ...]:
        """This layer's cache layers (``CHANNELS`` keys), in ``kv_cache_specs`` order."""
        if self.csa:
            return tuple(CHANNELS)
        return ("swa", "comp", "comp_state") if self.ratio else ("swa",)

    def forward(self, x: torch.Tensor, step: Dsv4Step, caches: dict, plans: dict) -> torch.Tensor:
        t, backend = x.shape[0], step.backend
        cos, sin = step.compress if self.ratio else step.main
        q_res = rms_norm_fp32(self.q_a_proj(x), self.q_a_norm, self.eps)
        q = unweighted_rms_norm(self.q_b_proj(q_res).view(t, self.num_heads, self.head_dim),
                                self.eps)
        q = apply_rotary_interleaved_tail(q, cos, sin)
        kv = apply_rotary_interleaved_tail(rms_norm_fp32(self.kv_proj(x), self.kv_norm, self.eps),
                                           cos, sin)
        swa_md = plans["swa"].metadata
        backend.write(kv, caches["swa"], swa_md.slot_mapping)
        sources = [(caches["swa"], swa_md.swa_indices, swa_md.swa_lens)]
        if self.ratio:
            comp_md = plans["comp"].metadata
            self.compressor.update(x, step, caches["comp_state"], plans["comp_state"].metadata,
                                   caches["comp"], comp_md)
            if self.csa:
                local = self.indexer.select(x, q_res, step, caches, plans)
                if step.topk_hook is not None:
                    step.topk_hook(self.layer_idx, local)
            else:  # every closed group of the token's request
                entries = torch.arange(step.max_seq_len // self.ratio, device=x.device,
                                       dtype=torch.int32)
                bound = (step.positions + 1) // self.ratio
                local = torch.where(entries[None, :] < bound[:, None], entries[None, :], -1)
            if local.shape[1]:  # no request has closed a group yet: no entry to read
                slots, lens = comp_md.topk_to_global(step.req, local)
                sources.append((caches["comp"], slots, lens))
        out = backend.attend(q, sources, self.sinks, self.scale)
        out = apply_rotary_interleaved_tail(out, cos, -sin)
        grouped = out.reshape(t, self.o_groups, -1).transpose(0, 1)  # [G, T, n * d / G]
        w = self.o_a_proj.weight.view(self.o_groups, -1, grouped.shape[-1])
        mixed = torch.bmm(grouped, w.transpose(1, 2)).transpose(0, 1).reshape(t, -1)
        return self.o_b_proj(mixed)

    def hf_entries(self, prefix: str) -> dict:
        """``prefix`` = ``model.layers.{i}.self_attn.``, fused names."""
        m = {}
        for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"):
            m.update(getattr(self, name).hf_entries(prefix + name))
        m[prefix + "q_a_norm.weight"] = (self.q_a_norm, None)
        m[prefix + "kv_norm.weight"] = (self.kv_norm, None)
        m[prefix + "sinks"] = (self.sinks, None)
        if self.compressor is not None:
            m.update(self.compressor.hf_entries(prefix + "compressor."))
        if self.indexer is not None:
            m.update(self.indexer.hf_entries(prefix + "compressor.indexer."))
        return m


class Dsv4Layer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        x, h, eps = cfg.dsv4, cfg.hidden_size, cfg.rms_norm_eps
        self.eps = eps
        hc = dict(hc_mult=x.hc_mult, hidden_size=h, sinkhorn_iters=x.hc_sinkhorn_iters,
                  hc_eps=x.hc_eps, norm_eps=eps, device=device)
        self.attn_hc, self.ffn_hc = HyperConnection(**hc), HyperConnection(**hc)
        self.input_layernorm = _f32(h, device=device)
        self.post_attention_layernorm = _f32(h, device=device)
        self.self_attn = Dsv4Attention(cfg, layer_idx, dtype=dtype, device=device)
        self.mlp = Dsv4MoE(h, cfg.vocab_size, cfg.moe, x, layer_idx, dtype=dtype, device=device)

    def forward(self, streams: torch.Tensor, input_ids: torch.Tensor, step: Dsv4Step,
                caches: dict, plans: dict) -> torch.Tensor:
        post, comb, x = self.attn_hc(streams)
        out = self.self_attn(rms_norm_fp32(x, self.input_layernorm, self.eps), step, caches, plans)
        streams = mix_streams(streams, out, post, comb)
        post, comb, x = self.ffn_hc(streams)
        out = self.mlp(rms_norm_fp32(x, self.post_attention_layernorm, self.eps), input_ids)
        return mix_streams(streams, out, post, comb)

    def hf_entries(self, prefix: str, layout: str) -> dict:
        """``prefix`` = ``model.layers.{i}.``, fused names (experts in ``layout``)."""
        m = {prefix + "input_layernorm.weight": (self.input_layernorm, None),
             prefix + "post_attention_layernorm.weight": (self.post_attention_layernorm, None)}
        for site in ("attn_hc", "ffn_hc"):
            mod = getattr(self, site)
            for name in ("fn", "base", "scale"):
                m[f"{prefix}{site}.{name}"] = (getattr(mod, name), None)
        m.update(self.self_attn.hf_entries(prefix + "self_attn."))
        m.update(self.mlp.hf_entries(prefix, "fused" if layout == "fused" else "original"))
        return m


# transformers' module names -> DeepSeek's (save_pretrained's "original" layout): the leaf
# (first component) of a name below self_attn / compressor / indexer
_ORIGINAL_LEAVES = {"q_a_proj": "wq_a", "q_a_norm": "q_norm", "q_b_proj": "wq_b",
                    "kv_proj": "wkv", "gate_proj": "wgate", "kv_norm": "norm",
                    "position_bias": "ape", "o_a_proj": "wo_a", "o_b_proj": "wo_b",
                    "sinks": "attn_sink"}
_ORIGINAL_LAYER = {"input_layernorm.": "attn_norm.", "post_attention_layernorm.": "ffn_norm.",
                   "attn_hc.": "hc_attn_", "ffn_hc.": "hc_ffn_"}


def _leaf(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return _ORIGINAL_LEAVES.get(head, head) + ("." + tail if tail else "")


def original_name(name: str) -> str:
    """A fused (transformers module) tensor name as ``save_pretrained`` writes it (DeepSeek's
    names); expert tensors are named by ``Dsv4MoE.hf_entries`` itself."""
    if name == "lm_head.weight":
        return "head.weight"
    if not name.startswith("model.layers."):
        return name
    parts = name.split(".", 3)  # model, layers, i, rest
    prefix, rest = ".".join(parts[:3]) + ".", parts[3]
    for fused, orig in _ORIGINAL_LAYER.items():
        if rest.startswith(fused):
            return prefix + orig + rest[len(fused):]
    if not rest.startswith("self_attn."):
        return name
    rest = rest[len("self_attn."):]
    if rest.startswith("compressor.indexer."):
        sub = rest[len("compressor.indexer."):]
        if sub.startswith("scorer.weights_proj."):
            return prefix + "attn.indexer.weights_proj." + sub[len("scorer.weights_proj."):]
        if sub.startswith("q_b_proj."):
            return prefix + "attn.indexer.wq_b." + sub[len("q_b_proj."):]
        return prefix + "attn.indexer.compressor." + _leaf(sub)
    if rest.startswith("compressor."):
        return prefix + "attn.compressor." + _leaf(rest[len("compressor."):])
    return prefix + "attn." + _leaf(rest)


def hub_name(original: str) -> str:
    """A ``save_pretrained`` name as DeepSeek's hub checkpoints spell it (no ``model.``
    prefix; ``embed``, ``hc_head_fn`` ...)."""
    name = original.removeprefix("model.")
    return {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn",
            "hc_head.hc_base": "hc_head_base", "hc_head.hc_scale": "hc_head_scale"}.get(name, name)


class DeepseekV4ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V4 (see the module docstring); the engine-facing interface of
    :class:`DecoderForCausalLM` (logits, device, weights)."""

    def __init__(self, config: ModelArchConfig, *, backend: AttentionBackend | None = None,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        nn.Module.__init__(self)
        if config.dsv4 is None or config.moe is None:
            raise ConfigError(f"{config.architecture} needs a DeepSeek-V4 config (Dsv4Config)")
        x = config.dsv4
        self.config, self.dtype = config, dtype
        self.attn_backend = dsv4_backend_for(backend) if backend is not None else Dsv4Backend("ref")
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(Dsv4Layer(config, i, dtype=dtype, device=device)
                                    for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(x.hc_mult, h, x.hc_eps, config.rms_norm_eps, device=device)
        self.norm = _f32(h, device=device)
        self.lm_head = None if config.tie_word_embeddings else nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False)
        mp = config.max_position_embeddings
        self.rotary = RotaryEmbedding(x.rope_dim, config.rope, mp, device=device)
        self.compress_rotary = RotaryEmbedding(x.rope_dim, x.compress_rope, mp, device=device)
        self.fuse_kv_write = False
        # when set, called as topk_hook(layer_idx, topk) with every CSA layer's selection
        # (request-local entries, -1 = none) of every forward pass (tests and step checks)
        self.topk_hook = None
        names = list(self.kv_cache_specs(16))
        self._cache_index = [
            {ch: names.index(f"model.layers.{i}.self_attn{CHANNELS[ch]}")
             for ch in layer.self_attn.channels}
            for i, layer in enumerate(self.layers)]

    # ---- the engine's interface
    def set_attention_backend(self, backend: AttentionBackend) -> None:
        """Install ``backend``'s DeepSeek-V4 counterpart (``dsv4_backend_for``)."""
        self.attn_backend = dsv4_backend_for(backend)

    def kv_cache_specs(self, block_size: int) -> dict:
        """The cache layers in order (the module docstring): latents and entries in the
        model's dtype, compressor states in float32."""
        from pagedkv.core.spec import MLAAttentionSpec, SlidingWindowMLASpec

        cfg, x = self.config, self.config.dsv4
        dt = str(self.dtype).removeprefix("torch.")
        d, di = cfg.head_dim, x.index_head_dim
        out = {}
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            p = f"model.layers.{i}.self_attn"
            out[p] = SlidingWindowMLASpec(block_size=block_size, num_kv_heads=1, head_size=d,
                                          dtype=dt, sliding_window=x.sliding_window)
            if not a.ratio:
                continue
            bc = math.lcm(block_size, a.ratio)
            comps = [("comp", a.compressor, d)] + ([("idx", a.indexer.compressor, di)] if a.csa else [])
            for ch, comp, width in comps:
                out[p + CHANNELS[ch]] = MLAAttentionSpec(
                    block_size=bc, num_kv_heads=1, head_size=width, dtype=dt,
                    compress_ratio=a.ratio)
                out[p + CHANNELS[ch + "_state"]] = SlidingWindowMLASpec(
                    block_size=block_size, num_kv_heads=1, head_size=comp.state_width,
                    dtype="float32", sliding_window=comp.window)
        return out

    def attention_layout(self, spec=None) -> AttentionLayout:
        """A cache layer's layout: the query heads over its one vector per token or state."""
        cfg = self.config
        if spec is None:
            return AttentionLayout(cfg.num_attention_heads, 1, cfg.head_dim, self.dtype, self.device,
                                   sliding_window=cfg.dsv4.sliding_window)
        return AttentionLayout(cfg.num_attention_heads, 1, spec.head_size,
                               getattr(torch, spec.dtype), self.device,
                               sliding_window=getattr(spec, "sliding_window", None))

    def allocate_kv_caches(self, num_blocks: int, block_size: int, *,
                           dtype: torch.dtype | None = None,
                           device: str | torch.device | None = None,
                           fill: float | None = 0.0) -> list:
        """One unshared tensor per cache layer, ``[num_blocks, states per block, width]`` in
        its spec's dtype (harnesses, profiling; the engine's runner shares one pool)."""
        if dtype is not None and dtype != self.dtype:
            raise ConfigError(f"DeepSeek-V4 keeps its caches in the model dtype ({self.dtype}) "
                              f"and float32, got dtype={dtype}")
        return allocate_layer_caches(self.kv_cache_specs(block_size).values(), num_blocks,
                                     device=device or self.device, fill=fill)

    def compile_regions(self, **kwargs) -> bool:
        """No compiled regions for DeepSeek-V4 yet: the layers stay eager."""
        return False

    def check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: Sequence) -> None:
        """As the decoder's, with one cache per cache layer (``kv_cache_specs``)."""
        want = sum(len(c) for c in self._cache_index)
        if len(kv_caches) != want:
            raise InvalidRequestError(f"expected one cache per cache layer ({want}, see "
                                      f"kv_cache_specs), got {len(kv_caches)}")
        super().check_inputs(input_ids, positions, kv_caches[: len(self.layers)])

    def step_attention(self, attn, kv_caches: Sequence | None = None) -> StepAttention:
        """The runner's :class:`StepAttention` as it is. A bare metadata object (profiling)
        serves only a step that writes nothing (every slot -1): each cache layer's plan is
        then its builder's metadata of that one table."""
        if isinstance(attn, StepAttention):
            return attn
        n = int(attn.num_actual_tokens)
        if kv_caches is None or bool((attn.slot_mapping[:n] >= 0).any()):
            raise InvalidRequestError(
                "DeepSeek-V4 needs a StepAttention with one plan per cache layer (its channels "
                "have their own block tables); a bare metadata serves only a profile step that "
                "writes no slot")
        specs = self.kv_cache_specs(kv_caches[0].shape[1])
        plans, built = [], {}
        for spec in specs.values():
            if spec not in built:
                cls = self.attn_backend.metadata_builder_for(spec)
                b = cls(spec, (), self.device, int(attn.num_reqs), attn.block_table_tensor.shape[1])
                built[spec] = self.attn_backend.plan(b.build(attn), self.attention_layout(spec))
            plans.append(built[spec])
        return StepAttention(attn, plans)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: Sequence[torch.Tensor], attn) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm (see the module docstring)."""
        self.check_inputs(input_ids, positions, kv_caches)
        attn = self.step_attention(attn, kv_caches)
        t = input_ids.shape[0]
        positions = positions.to(torch.int64)
        req, _ = token_rows(attn.metadata, t)
        step = Dsv4Step(positions, req, int(attn.metadata.max_seq_len), self.rotary(positions),
                        self.compress_rotary(positions), self.compress_rotary, self.attn_backend,
                        self.topk_hook)
        hidden = F.embedding(input_ids, self.embed_tokens)
        streams = hidden.unsqueeze(1).expand(t, self.config.dsv4.hc_mult, hidden.shape[-1]).contiguous()
        for layer, index in zip(self.layers, self._cache_index):
            caches = {ch: kv_caches[k] for ch, k in index.items()}
            plans = {ch: attn.plans[k] for ch, k in index.items()}
            streams = layer(streams, input_ids, step, caches, plans)
        return rms_norm_fp32(self.hc_head(streams), self.norm, self.config.rms_norm_eps)

    # ---- weights
    def hf_weight_map(self, layout: str | None = None) -> dict:
        """The tensors of ``layout``: ``original`` (``save_pretrained``'s DeepSeek names, the
        default), ``fused`` (transformers' module names, stacked experts) or ``hub``
        (``original`` without the ``model.`` prefix)."""
        layout = layout or LAYOUTS[0]
        if layout not in LAYOUTS:
            raise ConfigError(f"unknown DeepSeek-V4 layout {layout!r}; one of {LAYOUTS}")
        m = {"model.embed_tokens.weight": (self.embed_tokens, None),
             "model.norm.weight": (self.norm, None),
             "model.hc_head.hc_fn": (self.hc_head.hc_fn, None),
             "model.hc_head.hc_base": (self.hc_head.hc_base, None),
             "model.hc_head.hc_scale": (self.hc_head.hc_scale, None)}
        if self.lm_head is not None:
            m["lm_head.weight"] = (self.lm_head, None)
        for i, layer in enumerate(self.layers):
            m.update(layer.hf_entries(f"model.layers.{i}.", layout))
        if layout == "fused":
            return m
        # the experts are already named by the MoE block; everything else is renamed
        out = {(k if ".ffn." in k else original_name(k)): v for k, v in m.items()}
        if layout == "hub":
            out = {hub_name(k): v for k, v in out.items()}
        return out

    def hf_weight_layouts(self) -> dict[str, dict]:
        return {layout: self.hf_weight_map(layout) for layout in LAYOUTS}

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> "DeepseekV4ForCausalLM":
        """As the decoder's (matrices ~ N(0, std), vectors 1), then transformers' init of
        what is not a plain weight: sinks, position biases, mHC bases and the router bias 0,
        mHC scales 1, and hash tables drawn from the seed (k distinct experts per token)."""
        super().init_random_weights(seed, std)
        for i, layer in enumerate(self.layers):
            layer.self_attn.sinks.zero_()
            for comp in (layer.self_attn.compressor,
                         getattr(layer.self_attn.indexer, "compressor", None)):
                if comp is not None:
                    comp.position_bias.zero_()
            for hc in (layer.attn_hc, layer.ffn_hc):
                hc.base.zero_()
            mlp = layer.mlp
            if mlp.is_hash:
                gen = torch.Generator().manual_seed(seed * 100003 + 7919 + i)
                ids = torch.rand(mlp.tid2eid.shape[0], mlp.num_experts, generator=gen)
                mlp.tid2eid.copy_(ids.argsort(dim=-1)[:, : mlp.top_k])
            else:
                mlp.e_score_correction_bias.zero_()
        self.hc_head.hc_base.zero_()
        return self


__all__ = ["CHANNELS", "Compressor", "DeepseekV4ForCausalLM", "Dsv4Attention", "Dsv4Layer",
           "Dsv4Step", "Indexer", "hub_name", "original_name"]
