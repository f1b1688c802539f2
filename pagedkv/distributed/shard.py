"""Cut a loaded ``DecoderForCausalLM`` (Llama / Qwen2 / Qwen3 / Mistral) into one rank's shard.

Megatron's layout over ``N`` ranks, rank ``r``:

* attention: query heads ``[r H/N, (r+1) H/N)`` (column-parallel rows of ``q_proj``; ``o_proj``
  row-parallel: the matching input columns); KV heads ``[r Hkv/N, ...)`` when ``N`` divides
  ``Hkv``, otherwise (``Hkv`` divides ``N``) each rank holds the one KV head its query heads
  read, replicated on ``N / Hkv`` ranks; the KV cache of a rank holds its KV heads only;
* MLP: intermediate columns ``[r I/N, (r+1) I/N)`` of gate and up (column-parallel),
  ``down_proj`` row-parallel;
* embedding and LM head: vocabulary rows ``[r V_l, (r+1) V_l)``, ``V_l = ceil(V / N)``, the
  last shard zero-padded (``TPGroup.embed`` / ``gather_vocab``);
* norms (and Qwen3's per-head q/k norms), biases of row-parallel layers: replicated (the bias
  is added once, after the sum);
* decode context parallelism (``dcp`` = M): the KV heads are split over ``N / M`` shards, a
  DCP group of M consecutive ranks sharing one (each rank stores its share of the tokens, see
  ``DCPGroup``); query heads stay split N ways.

Qwen3-MoE / Mixtral (``MoeForCausalLM``): every expert's intermediate columns split as the
MLP's, the router replicated (``pagedkv.distributed.shard_moe``).

The shard is a model of the input's class and the local sizes (``local_config``) with ``tp`` set:
the runner, the KV-cache specs and the kernels see an ordinary model with fewer heads.
``random_shard`` builds such a shard directly from a config with random weights (benchmarks by
shape: no whole model anywhere; not a cut of the one-process random model).
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv.distributed.shard_moe import (
    check_moe_tensor_parallel,
    local_moe_config,
    shard_sparse_block,
)
from pagedkv.errors import ConfigError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import DecoderForCausalLM
from pagedkv.models.moe import SparseMoeBlock
from pagedkv.models.moe_decoder import MoeForCausalLM


def check_tensor_parallel(config: ModelArchConfig, world_size: int, model_class=None,
                          dcp: int = 1) -> None:
    """Raise ``ConfigError`` unless ``world_size`` ranks (in DCP groups of ``dcp``) can split
    this model: a dense decoder (``DecoderForCausalLM`` itself), heads and MLP columns
    divisible, KV heads divisible by the ``world_size / dcp`` KV shards or dividing them."""
    if world_size == 1:
        return
    if model_class is None:
        from pagedkv.models.registry import get_model_class

        model_class = get_model_class(config.architecture)
    if model_class not in (DecoderForCausalLM, MoeForCausalLM):
        raise ConfigError(
            f"tensor_parallel_size={world_size}: {config.architecture} is not supported yet; "
            "tensor parallelism covers the dense decoder families (Llama, Qwen2, Qwen3, "
            "Mistral) and Qwen3-MoE / Mixtral")
    if model_class is MoeForCausalLM:  # the experts' columns
        check_moe_tensor_parallel(config, world_size)
    h, kv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if h % world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} must divide the number of "
                          f"attention heads ({h})")
    shards = world_size // dcp
    if kv % shards and shards % kv:
        what = (f"tensor_parallel_size={world_size}" if dcp == 1 else
                f"tensor_parallel_size / decode_context_parallel_size = {shards}")
        raise ConfigError(f"{what} and the number of KV heads ({kv}) must divide one another")
    if inter % world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} must divide the MLP's "
                          f"intermediate size ({inter})")


def local_kv_heads(config: ModelArchConfig, rank: int, world_size: int, dcp: int = 1) -> range:
    """The KV heads rank ``rank`` holds: the KV heads are split over ``world_size / dcp``
    shards (a DCP group of ``dcp`` consecutive ranks shares one shard: the heads its ranks'
    query heads read), or each shard holds the one head its query heads read (replicated)."""
    kv, shards, shard = config.num_key_value_heads, world_size // dcp, rank // dcp
    if kv >= shards:
        n = kv // shards
        return range(shard * n, (shard + 1) * n)
    head = shard * kv // shards
    return range(head, head + 1)


def local_config(config: ModelArchConfig, world_size: int, dcp: int = 1) -> ModelArchConfig:
    """The sizes of one rank's layers (the vocabulary is not changed: the shard replaces its
    embedding and LM head tensors)."""
    kv = config.num_key_value_heads
    return dataclasses.replace(
        config, num_attention_heads=config.num_attention_heads // world_size,
        num_key_value_heads=max(1, kv // (world_size // dcp)),
        intermediate_size=config.intermediate_size // world_size,
        moe=None if config.moe is None else local_moe_config(config.moe, world_size))


def vocab_rows_per_rank(vocab_size: int, world_size: int) -> int:
    """``V_l = ceil(V / N)``: the rows of every rank's embedding / LM head shard (the last
    shard's rows past ``V`` are zeros)."""
    return -(-vocab_size // world_size)


def _vocab_shard(full: torch.Tensor, rank: int, world_size: int, device) -> torch.Tensor:
    per = vocab_rows_per_rank(full.shape[0], world_size)
    out = torch.zeros(per, full.shape[1], dtype=full.dtype, device=device)
    rows = full[rank * per:(rank + 1) * per]
    out[:rows.shape[0]].copy_(rows)
    return out


@torch.no_grad()
def shard_decoder(model: DecoderForCausalLM, tp, *, device=None, dcp: int = 1) -> DecoderForCausalLM:
    """Rank ``tp.rank``'s shard of ``model`` (a loaded ``DecoderForCausalLM``, any device) on
    ``device`` (default: the model's), with ``tp`` (a ``TPGroup``) installed; ``dcp``: the
    decode-context-parallel group size (the KV heads of a group's shard on each of its ranks)."""
    cfg = model.config
    rank, world = tp.rank, tp.world_size
    check_tensor_parallel(cfg, world, type(model), dcp)
    device = torch.device(device) if device is not None else model.device
    local = type(model)(local_config(cfg, world, dcp), backend=model.attn_backend,
                        dtype=model.dtype, device="meta")
    d, hq = cfg.head_dim, cfg.num_attention_heads // world
    q_rows = slice(rank * hq * d, (rank + 1) * hq * d)
    kvh = local_kv_heads(cfg, rank, world, dcp)
    kv_rows = slice(kvh.start * d, kvh.stop * d)
    q_size, kv_size = cfg.q_size, cfg.kv_size
    inter = cfg.intermediate_size
    il = inter // world
    m_rows = slice(rank * il, (rank + 1) * il)

    def qkv_rows(t):
        q, k, v = t.split([q_size, kv_size, kv_size], dim=0)
        return torch.cat([q[q_rows], k[kv_rows], v[kv_rows]], dim=0)

    def gate_up_rows(t):
        g, u = t.split([inter, inter], dim=0)
        return torch.cat([g[m_rows], u[m_rows]], dim=0)

    def put(module, name, value):
        value = None if value is None else torch.nn.Parameter(
            value.to(device=device).contiguous().clone(), requires_grad=False)
        setattr(module, name, value)

    put(local, "embed_tokens", _vocab_shard(model.embed_tokens, rank, world, device))
    if model.lm_head is not None:
        put(local, "lm_head", _vocab_shard(model.lm_head, rank, world, device))
    put(local.norm, "weight", model.norm.weight)
    for src, dst in zip(model.layers, local.layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            put(getattr(dst, norm), "weight", getattr(src, norm).weight)
        a, b = src.self_attn, dst.self_attn
        put(b.qkv_proj, "weight", qkv_rows(a.qkv_proj.weight))
        put(b.qkv_proj, "bias", None if a.qkv_proj.bias is None else qkv_rows(a.qkv_proj.bias))
        put(b.o_proj, "weight", a.o_proj.weight[:, q_rows])
        put(b.o_proj, "bias", a.o_proj.bias)
        if a.q_norm is not None:
            put(b.q_norm, "weight", a.q_norm.weight)
            put(b.k_norm, "weight", a.k_norm.weight)
        if isinstance(src.mlp, SparseMoeBlock):  # MoeForCausalLM: every expert's columns
            shard_sparse_block(src.mlp, dst.mlp, rank, world, put)
            continue
        gu, dn = src.mlp.gate_up_proj, src.mlp.down_proj
        put(dst.mlp.gate_up_proj, "weight", gate_up_rows(gu.weight))
        put(dst.mlp.gate_up_proj, "bias", None if gu.bias is None else gate_up_rows(gu.bias))
        put(dst.mlp.down_proj, "weight", dn.weight[:, m_rows])
        put(dst.mlp.down_proj, "bias", dn.bias)
    return _finish_shard(local, tp, device, "shard_decoder")


def _finish_shard(local, tp, device, who: str):
    """A shard built on the meta device, its parameters set: its rotary tables (buffers)
    rebuilt on ``device``, nothing left on the meta device, ``tp`` installed, eval mode."""
    from pagedkv.models.rotary import RotaryEmbedding

    cfg = local.config
    local.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings,
                                   device=device)
    leftover = [n for n, p in list(local.named_parameters()) + list(local.named_buffers())
                if p.device.type == "meta"]
    if leftover:
        raise AssertionError(f"{who} left tensors unset: {leftover}")
    local.tp = tp
    return local.eval()


@torch.no_grad()
def random_shard(config: ModelArchConfig, tp, *, backend=None, dtype=torch.float32,
                 device="cpu", dcp: int = 1, seed: int = 0) -> DecoderForCausalLM:
    """Rank ``tp.rank``'s shard of a model of ``config`` built directly at the local sizes on
    ``device`` with deterministic random weights (``init_random_weights(seed)``; the vocabulary
    shards as ``shard_decoder``'s, ``vocab_rows_per_rank`` rows, the padding rows zero): what
    ``LLM.from_shape(..., tensor_parallel_size=N)`` runs, for throughput benchmarks, without
    ever building the whole model.

    Every rank draws the same values for the same parameter, so replicated tensors (norms,
    biases, the MoE router) agree across the ranks; but a shard is *not* a cut of the model
    ``init_random_weights(seed)`` gives one process (each rank draws its local tensors), so
    the tensor-parallel model's outputs differ from ``tensor_parallel_size=1``'s: the same
    sizes and work, another random function."""
    from pagedkv.models.registry import get_model_class

    cls = get_model_class(config.architecture)
    rank, world = tp.rank, tp.world_size
    check_tensor_parallel(config, world, cls, dcp)
    device = torch.device(device)
    local = cls(local_config(config, world, dcp), backend=backend, dtype=dtype, device="meta")
    local.to_empty(device=device)
    per = vocab_rows_per_rank(config.vocab_size, world)
    local.embed_tokens = torch.nn.Parameter(
        torch.empty(per, config.hidden_size, dtype=dtype, device=device), requires_grad=False)
    if local.lm_head is not None:
        local.lm_head = torch.nn.Parameter(torch.empty_like(local.embed_tokens),
                                           requires_grad=False)
    local = _finish_shard(local, tp, device, "random_shard")
    local.init_random_weights(seed).finish_loading()
    real = max(0, min(per, config.vocab_size - rank * per))  # rows below V
    local.embed_tokens[real:].zero_()
    if local.lm_head is not None:
        local.lm_head[real:].zero_()
    return local


__all__ = ["check_tensor_parallel", "local_config", "local_kv_heads", "random_shard",
           "shard_decoder", "vocab_rows_per_rank"]
