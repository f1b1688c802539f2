"""Model architecture config: what pagedkv needs to know about a checkpoint's ``config.json``.

``ModelArchConfig.from_dict`` parses and validates a Hugging Face ``config.json`` of one of the
supported decoder-only families (Llama, Qwen2, Qwen3, Mistral, Gemma 2/3, the
mixture-of-experts Qwen3-MoE and Mixtral, DeepSeek-V3 with multi-head latent attention and
DeepSeek-V3.2 with its lightning indexer)
into one frozen dataclass. The family decides the defaults of absent keys (as transformers
does) and the structural flags of the generic decoder (q/k/v bias, o_proj bias, q/k RMSNorm);
an MoE family adds its routing (``MoeConfig``), DeepSeek-V3 its latent attention
(``MlaConfig``).

``shape_config(name)`` returns the config of a well-known model shape (``"qwen3-0.6b"``,
``"llama-3.2-1b"`` ...) for benchmarks with random weights.

No torch import: the engine's control plane may read these values.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any

from pagedkv.errors import ConfigError, UnsupportedArchitectureError

# --------------------------------------------------------------------------------------------
# Families


@dataclass(frozen=True)
class _Family:
    name: str
    # Defaults transformers' config classes use when config.json lacks the key.
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | None
    head_dim: int | None  # None: hidden_size // num_attention_heads
    # Which projections carry a bias: "attention_bias" (read the key), True or False.
    qkv_bias: str | bool
    o_bias: str | bool
    mlp_bias: str | bool
    qk_norm: bool
    # How a sliding window is switched on: "mistral" (sliding_window alone), "qwen"
    # (use_sliding_window + max_window_layers / layer_types), "gemma" (layer_types, default
    # every ``sliding_pattern``-th layer full), None (never).
    sliding: str | None
    # Gemma 2 / 3 (0 for the others): (1 + w) RMSNorms in float32, sandwich norms around
    # attention and MLP, GeGLU, embeddings scaled by sqrt(hidden), query_pre_attn_scalar,
    # logit soft-capping; Gemma 3: q/k norms and a local RoPE base for sliding layers.
    gemma: int = 0
    sliding_pattern: int = 0
    # mixture of experts: "qwen3_moe", "mixtral" or "deepseek_v3" (how config.json names and
    # routes the experts, see _parse_moe), None for dense families
    moe: str | None = None
    # multi-head latent attention (DeepSeek-V3, see _parse_mla)
    mla: bool = False
    # DeepSeek sparse attention: the lightning indexer beside MLA (DeepSeek-V3.2, see
    # _parse_indexer)
    indexer: bool = False
    # Gated-DeltaNet linear attention beside gated full attention (Qwen3-Next, see
    # _parse_linear_attn)
    linear_attn: bool = False
    # Mamba-2 mixers beside (Bamba) or in parallel with (Falcon-H1) attention: "bamba" or
    # "falcon_h1" (see _parse_mamba)
    mamba: str | None = None
    # attention sinks: a learned logit per query head in every attention layer's softmax
    # (GPT-OSS)
    attn_sinks: bool = False
    # DeepSeek-V4: sliding-window + compressed (CSA / HCA) attention, mHC, hash / top-k MoE
    # (Dsv4Config, see _parse_deepseek_v4)
    dsv4: bool = False
    # the sliding window of a "gemma" / "qwen_moe" family when config.json has none
    default_window: int = 4096
    # Cohere2: the parallel block with LayerNorm, RoPE (interleaved pairs) on the sliding
    # layers only, logits scaled (CohereConfig)
    cohere: bool = False


FAMILIES: dict[str, _Family] = {
    "LlamaForCausalLM": _Family(
        name="llama",
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        head_dim=None,
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias="mlp_bias",
        qk_norm=False,
        sliding=None,
    ),
    "MistralForCausalLM": _Family(
        name="mistral",
        max_position_embeddings=4096 * 32,
        bos_token_id=1,
        eos_token_id=2,
        head_dim=None,
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding="mistral",
    ),
    "Qwen2ForCausalLM": _Family(
        name="qwen2",
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        head_dim=None,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        qk_norm=False,
        sliding="qwen",
    ),
    "Qwen3ForCausalLM": _Family(
        name="qwen3",
        max_position_embeddings=32768,
        bos_token_id=None,
        eos_token_id=None,
        head_dim=128,
        qkv_bias="attention_bias",
        o_bias="attention_bias",
        mlp_bias=False,
        qk_norm=True,
        sliding="qwen",
    ),
}

FAMILIES["Gemma2ForCausalLM"] = _Family(
    name="gemma2", max_position_embeddings=8192, bos_token_id=2, eos_token_id=1, head_dim=256,
    qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=False,
    sliding="gemma", gemma=2, sliding_pattern=2)
FAMILIES["Gemma3ForCausalLM"] = _Family(
    name="gemma3", max_position_embeddings=131072, bos_token_id=2, eos_token_id=1, head_dim=256,
    qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False, qk_norm=True,
    sliding="gemma", gemma=3, sliding_pattern=6)

# Qwen3-MoE: Qwen3's attention (q/k norms; head_dim defaults to hidden / heads, Qwen3MoeConfig
# has no head_dim default); use_sliding_window puts sliding_window on every layer.
FAMILIES["Qwen3MoeForCausalLM"] = _Family(
    name="qwen3_moe", max_position_embeddings=32768, bos_token_id=None, eos_token_id=None,
    head_dim=None, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    qk_norm=True, sliding="qwen_moe", moe="qwen3_moe")
# Mixtral: Mistral's attention (sliding_window, when set, on every layer)
FAMILIES["MixtralForCausalLM"] = _Family(
    name="mixtral", max_position_embeddings=4096 * 32, bos_token_id=1, eos_token_id=2,
    head_dim=None, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
    sliding="mistral", moe="mixtral")
# GPT-OSS: sliding-window and full attention alternating (layer_types, default window 128),
# attention sinks, biases on q/k/v/o (attention_bias), YaRN RoPE; every layer MoE: a router
# with a bias, the top-k logits then a softmax over them, experts with biases, gate/up rows
# interleaved, the clamped SwiGLU (MoeConfig)
FAMILIES["GptOssForCausalLM"] = _Family(
    name="gpt_oss", max_position_embeddings=131072, bos_token_id=None, eos_token_id=None,
    head_dim=64, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    qk_norm=False, sliding="gemma", sliding_pattern=2, moe="gpt_oss", attn_sinks=True,
    default_window=128)
# Cohere2 (Command R7B / A): three sliding-window layers to one full-attention layer
# (layer_types or sliding_window_pattern 4), RoPE only on the sliding ones, in interleaved
# pairs; each layer h + attn(LN(h)) + mlp(LN(h)) on one weight-only LayerNorm; logits times
# logit_scale; embeddings tied by default (CohereConfig)
FAMILIES["Cohere2ForCausalLM"] = _Family(
    name="cohere2", max_position_embeddings=8192, bos_token_id=5, eos_token_id=255001,
    head_dim=None, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    qk_norm=False, sliding="gemma", sliding_pattern=4, cohere=True)

# DeepSeek-V3: multi-head latent attention (MlaConfig), first_k_dense_replace dense layers,
# then sigmoid-scored group-limited routing with shared experts; attention_bias on q_a_proj,
# kv_a_proj_with_mqa and o_proj
FAMILIES["DeepseekV3ForCausalLM"] = _Family(
    name="deepseek_v3", max_position_embeddings=4096, bos_token_id=0, eos_token_id=1,
    head_dim=None, qkv_bias=False, o_bias="attention_bias", mlp_bias=False, qk_norm=False,
    sliding=None, moe="deepseek_v3", mla=True)

# Qwen3-Next: Gated-DeltaNet linear-attention layers beside gated full-attention layers
# (layer_types), (1 + w) RMSNorms, q/k norms, partial RoPE, softmax top-k experts with a gated
# shared expert (LinearAttnConfig, MoeConfig)
FAMILIES["Qwen3NextForCausalLM"] = _Family(
    name="qwen3_next", max_position_embeddings=32768, bos_token_id=None, eos_token_id=None,
    head_dim=256, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False,
    qk_norm=True, sliding=None, moe="qwen3_next", linear_attn=True)

# DeepSeek-V3.2 (DSA): DeepSeek-V3 (MLA with q LoRA, always interleaved RoPE pairs; the same
# MoE) plus the lightning indexer in every attention layer (IndexerConfig); mlp_layer_types,
# when given, says which layers are sparse
FAMILIES["DeepseekV32ForCausalLM"] = _Family(
    name="deepseek_v32", max_position_embeddings=163840, bos_token_id=0, eos_token_id=1,
    head_dim=None, qkv_bias=False, o_bias="attention_bias", mlp_bias=False, qk_norm=False,
    sliding=None, moe="deepseek_v3", mla=True, indexer=True)

# Bamba: Mamba-2 mixer layers, full attention on attn_layer_indices (RoPE on half of each
# head); Falcon-H1: a Mamba-2 mixer and attention in parallel in every layer, muP multipliers
# (MambaConfig)
FAMILIES["BambaForCausalLM"] = _Family(
    name="bamba", max_position_embeddings=262144, bos_token_id=1, eos_token_id=2,
    head_dim=None, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    qk_norm=False, sliding=None, mamba="bamba")
FAMILIES["FalconH1ForCausalLM"] = _Family(
    name="falcon_h1", max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
    head_dim=None, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias",
    qk_norm=False, sliding=None, mamba="falcon_h1")
# Jamba: Mamba-1 mixer layers, attention (no RoPE) every attn_layer_period-th layer, softmax
# top-k experts every expert_layer_period-th layer (MambaConfig variant "jamba", MoeConfig)
FAMILIES["JambaForCausalLM"] = _Family(
    name="jamba", max_position_embeddings=262144, bos_token_id=1, eos_token_id=2,
    head_dim=None, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding=None,
    moe="jamba", mamba="jamba")
# DeepSeek-V4: every layer a sliding-window latent attention, plus compressed sparse attention
# (ratio 4, indexer top-k) or heavily compressed attention (ratio 128) on layer_types;
# manifold-constrained hyper-connections; hash-routed then top-k MoE (Dsv4Config, MoeConfig)
FAMILIES["DeepseekV4ForCausalLM"] = _Family(
    name="deepseek_v4", max_position_embeddings=1048576, bos_token_id=0, eos_token_id=1,
    head_dim=512, qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False, sliding=None,
    moe="deepseek_v4", dsv4=True)

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(FAMILIES)


@dataclass(frozen=True)
class MoeConfig:
    """The sparse MLP of a mixture-of-experts family, as transformers' modeling code runs it.

    Router: ``logits = x W_gate^T`` (model dtype), ``softmax`` in float32, ``top_k`` experts;
    with ``norm_topk_prob`` the top-k probabilities are renormalized to sum to 1. The weights
    of the weighted sum are cast to the model dtype (``weights_dtype == "model"``, Qwen3-MoE)
    or kept in float32 (``"float32"``, Mixtral). Experts are SiLU-gated MLPs of
    ``intermediate_size``. ``sparse_layers[i]``: layer ``i`` has the sparse block (else the
    dense MLP of ``ModelArchConfig.intermediate_size``).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    weights_dtype: str  # "model" | "float32"
    sparse_layers: tuple[bool, ...]
    # DeepSeek-V3 routing (``scoring == "sigmoid"``): the router runs in float32, scores are
    # ``sigmoid(logits)``; the experts are chosen on ``scores + e_score_correction_bias``
    # (``score_correction_bias``) within the ``topk_group`` best of ``n_group`` groups (a
    # group's score: the sum of its two best), weighted by their plain scores (renormalized
    # with ``norm_topk_prob``) times ``routed_scaling_factor``. ``shared_intermediate_size``
    # (``n_shared_experts * moe_intermediate_size``): the shared experts, one dense gated MLP
    # added to the routed output (0: none).
    scoring: str = "softmax"  # "softmax" | "sigmoid"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    score_correction_bias: bool = False
    shared_intermediate_size: int = 0
    # Qwen3-Next: the shared expert's output is scaled by ``sigmoid(x W_g^T)`` (``W_g [1, H]``,
    # ``shared_expert_gate``) before it is added
    shared_expert_gate: bool = False
    # GPT-OSS (``scoring == "topk_softmax"``): the router has a bias (``router_bias``), takes
    # the top-k logits and softmaxes over those k, in the model dtype; the experts have biases
    # (``expert_bias``) and the clamped SwiGLU (``activation == "swiglu_clamp"``:
    # ``(clamp(up, -limit, limit) + 1) * g sigmoid(alpha g)``, ``g = min(gate, limit)``)
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"  # "silu" | "swiglu_clamp" | "silu_clamp" (DeepSeek-V4)
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @property
    def num_sparse_layers(self) -> int:
        return sum(self.sparse_layers)


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3), as transformers' ``DeepseekV3Attention``.

    Queries: ``q_b_proj(q_a_layernorm(q_a_proj(x)))`` (``q_lora_rank``) or ``q_proj(x)``
    (``q_lora_rank`` None), per head ``[qk_nope_head_dim | qk_rope_head_dim]``. Keys and
    values: ``kv_a_proj_with_mqa(x) = [c | k_pe]`` (``kv_lora_rank | qk_rope_head_dim``), the
    latent ``c`` RMS-normed (``kv_a_layernorm``), ``k_pe`` one rotary head shared by every
    head; ``kv_b_proj(c)`` gives per head ``[k_nope (qk_nope_head_dim) | v (v_head_dim)]``.
    RoPE covers the rope parts only (``rope_interleave``: their dimensions come in interleaved
    pairs). The KV cache stores one latent vector per token: ``[c | k_pe]``, ``latent_dim``
    wide. The two RMSNorms use eps 1e-6 (transformers' default; not ``rms_norm_eps``).
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    attention_bias: bool  # q_a_proj (q_proj has none), kv_a_proj_with_mqa, o_proj
    norm_eps: float = 1e-6

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of one cached latent vector: ``kv_lora_rank + qk_rope_head_dim``."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class IndexerConfig:
    """The lightning indexer of DeepSeek sparse attention (DeepSeek-V3.2), as transformers'
    ``DeepseekV32Indexer``: ``n_heads`` query heads of ``head_dim`` from the query LoRA
    (``wq_b``), one key of ``head_dim`` per token (``wk``, LayerNorm ``k_norm``), per-head
    weights ``weights_proj(x)``; RoPE (halves, not interleaved) on the first ``rope_dim``
    (``qk_rope_head_dim``) dimensions of queries and keys. Each token attends to the ``topk``
    cached positions of its request with the highest ``sum_h w_h relu(q_h . k)``."""

    n_heads: int
    head_dim: int
    topk: int
    rope_dim: int


DSV4_LAYER_TYPES = ("sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention")
DSV4_MLP_LAYER_TYPES = ("hash_moe", "moe")
DSV4_SCORING = ("sqrtsoftplus", "sigmoid")


@dataclass(frozen=True)
class Dsv4Config:
    """DeepSeek-V4's layers, as transformers' ``DeepseekV4ForCausalLM`` runs them.

    Attention (every layer): queries ``q_b_proj(q_a_norm(q_a_proj(x)))`` per head (``head_dim``
    wide, an unweighted RMSNorm per head), one shared key = value head ``kv_norm(kv_proj(x))``;
    RoPE (interleaved pairs) on the last ``rope_dim`` dimensions of both, and undone on the
    output (rotation by ``-position``); learned sinks; the grouped output projection
    (``o_groups`` groups of heads each to ``o_lora_rank``, then ``o_b_proj``). Each query sees
    the last ``sliding_window`` keys and, by ``layer_types[i]``:

    * ``sliding_attention``: nothing else (RoPE ``ModelArchConfig.rope``, the "main" one);
    * ``compressed_sparse_attention`` (CSA, ratio ``compress_ratios[i]``, 4): compressed entries,
      one per closed group of ratio tokens (a softmax-gated pool over two overlapping windows:
      the previous group's first half-channels and this group's second half), of which the
      lightning indexer (``index_n_heads`` heads of ``index_head_dim`` over its own compressed
      keys) keeps ``index_topk`` per query;
    * ``heavily_compressed_attention`` (HCA, ratio 128): every compressed entry (one window).

    Compressed layers rotate with ``compress_rope`` (theta ``compress_rope_theta``, YaRN when
    configured), entries at the position of their group's first token. ``hc_mult`` residual
    streams (mHC) around attention and MLP (``hc_sinkhorn_iters`` Sinkhorn steps, ``hc_eps``).
    MLP: the routed experts of ``mlp_layer_types[i]`` (``hash_moe``: a fixed ``tid2eid`` token
    -> experts table; ``moe``: top-k on ``score + e_score_correction_bias``), scores
    ``scoring_func`` of the router logits, weights normalized then times
    ``routed_scaling_factor`` (``MoeConfig``), SwiGLU clamped at ``swiglu_limit``, plus one
    shared expert."""

    layer_types: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # per layer: 0 (sliding only) or the compress ratio
    sliding_window: int
    q_lora_rank: int
    rope_dim: int
    compress_rope: RopeConfig
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    scoring_func: str
    swiglu_limit: float

    def is_csa(self, layer: int) -> bool:
        return self.layer_types[layer] == "compressed_sparse_attention"

    def is_hash(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "hash_moe"


@dataclass(frozen=True)
class LinearAttnConfig:
    """Qwen3-Next's hybrid layout, as transformers' ``Qwen3NextGatedDeltaNet`` and
    ``Qwen3NextAttention`` run it.

    ``layer_types[i]``: ``"linear_attention"`` (a Gated-DeltaNet mixer, ``linear_attn``) or
    ``"full_attention"`` (gated attention, ``self_attn``). The mixer: ``in_proj_qkvz`` gives per
    key head ``[q (K) | k (K) | v (HV/HK * V) | z (HV/HK * V)]``, ``in_proj_ba`` per key head
    ``[b (HV/HK) | a (HV/HK)]``; a causal depthwise conv1d of ``conv_kernel_dim`` over
    ``[q | k | v]`` (``conv_dim`` channels, SiLU), the gated delta rule with L2-normed q/k
    (``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)``), an RMSNorm of each value
    head times ``silu(z)``, ``out_proj``. Full attention: ``q_proj`` gives per head ``[q | gate]``
    (the output is multiplied by ``sigmoid(gate)`` before ``o_proj``); RoPE covers the first
    ``rotary_dim`` (``head_dim * partial_rotary_factor``) dimensions of each head."""

    layer_types: tuple[str, ...]
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel_dim: int
    rotary_dim: int

    @property
    def key_dim(self) -> int:
        return self.num_key_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: ``[q | k | v]``."""
        return 2 * self.key_dim + self.value_dim

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

@dataclass(frozen=True)
class MambaConfig:
    """The Mamba-2 mixers of a hybrid family (Bamba, Falcon-H1) and what the family adds
    around them, as transformers' ``BambaMixer`` / ``FalconH1Mixer`` and their decoder layers
    run them.

    ``layer_types[i]``: ``"mamba"`` (a mixer, ``model.layers.{i}.mamba``), ``"attention"``
    (``self_attn``: Bamba's ``attn_layer_indices``) or ``"hybrid"`` (both on the same normed
    input, outputs added: every Falcon-H1 layer). The mixer: ``in_proj`` gives ``[z | x | B |
    C | dt]`` (``intermediate_size``, ``intermediate_size``, ``n_groups * d_state`` twice,
    ``num_heads``); a causal depthwise conv1d of width ``d_conv`` with SiLU over ``[x | B | C]``
    (``conv_dim`` channels); the SSD recurrence per head (``num_heads`` heads of ``head_dim``,
    state ``[head_dim, d_state]``, ``A = -exp(A_log)``, ``dt' = softplus(dt + dt_bias)``
    clamped to ``time_step_limit`` in prefill, unclamped in decode steps as transformers runs
    them, skip ``D``); the gate: ``gated_norm`` an RMSNorm over each of ``n_groups`` groups
    with weight ``w``, of ``y * silu(z)`` (Bamba; Falcon-H1 without ``norm_before_gate``) or
    ``RMSNorm(y) * w * silu(z)`` (``norm_before_gate``), else plain ``y * silu(z)``
    (Falcon-H1 without ``mamba_rms_norm``); ``out_proj``. Per-request states: conv
    ``(d_conv - 1, conv_dim)``, SSM ``(num_heads, head_dim, d_state)``.

    Falcon-H1's muP multipliers (all 1 for Bamba) scale the embeddings, the logits, the
    attention input and output and its keys (before RoPE), the mixer input and output, the five
    parts of ``in_proj``'s output (``ssm_multipliers``) and the MLP's gate and output
    (``mlp_multipliers``). RoPE covers the first ``rotary_dim`` dimensions of each attention
    head (Bamba: half the head, as transformers hard-codes it).

    Jamba (``variant == "jamba"``, :attr:`mamba1`) has Mamba-1 mixers, as transformers'
    ``JambaMambaMixer``: ``in_proj`` gives ``[x | z]`` (``intermediate_size`` each); the conv1d
    (SiLU) over ``x`` alone (``conv_dim = intermediate_size``); ``x_proj(x) = [dt (dt_rank) |
    B (d_state) | C (d_state)]``, each RMS-normed (``dt_layernorm``, ``b_layernorm``,
    ``c_layernorm``, the model's ``rms_norm_eps``), ``dt = dt_proj.weight @ dt`` with
    ``dt_proj.bias`` as the bias of the softplus; the selective scan with ``A = -exp(A_log)``
    per channel and state entry (``[intermediate_size, d_state]``), ``y * silu(z)``, no norm
    (``gated_norm`` false), no clamp; ``out_proj``; ``mamba_proj_bias`` on both projections,
    attention without RoPE (``rotary_dim`` 0). In the Mamba-2 vocabulary each channel is a head
    of ``head_dim`` 1 and ``B``/``C`` one group (``num_heads = intermediate_size``,
    ``n_groups = 1``). Per-request states: conv ``(d_conv - 1, intermediate_size)``, SSM
    ``(intermediate_size, d_state)`` (the ``selective_scan`` kernel's layout)."""

    variant: str  # "bamba" | "falcon_h1" | "jamba" (Mamba-1, see ``mamba1``)
    layer_types: tuple[str, ...]
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    intermediate_size: int
    conv_bias: bool
    in_proj_bias: bool
    out_proj_bias: bool
    rotary_dim: int
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    gated_norm: bool = True
    norm_before_gate: bool = False
    embedding_multiplier: float = 1.0
    lm_head_multiplier: float = 1.0
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    ssm_in_multiplier: float = 1.0
    ssm_out_multiplier: float = 1.0
    ssm_multipliers: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)  # z, x, B, C, dt
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)  # gate, down
    dt_rank: int = 0  # Mamba-1 (Jamba): the rank of the dt projection (x_proj -> dt_proj)

    @property
    def mamba1(self) -> bool:
        """Mamba-1 mixers (Jamba), see the class docstring; else Mamba-2."""
        return self.variant == "jamba"

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: ``[x | B | C]`` (Mamba-1: ``x``)."""
        if self.mamba1:
            return self.intermediate_size
        return self.intermediate_size + 2 * self.n_groups * self.d_state

    @property
    def in_proj_size(self) -> int:
        if self.mamba1:  # [x | z]
            return 2 * self.intermediate_size
        return self.intermediate_size + self.conv_dim + self.num_heads

    @property
    def conv_state_shape(self) -> tuple[int, int]:
        return (self.d_conv - 1, self.conv_dim)

    @property
    def ssm_state_shape(self) -> tuple[int, ...]:
        if self.mamba1:
            return (self.intermediate_size, self.d_state)
        return (self.num_heads, self.head_dim, self.d_state)

    def has_mixer(self, layer: int) -> bool:
        return self.layer_types[layer] != "attention"

    def has_attention(self, layer: int) -> bool:
        return self.layer_types[layer] != "mamba"

    def mixer_parameters(self, hidden_size: int) -> int:
        p, c, inter = self.in_proj_size, self.conv_dim, self.intermediate_size
        if self.mamba1:  # + x_proj, dt_proj (+ bias), A_log, D, the dt / B / C norms
            r, n = self.dt_rank, self.d_state
            return (hidden_size * p + (p if self.in_proj_bias else 0) + c * self.d_conv
                    + (c if self.conv_bias else 0) + inter * (r + 2 * n) + r * inter + inter
                    + inter * n + inter + r + 2 * n + inter * hidden_size
                    + (hidden_size if self.out_proj_bias else 0))
        return (hidden_size * p + (p if self.in_proj_bias else 0) + c * self.d_conv
                + (c if self.conv_bias else 0) + 3 * self.num_heads
                + (inter if self.gated_norm else 0) + inter * hidden_size
                + (hidden_size if self.out_proj_bias else 0))

# --------------------------------------------------------------------------------------------
# RoPE

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

_DTYPE_ALIASES = {
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def normalize_dtype_name(name: Any, *, what: str = "dtype") -> str:
    """Map ``"bf16"``, ``"torch.bfloat16"``, ``"half"`` ... to ``"bfloat16"``/``"float16"``/``"float32"``."""
    if not isinstance(name, str):
        name = str(name)
    key = name.strip().lower().removeprefix("torch.")
    try:
        return _DTYPE_ALIASES[key]
    except KeyError:
        raise ConfigError(
            f"{what} {name!r} is not supported; use one of float32, bfloat16, float16 "
            f"(aliases fp32, bf16, fp16, half)"
        ) from None


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters, in transformers 5.x's ``rope_parameters`` vocabulary.

    ``rope_type``: default | linear | dynamic | llama3 | yarn. ``factor`` is the scaling factor
    (1.0 for default). The other fields only matter for the types that read them.
    """

    rope_type: str = "default"
    rope_theta: float = 10000.0
    factor: float = 1.0
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    # llama3 and yarn: pretraining context length
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def _parse_rope(d: dict, max_position_embeddings: int) -> RopeConfig:
    """Read RoPE parameters from both layouts: 5.x ``rope_parameters`` and 4.x ``rope_theta`` +
    ``rope_scaling`` (with ``type`` or ``rope_type``). ``rope_scaling`` wins when both are set, as
    in transformers."""
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError(
            f"config.json: rope_parameters/rope_scaling must be an object, got {params!r}"
        )
    params = dict(params)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"config.json: rope type {rope_type!r} is not supported; supported rope types: "
            f"{', '.join(ROPE_TYPES)}"
        )
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise ConfigError(f"config.json: rope_theta must be a positive number, got {theta!r}")
    partial = params.get("partial_rotary_factor", d.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ConfigError(
            f"config.json: partial_rotary_factor={partial!r} is not supported by these families "
            f"(rotary embedding covers the whole head); remove it or set it to 1.0"
        )

    def num(key: str, *, required: bool = False, positive: bool = True) -> float | None:
        v = params.get(key)
        if v is None:
            if required:
                raise ConfigError(
                    f"config.json: rope type {rope_type!r} needs {key!r} in rope_parameters"
                )
            return None
        if not isinstance(v, (int, float)) or isinstance(v, bool) or (positive and v <= 0):
            raise ConfigError(
                f"config.json: rope_parameters[{key!r}] must be a positive number, got {v!r}"
            )
        return float(v)

    original = params.get("original_max_position_embeddings")
    if original is None and rope_type in ("llama3", "yarn"):
        original = d.get("original_max_position_embeddings", max_position_embeddings)
    if original is not None:
        if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
            raise ConfigError(
                "config.json: original_max_position_embeddings must be a positive integer, "
                f"got {original!r}"
            )

    if rope_type == "default":
        return RopeConfig(rope_theta=float(theta))
    if rope_type in ("linear", "dynamic"):
        return RopeConfig(rope_type=rope_type, rope_theta=float(theta), factor=num("factor", required=True))
    if rope_type == "llama3":
        low = num("low_freq_factor", required=True)
        high = num("high_freq_factor", required=True)
        if high <= low:
            raise ConfigError(
                f"config.json: llama3 rope needs high_freq_factor > low_freq_factor, got "
                f"high={high} low={low}"
            )
        return RopeConfig(
            rope_type="llama3",
            rope_theta=float(theta),
            factor=num("factor", required=True),
            low_freq_factor=low,
            high_freq_factor=high,
            original_max_position_embeddings=original,
        )
    # yarn
    factor = num("factor")
    if factor is None:
        factor = max_position_embeddings / original
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ConfigError(f"config.json: rope_parameters['truncate'] must be a bool, got {truncate!r}")
    return RopeConfig(
        rope_type="yarn",
        rope_theta=float(theta),
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=num("attention_factor"),
        beta_fast=num("beta_fast"),
        beta_slow=num("beta_slow"),
        mscale=num("mscale", positive=False),
        mscale_all_dim=num("mscale_all_dim", positive=False),
        truncate=truncate,
    )


# --------------------------------------------------------------------------------------------
# The config


@dataclass(frozen=True)
class ModelArchConfig:
    """Validated architecture of one supported checkpoint (see ``from_dict``)."""

    architecture: str
    family: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    dtype: str  # checkpoint dtype: float32 | bfloat16 | float16
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None = None
    hidden_act: str = "silu"
    # per layer: its sliding window W (a query at p sees keys p - W < k <= p), None = full
    layer_windows: tuple[int | None, ...] = ()
    # Gemma 2 / 3 only (see _Family.gemma): 2 or 3, else 0
    gemma: int = 0
    attn_scale: float | None = None  # softmax scale (default head_dim ** -0.5)
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    embed_scale: float | None = None  # embeddings times this (sqrt(hidden))
    local_rope: "RopeConfig | None" = None  # RoPE of the sliding-window layers (Gemma 3)
    moe: MoeConfig | None = None  # mixture-of-experts families only
    # DeepSeek-V3 only: the latent attention. Its layers cache one latent "KV head": then
    # ``num_key_value_heads`` is 1 and ``head_dim`` the latent width (``mla.latent_dim``), the
    # head of the KV cache (the query/key head is ``mla.qk_head_dim``); ``attn_scale`` the
    # softmax scale (``qk_head_dim ** -0.5``, times YaRN's ``mscale_all_dim`` factor squared)
    mla: MlaConfig | None = None
    # DeepSeek-V3.2 only: the lightning indexer (its key cache is a second cache layer per
    # attention layer)
    indexer: IndexerConfig | None = None
    # Qwen3-Next only: linear-attention (Gated-DeltaNet) layers beside gated full attention
    linear_attn: LinearAttnConfig | None = None
    # Bamba / Falcon-H1 only: the Mamba-2 mixers and the family's multipliers
    mamba: MambaConfig | None = None
    # Cohere2 only: its LayerNorm's eps and the logit scale
    cohere: "CohereConfig | None" = None
    # GPT-OSS: every attention layer has sinks (``self_attn.sinks [num_attention_heads]``)
    attn_sinks: bool = False
    # DeepSeek-V4 only: its attention kinds, mHC and routing (``num_key_value_heads`` 1, the
    # shared key = value head of ``head_dim``; ``rope`` the sliding layers' RoPE)
    dsv4: Dsv4Config | None = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    # ---- derived sizes
    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_id(self) -> int | None:
        """The first eos id (``eos_token_ids`` has all of them)."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def max_trained_len(self) -> int:
        """The longest context the model was trained (or RoPE-scaled) for, as vLLM derives it:
        ``max_position_embeddings``, times the RoPE ``factor`` for linear and dynamic scaling;
        yarn: ``original_max_position_embeddings * factor``; llama3 scaling is already counted in
        ``max_position_embeddings``."""
        rope = self.rope
        if rope.rope_type in ("linear", "dynamic") and rope.factor:
            return int(self.max_position_embeddings * rope.factor)
        if rope.rope_type == "yarn" and rope.factor:
            base = rope.original_max_position_embeddings or self.max_position_embeddings
            return int(base * rope.factor)
        return self.max_position_embeddings

    def kv_cache_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V (MLA: of the one latent vector), all layers, for one token."""
        if self.dsv4 is not None:  # what grows with the context: the compressed entries
            x = self.dsv4
            per = sum(self.head_dim / c + (x.index_head_dim / c if x.is_csa(i) else 0)
                      for i, c in enumerate(x.compress_ratios) if c)
            return int(per * dtype_bytes)
        if self.mla is not None:
            per_layer = self.mla.latent_dim + (self.indexer.head_dim if self.indexer else 0)
            return self.num_hidden_layers * per_layer * dtype_bytes
        return 2 * self.num_hidden_layers * self.kv_size * dtype_bytes

    def _mla_attention_parameters(self) -> int:
        m, h, n = self.mla, self.hidden_size, self.num_attention_heads
        q = (h * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * n * m.qk_head_dim
             if m.q_lora_rank is not None else h * n * m.qk_head_dim)
        kv = h * m.latent_dim + m.kv_lora_rank + m.kv_lora_rank * n * (m.qk_nope_head_dim + m.v_head_dim)
        bias = (m.q_lora_rank or 0) + m.latent_dim + h if m.attention_bias else 0
        return q + kv + n * m.v_head_dim * h + bias

    def num_parameters(self) -> int:
        """Parameter count (tied embeddings counted once)."""
        if self.dsv4 is not None:
            return _dsv4_parameters(self)
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.qkv_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.o_bias:
            attn += h
        if self.mla is not None:
            attn = self._mla_attention_parameters()
        if self.indexer is not None:  # wq_b, wk, k_norm (weight + bias), weights_proj
            x = self.indexer
            attn += (self.mla.q_lora_rank * x.n_heads * x.head_dim + h * x.head_dim
                     + 2 * x.head_dim + h * x.n_heads)
        mlp = 3 * h * i + (2 * i + h if self.mlp_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        per_layer = attn + mlp + norms
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        total = self.num_hidden_layers * per_layer + emb + h
        if self.mamba is not None:  # Bamba / Falcon-H1: attention and / or a mixer per layer
            m = self.mamba
            layers = range(self.num_hidden_layers)
            total += (sum(map(m.has_attention, layers)) - self.num_hidden_layers) * attn
            total += sum(map(m.has_mixer, layers)) * m.mixer_parameters(h)
        if self.moe is not None:  # sparse layers: router + experts instead of the dense MLP
            m = self.moe
            sparse = m.num_experts * (h + 3 * h * m.intermediate_size) - mlp
            sparse += 3 * h * m.shared_intermediate_size + (m.num_experts if m.score_correction_bias else 0)
            sparse += h if m.shared_expert_gate else 0
            total += m.num_sparse_layers * sparse
        if self.moe is not None and self.moe.expert_bias:  # GPT-OSS: router and expert biases
            m = self.moe
            total += m.num_sparse_layers * m.num_experts * (1 + 2 * m.intermediate_size + h)
        if self.attn_sinks:
            total += self.num_hidden_layers * self.num_attention_heads
        if self.cohere is not None:  # one norm per layer (attention and MLP share it)
            total -= self.num_hidden_layers * h
        if self.linear_attn is not None:  # Qwen3-Next: gated q_proj; mixers instead of attention
            la = self.linear_attn
            linear = sum(map(la.is_linear, range(self.num_hidden_layers)))
            gate = h * self.q_size + (self.q_size if self.qkv_bias else 0)
            mixer = (h * (2 * la.key_dim + 2 * la.value_dim + 2 * la.num_value_heads)
                     + la.conv_dim * la.conv_kernel_dim + 2 * la.num_value_heads
                     + la.value_head_dim + la.value_dim * h)
            total += (self.num_hidden_layers - linear) * gate
            total += linear * (mixer - attn - (2 * self.head_dim if self.qk_norm else 0))
        return total

    # ---- parsing
    @classmethod
    def from_json_file(cls, path: str | os.PathLike, *, max_model_len: int | None = None) -> "ModelArchConfig":
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise ConfigError(f"config.json not found at {path}; point pagedkv at a checkpoint directory")
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{path} must hold a JSON object, got {type(d).__name__}")
        return cls.from_dict(d, max_model_len=max_model_len, source=path)

    @classmethod
    def from_dict(
        cls, d: dict, *, max_model_len: int | None = None, source: str = "config.json"
    ) -> "ModelArchConfig":
        """Parse and validate a Hugging Face ``config.json`` dict.

        ``max_model_len`` is accepted for the callers' convenience and not used: sliding
        windows are read per layer (``layer_windows``) whatever the engine's length.
        """
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        arch = _pick_architecture(d, source)
        fam = FAMILIES[arch]
        if fam.dsv4:
            return _parse_deepseek_v4(cls, d, arch, fam, source)

        def req_int(key: str) -> int:
            if key not in d or d[key] is None:
                raise ConfigError(f"{source}: required field {key!r} is missing ({arch})")
            return _pos_int(d[key], key, source)

        hidden = req_int("hidden_size")
        layers = req_int("num_hidden_layers")
        heads = req_int("num_attention_heads")
        inter = req_int("intermediate_size")
        vocab = req_int("vocab_size")
        kv_heads = d.get("num_key_value_heads")
        kv_heads = heads if kv_heads is None else _pos_int(kv_heads, "num_key_value_heads", source)
        if heads % kv_heads:
            raise ConfigError(
                f"{source}: num_attention_heads ({heads}) must be a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        head_dim = d.get("head_dim")
        if head_dim is None:
            head_dim = fam.head_dim
        if head_dim is None:
            if hidden % heads:
                raise ConfigError(
                    f"{source}: head_dim is absent and hidden_size ({hidden}) is not a multiple of "
                    f"num_attention_heads ({heads}); add head_dim to config.json"
                )
            head_dim = hidden // heads
        head_dim = _pos_int(head_dim, "head_dim", source)
        mla = _parse_mla(d, source) if fam.mla else None
        if mla is not None:
            # the cache's one latent head (transformers' head_dim is the rope part)
            head_dim, kv_heads = mla.latent_dim, 1
        elif head_dim % 2:
            raise ConfigError(f"{source}: head_dim must be even for rotary embeddings, got {head_dim}")

        if fam.gemma:
            act = d.get("hidden_activation", d.get("hidden_act", "gelu_pytorch_tanh"))
            if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
                raise ConfigError(f"{source}: hidden_activation {act!r} is not supported; "
                                  f"{arch} uses 'gelu_pytorch_tanh'")
        else:
            act = d.get("hidden_act", "silu")
            if act != "silu":
                raise ConfigError(f"{source}: hidden_act {act!r} is not supported; these families use 'silu'")
        eps = d.get("rms_norm_eps", 1e-5 if fam.mamba in ("bamba", "falcon_h1") else 1e-6)
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
            raise ConfigError(f"{source}: rms_norm_eps must be a positive number, got {eps!r}")

        max_pos = d.get("max_position_embeddings")
        max_pos = fam.max_position_embeddings if max_pos is None else _pos_int(
            max_pos, "max_position_embeddings", source
        )
        local_rope = linear_attn = mamba = None
        if fam.gemma == 3:
            rope, local_rope = _parse_gemma3_rope(d, max_pos, source)
        elif fam.linear_attn:
            rope, linear_attn = _parse_linear_attn(d, layers, head_dim, max_pos, source)
        elif fam.mamba:
            rope, mamba = _parse_mamba(d, fam, hidden, layers, head_dim, max_pos, source)
        else:
            rope = _parse_rope(d, max_pos)
        windows = _layer_windows(d, fam, layers, source)
        moe = _parse_moe(d, fam, layers, source) if fam.moe else None
        gemma_fields = {}
        if mla is not None:
            if fam.indexer:
                gemma_fields = dict(indexer=_parse_indexer(d, mla, source))
                # transformers' DeepseekV32Attention always rotates interleaved pairs
                mla = replace(mla, rope_interleave=True)
            gemma_fields.update(attn_scale=_mla_softmax_scale(mla, rope), mla=mla)
        if fam.gemma:
            def opt_num(key, default):
                v = d.get(key, default)
                if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0):
                    raise ConfigError(f"{source}: {key} must be a positive number or null, got {v!r}")
                return None if v is None else float(v)

            scalar = opt_num("query_pre_attn_scalar", 256)
            gemma_fields = dict(
                attn_scale=scalar ** -0.5,
                attn_logit_softcap=opt_num("attn_logit_softcapping", 50.0 if fam.gemma == 2 else None),
                final_logit_softcap=opt_num("final_logit_softcapping", 30.0 if fam.gemma == 2 else None),
                embed_scale=hidden ** 0.5, local_rope=local_rope, gemma=fam.gemma)

        def flag(spec: str | bool) -> bool:
            if isinstance(spec, bool):
                return spec
            v = d.get(spec, False)
            if not isinstance(v, bool):
                raise ConfigError(f"{source}: {spec} must be true or false, got {v!r}")
            return v

        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ConfigError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")

        dtype_raw = d.get("dtype", d.get("torch_dtype"))
        dtype = "float32" if dtype_raw is None else normalize_dtype_name(dtype_raw, what=f"{source}: dtype")

        bos = d["bos_token_id"] if "bos_token_id" in d else fam.bos_token_id
        eos = d["eos_token_id"] if "eos_token_id" in d else fam.eos_token_id
        bos = _opt_token(bos, "bos_token_id", vocab, source)
        if eos is None:
            eos_ids: tuple[int, ...] = ()
        elif isinstance(eos, list):
            eos_ids = tuple(_opt_token(e, "eos_token_id", vocab, source) for e in eos)
        else:
            eos_ids = (_opt_token(eos, "eos_token_id", vocab, source),)
        pad = _opt_token(d.get("pad_token_id"), "pad_token_id", vocab, source)

        return cls(
            architecture=arch,
            family=fam.name,
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            rms_norm_eps=float(eps),
            max_position_embeddings=max_pos,
            rope=rope,
            tie_word_embeddings=tie,
            qkv_bias=flag(fam.qkv_bias),
            o_bias=flag(fam.o_bias),
            mlp_bias=flag(fam.mlp_bias),
            qk_norm=fam.qk_norm,
            dtype=dtype,
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            pad_token_id=pad,
            hidden_act=act,
            layer_windows=windows,
            moe=moe,
            linear_attn=linear_attn,
            mamba=mamba,
            attn_sinks=fam.attn_sinks,
            cohere=_parse_cohere(d, source) if fam.cohere else None,
            raw=dict(d),
            **gemma_fields,
        )


def load_model_config(model_dir: str | os.PathLike, *, max_model_len: int | None = None) -> ModelArchConfig:
    """Parse ``<model_dir>/config.json``."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ConfigError(f"model directory {model_dir!r} does not exist")
    return ModelArchConfig.from_json_file(os.path.join(model_dir, "config.json"), max_model_len=max_model_len)


# --------------------------------------------------------------------------------------------
# helpers


def _pick_architecture(d: dict, source: str) -> str:
    archs = d.get("architectures")
    if not archs:
        raise ConfigError(
            f"{source}: field 'architectures' is missing or empty; expected one of "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ConfigError(f"{source}: 'architectures' must be a list of names, got {archs!r}")
    for a in archs:
        if a in FAMILIES:
            return a
    raise UnsupportedArchitectureError(
        f"{source}: architecture {', '.join(archs)} is not supported; supported architectures: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _pos_int(v: Any, key: str, source: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ConfigError(f"{source}: {key} must be a positive integer, got {v!r}")
    return v


def _opt_token(v: Any, key: str, vocab: int, source: str) -> int | None:
    """A special-token id: null or a non-negative int. An id >= vocab_size is accepted (some
    checkpoints name tokenizer-only ids); the model can then never produce it."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ConfigError(f"{source}: {key} must be a non-negative token id or null, got {v!r}")
    return v


def _parse_gemma3_rope(d: dict, max_pos: int, source: str) -> tuple[RopeConfig, RopeConfig]:
    """Gemma 3's two RoPEs: ``rope_parameters`` keyed by layer type (``full_attention`` /
    ``sliding_attention``, transformers 5.x), or the older ``rope_theta`` (global, default 1e6)
    + ``rope_scaling`` + ``rope_local_base_freq`` (local, default 1e4)."""
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full = dict(rp.get("full_attention") or {})
        local = dict(rp.get("sliding_attention") or {})
    else:
        full = dict(d.get("rope_scaling") or {})
        full.setdefault("rope_theta", d.get("rope_theta", 1_000_000.0))
        local = {"rope_theta": d.get("rope_local_base_freq", 10_000.0)}
    full.setdefault("rope_theta", 1_000_000.0)
    local.setdefault("rope_theta", 10_000.0)
    return (_parse_rope({"rope_parameters": full}, max_pos),
            _parse_rope({"rope_parameters": local}, max_pos))


def _layer_windows(d: dict, fam: _Family, layers: int, source: str) -> tuple[int | None, ...]:
    """Each layer's sliding window (None: full attention), as transformers reads the config:
    Mistral and Mixtral: ``sliding_window`` on every layer when set; Qwen3-MoE: on every layer
    with ``use_sliding_window`` (default window 4096); Qwen2/Qwen3: only with
    ``use_sliding_window``, on the layers ``layer_types`` marks ``sliding_attention`` (or,
    without ``layer_types``, layers ``>= max_window_layers``)."""
    window = d.get("sliding_window",
                   fam.default_window if fam.sliding in ("gemma", "qwen_moe") else None)
    if fam.sliding is None or window is None:
        return (None,) * layers
    if isinstance(window, bool) or not isinstance(window, int) or window <= 0:
        raise ConfigError(f"{source}: sliding_window must be null or a positive integer, got {window!r}")
    if fam.sliding == "mistral":
        return (window,) * layers
    if fam.sliding == "qwen_moe":
        return (window if d.get("use_sliding_window", False) else None,) * layers
    if fam.sliding == "gemma":
        layer_types = d.get("layer_types")
        if layer_types is None:
            pattern = d.get("sliding_window_pattern", fam.sliding_pattern)
            return tuple(window if (i + 1) % pattern else None for i in range(layers))
        if not isinstance(layer_types, list) or len(layer_types) != layers or not set(layer_types) <= {
                "full_attention", "sliding_attention"}:
            raise ConfigError(f"{source}: layer_types must list 'full_attention' / 'sliding_attention' "
                              f"for each of the {layers} layers, got {layer_types!r}")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    if not d.get("use_sliding_window", False):
        return (None,) * layers
    layer_types = d.get("layer_types")
    if layer_types is None:
        first = d.get("max_window_layers", 28)
        return tuple(window if i >= first else None for i in range(layers))
    if not isinstance(layer_types, list) or len(layer_types) != layers or not set(layer_types) <= {
            "full_attention", "sliding_attention"}:
        raise ConfigError(f"{source}: layer_types must list 'full_attention' / 'sliding_attention' "
                          f"for each of the {layers} layers, got {layer_types!r}")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)


def _parse_mla(d: dict, source: str) -> MlaConfig:
    """DeepSeek-V3's latent attention, with ``DeepseekV3Config``'s defaults (V3's sizes:
    ``q_lora_rank`` 1536, ``kv_lora_rank`` 512, ``qk_nope_head_dim`` 128, ``qk_rope_head_dim``
    64, ``v_head_dim`` 128, ``rope_interleave`` true). ``q_lora_rank`` null: a plain
    ``q_proj``."""
    def size(key: str, default: int | None, *, optional: bool = False) -> int | None:
        v = d.get(key, default)
        if v is None and optional:
            return None
        return _pos_int(v, key, source)

    rope_dim = size("qk_rope_head_dim", 64)
    if rope_dim % 2:
        raise ConfigError(f"{source}: qk_rope_head_dim must be even for rotary embeddings, "
                          f"got {rope_dim}")
    interleave = d.get("rope_interleave", True)
    interleave = True if interleave is None else interleave
    bias = d.get("attention_bias", False)
    for key, v in (("rope_interleave", interleave), ("attention_bias", bias)):
        if not isinstance(v, bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {v!r}")
    return MlaConfig(q_lora_rank=size("q_lora_rank", 1536, optional=True),
                     kv_lora_rank=size("kv_lora_rank", 512),
                     qk_nope_head_dim=size("qk_nope_head_dim", 128),
                     qk_rope_head_dim=rope_dim, v_head_dim=size("v_head_dim", 128),
                     rope_interleave=interleave, attention_bias=bias)


def _parse_indexer(d: dict, mla: MlaConfig, source: str) -> IndexerConfig:
    """DeepSeek-V3.2's indexer, with ``DeepseekV32Config``'s defaults (``index_n_heads`` 64,
    ``index_head_dim`` 128, ``index_topk`` 2048). Its queries come from the query LoRA, so
    ``q_lora_rank`` must be set; RoPE covers the first ``qk_rope_head_dim`` dimensions."""
    if mla.q_lora_rank is None:
        raise ConfigError(f"{source}: DeepSeek-V3.2's indexer reads the query LoRA; "
                          "q_lora_rank must be a positive integer, not null")
    sizes = {}
    for key, default in (("index_n_heads", 64), ("index_head_dim", 128), ("index_topk", 2048)):
        v = d.get(key)
        sizes[key] = _pos_int(default if v is None else v, key, source)
    if sizes["index_head_dim"] < mla.qk_rope_head_dim:
        raise ConfigError(f"{source}: index_head_dim ({sizes['index_head_dim']}) must be at "
                          f"least qk_rope_head_dim ({mla.qk_rope_head_dim}), its rotary part")
    return IndexerConfig(n_heads=sizes["index_n_heads"], head_dim=sizes["index_head_dim"],
                         topk=sizes["index_topk"], rope_dim=mla.qk_rope_head_dim)


def _mla_softmax_scale(mla: MlaConfig, rope: RopeConfig) -> float:
    """``qk_head_dim ** -0.5``, and with a scaled RoPE whose ``mscale_all_dim`` is set, times
    ``yarn_mscale(factor, mscale_all_dim) ** 2`` (transformers' ``yarn_apply_mscale``; the
    cos/sin carry ``mscale / mscale_all_dim`` of it, see ``rotary.py``)."""
    scale = mla.qk_head_dim ** (-0.5)
    if rope.rope_type != "default" and rope.mscale_all_dim:
        import math

        m = 1.0 if rope.factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale = scale * m * m
    return scale


LAYER_TYPES = ("linear_attention", "full_attention")


def _parse_linear_attn(d: dict, layers: int, head_dim: int, max_pos: int,
                       source: str) -> tuple[RopeConfig, LinearAttnConfig]:
    """Qwen3-Next's RoPE (``partial_rotary_factor``, default 0.25, in ``rope_parameters`` or
    at the top level) and its ``LinearAttnConfig``, with ``Qwen3NextConfig``'s defaults:
    ``layer_types`` (default: every ``full_attention_interval``-th (4) layer full attention),
    ``linear_num_key_heads`` 16, ``linear_num_value_heads`` 32, ``linear_key_head_dim`` /
    ``linear_value_head_dim`` 128, ``linear_conv_kernel_dim`` 4."""
    rope_d = dict(d)
    params = d.get("rope_scaling") or d.get("rope_parameters") or {}
    params = dict(params) if isinstance(params, dict) else params  # (_parse_rope rejects it)
    top = rope_d.pop("partial_rotary_factor", 0.25)
    factor = params.pop("partial_rotary_factor", top) if isinstance(params, dict) else top
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ConfigError(f"{source}: partial_rotary_factor must be a number in (0, 1], got "
                          f"{factor!r}")
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"{source}: the rotary part of the head (head_dim {head_dim} x "
                          f"partial_rotary_factor {factor} = {rotary_dim}) must be even and >= 2")
    rope_d.pop("rope_scaling", None)
    rope_d["rope_parameters"] = params
    rope = _parse_rope(rope_d, max_pos)
    types = d.get("layer_types")
    if types is None:
        interval = d.get("full_attention_interval", 4)
        interval = _pos_int(interval, "full_attention_interval", source)
        types = [LAYER_TYPES[0] if (i + 1) % interval else LAYER_TYPES[1] for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(LAYER_TYPES):
        raise ConfigError(f"{source}: layer_types must list 'linear_attention' / "
                          f"'full_attention' for each of the {layers} layers, got {types!r}")

    def size(key: str, default: int) -> int:
        v = d.get(key)
        return _pos_int(default if v is None else v, key, source)

    hk, hv = size("linear_num_key_heads", 16), size("linear_num_value_heads", 32)
    if hv % hk:
        raise ConfigError(f"{source}: linear_num_value_heads ({hv}) must be a multiple of "
                          f"linear_num_key_heads ({hk})")
    kd, vd = size("linear_key_head_dim", 128), size("linear_value_head_dim", 128)
    if kd > 256:
        raise ConfigError(f"{source}: linear_key_head_dim {kd} is larger than the gated delta "
                          f"rule kernels support (256)")
    width = size("linear_conv_kernel_dim", 4)
    if not 2 <= width <= 4:
        raise ConfigError(f"{source}: linear_conv_kernel_dim must be 2, 3 or 4 (the causal "
                          f"conv1d kernel's widths), got {width}")
    return rope, LinearAttnConfig(layer_types=tuple(types), num_key_heads=hk,
                                  num_value_heads=hv, key_head_dim=kd, value_head_dim=vd,
                                  conv_kernel_dim=width, rotary_dim=rotary_dim)


def _parse_mamba(d: dict, fam: _Family, hidden: int, layers: int, head_dim: int, max_pos: int,
                 source: str) -> tuple[RopeConfig, MambaConfig]:
    """Bamba's / Falcon-H1's RoPE and ``MambaConfig``, with ``BambaConfig``'s /
    ``FalconH1Config``'s defaults: ``mamba_n_heads`` 128, ``mamba_d_head`` "auto" (the mixer
    width / heads), ``mamba_n_groups`` 1, ``mamba_d_state`` 256, ``mamba_d_conv`` 4, mixer width
    ``mamba_expand`` (2) x hidden (Falcon-H1: ``mamba_d_ssm``, default 1024, when not null),
    ``mamba_conv_bias`` true, ``mamba_proj_bias`` false (Bamba's ``out_proj`` too; Falcon-H1's
    ``out_proj`` has ``projectors_bias``), ``time_step_limit`` [0, inf] (null: no limit;
    ``{"__float__": "Infinity"}`` as ``save_pretrained`` writes it). Bamba: attention on
    ``attn_layer_indices`` (default none), RoPE on half of each head whatever
    ``partial_rotary_factor`` says (transformers sets 0.5). Falcon-H1: every layer hybrid,
    ``mamba_rms_norm`` false, ``mamba_norm_before_gate`` true, the multipliers 1. Jamba:
    :func:`_parse_mamba1`."""
    if fam.mamba == "jamba":
        return _parse_rope(d, max_pos), _parse_mamba1(d, hidden, layers, source)
    falcon = fam.mamba == "falcon_h1"

    def size(key: str, default: int) -> int:
        v = d.get(key)
        return _pos_int(default if v is None else v, key, source)

    def flag(key: str, default: bool) -> bool:
        v = d.get(key)
        v = default if v is None else v
        if not isinstance(v, bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {v!r}")
        return v

    def number(v: Any, key: str) -> float:
        if isinstance(v, dict) and set(v) == {"__float__"}:  # save_pretrained's inf / nan
            try:
                v = float(v["__float__"])
            except (TypeError, ValueError):
                pass
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(f"{source}: {key} must be a number, got {v!r}")
        return float(v)

    def numbers(key: str, n: int) -> tuple[float, ...]:
        v = d.get(key)
        if v is None:
            return (1.0,) * n
        if not isinstance(v, list) or len(v) != n:
            raise ConfigError(f"{source}: {key} must list {n} numbers, got {v!r}")
        return tuple(number(x, key) for x in v)

    heads, groups = size("mamba_n_heads", 128), size("mamba_n_groups", 1)
    d_state, d_conv = size("mamba_d_state", 256), size("mamba_d_conv", 4)
    inter = size("mamba_expand", 2) * hidden
    if falcon and d.get("mamba_d_ssm", 1024) is not None:
        inter = _pos_int(d.get("mamba_d_ssm", 1024), "mamba_d_ssm", source)
    d_head = d.get("mamba_d_head", "auto")
    if d_head in (None, "auto"):
        if inter % heads:
            raise ConfigError(f"{source}: mamba_n_heads ({heads}) must divide the mixer width "
                              f"({inter})")
        d_head = inter // heads
    d_head = _pos_int(d_head, "mamba_d_head", source)
    if d_head * heads != inter:
        raise ConfigError(f"{source}: mamba_d_head ({d_head}) x mamba_n_heads ({heads}) must "
                          f"equal the mixer width ({inter})")
    if heads % groups:
        raise ConfigError(f"{source}: mamba_n_heads ({heads}) must be a multiple of "
                          f"mamba_n_groups ({groups})")
    if not 2 <= d_conv <= 4:
        raise ConfigError(f"{source}: mamba_d_conv must be 2, 3 or 4 (the causal conv1d "
                          f"kernel's widths), got {d_conv}")
    if d_state > 256:
        raise ConfigError(f"{source}: mamba_d_state {d_state} is larger than the Mamba-2 "
                          f"kernels support (256)")
    limit = d.get("time_step_limit", [0.0, math.inf])
    if limit is None:
        limit = [0.0, math.inf]
    if not isinstance(limit, (list, tuple)) or len(limit) != 2:
        raise ConfigError(f"{source}: time_step_limit must be [min, max], got {limit!r}")
    lo, hi = (number(x, "time_step_limit") for x in limit)
    if not 0.0 <= lo <= hi:
        raise ConfigError(f"{source}: time_step_limit must satisfy 0 <= min <= max, got "
                          f"{limit!r}")

    if falcon:
        types = ("hybrid",) * layers
        rope, factor = _parse_rope(d, max_pos), 1.0
    else:
        idx = d.get("attn_layer_indices")
        idx = [] if idx is None else idx
        if not isinstance(idx, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in idx):
            raise ConfigError(f"{source}: attn_layer_indices must list layer indices in "
                              f"[0, {layers}), got {idx!r}")
        types = tuple("attention" if i in idx else "mamba" for i in range(layers))
        rope_d = dict(d)
        rope_d.pop("partial_rotary_factor", None)
        params = dict(d.get("rope_scaling") or d.get("rope_parameters") or {})
        params.pop("partial_rotary_factor", None)
        rope_d.pop("rope_scaling", None)
        rope_d["rope_parameters"] = params
        rope, factor = _parse_rope(rope_d, max_pos), 0.5
    rotary_dim = int(head_dim * factor)
    if rotary_dim < 2 or rotary_dim % 2:
        raise ConfigError(f"{source}: the rotary part of the head (head_dim {head_dim} x "
                          f"{factor} = {rotary_dim}) must be even and >= 2")
    muls = {}
    if falcon:
        for key in ("embedding_multiplier", "lm_head_multiplier", "attention_in_multiplier",
                    "attention_out_multiplier", "key_multiplier", "ssm_in_multiplier",
                    "ssm_out_multiplier"):
            muls[key] = number(d.get(key, 1.0), key)
        muls.update(ssm_multipliers=numbers("ssm_multipliers", 5),
                    mlp_multipliers=numbers("mlp_multipliers", 2))
    return rope, MambaConfig(
        variant=fam.mamba, layer_types=types, num_heads=heads, head_dim=d_head, n_groups=groups,
        d_state=d_state, d_conv=d_conv, intermediate_size=inter,
        conv_bias=flag("mamba_conv_bias", True), in_proj_bias=flag("mamba_proj_bias", False),
        out_proj_bias=flag("projectors_bias" if falcon else "mamba_proj_bias", False),
        rotary_dim=rotary_dim, time_step_limit=(lo, hi),
        gated_norm=flag("mamba_rms_norm", False) if falcon else True,
        norm_before_gate=flag("mamba_norm_before_gate", True) if falcon else False, **muls)


def _layer_period(d: dict, what: str, defaults: tuple[int, int], layers: int,
                  source: str) -> tuple[bool, ...]:
    """Jamba's layer rule: layer ``i`` is chosen iff ``i % {what}_layer_period ==
    {what}_layer_offset`` (``offset < period``, as ``JambaConfig`` validates)."""
    period, offset = (d.get(f"{what}_layer_{k}") for k in ("period", "offset"))
    period = _pos_int(defaults[0] if period is None else period, f"{what}_layer_period", source)
    offset = defaults[1] if offset is None else offset
    if isinstance(offset, bool) or not isinstance(offset, int) or not 0 <= offset < period:
        raise ConfigError(f"{source}: {what}_layer_offset must be an integer in [0, "
                          f"{what}_layer_period = {period}), got {offset!r}")
    return tuple(i % period == offset for i in range(layers))


def _parse_mamba1(d: dict, hidden: int, layers: int, source: str) -> MambaConfig:
    """Jamba's ``MambaConfig`` (Mamba-1 mixers, see ``MambaConfig``) with ``JambaConfig``'s
    defaults: attention on the layers ``i % attn_layer_period (8) == attn_layer_offset (4)``,
    ``mamba_d_state`` 16, ``mamba_d_conv`` 4, mixer width ``mamba_expand`` (2) x hidden,
    ``mamba_dt_rank`` "auto" (``ceil(hidden / 16)``), ``mamba_conv_bias`` true,
    ``mamba_proj_bias`` false (``in_proj`` and ``out_proj``)."""
    def size(key: str, default: int) -> int:
        v = d.get(key)
        return _pos_int(default if v is None else v, key, source)

    attn = _layer_period(d, "attn", (8, 4), layers, source)
    inter = size("mamba_expand", 2) * hidden
    d_state, d_conv = size("mamba_d_state", 16), size("mamba_d_conv", 4)
    rank = d.get("mamba_dt_rank", "auto")
    rank = math.ceil(hidden / 16) if rank in (None, "auto") else _pos_int(rank, "mamba_dt_rank",
                                                                           source)
    if not 2 <= d_conv <= 4:
        raise ConfigError(f"{source}: mamba_d_conv must be 2, 3 or 4 (the causal conv1d "
                          f"kernel's widths), got {d_conv}")
    if d_state > 256:
        raise ConfigError(f"{source}: mamba_d_state {d_state} is larger than the selective "
                          f"scan kernel supports (256)")
    flags = {}
    for key, default in (("mamba_conv_bias", True), ("mamba_proj_bias", False)):
        v = d.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{source}: {key} must be true or false, got {v!r}")
        flags[key] = v
    return MambaConfig(
        variant="jamba", layer_types=tuple("attention" if a else "mamba" for a in attn),
        num_heads=inter, head_dim=1, n_groups=1, d_state=d_state, d_conv=d_conv,
        intermediate_size=inter, conv_bias=flags["mamba_conv_bias"],
        in_proj_bias=flags["mamba_proj_bias"], out_proj_bias=flags["mamba_proj_bias"],
        rotary_dim=0, gated_norm=False, dt_rank=rank)


@dataclass(frozen=True)
class CohereConfig:
    """What Cohere2 adds to the decoder: ``layer_norm_eps`` of its weight-only LayerNorms
    (``rms_norm_eps`` does not apply) and ``logit_scale`` (logits times it)."""

    layer_norm_eps: float
    logit_scale: float


def _parse_cohere(d: dict, source: str) -> CohereConfig:
    """Cohere2's keys, with ``Cohere2Config``'s defaults (eps 1e-5, logit scale 0.0625)."""
    vals = {}
    for key, default in (("layer_norm_eps", 1e-5), ("logit_scale", 0.0625)):
        v = d.get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"{source}: {key} must be a positive number, got {v!r}")
        vals[key] = float(v)
    return CohereConfig(**vals)


def _parse_moe(d: dict, fam: _Family, layers: int, source: str) -> MoeConfig:
    """The experts of an MoE family, with transformers' defaults and layer rule.

    Qwen3-MoE: ``num_experts`` (saved configs may name it ``num_local_experts``, default 128),
    ``num_experts_per_tok`` (8), ``moe_intermediate_size`` (768), ``norm_topk_prob`` (false);
    layer ``i`` is sparse iff ``i`` is not in ``mlp_only_layers`` and ``num_experts > 0`` and
    ``(i + 1) % decoder_sparse_step == 0`` (default 1). Mixtral: ``num_local_experts`` (8),
    ``num_experts_per_tok`` (2), experts of ``intermediate_size``, always renormalized, every
    layer sparse. DeepSeek-V3: ``n_routed_experts`` (256), ``num_experts_per_tok`` (8),
    ``moe_intermediate_size`` (2048), ``norm_topk_prob`` (true), ``n_group`` (8) /
    ``topk_group`` (4), ``routed_scaling_factor`` (2.5), ``n_shared_experts`` (1); layer ``i``
    is sparse iff ``i >= first_k_dense_replace`` (3). Qwen3-Next: Qwen3-MoE's rule and names
    with ``Qwen3NextConfig``'s defaults (512 experts, 10 per token, ``moe_intermediate_size``
    512, ``norm_topk_prob`` true) and a shared expert of ``shared_expert_intermediate_size``
    (512) scaled by its sigmoid gate. Jamba: ``num_experts`` (16), ``num_experts_per_tok``
    (2), experts of ``intermediate_size``, weights not renormalized, in the model dtype; layer
    ``i`` is sparse iff ``num_experts > 1`` and ``i % expert_layer_period (2) ==
    expert_layer_offset (1)``."""
    def count(key: str, default: int, *, zero: bool = False) -> int:
        v = d.get(key)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if zero else 1):
            raise ConfigError(f"{source}: {key} must be a {'non-negative' if zero else 'positive'} "
                              f"integer, got {v!r}")
        return v

    deepseek = {}
    if fam.moe == "gpt_oss":
        # GptOssConfig's defaults: 128 experts of intermediate_size, 4 per token (read by the
        # rule below), every layer sparse, the weights in the model dtype
        if d.get("num_experts_per_tok") is None:
            d = {**d, "num_experts_per_tok": 4}
        experts = count("num_local_experts", 128)
        inter = count("intermediate_size", 2880)
        norm, weights_dtype, sparse = False, "model", (True,) * layers
        swiglu = {}
        for key, default in (("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)):
            v = d.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise ConfigError(f"{source}: {key} must be a positive number, got {v!r}")
            swiglu[key] = float(v)
        deepseek = dict(scoring="topk_softmax", router_bias=True, expert_bias=True,
                        activation="swiglu_clamp", **swiglu)
    elif fam.moe == "mixtral":
        experts = count("num_local_experts", 8)
        inter = count("intermediate_size", 14336)
        norm, weights_dtype, sparse = True, "float32", (True,) * layers
    elif fam.moe == "jamba":
        experts = count("num_experts" if "num_experts" in d else "num_local_experts", 16)
        inter = count("intermediate_size", 14336)
        norm, weights_dtype = False, "model"
        sparse = tuple(s and experts > 1 for s in _layer_period(d, "expert", (2, 1), layers,
                                                                  source))
    elif fam.moe == "deepseek_v3":
        experts = count("n_routed_experts" if "n_routed_experts" in d else "num_local_experts", 256)
        inter = count("moe_intermediate_size", 2048)
        norm = d.get("norm_topk_prob", True)
        norm = True if norm is None else norm
        if not isinstance(norm, bool):
            raise ConfigError(f"{source}: norm_topk_prob must be true or false, got {norm!r}")
        weights_dtype = "float32"  # the router runs in float32
        first_dense = count("first_k_dense_replace", 3, zero=True)
        sparse = tuple(i >= first_dense for i in range(layers))
        kinds = d.get("mlp_layer_types") if fam.indexer else None
        if kinds is not None:  # DeepSeek-V3.2: the layer kinds, when listed, decide
            if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= {
                    "dense", "sparse"}:
                raise ConfigError(f"{source}: mlp_layer_types must list 'dense' / 'sparse' for "
                                  f"each of the {layers} layers, got {kinds!r}")
            sparse = tuple(k == "sparse" for k in kinds)
        groups, topk_groups = count("n_group", 8), count("topk_group", 4)
        if experts % groups or experts // groups < 2:
            raise ConfigError(f"{source}: n_routed_experts ({experts}) must be a multiple of "
                              f"n_group ({groups}) with at least 2 experts per group")
        if topk_groups > groups:
            raise ConfigError(f"{source}: topk_group ({topk_groups}) must not exceed n_group "
                              f"({groups})")
        scaling = d.get("routed_scaling_factor", 2.5)
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or scaling <= 0:
            raise ConfigError(f"{source}: routed_scaling_factor must be a positive number, "
                              f"got {scaling!r}")
        deepseek = dict(scoring="sigmoid", n_group=groups, topk_group=topk_groups,
                        routed_scaling_factor=float(scaling), score_correction_bias=True,
                        shared_intermediate_size=count("n_shared_experts", 1, zero=True) * inter)
    else:
        qwen3_next = fam.moe == "qwen3_next"
        key = "num_experts" if "num_experts" in d else "num_local_experts"
        experts = count(key, 512 if qwen3_next else 128, zero=True)
        inter = count("moe_intermediate_size", 512 if qwen3_next else 768)
        norm = d.get("norm_topk_prob", qwen3_next)
        if qwen3_next:
            deepseek = dict(shared_intermediate_size=count("shared_expert_intermediate_size", 512),
                            shared_expert_gate=True)
        if not isinstance(norm, bool):
            raise ConfigError(f"{source}: norm_topk_prob must be true or false, got {norm!r}")
        weights_dtype = "model"
        step = count("decoder_sparse_step", 1)
        only = d.get("mlp_only_layers")
        only = [] if only is None else only
        if not isinstance(only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in only):
            raise ConfigError(f"{source}: mlp_only_layers must list layer indices in "
                              f"[0, {layers}), got {only!r}")
        sparse = tuple(i not in only and experts > 0 and (i + 1) % step == 0
                       for i in range(layers))
    top_k = count("num_experts_per_tok", {"mixtral": 2, "jamba": 2, "qwen3_next": 10}.get(fam.moe, 8))
    if any(sparse) and top_k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) must not exceed the number "
                          f"of experts ({experts})")
    if "topk_group" in deepseek and any(sparse) and top_k > deepseek["topk_group"] * (experts // deepseek["n_group"]):
        raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) must not exceed the experts "
                          f"of topk_group ({deepseek['topk_group']}) groups of "
                          f"{experts // deepseek['n_group']}")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported; the experts use 'silu'")
    return MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=inter,
                     norm_topk_prob=norm, weights_dtype=weights_dtype, sparse_layers=sparse,
                     **deepseek)


