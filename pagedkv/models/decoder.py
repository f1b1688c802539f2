"""One generic decoder-only transformer for the Llama, Qwen2, Qwen3 and Mistral families.

The families differ only by flags of ``ModelArchConfig``: q/k/v bias (Qwen2; Llama and Qwen3
with ``attention_bias``), o_proj bias, MLP bias (Llama ``mlp_bias``), per-head q/k RMSNorm
before RoPE (Qwen3), tied embeddings, RoPE scaling.

Inputs are flat packed tokens of a mixed batch (``input_ids [T]``, ``positions [T]`` int64),
one KV cache per layer and an attention-metadata object; attention goes through an
``AttentionBackend``. ``forward`` returns hidden states ``[T, hidden]``;
``compute_logits(hidden, indices)`` projects only the rows that get sampled.

Layer paths, same results up to rounding: the plain one (``forward_split``: QKV, q/k norms,
RoPE in torch, the backend writes K/V) and, when the backend has ``fused_kv_write`` and the
Triton kernels can run, the fused one (QKV GEMM, then one kernel for q/k norms + RoPE + the
paged KV write, the backend only attends; between two attention calls one region
``post_pre_qkv``). ``compile_regions`` compiles the torch parts of both. Two opt-in variants of
the fused path for decode-sized batches: the QKV GEMM inside that kernel too
(``fuse_qkv_projection``: the regions end at the input norm, ``post_pre_norm``), and the fused
decode chain (``fuse_decode_chain``, ``DecoderLayer.decode_chain``: four kernels a layer
besides attention, no compiled region).
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.attention.backend import (
    AttentionBackend,
    AttentionLayout,
    AttentionMetadataLike,
    AttentionPlan,
    StepAttention,
)
from pagedkv.attention.kv_cache import allocate_kv_caches, allocate_layer_caches
from pagedkv.attention.torch_ref import TorchRefBackend
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.kernels import lm_head_argmax as _lha
from pagedkv.kernels.argmax import argmax_rows
from pagedkv.kernels.splitk_gemm import linear_partials
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.layers import GatedMLP, Linear, QKVProjection, RMSNorm, gate_up_silu, rms_norm
from pagedkv.models.rotary import RotaryEmbedding, apply_rotary, tokens_seq_lens


# The fused QKV projection (``pagedkv.kernels.qkv_rope_cache``) for decode-sized batches:
# opt-in (environment ``PAGEDKV_FUSED_QKV=1``) until measured end to end on the H200.
FUSED_QKV_ENABLED = os.environ.get("PAGEDKV_FUSED_QKV", "0") == "1"
FUSED_QKV_MAX_ROWS = 256
# The fused decode chain (``DecoderLayer.decode_chain``: the input and post-attention norms
# inside the QKV and gate/up kernels, the residual adds inside the o / down split-K epilogues,
# no inductor kernel between two attention calls) for decode-sized batches: opt-in
# (``PAGEDKV_FUSED_DECODE=1``) until measured end to end on the H200.
FUSED_DECODE_ENABLED = os.environ.get("PAGEDKV_FUSED_DECODE", "0") == "1"
FUSED_DECODE_MAX_ROWS = 256
# The persistent decode layer (``pagedkv.kernels.persistent_layer``: o_proj, the post-attention
# norm, gate/up + SiLU, down_proj, the next layer's input norm and fused QKV + q/k norms + RoPE
# + KV write in one launch with grid barriers; ``DecoderLayer.persistent_post``) for
# decode-sized batches: opt-in (``PAGEDKV_PERSISTENT_DECODE=1``): measured slower than the
# default path at 1-256 rows (H100, BENCHMARKS.md thirty-fifth session).
PERSISTENT_DECODE_ENABLED = os.environ.get("PAGEDKV_PERSISTENT_DECODE", "0") == "1"
PERSISTENT_DECODE_MAX_ROWS = 256

# The q/k norms, RoPE and K/V write of decode-only steps done by the decode attention launch
# itself (``pagedkv.attention.triton_decode.QKPrologue``; one launch less a layer): opt-in
# (``PAGEDKV_DECODE_PROLOGUE=1``): measured no faster (H100, thirty-sixth session: -2.1 to
# +2.1 us a layer at B1-B256, W1 -0.4%, one pair; BENCHMARKS.md).
DECODE_PROLOGUE_ENABLED = os.environ.get("PAGEDKV_DECODE_PROLOGUE", "0") == "1"


class Attention(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = QKVProjection(
            cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
            bias=cfg.qkv_bias, dtype=dtype, device=device,
        )
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, dtype=dtype, device=device)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: AttentionPlan,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(self.layer_idx, q, k, v, kv_cache, plan, self.scale)
        return self.o_proj(out.reshape(hidden.shape[0], self.num_heads * self.head_dim))


def residual_add(hidden: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``hidden + delta``. Inside a compiled region, for bf16/fp16, written as a float32 add
    with one rounding, which is bitwise what the eager half-precision add computes (torch adds
    half types in float32 and rounds once) but keeps inductor from folding the add into the
    preceding GEMM (``addmm``: cuBLAS then first copies ``hidden`` into the output, an extra
    kernel per residual, measured 1.6 us per layer on the H200); the add fuses into the
    following RMSNorm kernel instead."""
    if delta.dtype != hidden.dtype or (
            hidden.dtype in (torch.bfloat16, torch.float16) and torch.compiler.is_compiling()):
        # a float32 delta (split-K partial sums, ``linear_partials``) is added unrounded
        return (hidden.float() + delta.float()).to(hidden.dtype)
    return hidden + delta


