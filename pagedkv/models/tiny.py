"""Small deterministic checkpoints of each supported family, built offline.

``build_tiny_checkpoint("qwen3")`` writes (once) a Hugging Face checkpoint directory into a
cache directory and returns its path: ``config.json`` and safetensors weights written by
transformers' own model class (``save_pretrained``; sharded with ``max_shard_size``), plus a
byte-level BPE tokenizer trained with ``tokenizers`` on a small built-in corpus
(``tokenizer.json`` + ``tokenizer_config.json`` with bos/eos/pad).

Weights are drawn from one seeded generator in parameter-name order (matrices ~ N(0, init_std);
norm weights 1 + N(0, 0.1); biases N(0, 0.1)), so they do not depend on transformers' init
code, and norms and biases are not trivially 1 and 0 (a loader that drops them is caught). The
routers of the MoE families (Qwen3-MoE, Mixtral, DeepSeek-V3) are then adjusted so the corpus
reaches every expert (``_spread_routing``); DeepSeek-V3's ``e_score_correction_bias`` (a buffer,
zero in transformers' init) gets N(0, 0.05) values, so the expert choice depends on it.

Idempotent: a directory is keyed by a hash of its spec and reused when its marker file exists;
it is built in a temporary directory and renamed into place, so concurrent builders are safe.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, field, replace

from pagedkv.errors import ConfigError, InvariantError
from pagedkv.models.cache_dir import cache_root

FORMAT_VERSION = 1
MARKER = "pagedkv_tiny.json"

FAMILY_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "deepseek_v32": "DeepseekV32ForCausalLM",
}
MOE_FAMILIES = ("qwen3_moe", "mixtral", "deepseek_v3", "deepseek_v32")
# Mamba-2 hybrids (their mixer options are transformers config keys: TinySpec.mamba_options)
MAMBA_FAMILIES = ("bamba", "falcon_h1")
FAMILY_ARCHITECTURES.update(bamba="BambaForCausalLM", falcon_h1="FalconH1ForCausalLM")
# Qwen3-Next: Gated-DeltaNet layers beside gated attention, MoE (TinySpec.linear_options)
FAMILY_ARCHITECTURES["qwen3_next"] = "Qwen3NextForCausalLM"
MOE_FAMILIES = (*MOE_FAMILIES, "qwen3_next")
# GPT-OSS: sliding / full attention alternating, attention sinks, MoE with biases everywhere
FAMILY_ARCHITECTURES["gpt_oss"] = "GptOssForCausalLM"
MOE_FAMILIES = (*MOE_FAMILIES, "gpt_oss")
# Cohere2: 3 sliding : 1 full attention, RoPE on the sliding layers, parallel block, logit scale
FAMILY_ARCHITECTURES["cohere2"] = "Cohere2ForCausalLM"
# transformers config class per family where it is not "<Architecture minus ForCausalLM>Config"
CONFIG_CLASSES = {"gemma3": "Gemma3TextConfig"}

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")  # ids 0, 1, 2
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

CORPUS = """\
The scheduler decides which requests run in the next step and how many tokens each may compute.
Every request owns a list of blocks; a block holds the keys and values of sixteen tokens.
The block table maps a request row and a logical block to a physical block in the pool.
A slot is a block id times the block size plus the offset of the token inside its block.
Padding slots are minus one and the writer skips them; the null block is never written.
When the pool runs out of free blocks, the scheduler preempts the newest running request.
Prefix caching hashes full blocks so that a new prompt can reuse the blocks of an old one.
Chunked prefill splits a long prompt over several steps so that decode requests keep moving.
The quick brown fox jumps over the lazy dog while the model writes one token at a time.
Numbers such as 1, 2, 3, 16, 32, 128 and 4096 appear in shapes, sizes and budgets.
Attention reads the context of each request through its block table, one page at a time.
Greedy decoding picks the most likely token; sampling draws from the softened distribution.
A small model with random weights still produces deterministic tokens for a fixed seed.
Hello world! How are you today? The weather is fine, and the tests are green again.
Keys, values, queries and heads: grouped-query attention shares one key head among several.
Rotary embeddings turn positions into angles; scaling stretches them for longer contexts.
"""


@dataclass(frozen=True)
class TinySpec:
    family: str
    num_layers: int = 2
    hidden_size: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    vocab_size: int = 512
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    rope_scaling: dict | None = field(default=None, hash=False)
    tie_word_embeddings: bool | None = None  # None: family default (qwen tied, llama/mistral not)
    attention_bias: bool = False  # llama and qwen3 only (qwen2 always has q/k/v bias)
    mlp_bias: bool = False  # llama only
    dtype: str = "float32"
    max_shard_size: str | int | None = None
    seed: int = 0
    init_std: float = 0.1
    # sliding window of the mistral family (every layer) or of qwen2/qwen3 (layers >=
    # max_window_layers, transformers' rule); None: full attention everywhere
    sliding_window: int | None = None
    max_window_layers: int = 0
    # mixture of experts (qwen3_moe, mixtral). Mixtral's experts have intermediate_size;
    # Qwen3-MoE's moe_intermediate_size (its dense layers intermediate_size).
    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 32
    # qwen3_moe and deepseek_v3 (Mixtral always renormalizes); None: the family's default
    # (qwen3_moe false, deepseek_v3 true)
    norm_topk_prob: bool | None = None
    decoder_sparse_step: int = 1  # qwen3_moe
    mlp_only_layers: tuple[int, ...] = ()  # qwen3_moe
    # False: save transformers' own layout (stacked expert tensors) instead of the per-expert
    # names save_pretrained writes by default
    save_original_format: bool = True
    # DeepSeek-V3: latent attention (q_lora_rank None: a plain q_proj; v_head_dim differs
    # from qk_nope_head_dim so that a mix-up of the two shows), layers >= first_k_dense_replace
    # sparse, group-limited routing (n_group groups, the best topk_group of them), shared
    # experts. num_kv_heads and head_dim do not apply (the latent has one head).
    q_lora_rank: int | None = 24
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 12
    rope_interleave: bool = True
    first_k_dense_replace: int = 1
    n_group: int = 2
    topk_group: int = 1
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    # qwen3_next: transformers config keys over the tiny hybrid (_QWEN3_NEXT_TINY: layers
    # alternating linear / full attention, 2 key and 4 value heads of 16, conv width 4, RoPE on
    # half of each head, a shared expert of 24), e.g. {"linear_conv_kernel_dim": 3}
    linear_options: dict | None = field(default=None, hash=False)
    # bamba / falcon_h1: transformers config keys over the tiny mixers (_MAMBA_TINY: 4 heads
    # in 2 groups, state 16; Bamba's attention on layer 1, Falcon-H1's multipliers 1), e.g.
    # {"mamba_rms_norm": True, "key_multiplier": 0.7}
    mamba_options: dict | None = field(default=None, hash=False)
    # DeepSeek-V3.2 (deepseek_v32: DeepSeek-V3's options, RoPE always interleaved, q LoRA
    # required) adds the lightning indexer: index_n_heads query heads of index_head_dim (its
    # first qk_rope_head_dim dimensions rotated), top-k of index_topk positions per token
    index_n_heads: int = 16
    index_head_dim: int = 16
    index_topk: int = 8

    def validate(self) -> None:
        if self.family not in FAMILY_ARCHITECTURES:
            raise ConfigError(
                f"unknown tiny family {self.family!r}; choose one of {', '.join(FAMILY_ARCHITECTURES)}"
            )
        if self.vocab_size < 300:
            raise ConfigError(
                f"tiny vocab_size must be >= 300 (256 byte tokens + specials + merges), got {self.vocab_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("tiny num_heads must be a multiple of num_kv_heads")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"tiny dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.attention_bias and self.family not in ("llama", "qwen3", "qwen3_moe", "cohere2", "gemma2",
                                                       "gemma3", *DEEPSEEK_FAMILIES):
            raise ConfigError("attention_bias is a llama/qwen3/gemma/deepseek option")
        if self.mlp_bias and self.family != "llama":
            raise ConfigError("mlp_bias is a llama option")
        if self.sliding_window is not None and self.family == "llama":
            raise ConfigError("sliding_window is a mistral / qwen2 / qwen3 option")
        moe_opts = {f: getattr(self, f) for f in _MOE_DEFAULTS if getattr(self, f) != _MOE_DEFAULTS[f]}
        if self.family not in MOE_FAMILIES and moe_opts:
            raise ConfigError(f"{', '.join(moe_opts)}: options of the MoE families {MOE_FAMILIES}")
        if self.family == "mixtral" and set(moe_opts) & {"moe_intermediate_size", "norm_topk_prob",
                                                          "decoder_sparse_step", "mlp_only_layers"}:
            raise ConfigError("mixtral: every layer is sparse, experts of intermediate_size, "
                              "always renormalized; only num_experts / num_experts_per_tok apply")
        mla_opts = [f for f in _MLA_DEFAULTS if getattr(self, f) != _MLA_DEFAULTS[f]]
        if self.family not in DEEPSEEK_FAMILIES and mla_opts:
            raise ConfigError(f"{', '.join(mla_opts)}: options of deepseek_v3 / deepseek_v32")
        dsa_opts = [f for f in _DSA_DEFAULTS if getattr(self, f) != _DSA_DEFAULTS[f]]
        if self.family != "deepseek_v32" and dsa_opts:
            raise ConfigError(f"{', '.join(dsa_opts)}: options of deepseek_v32")
        if self.family == "deepseek_v32" and (self.q_lora_rank is None or not self.rope_interleave
                                              or self.index_head_dim < self.qk_rope_head_dim):
            raise ConfigError("deepseek_v32: needs q_lora_rank, interleaved RoPE and "
                              "index_head_dim >= qk_rope_head_dim")
        if self.family in DEEPSEEK_FAMILIES:
            if set(moe_opts) & {"decoder_sparse_step", "mlp_only_layers"}:
                raise ConfigError("deepseek_v3: sparse layers follow first_k_dense_replace")
            if self.num_experts % self.n_group or self.num_experts // self.n_group < 2:
                raise ConfigError("deepseek_v3: num_experts must be a multiple of n_group with "
                                  ">= 2 experts per group")
            if not 1 <= self.topk_group <= self.n_group or self.num_experts_per_tok > (
                    self.topk_group * (self.num_experts // self.n_group)):
                raise ConfigError("deepseek_v3: need 1 <= topk_group <= n_group and "
                                  "num_experts_per_tok <= the experts of topk_group groups")
        if self.family in MOE_FAMILIES and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ConfigError("tiny num_experts_per_tok must lie in [1, num_experts]")
        if self.mamba_options is not None and self.family not in MAMBA_FAMILIES:
            raise ConfigError(f"mamba_options: an option of {MAMBA_FAMILIES}")
        if self.linear_options is not None and self.family != "qwen3_next":
            raise ConfigError("linear_options: an option of qwen3_next")
        if not all(0 <= i < self.num_layers for i in self.mlp_only_layers):
            raise ConfigError(f"tiny mlp_only_layers must be layer indices < {self.num_layers}")

    @property
    def tied(self) -> bool:
        if self.tie_word_embeddings is not None:
            return self.tie_word_embeddings
        return self.family in ("qwen2", "qwen3")

    def key(self) -> str:
        d = asdict(self)
        for f, default in {**_MOE_DEFAULTS, **_MLA_DEFAULTS, **_DSA_DEFAULTS}.items():  # absent at their
            if d[f] == default:  # defaults: older keys hold
                del d[f]
        if d["mamba_options"] is None:  # absent: older keys hold
            del d["mamba_options"]
        if d["linear_options"] is None:  # absent: older keys hold
            del d["linear_options"]
        d["format"] = FORMAT_VERSION
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


_MOE_DEFAULTS = {f: getattr(TinySpec, f) for f in (
    "num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
    "decoder_sparse_step", "mlp_only_layers", "save_original_format")}
_MLA_DEFAULTS = {f: getattr(TinySpec, f) for f in (
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "rope_interleave", "first_k_dense_replace", "n_group", "topk_group", "n_shared_experts",
    "routed_scaling_factor")}
_DSA_DEFAULTS = {f: getattr(TinySpec, f) for f in ("index_n_heads", "index_head_dim", "index_topk")}
DEEPSEEK_FAMILIES = ("deepseek_v3", "deepseek_v32")


def default_cache_dir() -> str:
    return os.path.join(cache_root(), "tiny")


def hf_config_dict(spec: TinySpec) -> dict:
    """Keyword arguments of the family's transformers config class."""
    rope = {"rope_type": "default", "rope_theta": float(spec.rope_theta)}
    if spec.rope_scaling:
        rope = {"rope_theta": float(spec.rope_theta), **spec.rope_scaling}
        rope.setdefault("rope_type", "default")
    d = dict(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        initializer_range=spec.init_std,
        tie_word_embeddings=spec.tied,
        rope_parameters=rope,
        bos_token_id=BOS_ID,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
    )
    if spec.family == "llama":
        d.update(attention_bias=spec.attention_bias, mlp_bias=spec.mlp_bias)
    elif spec.family in ("qwen2", "qwen3"):
        if spec.family == "qwen3":
            d.update(attention_bias=spec.attention_bias)
        if spec.sliding_window is None:
            d.update(use_sliding_window=False)
        else:
            d.update(use_sliding_window=True, sliding_window=spec.sliding_window,
                     max_window_layers=spec.max_window_layers)
    elif spec.family == "mistral":
        d.update(sliding_window=spec.sliding_window)
    elif spec.family == "mixtral":
        d.update(sliding_window=spec.sliding_window, num_local_experts=spec.num_experts,
                 num_experts_per_tok=spec.num_experts_per_tok)
    elif spec.family in DEEPSEEK_FAMILIES:
        del d["head_dim"]  # transformers sets it to qk_rope_head_dim
        d.update(num_key_value_heads=spec.num_heads, attention_bias=spec.attention_bias,
                 q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                 qk_nope_head_dim=spec.qk_nope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
                 v_head_dim=spec.v_head_dim, rope_interleave=spec.rope_interleave,
                 n_routed_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                 moe_intermediate_size=spec.moe_intermediate_size,
                 norm_topk_prob=True if spec.norm_topk_prob is None else spec.norm_topk_prob,
                 first_k_dense_replace=spec.first_k_dense_replace, n_group=spec.n_group,
                 topk_group=spec.topk_group, n_shared_experts=spec.n_shared_experts,
                 routed_scaling_factor=spec.routed_scaling_factor)
        if spec.family == "deepseek_v32":  # always interleaved; the indexer
            del d["rope_interleave"]
            d.update(index_n_heads=spec.index_n_heads, index_head_dim=spec.index_head_dim,
                     index_topk=spec.index_topk)
    elif spec.family == "qwen3_moe":
        d.update(attention_bias=spec.attention_bias, num_experts=spec.num_experts,
                 num_experts_per_tok=spec.num_experts_per_tok,
                 moe_intermediate_size=spec.moe_intermediate_size,
                 norm_topk_prob=bool(spec.norm_topk_prob), decoder_sparse_step=spec.decoder_sparse_step,
                 mlp_only_layers=list(spec.mlp_only_layers),
                 use_sliding_window=spec.sliding_window is not None,
                 sliding_window=spec.sliding_window)
    elif spec.family in ("gemma2", "gemma3"):
        # interleaved local/global layers need a window; the softcaps keep their defaults
        d.update(sliding_window=spec.sliding_window or 16, query_pre_attn_scalar=spec.head_dim,
                 hidden_activation="gelu_pytorch_tanh", attention_bias=spec.attention_bias)
        if spec.family == "gemma3":
            d["rope_parameters"] = {
                "full_attention": dict(rope, rope_theta=float(spec.rope_theta) * 100),
                "sliding_attention": {"rope_type": "default", "rope_theta": float(spec.rope_theta)},
            }
    if spec.family == "gpt_oss":
        # q/k/v/o biases; layers alternate sliding (window 16 unless set) / full; experts of
        # intermediate_size; YaRN RoPE (4x over max_position_embeddings / 4) unless
        # rope_scaling is set; a SwiGLU limit of 1 (7 in the real models) so that the clamp
        # acts on the tiny model's activations
        d.update(sliding_window=spec.sliding_window or 16, attention_bias=True,
                 num_local_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                 swiglu_limit=1.0, layer_types=[("sliding_attention", "full_attention")[i % 2]
                                                for i in range(spec.num_layers)])
        if not spec.rope_scaling:
            d["rope_parameters"] = dict(
                rope_type="yarn", rope_theta=float(spec.rope_theta), factor=4.0,
                original_max_position_embeddings=spec.max_position_embeddings // 4,
                beta_fast=32.0, beta_slow=1.0, truncate=False)
    if spec.family == "cohere2":
        # head_dim is hidden / heads and the norm eps layer_norm_eps (no such keys); tied
        # unless said otherwise; a logit scale of 0.5 (0.0625 in Cohere2Config) and YaRN-free
        # default RoPE; layers sliding, sliding, sliding, full, ...
        del d["head_dim"], d["rms_norm_eps"]
        d.update(layer_norm_eps=spec.rms_norm_eps, logit_scale=0.5,
                 sliding_window=spec.sliding_window or 16, attention_bias=spec.attention_bias,
                 tie_word_embeddings=spec.tie_word_embeddings is not False,
                 layer_types=[("sliding_attention", "full_attention")[(i + 1) % 4 == 0]
                              for i in range(spec.num_layers)])
    if spec.family in MAMBA_FAMILIES:
        d.update(_MAMBA_TINY)
        d.update({"attn_layer_indices": [1]} if spec.family == "bamba" else {"mamba_d_ssm": None})
        d.update(spec.mamba_options or {})
    if spec.family == "qwen3_next":
        d.update(_QWEN3_NEXT_TINY, attention_bias=spec.attention_bias,
                 num_experts=spec.num_experts, num_experts_per_tok=spec.num_experts_per_tok,
                 moe_intermediate_size=spec.moe_intermediate_size,
                 norm_topk_prob=spec.norm_topk_prob is not False,
                 decoder_sparse_step=spec.decoder_sparse_step,
                 mlp_only_layers=list(spec.mlp_only_layers),
                 layer_types=[("linear_attention", "full_attention")[i % 2]
                              for i in range(spec.num_layers)],
                 rope_parameters=dict(d["rope_parameters"], partial_rotary_factor=0.5))
        d.update(spec.linear_options or {})
    return d