_DSV4_RATIO_TO_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention",
                       128: "heavily_compressed_attention"}


def _parse_deepseek_v4(cls, d: dict, arch: str, fam: _Family, source: str) -> "ModelArchConfig":
    """DeepSeek-V4 (``Dsv4Config``), with ``DeepseekV4Config``'s defaults and its legacy keys:
    ``compress_ratios`` (per layer 0 / 4 / 128), ``compress_rate_csa`` / ``compress_rate_hca``,
    ``num_hash_layers``, ``qk_rope_head_dim``. Defaults: ``layer_types`` two HCA layers then
    HCA / CSA alternating, ``mlp_layer_types`` three ``hash_moe`` then ``moe``, RoPE on
    ``partial_rotary_factor`` (64 / 512) of each head; the "main" RoPE (sliding layers) plain
    with ``rope_theta``, the "compress" one with ``compress_rope_theta`` and the YaRN keys of a
    flat ``rope_parameters`` / ``rope_scaling`` (``attention_factor`` 1). One shared expert of
    ``moe_intermediate_size`` (as transformers, whatever ``n_shared_experts``); the routing
    weights are always normalized (``norm_topk_prob`` is not read)."""
    def get(key, default):
        v = d.get(key)
        return default if v is None else v

    def size(key: str, default: int) -> int:
        return _pos_int(get(key, default), key, source)

    def num(key: str, default: float) -> float:
        v = get(key, default)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
            raise ConfigError(f"{source}: {key} must be a positive number, got {v!r}")
        return float(v)

    def kinds(key: str, allowed: tuple, n: int, value) -> tuple[str, ...]:
        if not isinstance(value, list) or len(value) < n or not set(value[:n]) <= set(allowed):
            raise ConfigError(f"{source}: {key} must list one of {allowed} for each of the {n} "
                              f"layers, got {value!r}")
        return tuple(value[:n])

    hidden, layers = size("hidden_size", 4096), size("num_hidden_layers", 43)
    heads, vocab = size("num_attention_heads", 64), size("vocab_size", 129280)
    head_dim = size("head_dim", fam.head_dim)
    if get("num_key_value_heads", 1) != 1:
        raise ConfigError(f"{source}: DeepSeek-V4 attends with one shared key/value head; "
                          f"num_key_value_heads must be 1, got {d.get('num_key_value_heads')!r}")
    act = get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{source}: hidden_act {act!r} is not supported; DeepSeek-V4 uses 'silu'")
    eps = num("rms_norm_eps", 1e-6)
    max_pos = size("max_position_embeddings", fam.max_position_embeddings)

    rates = dict(get("compress_rates", {"compressed_sparse_attention": 4,
                                        "heavily_compressed_attention": 128}))
    for key, kind in (("compress_rate_csa", "compressed_sparse_attention"),
                      ("compress_rate_hca", "heavily_compressed_attention")):
        if d.get(key) is not None:
            rates[kind] = d[key]
    for kind in DSV4_LAYER_TYPES[1:]:
        v = rates.get(kind)
        if isinstance(v, bool) or not isinstance(v, int) or v < 2:
            raise ConfigError(f"{source}: the compress rate of {kind} must be an integer >= 2, "
                              f"got {v!r}")
    types = d.get("layer_types")
    if types is None and d.get("compress_ratios") is not None:
        legacy = d["compress_ratios"]
        if not isinstance(legacy, list) or not set(legacy[:layers]) <= set(_DSV4_RATIO_TO_TYPE):
            raise ConfigError(f"{source}: compress_ratios must list 0, 4 or 128 per layer, "
                              f"got {legacy!r}")
        types = [_DSV4_RATIO_TO_TYPE[r] for r in legacy]
    if types is None:
        types = ["heavily_compressed_attention"] * min(layers, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(layers - 2, 0))]
    types = kinds("layer_types", DSV4_LAYER_TYPES, layers, types)
    ratios = tuple(0 if t == "sliding_attention" else rates[t] for t in types)
    mlp_types = d.get("mlp_layer_types")
    if mlp_types is None:
        n_hash = get("num_hash_layers", 3)
        if isinstance(n_hash, bool) or not isinstance(n_hash, int) or n_hash < 0:
            raise ConfigError(f"{source}: num_hash_layers must be a non-negative integer, "
                              f"got {n_hash!r}")
        mlp_types = ["hash_moe"] * min(layers, n_hash) + ["moe"] * max(0, layers - n_hash)
    mlp_types = kinds("mlp_layer_types", DSV4_MLP_LAYER_TYPES, layers, mlp_types)

    partial = d.get("partial_rotary_factor")
    if partial is None:
        legacy = d.get("qk_rope_head_dim")
        partial = legacy / head_dim if legacy is not None else 64 / 512
    rope_dim = int(head_dim * partial)
    if rope_dim < 2 or rope_dim % 2 or rope_dim > head_dim:
        raise ConfigError(f"{source}: the rotary part of each head (head_dim * "
                          f"partial_rotary_factor = {rope_dim}) must be even, in [2, {head_dim}]")
    rp = d.get("rope_parameters") or d.get("rope_scaling") or {}
    if not isinstance(rp, dict):
        raise ConfigError(f"{source}: rope_parameters must be an object, got {rp!r}")
    if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
        main, compress = dict(rp["main"]), dict(rp["compress"])
    else:
        main = {"rope_type": "default", "rope_theta": get("rope_theta", 10000.0)}
        compress = {**{k: v for k, v in rp.items() if k not in ("main", "compress")},
                    "rope_theta": get("compress_rope_theta", 160000.0)}
        compress.setdefault("rope_type", compress.pop("type", "default"))
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
    ropes = []
    for sub in (main, compress):
        sub = {k: v for k, v in sub.items() if k != "partial_rotary_factor"}
        ropes.append(_parse_rope({"rope_parameters": sub}, max_pos))

    q_lora, o_groups, o_rank = size("q_lora_rank", 1024), size("o_groups", 8), size("o_lora_rank", 1024)
    if (heads * head_dim) % o_groups:
        raise ConfigError(f"{source}: o_groups ({o_groups}) must divide num_attention_heads x "
                          f"head_dim ({heads * head_dim})")
    index_dim = size("index_head_dim", 128)
    if index_dim < rope_dim:
        raise ConfigError(f"{source}: index_head_dim ({index_dim}) must be at least the rotary "
                          f"part of a head ({rope_dim})")
    scoring = get("scoring_func", "sqrtsoftplus")
    if scoring not in DSV4_SCORING:
        raise ConfigError(f"{source}: scoring_func {scoring!r} is not supported; one of "
                          f"{DSV4_SCORING}")
    experts, top_k = size("n_routed_experts", 256), size("num_experts_per_tok", 6)
    if top_k > experts:
        raise ConfigError(f"{source}: num_experts_per_tok ({top_k}) must not exceed "
                          f"n_routed_experts ({experts})")
    inter = size("moe_intermediate_size", 2048)
    limit = num("swiglu_limit", 10.0)
    x = Dsv4Config(
        layer_types=types, compress_ratios=ratios, sliding_window=size("sliding_window", 128),
        q_lora_rank=q_lora, rope_dim=rope_dim, compress_rope=ropes[1], o_groups=o_groups,
        o_lora_rank=o_rank, index_n_heads=size("index_n_heads", 64), index_head_dim=index_dim,
        index_topk=size("index_topk", 512), hc_mult=size("hc_mult", 4),
        hc_sinkhorn_iters=size("hc_sinkhorn_iters", 20), hc_eps=num("hc_eps", 1e-6),
        mlp_layer_types=mlp_types, scoring_func=scoring, swiglu_limit=limit)
    moe = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=inter,
                    norm_topk_prob=True, weights_dtype="model", sparse_layers=(True,) * layers,
                    scoring=scoring, routed_scaling_factor=num("routed_scaling_factor", 1.5),
                    score_correction_bias=True, shared_intermediate_size=inter,
                    activation="silu_clamp", swiglu_limit=limit)
    tie = get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise ConfigError(f"{source}: tie_word_embeddings must be true or false, got {tie!r}")
    dtype_raw = d.get("dtype", d.get("torch_dtype"))
    bos = _opt_token(d["bos_token_id"] if "bos_token_id" in d else fam.bos_token_id,
                     "bos_token_id", vocab, source)
    eos = d["eos_token_id"] if "eos_token_id" in d else fam.eos_token_id
    eos_ids = () if eos is None else tuple(
        _opt_token(e, "eos_token_id", vocab, source) for e in (eos if isinstance(eos, list) else [eos]))
    return cls(
        architecture=arch, family=fam.name, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=1, head_dim=head_dim,
        intermediate_size=inter, vocab_size=vocab, rms_norm_eps=eps,
        max_position_embeddings=max_pos, rope=ropes[0], tie_word_embeddings=tie,
        qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False,
        dtype="float32" if dtype_raw is None else normalize_dtype_name(dtype_raw, what=f"{source}: dtype"),
        bos_token_id=bos, eos_token_ids=eos_ids,
        pad_token_id=_opt_token(d.get("pad_token_id"), "pad_token_id", vocab, source),
        hidden_act=act, moe=moe, dsv4=x, raw=dict(d))


