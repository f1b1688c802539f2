"""The sparse mixture-of-experts MLP of Qwen3-MoE, Mixtral and DeepSeek-V3: a router and
stacked experts (DeepSeek-V3: plus shared experts).

Routing, as transformers' modeling code does it (``route_topk``): ``logits = x W_gate^T`` in
the model dtype, ``softmax`` in float32, ``top-k``; with ``norm_topk_prob`` (Qwen3-MoE's flag;
Mixtral always) the k probabilities are divided by their sum. Qwen3-MoE casts the weights to
the model dtype, Mixtral keeps them in float32 (``MoeConfig.weights_dtype``); the weighted sum
over the k experts runs in the promoted dtype and is rounded once (``fused_moe_ref``).

DeepSeek-V3 routes as its ``DeepseekV3TopkRouter`` does (``route_grouped_sigmoid``): float32
logits (the router weight and ``e_score_correction_bias`` stay float32 whatever the model dtype,
as transformers keeps them), ``sigmoid`` scores; the experts are chosen on ``scores + bias``
inside the ``topk_group`` best of ``n_group`` groups (a group scores the sum of its two best),
weighted by their plain scores (divided by their sum + 1e-20 with ``norm_topk_prob``) times
``routed_scaling_factor``, in float32. Its shared experts are one dense gated MLP
(``shared_experts``, ``n_shared_experts * moe_intermediate_size`` wide) added to the routed
output. Qwen3-Next routes as Qwen3-MoE (weights in the model dtype) and adds one shared expert
(``shared_expert_intermediate_size`` wide) scaled by ``sigmoid(x W_g^T)``
(``shared_expert_gate``, ``W_g [1, H]``), as its ``Qwen3NextSparseMoeBlock``.

Experts are stacked weights: ``w13 [E, 2I, H]`` (each expert's gate rows then its up rows:
one GEMM) and ``w2 [E, H, I]``. On CUDA the Triton fused-MoE kernel runs them
(``pagedkv.kernels.fused_moe.fused_moe``), elsewhere the torch reference (tokens sorted by
expert, one GEMM per expert with tokens).

GPT-OSS routes with ``route_topk_softmax`` (router with a bias: the top-k logits, then a
softmax over those k, in the model dtype); its experts have biases (``w13_bias [E, 2I]`` in
w13's row order, ``w2_bias [E, H]``), gate and up rows interleaved in ``w13`` (row ``2i`` gate
unit ``i``, ``2i + 1`` its up unit: transformers' ``gate_up_proj [E, H, 2I]`` is then
``w13.transpose(1, 2)``, loaded in place) and the clamped SwiGLU (``GatedActivation``), all
run by the same fused-MoE kernels and twin. Its checkpoints hold transformers' module layout
only: ``mlp.router.{weight,bias}``, ``mlp.experts.{gate_up_proj,down_proj}[_bias]``.

Checkpoint layouts (``hf_entries``): ``per_expert``, what ``save_pretrained`` writes and the
hub holds (Qwen3-MoE ``mlp.experts.{e}.{gate,up,down}_proj.weight``, Mixtral
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` with w1 = gate, w3 = up, w2 = down; router
``mlp.gate.weight`` / ``block_sparse_moe.gate.weight``), and ``fused``, transformers' own module
layout (``save_pretrained(save_original_format=False)``: ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``, ``mlp.gate.weight`` for both families). DeepSeek-V3 names its
experts as Qwen3-MoE does, plus ``mlp.gate.e_score_correction_bias`` and
``mlp.shared_experts.{gate,up,down}_proj.weight`` (both layouts); Qwen3-Next as Qwen3-MoE,
plus ``mlp.shared_expert.{gate,up,down}_proj.weight`` and ``mlp.shared_expert_gate.weight``.
Jamba routes as Qwen3-MoE without renormalizing; its block is ``feed_forward`` (both layouts),
its router ``feed_forward.router.weight``, its experts ``feed_forward.experts.{e}.{gate,up,
down}_proj.weight`` / ``feed_forward.experts.gate_up_proj`` and ``down_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.kernels.fused_moe import GatedActivation, fused_moe_ref
from pagedkv.models.config import MoeConfig
from pagedkv.models.layers import GatedMLP, Linear

LAYOUTS = ("per_expert", "fused")
# per-expert names: family -> (module prefix, gate, up, down)
_PER_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
    "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_next": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "jamba": ("feed_forward", "gate_proj", "up_proj", "down_proj"),
}
# Jamba names its block feed_forward in both layouts and its router "router"
_FUSED_BLOCK_NAMES = {"jamba": "feed_forward"}  # default "mlp"
_ROUTER_NAMES = {"jamba": "router"}  # default "gate"
# the shared expert(s)' module name, by family
_SHARED_NAMES = {"deepseek_v3": "shared_experts", "qwen3_next": "shared_expert"}


def route_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
               weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k] in weights_dtype, topk_ids [T, k] int64)`` of the router logits
    ``[T, E]``: float32 softmax, top-k, renormalized when ``norm_topk_prob``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


def route_topk_softmax(router_logits: torch.Tensor,
                       top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's routing: ``(topk_weights [T, k], topk_ids [T, k] int64)``: the ``top_k``
    largest logits ``[T, E]``, then a softmax over those k, in the logits' dtype (as
    ``GptOssTopKRouter``)."""
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def route_grouped_sigmoid(router_logits: torch.Tensor, correction_bias: torch.Tensor | None,
                          top_k: int, n_group: int, topk_group: int, norm_topk_prob: bool,
                          routed_scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing: ``(topk_weights [T, k] float32, topk_ids [T, k] int64)`` of the
    float32 router logits ``[T, E]`` (see the module docstring; the same torch ops as
    transformers, so ties and the order of the k choices come out the same)."""
    t, e = router_logits.shape
    scores = router_logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias
    group_scores = choice.view(t, n_group, e // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


# families whose checkpoints hold transformers' module layout only (no per-expert names)
_MODULE_LAYOUT_ONLY = ("gpt_oss",)


def _gpt_oss_entries(block: "SparseMoeBlock", prefix: str) -> dict:
    """GPT-OSS's tensors of one block: the router's weight and bias, the experts' stacked
    ``gate_up_proj [E, H, 2I]`` (a transposed view of the interleaved ``w13``, filled in
    place), ``down_proj [E, I, H]`` (of ``w2``) and their biases."""
    p = prefix + "mlp."
    m = block.gate.hf_entries(p + "router")
    m[p + "experts.gate_up_proj"] = (block.w13.data.transpose(1, 2), None)
    m[p + "experts.gate_up_proj_bias"] = (block.w13_bias, None)
    m[p + "experts.down_proj"] = (block.w2.data.transpose(1, 2), None)
    m[p + "experts.down_proj_bias"] = (block.w2_bias, None)
    return m


class SparseMoeBlock(nn.Module):
    """Router (``gate``: ``[E, H]``, no bias) + experts ``w13 [E, 2I, H]``, ``w2 [E, H, I]``;
    DeepSeek-V3 (``moe.scoring == "sigmoid"``): a float32 router with
    ``e_score_correction_bias [E]`` and ``shared_experts`` (a :class:`GatedMLP`); Qwen3-Next:
    ``shared_experts`` times ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, hidden_size: int, moe: MoeConfig, family: str, *, dtype=None, device=None):
        super().__init__()
        if family not in _PER_EXPERT_NAMES and family not in _MODULE_LAYOUT_ONLY:
            raise ValueError(f"no MoE checkpoint naming for family {family!r}")
        self.family = family
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.intermediate_size = moe.intermediate_size
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_model_dtype = moe.weights_dtype == "model"
        self.moe = moe
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size
        sigmoid = moe.scoring == "sigmoid"
        # DeepSeek-V3's router stays float32 (transformers keeps gate.weight in float32)
        self.gate = Linear(h, e, bias=moe.router_bias, dtype=torch.float32 if sigmoid else dtype,
                           device=device)
        self.e_score_correction_bias = nn.Parameter(
            torch.empty(e, dtype=torch.float32, device=device), requires_grad=False) \
            if moe.score_correction_bias else None
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device), requires_grad=False)
        # GPT-OSS: expert biases, gate/up rows interleaved, the clamped SwiGLU
        bias = lambda *shape: nn.Parameter(  # noqa: E731
            torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
        self.w13_bias = bias(e, 2 * i) if moe.expert_bias else None
        self.w2_bias = bias(e, h) if moe.expert_bias else None
        self.activation = GatedActivation(moe.activation, moe.swiglu_alpha, moe.swiglu_limit)
        self.gate_up_interleaved = family in _MODULE_LAYOUT_ONLY
        self.shared_experts = GatedMLP(h, moe.shared_intermediate_size, bias=False, dtype=dtype,
                                       device=device) if moe.shared_intermediate_size else None
        self.shared_expert_gate = Linear(h, 1, bias=False, dtype=dtype, device=device) \
            if moe.shared_expert_gate else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights, topk_ids)`` of the tokens ``x [T, H]``."""
        m = self.moe
        if m.scoring == "sigmoid":
            logits = F.linear(x.float(), self.gate.weight.float())
            return route_grouped_sigmoid(logits, self.e_score_correction_bias, self.top_k,
                                         m.n_group, m.topk_group, self.norm_topk_prob,
                                         m.routed_scaling_factor)
        if m.scoring == "topk_softmax":
            return route_topk_softmax(self.gate(x), self.top_k)
        wdtype = x.dtype if self.weights_in_model_dtype else torch.float32
        return route_topk(self.gate(x), self.top_k, self.norm_topk_prob, wdtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if x.device.type == "cuda":
            from pagedkv.kernels.fused_moe import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids, **self.expert_options())
        else:
            out = fused_moe_ref(x, self.w13, self.w2, weights, ids, **self.expert_options())
        if self.shared_experts is not None:
            shared = self.shared_experts(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
            out = out + shared
        return out

    def expert_options(self) -> dict:
        """The experts' options of ``fused_moe`` / ``fused_moe_ref`` (biases, activation,
        gate/up row order); none for the plain SiLU experts (the calls stay as they were)."""
        if self.w13_bias is None and not self.gate_up_interleaved and self.activation.name == "silu":
            return {}
        return dict(b13=self.w13_bias, b2=self.w2_bias, activation=self.activation,
                    gate_up_interleaved=self.gate_up_interleaved)

    def hf_entries(self, prefix: str, layout: str) -> dict:
        """This block's Hugging Face tensors (``prefix`` = ``model.layers.{i}.``) in ``layout``
        (``per_expert`` or ``fused``, see the module docstring) -> (tensor, rows)."""
        if self.family in _MODULE_LAYOUT_ONLY:  # one layout whatever ``layout`` says
            return _gpt_oss_entries(self, prefix)
        router = _ROUTER_NAMES.get(self.family, "gate") + ".weight"
        if layout == "fused":
            p = prefix + _FUSED_BLOCK_NAMES.get(self.family, "mlp") + "."
            m = {p + router: (self.gate.weight, None),
                 p + "experts.gate_up_proj": (self.w13, None),
                 p + "experts.down_proj": (self.w2, None)}
            return self._shared_entries(p, m)
        if layout != "per_expert":
            raise ValueError(f"unknown MoE checkpoint layout {layout!r}; one of {LAYOUTS}")
        module, gate, up, down = _PER_EXPERT_NAMES[self.family]
        p = f"{prefix}{module}."
        i = self.intermediate_size
        m = {p + router: (self.gate.weight, None)}
        for e in range(self.num_experts):
            w13 = self.w13.data[e]
            m[f"{p}experts.{e}.{gate}.weight"] = (w13, (0, i))
            m[f"{p}experts.{e}.{up}.weight"] = (w13, (i, i))
            m[f"{p}experts.{e}.{down}.weight"] = (self.w2.data[e], None)
        return self._shared_entries(p, m)

    def _shared_entries(self, p: str, m: dict) -> dict:
        """DeepSeek-V3's router bias and shared experts, Qwen3-Next's shared expert and its
        gate (``p`` = ``model.layers.{i}.mlp.``)."""
        if self.e_score_correction_bias is not None:
            m[p + "gate.e_score_correction_bias"] = (self.e_score_correction_bias, None)
        if self.shared_experts is not None:
            m.update(self.shared_experts.hf_entries(
                p + _SHARED_NAMES.get(self.family, "shared_experts")))
        if self.shared_expert_gate is not None:
            m.update(self.shared_expert_gate.hf_entries(p + "shared_expert_gate"))
        return m


__all__ = ["LAYOUTS", "SparseMoeBlock", "route_grouped_sigmoid", "route_topk",
           "route_topk_softmax"]