_QWEN3_NEXT_TINY = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                        linear_value_head_dim=16, linear_conv_kernel_dim=4,
                        shared_expert_intermediate_size=24)


_MAMBA_TINY = dict(mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
                   mamba_expand=2, mamba_chunk_size=16)


def train_tokenizer(vocab_size: int, *, add_bos: bool):
    """A byte-level BPE tokenizer trained on ``CORPUS`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.splitlines(), trainer=trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    for i, t in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(t) != i:
            raise InvariantError("tiny-tokenizer", "special token got an unexpected id",
                                 token=t, expected=i, got=tok.token_to_id(t))
    return tok


def _fill_weights(model, spec: TinySpec) -> None:
    import torch

    family_salt = list(FAMILY_ARCHITECTURES).index(spec.family)  # insertion order: stable
    gen = torch.Generator().manual_seed(spec.seed * 1000 + family_salt)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                vals = torch.randn(p.shape, generator=gen) * spec.init_std
            elif name.endswith("bias"):
                vals = torch.randn(p.shape, generator=gen) * 0.1
            else:  # norm weights
                vals = 1.0 + torch.randn(p.shape, generator=gen) * 0.1
            p.copy_(vals.to(p.dtype))


def _fill_correction_bias(model, spec: TinySpec) -> None:
    """DeepSeek-V3's ``e_score_correction_bias`` buffers ~ N(0, 0.05), seeded per layer."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed * 1000 + 977)
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape, generator=gen) * 0.05)