def _dsv4_parameters(cfg: "ModelArchConfig") -> int:
    """DeepSeek-V4's parameter count (buffers: ``tid2eid`` and ``e_score_correction_bias``
    not counted), module by module as transformers builds it."""
    x, m = cfg.dsv4, cfg.moe
    h, n, d, v, i = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.vocab_size, m.intermediate_size
    q, hc = x.q_lora_rank, x.hc_mult
    attn = (h * q + q + q * n * d + h * d + d + x.o_groups * x.o_lora_rank * (n * d // x.o_groups + h)
            + n)
    mlp = m.num_experts * (h + 3 * h * i) + 3 * h * i
    mix = (2 + hc) * hc
    per_layer = attn + mlp + 2 * h + 2 * (mix * hc * h + mix + 3)
    total = cfg.num_hidden_layers * per_layer
    for layer, c in enumerate(x.compress_ratios):
        if not c:
            continue
        w = 2 if x.is_csa(layer) else 1  # CSA: two overlapping series
        total += 2 * h * w * d + c * w * d + d
        if x.is_csa(layer):
            di = x.index_head_dim
            total += 2 * h * 2 * di + c * 2 * di + di + q * x.index_n_heads * di + h * x.index_n_heads
    emb = v * h * (1 if cfg.tie_word_embeddings else 2)
    return total + emb + h + hc * hc * h + hc + 1


# --------------------------------------------------------------------------------------------
# Named shapes (benchmarks with random weights)

SHAPES: dict[str, dict] = {
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 3072,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": "bfloat16",
    },
    "qwen3-1.7b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 6144,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": "bfloat16",
    },
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "attention_bias": False,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "dtype": "bfloat16",
    },
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "use_sliding_window": False,
        "sliding_window": 32768,
        "max_window_layers": 24,
        "bos_token_id": 151643,
        "eos_token_id": 151643,
        "dtype": "bfloat16",
    },
    "llama-3.2-1b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "dtype": "bfloat16",
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "dtype": "bfloat16",
    },
    "mistral-7b-v0.3": {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 32768,
        "tie_word_embeddings": False,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 32768,
        "sliding_window": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    },
    # Gemma-3-1B's dimensions (transformers' Gemma3TextConfig with the published sizes: 26
    # layers, 5 local : 1 global, window 512, local / global RoPE bases 1e4 / 1e6).
    "gemma-3-1b": {
        "architectures": [
            "Gemma3ForCausalLM"
        ],
        "dtype": "bfloat16",
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
        "tie_word_embeddings": True,
        "rope_parameters": {
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": 10000.0
            },
            "full_attention": {
                "rope_type": "default",
                "rope_theta": 1000000.0
            }
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        # five local layers to one global (Gemma 3), 26 layers
        "layer_types": (["sliding_attention"] * 5 + ["full_attention"]) * 4 + ["sliding_attention"] * 2,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "use_bidirectional_attention": False,
        "model_type": "gemma3_text"
    },
    # DeepSeek-V2-Lite's dimensions (27 layers, hidden 2048, 16 heads, kv_lora_rank 512 + rope
    # 64, no q LoRA, 64 routed experts (6 per token) + 2 shared, first layer dense, YaRN x40)
    # on the DeepSeek-V3 architecture pagedkv implements: V3's sigmoid routing with correction
    # bias instead of V2's softmax top-k (same FLOPs and bytes per token).
    "deepseek-v2-lite": {
        "architectures": [
            "DeepseekV3ForCausalLM"
        ],
        "dtype": "bfloat16",
        "vocab_size": 102400,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": 27,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_shared_experts": 2,
        "n_routed_experts": 64,
        "output_router_logits": False,
        "routed_scaling_factor": 1.0,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "qk_nope_head_dim": 128,
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "norm_topk_prob": False,
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-06,
        "pad_token_id": None,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "mscale": 0.707,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
            "rope_theta": 10000,
            "rope_type": "yarn"
        },
        "rope_interleave": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "num_nextn_predict_layers": 1,
        "qk_head_dim": 192,
        "head_dim": 64,
        "model_type": "deepseek_v3"
    },
}