def pre_attention(
    hidden: torch.Tensor,
    delta: torch.Tensor | None,
    ln_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    qk_eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer up to attention: ``hidden += delta`` (the previous layer's MLP output, when
    given), input RMSNorm, fused QKV projection, per-head q/k RMSNorm (Qwen3), RoPE. Returns
    ``(hidden, q, k, v)``. Plain tensor code: ``DecoderForCausalLM.compile_regions`` compiles it."""
    if delta is not None:
        hidden = residual_add(hidden, delta)
    x = rms_norm(hidden, ln_weight, eps)
    qkv = F.linear(x, qkv_weight, qkv_bias)
    t = x.shape[0]
    q_size = num_heads * head_dim
    kv_size = num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(t, num_heads, head_dim)
    k = k.reshape(t, num_kv_heads, head_dim)
    v = v.reshape(t, num_kv_heads, head_dim)
    if q_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, qk_eps), rms_norm(k, k_norm_weight, qk_eps)
    return hidden, apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v


def pre_attention_qkv(
    hidden: torch.Tensor,
    delta: torch.Tensor | None,
    ln_weight: torch.Tensor,
    eps: float,
    qkv_weight: torch.Tensor,
    qkv_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer up to its fused QKV projection: ``hidden += delta`` (when given), input RMSNorm,
    QKV GEMM. Returns ``(hidden, qkv [T, (H + 2 Hkv) D])``. The fused-KV-write path: the q/k
    norms, RoPE and the KV-cache write follow in one kernel
    (``pagedkv.kernels.qk_norm_rope_cache``)."""
    hidden, x = pre_attention_norm(hidden, delta, ln_weight, eps)
    return hidden, F.linear(x, qkv_weight, qkv_bias)


def pre_attention_norm(
    hidden: torch.Tensor,
    delta: torch.Tensor | None,
    ln_weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer up to its input RMSNorm: ``hidden += delta`` (when given), the norm. Returns
    ``(hidden, x)``. The fused-projection path: the QKV GEMM, q/k norms, RoPE and the KV-cache
    write follow in one kernel (``pagedkv.kernels.qkv_rope_cache``)."""
    if delta is not None:
        hidden = residual_add(hidden, delta)
    return hidden, rms_norm(hidden, ln_weight, eps)


def post_attention(
    hidden: torch.Tensor,
    attn_out: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    ln_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    reduce=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer after attention: ``hidden += o_proj(attn_out)``, post-attention RMSNorm, the
    gated MLP. Returns ``(hidden, mlp_out)``; the residual add of ``mlp_out`` is done by the next
    layer's :func:`pre_attention` (or the final norm), so it fuses with that norm.

    ``reduce`` (a tensor-parallel shard's ``TPGroup.all_reduce``): ``o_proj`` and ``down_proj``
    are row-parallel, their partial products summed over the ranks before the bias."""
    hidden = residual_add(hidden, _row_linear(attn_out.reshape(hidden.shape[0], -1), o_weight,
                                              o_bias, reduce))
    x = rms_norm(hidden, ln_weight, eps)
    return hidden, _row_linear(gate_up_silu(x, gate_up_weight, gate_up_bias),
                               down_weight, down_bias, reduce)


def _row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                reduce=None) -> torch.Tensor:
    """The product of a projection into the residual stream: ``linear_partials`` (``F.linear``,
    or on CUDA for decode-sized batches the unrounded float32 split-K sum); with ``reduce``,
    ``F.linear`` summed over the ranks before the bias."""
    if reduce is None:
        return linear_partials(x, weight, bias)
    out = reduce(F.linear(x, weight))
    return out if bias is None else out + bias


def post_pre_qkv(
    hidden: torch.Tensor,
    attn_out: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    ln_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    next_ln_weight: torch.Tensor,
    next_eps: float,
    next_qkv_weight: torch.Tensor,
    next_qkv_bias: torch.Tensor | None,
    reduce=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Everything between two attention calls on the fused-KV-write path: layer i's
    :func:`post_attention` then layer i+1's :func:`pre_attention_qkv`. Returns ``(hidden,
    qkv)`` of layer i+1. One compiled region per layer boundary instead of two: half the
    per-call host cost of compiled regions in eager (prefill) steps."""
    hidden, x = post_pre_norm(hidden, attn_out, o_weight, o_bias, ln_weight, eps,
                              gate_up_weight, gate_up_bias, down_weight, down_bias,
                              next_ln_weight, next_eps, reduce)
    return hidden, F.linear(x, next_qkv_weight, next_qkv_bias)


def post_pre_norm(
    hidden: torch.Tensor,
    attn_out: torch.Tensor,
    o_weight: torch.Tensor,
    o_bias: torch.Tensor | None,
    ln_weight: torch.Tensor,
    eps: float,
    gate_up_weight: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_weight: torch.Tensor,
    down_bias: torch.Tensor | None,
    next_ln_weight: torch.Tensor,
    next_eps: float,
    reduce=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`post_pre_qkv` up to layer i+1's input norm (the fused-projection path: the QKV
    GEMM runs in the kernel that also writes K/V). Returns ``(hidden, x)`` of layer i+1."""
    hidden, delta = post_attention(hidden, attn_out, o_weight, o_bias, ln_weight, eps,
                                   gate_up_weight, gate_up_bias, down_weight, down_bias, reduce)
    return pre_attention_norm(hidden, delta, next_ln_weight, next_eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None,
                 mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = Attention(cfg, layer_idx, dtype=dtype, device=device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        # the dense gated MLP, unless a subclass brings its own (the MoE layer's sparse block)
        self.mlp = mlp if mlp is not None else GatedMLP(
            cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias, dtype=dtype, device=device)

    def forward(self, hidden, cos, sin, kv_cache, plan, backend) -> torch.Tensor:
        hidden, delta = self.forward_split(hidden, None, cos, sin, kv_cache, plan, backend)
        return residual_add(hidden, delta)

    def pre_qkv_args(self) -> tuple:
        """The weights :func:`pre_attention_qkv` takes for this layer."""
        qkv = self.self_attn.qkv_proj
        return (self.input_layernorm.weight, self.input_layernorm.eps, qkv.weight, qkv.bias)

    def post_args(self) -> tuple:
        """The weights :func:`post_attention` takes for this layer."""
        attn, mlp = self.self_attn, self.mlp
        return (attn.o_proj.weight, attn.o_proj.bias, self.post_attention_layernorm.weight,
                self.post_attention_layernorm.eps, mlp.gate_up_proj.weight,
                mlp.gate_up_proj.bias, mlp.down_proj.weight, mlp.down_proj.bias)

    def _head_args(self, plan) -> tuple[tuple, torch.Tensor]:
        """What the fused KV-write kernels take from this layer and the step: ``(H, Hkv, D,
        q_norm_weight, k_norm_weight, eps)`` and the plan's slot mapping of the real tokens."""
        attn = self.self_attn
        qn = attn.q_norm
        metadata = plan.metadata
        slots = metadata.slot_mapping[: int(metadata.num_actual_tokens)]
        return (attn.num_heads, attn.num_kv_heads, attn.head_dim,
                None if qn is None else qn.weight, None if qn is None else attn.k_norm.weight,
                0.0 if qn is None else qn.eps), slots

    def attend_fused(self, qkv_out, cos, sin, kv_cache, plan, backend,
                     prologue: bool = False) -> torch.Tensor:
        """The fused path's attention: q/k norms + RoPE + KV write (at the plan's slot mapping)
        in one kernel (``qk_norm_rope_cache``), then the backend with ``k = v = None``; with
        ``prologue`` (``fuse_decode_prologue``), on decode-only steps the decode launch does
        the norms, RoPE and write itself (the backend's ``forward_decode_prologue``)."""
        from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache

        attn = self.self_attn
        heads, slots = self._head_args(plan)
        if prologue:
            from pagedkv.attention.triton_decode import QKPrologue

            out = backend.forward_decode_prologue(
                attn.layer_idx, QKPrologue(qkv_out, *heads, cos, sin, slots), kv_cache, plan,
                attn.scale)
            if out is not None:
                return out
        q = qk_norm_rope_cache(qkv_out, *heads, cos, sin, slots, kv_cache[0], kv_cache[1],
                               check=attn.layer_idx == 0)  # every layer has layer 0's shapes
        return backend.forward(attn.layer_idx, q, None, None, kv_cache, plan, attn.scale)

    def attend_projected(self, x, cos, sin, kv_cache, plan, backend,
                         normed: bool = True) -> torch.Tensor:
        """The fused-projection path's attention: the QKV GEMM of ``x`` with its q/k norms +
        RoPE + KV write in one kernel (``qkv_rope_cache``), then the backend with ``k = v =
        None``. ``x`` is the input norm's output, or (``normed=False``) the layer's input, the
        kernel then applying the input RMSNorm on the fly."""
        from pagedkv.kernels.qkv_rope_cache import qkv_rope_cache

        attn = self.self_attn
        proj = attn.qkv_proj
        ln = self.input_layernorm
        heads, slots = self._head_args(plan)
        q = qkv_rope_cache(
            x, proj.weight, proj.bias, *heads, cos, sin, slots, kv_cache[0], kv_cache[1],
            check=attn.layer_idx == 0,  # every layer has layer 0's shapes
            ln_weight=None if normed else ln.weight, ln_eps=0.0 if normed else ln.eps)
        return backend.forward(attn.layer_idx, q, None, None, kv_cache, plan, attn.scale)

    def decode_chain(self, hidden, cos, sin, kv_cache, plan, backend) -> torch.Tensor:
        """The whole layer in four kernels besides attention (``fuse_decode_chain``): the QKV
        projection with the input norm, q/k norms, RoPE and the KV write
        (:meth:`attend_projected`); o_proj with the residual add in its epilogue
        (``splitk_residual``); gate/up with the post-attention norm and SiLU
        (``gate_up_silu``); down_proj with the residual add. Returns the layer's output
        (residual included)."""
        from pagedkv.kernels.gate_up_silu import gate_up_silu_op
        from pagedkv.kernels.splitk_gemm import splitk_residual_op, splitk_splits

        attn, mlp = self.self_attn, self.mlp
        out = self.attend_projected(hidden, cos, sin, kv_cache, plan, backend, normed=False)
        o, gu, down = attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        hidden = splitk_residual_op(out.reshape(hidden.shape[0], -1), o.weight, o.bias, hidden,
                                    splitk_splits(*o.weight.shape))
        ln = self.post_attention_layernorm
        act = gate_up_silu_op(hidden, gu.weight, gu.bias, ln.weight, ln.eps)
        return splitk_residual_op(act, down.weight, down.bias, hidden,
                                  splitk_splits(*down.weight.shape))

    def persistent_post(self, hidden, attn_out, nxt=None, cos=None, sin=None, kv_cache=None,
                        plan=None, check: bool = False):
        """This layer after its attention (``attn_out``) in one persistent launch
        (``fuse_persistent_decode``): o_proj + residual, the post-attention norm, gate/up +
        SiLU, down_proj + residual and, with ``nxt`` (the next layer), its input norm and
        fused QKV projection with q/k norms, RoPE and the K/V write into ``kv_cache`` at
        ``plan``'s slots. Returns ``(hidden, q)`` (``q`` None without ``nxt``): ``hidden`` is
        the residual stream with this layer's MLP output added."""
        from pagedkv.kernels.persistent_layer import persistent_layer

        attn, mlp, ln = self.self_attn, self.mlp, self.post_attention_layernorm
        args = (hidden, attn_out, attn.o_proj.weight, ln.weight, mlp.gate_up_proj.weight,
                mlp.down_proj.weight)
        if nxt is None:  # the last layer: phases 0-2, its own input norm and QKV as shapes only
            h2, _, _, _ = persistent_layer(*args, self.input_layernorm.weight,
                                           attn.qkv_proj.weight, ln.eps, phases=(0, 2),
                                           check=check)
            return h2, None
        (heads, kv_heads, dim, qw, kw, qk_eps), slots = nxt._head_args(plan)
        proj = nxt.self_attn.qkv_proj
        q = torch.empty((hidden.shape[0], heads, dim), dtype=hidden.dtype, device=hidden.device)
        rope = dict(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, q_norm_weight=qw,
                    k_norm_weight=kw, eps=qk_eps, cos=cos, sin=sin, slot_mapping=slots,
                    key_cache=kv_cache[0], value_cache=kv_cache[1], q_out=q)
        h2, q, _, _ = persistent_layer(*args, nxt.input_layernorm.weight, proj.weight, ln.eps,
                                       qkv_bias=proj.bias, rope=rope, check=check)
        return h2, q

    def hf_entries(self, prefix: str, layout: str | None = None) -> dict:
        """This layer's Hugging Face tensors (``prefix`` = ``model.layers.{i}.``) for the
        model's ``hf_weight_map``: norms, attention, the dense MLP (one layout)."""
        attn, mlp = self.self_attn, self.mlp
        m = {prefix + "input_layernorm.weight": (self.input_layernorm.weight, None),
             prefix + "post_attention_layernorm.weight": (self.post_attention_layernorm.weight, None)}
        m.update(attention_hf_entries(prefix, attn.qkv_proj, attn.o_proj, attn.q_norm, attn.k_norm))
        m.update(mlp.hf_entries(prefix + "mlp"))
        return m

    def forward_split(self, hidden, delta, cos, sin, kv_cache, plan, backend,
                      pre=pre_attention, post=post_attention,
                      pre_qkv=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, mlp_out)`` of this layer for ``hidden + delta`` (see
        :func:`pre_attention` / :func:`post_attention`, or compiled versions of them).

        With ``pre_qkv`` (:func:`pre_attention_qkv` or its compiled version; for backends with
        ``fused_kv_write``), the q/k norms, RoPE and the KV write run as one kernel
        (``qk_norm_rope_cache``) and the backend is called with ``k = v = None``."""
        attn = self.self_attn
        qkv = attn.qkv_proj
        qn = attn.q_norm
        if pre_qkv is not None:
            hidden, qkv_out = pre_qkv(hidden, delta, *self.pre_qkv_args())
            out = self.attend_fused(qkv_out, cos, sin, kv_cache, plan, backend)
        else:
            hidden, q, k, v = pre(
                hidden, delta, self.input_layernorm.weight, self.input_layernorm.eps,
                qkv.weight, qkv.bias,
                None if qn is None else qn.weight, None if qn is None else attn.k_norm.weight,
                0.0 if qn is None else qn.eps,
                cos, sin, attn.num_heads, attn.num_kv_heads, attn.head_dim,
            )
            out = backend.forward(attn.layer_idx, q, k, v, kv_cache, plan, attn.scale)
        return post(hidden, out, *self.post_args())


class DecoderForCausalLM(nn.Module):
    """Llama / Qwen2 / Qwen3 / Mistral causal LM over a paged KV cache."""

    # tensor parallelism (``pagedkv.distributed.shard``): a shard's ``TPGroup``, None for the
    # whole model (a class default: the families that build their own modules inherit it); a
    # shard's embedding / LM head hold its vocabulary rows, its layers its heads and MLP
    # columns, and its regions all-reduce the row-parallel outputs
    tp = None
    # decode-sized batches: the QKV GEMM in the fused-KV-write kernel too (fused_qkv_usable)
    fuse_qkv_projection = FUSED_QKV_ENABLED
    # decode-sized batches: every layer as four fused kernels + attention (decode_chain_usable)
    fuse_decode_chain = FUSED_DECODE_ENABLED
    # decode-sized batches: every layer as one persistent launch + attention
    # (persistent_decode_usable)
    fuse_persistent_decode = PERSISTENT_DECODE_ENABLED
    # decode-only steps on the fused-KV-write path: the q/k norms, RoPE and K/V write inside
    # the decode attention launch (DecoderLayer.attend_fused, the backend's
    # forward_decode_prologue)
    fuse_decode_prologue = DECODE_PROLOGUE_ENABLED

    def __init__(
        self,
        config: ModelArchConfig,
        *,
        backend: AttentionBackend | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.attn_backend: AttentionBackend = backend if backend is not None else TorchRefBackend()
        h = config.hidden_size
        self.embed_tokens = nn.Parameter(
            torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            self.make_layer(config, i, dtype=dtype, device=device)
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype=dtype, device=device)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Parameter(
                torch.empty(config.vocab_size, h, dtype=dtype, device=device), requires_grad=False
            )
        self.rotary = RotaryEmbedding(
            config.head_dim, config.rope, config.max_position_embeddings, device=device
        )
        # layers use the fused q/k-norm + RoPE + KV-write kernel when the backend allows it
        self.fuse_kv_write = True

    def make_layer(self, config: ModelArchConfig, layer_idx: int, *, dtype, device) -> nn.Module:
        """Layer ``layer_idx`` (a subclass picks per layer, e.g. sparse or dense MLP)."""
        return DecoderLayer(config, layer_idx, dtype=dtype, device=device)

    # ---- properties
    @property
    def device(self) -> torch.device:
        return self.embed_tokens.device

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def set_attention_backend(self, backend: AttentionBackend) -> None:
        self.attn_backend = backend

    # ---- forward
    def attention_layout(self, spec=None) -> AttentionLayout:
        """The layout of the attention layers with KV-cache spec ``spec`` (its sliding window,
        if any); without a spec, full attention."""
        cfg = self.config
        return AttentionLayout(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                               self.dtype, self.device,
                               sliding_window=getattr(spec, "sliding_window", None))

    def step_attention(self, attn: StepAttention | AttentionMetadataLike) -> StepAttention:
        """``attn`` as the forward pass takes it: a :class:`StepAttention` as it is, or one
        metadata object for every layer (harnesses, profiling), planned here once per
        distinct layer layout."""
        if isinstance(attn, StepAttention):
            return attn
        # one plan per distinct layout (full / each window), from the one metadata (its table
        # must hold every position: windows only mask)
        specs = list(self.kv_cache_specs(16).values())
        plans: dict = {}
        per_layer = []
        for spec in specs:
            layout = self.attention_layout(spec)
            if layout not in plans:
                plans[layout] = self.attn_backend.plan(attn, layout)
            per_layer.append(plans[layout])
        return StepAttention(attn, per_layer)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: Sequence[torch.Tensor],
        attn: StepAttention | AttentionMetadataLike,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for packed tokens ``input_ids [T]``
        at ``positions [T]``; writes each layer's K/V into ``kv_caches[layer]``. ``attn``: the
        step's plans per layer (:class:`StepAttention`, what the runner passes), or a single
        metadata object for all layers."""
        self.check_inputs(input_ids, positions, kv_caches)
        attn = self.step_attention(attn)
        plans = attn.plans
        seq_lens = tokens_seq_lens(attn.metadata, input_ids.shape[0]) if self.rotary.is_dynamic else None
        cos, sin = self._rope(positions, seq_lens)
        hidden = self.embed(input_ids)
        backend = self.attn_backend
        pre, post, pre_qkv, mid = self._regions
        layers = self.layers
        if kv_caches and self.persistent_decode_usable(input_ids.shape[0], kv_caches[0]):
            # one persistent launch between two attention calls (layer 0's QKV: the fused
            # projection with its input norm)
            out = layers[0].attend_projected(hidden, cos, sin, kv_caches[0], plans[0], backend,
                                             normed=False)
            last = len(layers) - 1
            for i, layer in enumerate(layers):
                if i == last:
                    hidden, _ = layer.persistent_post(hidden, out, check=i == 0)
                    break
                nxt = layers[i + 1]
                hidden, q = layer.persistent_post(hidden, out, nxt, cos, sin, kv_caches[i + 1],
                                                  plans[i + 1], check=i == 0)
                out = backend.forward(nxt.self_attn.layer_idx, q, None, None, kv_caches[i + 1],
                                      plans[i + 1], nxt.self_attn.scale)
            return self.norm(hidden)
        if kv_caches and self.decode_chain_usable(input_ids.shape[0], kv_caches[0]):
            # the fused decode chain: no compiled region, four kernels a layer + attention
            for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
                hidden = layer.decode_chain(hidden, cos, sin, kv_cache, plans[i], backend)
            return self.norm(hidden)
        if kv_caches and self.fused_qkv_usable(input_ids.shape[0], kv_caches[0]):
            # fused projection: the regions end at the input norm, one kernel does the rest
            pre_norm, mid_norm = self._norm_regions
            hidden, x = pre_norm(hidden, None, *layers[0].pre_qkv_args()[:2])
            last = len(layers) - 1
            for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
                out = layer.attend_projected(x, cos, sin, kv_cache, plans[i], backend)
                if i < last:
                    hidden, x = mid_norm(hidden, out, *layer.post_args(),
                                         *layers[i + 1].pre_qkv_args()[:2])
                else:
                    hidden, delta = post(hidden, out, *layer.post_args())
                    hidden = residual_add(hidden, delta)
            return self.norm(hidden)
        if kv_caches and self.fused_kv_write_usable(kv_caches[0]):
            # fused path: one region between two attention calls (post_i + pre_qkv_{i+1})
            hidden, qkv = pre_qkv(hidden, None, *layers[0].pre_qkv_args())
            last = len(layers) - 1
            prologue = self.fuse_decode_prologue and hasattr(backend, "forward_decode_prologue")
            for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
                out = layer.attend_fused(qkv, cos, sin, kv_cache, plans[i], backend, prologue)
                if i < last:
                    hidden, qkv = mid(hidden, out, *layer.post_args(),
                                      *layers[i + 1].pre_qkv_args())
                else:
                    hidden, delta = post(hidden, out, *layer.post_args())
                    hidden = residual_add(hidden, delta)
            return self.norm(hidden)
        delta = None
        for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
            hidden, delta = layer.forward_split(hidden, delta, cos, sin, kv_cache, plans[i],
                                                backend, pre, post)
        if delta is not None:
            hidden = residual_add(hidden, delta)
        return self.norm(hidden)

    def forward_layer_modules(self, input_ids: torch.Tensor, positions: torch.Tensor,
                              kv_caches: Sequence, attn) -> torch.Tensor:
        """The eager forward of the families whose layers are one module call each
        (``layer(hidden, cos, sin, cache, plan, backend) -> hidden``, ``cache`` and ``plan``
        the layer's entries of ``kv_caches`` and ``attn.plans``, :meth:`layer_caches`):
        :meth:`embed`, the layers in order, the final norm."""
        self.check_inputs(input_ids, positions, kv_caches)
        attn = self.step_attention(attn)
        seq_lens = tokens_seq_lens(attn.metadata, input_ids.shape[0]) if self.rotary.is_dynamic else None
        cos, sin = self._rope(positions, seq_lens)
        hidden = self.embed(input_ids)
        backend = self.attn_backend
        for i, layer in enumerate(self.layers):
            cache, plan = self.layer_caches(i, kv_caches, attn.plans)
            hidden = layer(hidden, cos, sin, cache, plan, backend)
        return self.norm(hidden)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings (a tensor-parallel shard: its vocabulary rows, summed over
        the ranks, ``TPGroup.embed``)."""
        if self.tp is not None:
            return self.tp.embed(input_ids, self.embed_tokens)
        return F.embedding(input_ids, self.embed_tokens)

    def layer_caches(self, i: int, kv_caches: Sequence, plans: Sequence) -> tuple:
        """``(cache, plan)`` of layer ``i`` in :meth:`forward_layer_modules`: here its entry
        of the cache layers (a family with several cache layers a layer gives them all)."""
        return kv_caches[i], plans[i]

    def check_inputs(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     kv_caches: Sequence[torch.Tensor]) -> None:
        """The forward's argument checks: flat ``[T]`` ids and positions, one cache per layer."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise InvalidRequestError(
                f"input_ids and positions must both be flat [T] tensors, got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        if len(kv_caches) != len(self.layers):
            raise InvalidRequestError(
                f"expected one KV cache per layer ({len(self.layers)}), got {len(kv_caches)}"
            )

    def fused_kv_write_usable(self, kv_cache: torch.Tensor) -> bool:
        """Whether layers take the fused path (q/k norms + RoPE + KV write in one kernel): the
        backend accepts K/V written by the caller (``fused_kv_write``), the kernel runs on this
        cache's device (CUDA, or the Triton interpreter) and ``fuse_kv_write`` is not off."""
        if not (self.fuse_kv_write and self.attn_backend.fused_kv_write):
            return False
        from pagedkv.kernels._common import use_triton
        from pagedkv.kernels.qk_norm_rope_cache import _qk_norm_rope_cache_kernel

        return use_triton(_qk_norm_rope_cache_kernel, kv_cache)

    def fused_qkv_usable(self, num_tokens: int, kv_cache: torch.Tensor) -> bool:
        """Whether a forward of ``num_tokens`` rows takes the fused projection
        (``fuse_qkv_projection``, default ``FUSED_QKV_ENABLED``, off: not yet measured end to
        end): the fused-KV-write path applies, the batch has at most ``FUSED_QKV_MAX_ROWS``
        rows (decode-sized: larger GEMMs belong to cuBLAS), the head size is one the kernel
        serves, and the model is not a tensor-parallel shard."""
        if not (self.fuse_qkv_projection and self.tp is None
                and num_tokens <= FUSED_QKV_MAX_ROWS and self.fused_kv_write_usable(kv_cache)):
            return False
        from pagedkv.kernels.qkv_rope_cache import fused_applies

        return fused_applies(self.layers[0].self_attn.head_dim)

    def decode_chain_usable(self, num_tokens: int, kv_cache: torch.Tensor) -> bool:
        """Whether a forward of ``num_tokens`` rows runs every layer as
        :meth:`DecoderLayer.decode_chain` (``fuse_decode_chain``, default
        ``FUSED_DECODE_ENABLED``, off: not yet measured end to end): the fused projection's
        conditions (:meth:`fused_qkv_usable` without its own switch), at most
        ``FUSED_DECODE_MAX_ROWS`` rows, dense gated-MLP layers."""
        if not (self.fuse_decode_chain and self.tp is None
                and num_tokens <= FUSED_DECODE_MAX_ROWS and self.fused_kv_write_usable(kv_cache)
                and all(type(layer) is DecoderLayer and isinstance(layer.mlp, GatedMLP)
                        for layer in self.layers)):
            return False
        from pagedkv.kernels.qkv_rope_cache import fused_applies

        return fused_applies(self.layers[0].self_attn.head_dim)

    def persistent_decode_usable(self, num_tokens: int, kv_cache: torch.Tensor) -> bool:
        """Whether a forward of ``num_tokens`` rows runs every layer's post-attention part
        and the next layer's QKV as one persistent launch (:meth:`DecoderLayer.persistent_post`;
        ``fuse_persistent_decode``, default ``PERSISTENT_DECODE_ENABLED``, off: the layer
        measured slower than the default path): the fused projection's conditions
        (:meth:`fused_qkv_usable` without its own switch), at most ``PERSISTENT_DECODE_MAX_ROWS`` rows, dense
        gated-MLP layers with plain RMSNorms of one epsilon, no o_proj / MLP biases (the
        kernel has none; a q/k/v bias is served), no FP8 cache, shapes the kernel tiles."""
        if not (self.fuse_persistent_decode and self.tp is None and 0 < num_tokens
                and num_tokens <= PERSISTENT_DECODE_MAX_ROWS
                and self.fused_kv_write_usable(kv_cache)):
            return False
        from pagedkv.kernels.fp8_kv import is_fp8_kv
        from pagedkv.kernels.persistent_layer import shapes_served

        if is_fp8_kv(kv_cache.dtype):
            return False
        eps = set()
        for layer in self.layers:
            if not (type(layer) is DecoderLayer and type(layer.mlp) is GatedMLP
                    and type(layer.input_layernorm) is RMSNorm
                    and type(layer.post_attention_layernorm) is RMSNorm
                    and layer.self_attn.o_proj.bias is None
                    and layer.mlp.gate_up_proj.bias is None and layer.mlp.down_proj.bias is None):
                return False
            eps.update((layer.input_layernorm.eps, layer.post_attention_layernorm.eps))
        attn = self.layers[0].self_attn
        return len(eps) == 1 and shapes_served(self.config.hidden_size,
                                               self.layers[0].mlp.down_proj.weight.shape[1],
                                               attn.head_dim)

    # ---- torch.compile
    @property
    def _norm_regions(self):
        """``(pre_norm, mid_norm)``: :func:`pre_attention_norm` and :func:`post_pre_norm`,
        compiled once :meth:`compile_regions` has run (lazily: compiled at their first call)."""
        return self.__dict__.get("_compiled_norm_regions") or (pre_attention_norm, post_pre_norm)

    @property
    def _regions(self):
        if self.tp is not None:  # a shard: regions with the row-parallel all-reduces
            return self.tp.regions
        return self.__dict__.get("_compiled_regions") or (pre_attention, post_attention,
                                                          pre_attention_qkv, post_pre_qkv)

    @property
    def compiled(self) -> bool:
        return self.__dict__.get("_compiled_regions") is not None

    def compile_regions(self, *, check: bool = True, allow_cpu: bool = False, **compile_kwargs) -> bool:
        """``torch.compile`` the pointwise regions of every layer (:func:`pre_attention`: residual
        add + RMSNorm + QKV + q/k norms + RoPE; :func:`pre_attention_qkv`, its fused-KV-write
        variant, up to the QKV GEMM; :func:`post_attention`: o_proj + residual add + RMSNorm +
        gated MLP; :func:`post_pre_qkv`: the two fused-path regions between two attention calls
        as one) so their many small kernels fuse; attention stays outside. One
        compiled function serves every layer (weights are arguments); the token dimension is
        dynamic (one graph for T >= 2, one for T == 1, one more for layer 0, which has no residual
        delta). Inductor keeps intermediate values in float32 where eager rounds each op to the
        model dtype, so bf16 results differ slightly from eager (not bit-identical).

        CUDA only (a CPU model is left eager and False returned, unless ``allow_cpu``: tests
        run the compiled regions through inductor's CPU backend). With ``check`` the compiled
        regions are run once against eager on random inputs of layer 0 (this compiles them);
        on an exception or a mismatch a warning is logged, the model stays eager and False is
        returned. Call before capturing CUDA graphs."""
        if (self.device.type != "cuda" and not allow_cpu) or self.tp is not None:
            return False  # a tensor-parallel shard stays eager (its regions all-reduce)
        import logging

        log = logging.getLogger(__name__)
        # Every model compiled in this process adds its variants (layer 0 or not, T == 1 or
        # not: 4 per dtype/shape) to the same code objects' caches.
        cfg = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):
            if getattr(cfg, name, 0) < 64:
                try:
                    setattr(cfg, name, 64)
                except (AttributeError, TypeError):
                    pass
        _inductor_pdl(self.device)
        try:
            pre = _dynamic_tokens(torch.compile(pre_attention, **compile_kwargs), (0, 1, 9, 10))
            post = _dynamic_tokens(torch.compile(post_attention, **compile_kwargs), (0, 1))
            pre_qkv = _dynamic_tokens(torch.compile(pre_attention_qkv, **compile_kwargs), (0, 1))
            mid = _dynamic_tokens(torch.compile(post_pre_qkv, **compile_kwargs), (0, 1))
            norm_regions = (
                _dynamic_tokens(torch.compile(pre_attention_norm, **compile_kwargs), (0, 1)),
                _dynamic_tokens(torch.compile(post_pre_norm, **compile_kwargs), (0, 1)))
            if check:
                self._check_regions(pre, post, pre_qkv, mid,
                                    norm_regions if self.fuse_qkv_projection else None)
        except Exception as e:  # compilation problems must not take the engine down
            log.warning("compile_regions: falling back to eager (%s: %s)", type(e).__name__, e)
            self.__dict__.pop("_compiled_regions", None)
            self.__dict__.pop("_compiled_norm_regions", None)
            return False
        self.__dict__["_compiled_regions"] = (pre, post, pre_qkv, mid)
        self.__dict__["_compiled_norm_regions"] = norm_regions
        return True

    @torch.inference_mode()
    def _check_regions(self, pre, post, pre_qkv, mid, norm_regions=None) -> None:
        layer = self.layers[0]
        attn = layer.self_attn
        cfg = self.config
        gen = torch.Generator(device=self.device).manual_seed(0)
        for t in (7, 1):
            kw = dict(device=self.device, dtype=self.dtype)
            h = torch.randn(t, cfg.hidden_size, generator=gen, **kw)
            d = torch.randn(t, cfg.hidden_size, generator=gen, **kw)
            a = torch.randn(t, attn.num_heads, attn.head_dim, generator=gen, **kw)
            pos = torch.randint(0, 4096, (t,), generator=gen, device=self.device)
            cos, sin = self._rope(pos, None)

            class _Attn:  # returns a fixed attention output, checks what it is given
                def forward(self, layer_idx, q, k, v, kv_cache, metadata, scale):
                    self.qkv = (q, k, v)
                    return a

            for delta in (None, d):
                ref_b, got_b = _Attn(), _Attn()
                ref = layer.forward_split(h, delta, cos, sin, None, None, ref_b)
                got = layer.forward_split(h, delta, cos, sin, None, None, got_b, pre, post)
                for x, y in zip(ref + ref_b.qkv, got + got_b.qkv):
                    _close(x, y, self.dtype)
                args = (h, delta, *layer.pre_qkv_args())
                for x, y in zip(pre_attention_qkv(*args), pre_qkv(*args)):
                    _close(x, y, self.dtype)
            args = (h, a, *layer.post_args(), *layer.pre_qkv_args())
            for x, y in zip(post_pre_qkv(*args), mid(*args)):
                _close(x, y, self.dtype)
            if norm_regions is not None:  # the fused projection's regions (when it is on)
                pre_norm, mid_norm = norm_regions
                args = (h, d, *layer.pre_qkv_args()[:2])
                for x, y in zip(pre_attention_norm(*args), pre_norm(*args)):
                    _close(x, y, self.dtype)
                args = (h, a, *layer.post_args(), *layer.pre_qkv_args()[:2])
                for x, y in zip(post_pre_norm(*args), mid_norm(*args)):
                    _close(x, y, self.dtype)

    def _rope(self, positions: torch.Tensor, seq_lens: torch.Tensor | None):
        """cos/sin of ``positions`` in the model dtype: ``apply_rotary`` casts them to q/k's
        dtype (the model's) in every call, so casting once per step gives the same values with
        4 kernels per layer fewer."""
        cos, sin = self.rotary(positions, seq_lens)
        if cos.dtype != self.dtype:
            cos, sin = cos.to(self.dtype), sin.to(self.dtype)
        return cos, sin

    def compute_logits(self, hidden: torch.Tensor, indices: torch.Tensor | Sequence[int] | None = None,
                       *, widen: bool = True) -> torch.Tensor:
        """Float32 logits ``[len(indices), vocab]`` for the rows ``indices`` of ``hidden`` (all
        rows when ``None``). The projection runs in the model dtype, then widens
        (``widen=False``: the model-dtype logits, e.g. for an argmax, which the exact widening
        does not change)."""
        if indices is not None:
            if not isinstance(indices, torch.Tensor):
                indices = torch.tensor(list(indices), dtype=torch.int64)
            hidden = hidden.index_select(0, indices.to(device=hidden.device, dtype=torch.int64))
        logits = F.linear(hidden, self.lm_head_weight)
        if self.tp is not None:  # a shard's vocabulary columns, gathered from every rank
            logits = self.tp.gather_vocab(logits, self.config.vocab_size)
        return logits.to(torch.float32) if widen else logits

    def greedy_tokens(self, hidden: torch.Tensor,
                      indices: torch.Tensor | Sequence[int] | None = None) -> torch.Tensor:
        """The greedy tokens (int64 ``[len(indices)]``) of the rows ``indices`` of ``hidden``
        (all rows when ``None``): the argmax of the model-dtype logits. Where the logits are
        this class's plain LM-head product (not a subclass's ``compute_logits`` that
        transforms them, e.g. a soft cap, nor one set on the instance; no tensor-parallel
        shards) and the fused kernel applies (``pagedkv.kernels.lm_head_argmax.
        fused_applies``), one pass that never writes the logits; otherwise
        ``compute_logits`` then ``argmax_rows``."""
        w = self.lm_head_weight
        # this class's own projection: not a subclass's override, nor a function set on the
        # instance (a hook that records or transforms the logits must see every step's)
        plain = getattr(self.compute_logits, "__func__", None) is DecoderForCausalLM.compute_logits
        if self.tp is None and plain:
            if indices is not None:
                if not isinstance(indices, torch.Tensor):
                    indices = torch.tensor(list(indices), dtype=torch.int64)
                hidden = hidden.index_select(0, indices.to(device=hidden.device,
                                                           dtype=torch.int64))
            if _lha.fused_applies(hidden, w):
                return _lha.lm_head_argmax(hidden, w)
            return argmax_rows(self.compute_logits(hidden, None, widen=False))
        return argmax_rows(self.compute_logits(hidden, indices, widen=False))

    # ---- KV cache helpers
    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, self.config.num_key_value_heads, self.config.head_dim)

    def kv_cache_specs(self, block_size: int) -> dict:
        """Each attention layer's KV-cache spec, keyed by the runner's layer names
        (``model.layers.{i}.self_attn``), in layer order, KV in the model's dtype: a
        ``SlidingWindowSpec`` for a layer with a sliding window, else a ``FullAttentionSpec``."""
        from pagedkv.core.spec import FullAttentionSpec, SlidingWindowSpec

        cfg = self.config
        common = dict(block_size=block_size, num_kv_heads=cfg.num_key_value_heads,
                      head_size=cfg.head_dim, dtype=str(self.dtype).removeprefix("torch."))
        full = FullAttentionSpec(**common)
        windows = cfg.layer_windows or (None,) * len(self.layers)
        out = {}
        for i, w in enumerate(windows):
            out[f"model.layers.{i}.self_attn"] = (
                full if w is None else SlidingWindowSpec(sliding_window=w, **common))
        return out

    def allocate_kv_caches(
        self, num_blocks: int, block_size: int, *, dtype: torch.dtype | None = None,
        device: str | torch.device | None = None, fill: float | None = 0.0,
    ) -> list[torch.Tensor]:
        return allocate_kv_caches(
            self.config.num_hidden_layers, num_blocks, block_size,
            self.config.num_key_value_heads, self.config.head_dim,
            dtype=dtype or self.dtype, device=device or self.device, fill=fill,
        )

    def allocate_spec_caches(self, num_blocks: int, block_size: int, *,
                             dtype: torch.dtype | None = None,
                             device: str | torch.device | None = None,
                             fill: float | None = 0.0) -> list:
        """Unshared caches, one per cache layer of ``kv_cache_specs(block_size)``, each in its
        spec's layout and dtype (``attention.kv_cache.allocate_layer_caches``): the
        ``allocate_kv_caches`` of families whose specs are not all one attention layout. The
        specs carry the model dtype: another ``dtype`` is refused."""
        if dtype is not None and dtype != self.dtype:
            raise ConfigError(f"the caches of {self.config.architecture} take the model dtype "
                              f"({self.dtype}), not {dtype}")
        return allocate_layer_caches(self.kv_cache_specs(block_size).values(), num_blocks,
                                     device=device or self.device, fill=fill)

    # ---- weights
    def hf_weight_map(self, layout: str | None = None) -> dict[str, tuple[torch.Tensor, tuple[int, int] | None]]:
        """Hugging Face tensor name -> (parameter or a view of one, row range ``(start, rows)``
        or ``None`` for the whole tensor). Exactly the tensors a checkpoint of this architecture
        must provide, in ``layout`` (see :meth:`hf_weight_layouts`; ``None``: the default one)."""
        m: dict[str, tuple[nn.Parameter, tuple[int, int] | None]] = {
            "model.embed_tokens.weight": (self.embed_tokens, None),
            "model.norm.weight": (self.norm.weight, None),
        }
        if self.lm_head is not None:
            m["lm_head.weight"] = (self.lm_head, None)
        for i, layer in enumerate(self.layers):
            m.update(layer.hf_entries(f"model.layers.{i}.", layout))
        return m

    def hf_weight_layouts(self) -> dict[str, dict]:
        """Every tensor layout a checkpoint of this architecture may have, by name -> its
        ``hf_weight_map``; the loader takes the one the checkpoint's names match (one layout
        for dense models)."""
        return {"hf": self.hf_weight_map()}

    def finish_loading(self) -> "DecoderForCausalLM":
        """Called by the loader once the checkpoint's weights are in (a model that derives
        values from its weights computes them here; nothing for these families)."""
        return self

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> "DecoderForCausalLM":
        """Deterministic random weights (benchmarks by shape): matrices ~ N(0, std), norms 1,
        biases 0. Each parameter draws from its own generator on its own device (fast for
        large shapes; values depend on the device type)."""
        for i, (name, p) in enumerate(self.named_parameters()):
            if p.dim() >= 2:
                gen = torch.Generator(device=p.device).manual_seed(seed * 100003 + i)
                vals = torch.randn(p.shape, generator=gen, dtype=torch.float32, device=p.device)
                p.copy_(vals.mul_(std).to(p.dtype))
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.fill_(1.0)
        return self


def attention_hf_entries(prefix: str, qkv_proj, o_proj, q_norm=None, k_norm=None) -> dict:
    """The Hugging Face tensors of one layer's attention (``self_attn.{q,k,v,o}_proj``, the
    q/k norms when present) in a model's ``hf_weight_map``."""
    a = prefix + "self_attn."
    m = qkv_proj.hf_entries_of_shards({s: f"{a}{s}_proj" for s in ("q", "k", "v")})
    m.update(o_proj.hf_entries(a + "o_proj"))
    if q_norm is not None:
        m[a + "q_norm.weight"] = (q_norm.weight, None)
        m[a + "k_norm.weight"] = (k_norm.weight, None)
    return m


def _close(ref: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> None:
    """Compiled vs eager region outputs of a ``dtype`` model: relative (Frobenius) error within
    a few model-dtype roundings (a float32 output of a half-precision model, such as the
    split-K partial sums, carries the roundings of its half-precision inputs)."""
    tol = 5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-3
    r, g = ref.float(), got.float()
    err = float((r - g).norm() / r.norm().clamp_min(1e-6))
    if not (err <= tol) or ref.shape != got.shape:
        raise ValueError(f"compiled region differs from eager: relative error {err:.3g} "
                         f"(tolerance {tol}), shapes {tuple(ref.shape)} / {tuple(got.shape)}")


def _inductor_pdl(device: torch.device) -> None:
    """With programmatic dependent launch on (``PAGEDKV_PDL=1``, ``pagedkv.kernels.pdl``) and
    a device that has it, inductor's own kernels are generated for it too (its
    ``triton.enable_pdl``, a process-wide setting, where this torch has it), so the compiled
    regions' kernels between attention calls also launch early. Off otherwise."""
    from pagedkv.kernels import pdl

    if pdl.PDL_ENABLED and pdl.pdl_supported(device):
        ind = torch._inductor.config.triton
        if hasattr(ind, "enable_pdl"):
            ind.enable_pdl = True


def _dynamic_tokens(fn, token_args: tuple[int, ...]):
    """``fn`` with dimension 0 (tokens) of the positional arguments ``token_args`` marked
    dynamic on every call, so one compiled graph serves every token count."""
    mark = torch._dynamo.maybe_mark_dynamic

    def call(*args):
        for i in token_args:
            a = args[i]
            if a is not None:
                mark(a, 0)
        return fn(*args)

    call.__wrapped__ = fn
    return call


__all__ = ["Attention", "DecoderForCausalLM", "DecoderLayer", "post_attention", "post_pre_qkv",
           "pre_attention", "pre_attention_qkv"]