def _fill_mamba(model, spec: TinySpec) -> None:
    """The Mamba-2 mixers' per-head parameters, seeded: ``A_log = log(U(0.05, 0.6))`` and
    ``dt_bias ~ N(-1, 0.3)`` (slow decays, so a state carries many tokens and a state that is
    lost or stale shows in the outputs), ``D ~ N(1, 0.3)``; conv kernels ~ N(0, 0.4) (the
    generic 0.1 leaves the SiLU almost linear)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed * 1000 + 983)
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = getattr(layer, "mamba", None)
            if mixer is None:
                continue
            n = mixer.A_log.shape[0]
            mixer.A_log.copy_(torch.log(0.05 + 0.55 * torch.rand(n, generator=gen)))
            mixer.dt_bias.copy_(-1.0 + 0.3 * torch.randn(n, generator=gen))
            mixer.D.copy_(1.0 + 0.3 * torch.randn(n, generator=gen))
            w = mixer.conv1d.weight
            w.copy_(0.4 * torch.randn(w.shape, generator=gen))


def _spread_routing(model, tok) -> None:
    """Make the random routers of an MoE model route the corpus to all experts.

    With random weights the inputs of a layer's router share a few large common directions
    (mean cosine 0.3-0.8 between tokens), so ``W x`` is dominated by them and two or three
    experts take most tokens. Layer by layer (each change moves the later inputs), the random
    router ``R`` becomes ``W = c R S^(-1/2) Q``: ``Q`` removes the direction of the mean input
    of the corpus tokens (the router has no bias to cancel it), ``S`` is the covariance of the
    projected inputs (regularized), so the corpus logits are an isotropic random projection,
    scaled (``c``) to standard deviation 1. Deterministic: the weights, the corpus and the
    tokenizer are."""
    import torch

    ids = [torch.tensor([tok.encode(line).ids]) for line in CORPUS.splitlines() if line]
    for layer in model.model.layers:
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is None or not hasattr(layer.mlp, "experts"):
            continue  # a dense layer
        inputs = []
        hook = router.register_forward_pre_hook(
            lambda mod, args: inputs.append(args[0].reshape(-1, args[0].shape[-1])))
        with torch.no_grad():
            for x in ids:
                model(x)
            hook.remove()
            xs = torch.cat(inputs).double()
            u = xs.mean(0)
            u = u / u.norm()
            q = torch.eye(xs.shape[1], dtype=torch.float64) - torch.outer(u, u)
            ys = xs @ q
            cov = ys.T @ ys / ys.shape[0]
            vals, vecs = torch.linalg.eigh(cov)
            vals = vals.clamp_min(0) + 1e-3 * float(vals.clamp_min(0).mean())
            w = router.weight.double() @ (vecs @ torch.diag(vals.rsqrt()) @ vecs.T) @ q
            w = w / (xs @ w.T).std()
            router.weight.copy_(w.to(router.weight.dtype))


def _fill_gated_deltanet(model, spec: TinySpec) -> None:
    """Qwen3-Next's mixers: ``A_log = log(U(0.02, 0.3))``, seeded (slow decays, so the
    recurrent state carries many tokens and a lost or stale state shows in the outputs)."""
    import torch

    gen = torch.Generator().manual_seed(spec.seed * 1000 + 991)
    with torch.no_grad():
        for layer in model.model.layers:
            mixer = getattr(layer, "linear_attn", None)
            if mixer is not None:
                a = torch.rand(mixer.A_log.shape, generator=gen) * 0.28 + 0.02
                mixer.A_log.copy_(a.log())


def _build(spec: TinySpec, out_dir: str) -> None:
    import torch
    import transformers

    arch = FAMILY_ARCHITECTURES[spec.family]
    config_cls = getattr(transformers, CONFIG_CLASSES.get(spec.family, arch.replace("ForCausalLM", "Config")))
    model_cls = getattr(transformers, arch)
    config = config_cls(**hf_config_dict(spec))
    model = model_cls(config)
    _fill_weights(model, spec)
    tok = train_tokenizer(spec.vocab_size, add_bos=spec.family in (
        "llama", "mistral", "gemma2", "gemma3", "mixtral", *DEEPSEEK_FAMILIES))
    if tok.get_vocab_size() > spec.vocab_size:
        raise ConfigError(f"trained tokenizer has {tok.get_vocab_size()} tokens > vocab_size {spec.vocab_size}")
    if spec.family in DEEPSEEK_FAMILIES:
        _fill_correction_bias(model, spec)
    if spec.family == "qwen3_next":
        _fill_gated_deltanet(model, spec)
    if spec.family in MOE_FAMILIES:
        _spread_routing(model, tok)
    if spec.family in MAMBA_FAMILIES:
        _fill_mamba(model, spec)
    model = model.to(getattr(torch, spec.dtype))
    kwargs = {} if spec.max_shard_size is None else {"max_shard_size": spec.max_shard_size}
    if not spec.save_original_format:
        kwargs["save_original_format"] = False
    model.save_pretrained(out_dir, **kwargs)

    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": SPECIAL_TOKENS[BOS_ID],
                "eos_token": SPECIAL_TOKENS[EOS_ID],
                "pad_token": SPECIAL_TOKENS[PAD_ID],
                "model_max_length": spec.max_position_embeddings,
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=2,
        )
    with open(os.path.join(out_dir, MARKER), "w", encoding="utf-8") as f:
        json.dump({**asdict(spec), "format": FORMAT_VERSION, "transformers": transformers.__version__},
                  f, indent=2, default=str)


def build_tiny_checkpoint(family: str, cache_dir: str | os.PathLike | None = None, **options) -> str:
    """Path of the tiny checkpoint of ``family`` with ``options`` (``TinySpec`` fields),
    building it into ``cache_dir`` (default ``<cache_root()>/tiny``: ``$PAGEDKV_CACHE``,
    ``$PAGEDKV_CACHE_DIR`` or ``~/.cache/pagedkv``) unless it is there already."""
    try:
        spec = TinySpec(family=family, **options)
    except TypeError as e:
        raise ConfigError(f"bad tiny checkpoint option: {e}; options are the TinySpec fields") from None
    spec.validate()
    cache_dir = os.fspath(cache_dir) if cache_dir is not None else default_cache_dir()
    os.makedirs(cache_dir, exist_ok=True)
    target = os.path.join(cache_dir, f"{family}-{spec.key()}")
    if os.path.isfile(os.path.join(target, MARKER)):
        return target
    tmp = tempfile.mkdtemp(prefix=f".{family}-building-", dir=cache_dir)
    try:
        _build(spec, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, MARKER)):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def shape_spec_options(name: str, **overrides) -> tuple[str, dict]:
    """``(family, TinySpec options)`` reproducing a named shape of ``pagedkv.models.config``
    (``"qwen3-0.6b"`` ...) with random weights (std 0.02), for full-size parity runs::

        family, opts = shape_spec_options("qwen3-0.6b", dtype="bfloat16")
        path = build_tiny_checkpoint(family, cache_dir, **opts)
    """
    from pagedkv.models.config import shape_config, shape_config_dict

    cfg = shape_config(name)
    raw = shape_config_dict(name)
    family = next(f for f, a in FAMILY_ARCHITECTURES.items() if a == cfg.architecture)
    rope = raw.get("rope_scaling") or None
    opts = dict(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.intermediate_size,
        vocab_size=cfg.vocab_size,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope.rope_theta,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_scaling=dict(rope) if rope else None,
        tie_word_embeddings=cfg.tie_word_embeddings,
        dtype=cfg.dtype,
        init_std=0.02,
    )
    opts.update(overrides)
    return family, opts


def tiny_spec(family: str, **options) -> TinySpec:
    spec = replace(TinySpec(family=family), **options)
    spec.validate()
    return spec


__all__ = [
    "CORPUS",
    "FAMILY_ARCHITECTURES",
    "MAMBA_FAMILIES",
    "MOE_FAMILIES",
    "TinySpec",
    "build_tiny_checkpoint",
    "default_cache_dir",
    "hf_config_dict",
    "shape_spec_options",
    "tiny_spec",
    "train_tokenizer",
]