# DeepSeek-V3.2 shapes for decode benchmarks with random weights (bench_dsv32_decode.py), as
# DeepseekV32Config's to_dict: "small": DeepSeek-V2-Lite's dimensions (27 layers, hidden 2048,
# 16 heads, latents 512 + 64, 64 routed experts (6 per token) + 2 shared, YaRN x40) with V3.2's
# attention: a query LoRA of 768 (V3.2's indexer reads it; V2-Lite has none) and V3.2's
# indexer (64 heads x 128, top-k 2048); "tiny": a CPU-sized one (top-k 16).
SHAPES["deepseek-v3.2-small"] = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32", "dtype": "bfloat16",
    "vocab_size": 102400, "hidden_size": 2048, "intermediate_size": 10944,
    "moe_intermediate_size": 1408, "num_hidden_layers": 27, "num_attention_heads": 16,
    "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": 768,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1,
    "topk_group": 1, "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    "norm_topk_prob": False, "hidden_act": "silu", "max_position_embeddings": 163840,
    "initializer_range": 0.02, "rms_norm_eps": 1e-06, "bos_token_id": 0, "eos_token_id": 1,
    "tie_word_embeddings": False, "attention_bias": False,
    "rope_parameters": {"rope_type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                        "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                        "rope_theta": 10000},
    "index_topk": 2048, "index_head_dim": 128, "index_n_heads": 64,
}
SHAPES["deepseek-v3.2-tiny"] = {
    **SHAPES["deepseek-v3.2-small"], "dtype": "float32", "vocab_size": 512, "hidden_size": 64,
    "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
    "n_routed_experts": 8, "kv_lora_rank": 32, "q_lora_rank": 24, "qk_rope_head_dim": 8,
    "v_head_dim": 12, "qk_nope_head_dim": 16, "n_group": 2, "num_experts_per_tok": 2,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000},
    "index_topk": 16, "index_head_dim": 16, "index_n_heads": 16,
}

# Bamba-9B's dimensions (ibm-ai-platform/Bamba-9B's config.json: 32 layers, attention on 9, 18
# and 27, 128 Mamba-2 heads of 64 with a 128-wide state in one group), for decode throughput
# runs with random weights; bamba-tiny: the same layout at CPU size (the bench's --tiny)
SHAPES["bamba-9b"] = {
    "architectures": ["BambaForCausalLM"], "model_type": "bamba", "dtype": "bfloat16",
    "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64,
    "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "hidden_act": "silu", "rms_norm_eps": 1e-5, "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
}
SHAPES["bamba-tiny"] = {
    **SHAPES["bamba-9b"], "dtype": "float32", "vocab_size": 256, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
    "num_key_value_heads": 2, "attn_layer_indices": [1], "mamba_n_heads": 4, "mamba_d_head": 32,
    "mamba_d_state": 16, "mamba_chunk_size": 16, "max_position_embeddings": 4096,
}

# a Llama at CPU size (2 layers, 4 heads over 2 KV heads, vocabulary 256): the from_shape
# paths' tests (tensor parallelism included)
SHAPES["llama-tiny"] = {
    "architectures": ["LlamaForCausalLM"], "dtype": "float32", "vocab_size": 256,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
}


def shape_config_dict(name: str) -> dict:
    """A copy of the ``config.json`` dict of a named shape."""
    key = name.strip().lower()
    if key not in SHAPES:
        raise ConfigError(f"unknown model shape {name!r}; known shapes: {', '.join(sorted(SHAPES))}")
    return json.loads(json.dumps(SHAPES[key]))


def shape_config(name: str, *, dtype: str | None = None) -> ModelArchConfig:
    """The architecture of a well-known model (``"qwen3-0.6b"``, ``"llama-3.2-1b"``,
    ``"qwen2.5-0.5b"`` ...), for benchmarks with random weights."""
    d = shape_config_dict(name)
    if dtype is not None:
        d["dtype"] = normalize_dtype_name(dtype)
    return ModelArchConfig.from_dict(d, source=f"shape {name!r}")


__all__ = [
    "FAMILIES",
    "Dsv4Config",
    "IndexerConfig",
    "LinearAttnConfig",
    "MambaConfig",
    "MlaConfig",
    "ModelArchConfig",
    "MoeConfig",
    "ROPE_TYPES",
    "RopeConfig",
    "SHAPES",
    "SUPPORTED_ARCHITECTURES",
    "load_model_config",
    "normalize_dtype_name",
    "shape_config",
    "shape_config_dict",
]
