"""The sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral: a router and stacked experts.

Routing, as transformers' modeling code does it (``route_topk``): ``logits = x W_gate^T`` in
the model dtype, ``softmax`` in float32, ``top-k``; with ``norm_topk_prob`` (Qwen3-MoE's flag;
Mixtral always) the k probabilities are divided by their sum. Qwen3-MoE casts the weights to
the model dtype, Mixtral keeps them in float32 (``MoeConfig.weights_dtype``); the weighted sum
over the k experts runs in the promoted dtype and is rounded once (``fused_moe_ref``).

Experts are stacked weights: ``w13 [E, 2I, H]`` (each expert's gate rows then its up rows:
one GEMM) and ``w2 [E, H, I]``. On CUDA the Triton fused-MoE kernel runs them
(``pagedkv.kernels.fused_moe.fused_moe``), elsewhere the torch reference (tokens sorted by
expert, one GEMM per expert with tokens).

Checkpoint layouts (``hf_entries``): ``per_expert``, what ``save_pretrained`` writes and the
hub holds (Qwen3-MoE ``mlp.experts.{e}.{gate,up,down}_proj.weight``, Mixtral
``block_sparse_moe.experts.{e}.{w1,w3,w2}.weight`` with w1 = gate, w3 = up, w2 = down; router
``mlp.gate.weight`` / ``block_sparse_moe.gate.weight``), and ``fused``, transformers' own module
layout (``save_pretrained(save_original_format=False)``: ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``, ``mlp.gate.weight`` for both families).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.kernels.fused_moe import fused_moe_ref
from pagedkv.models.config import MoeConfig
from pagedkv.models.layers import Linear

LAYOUTS = ("per_expert", "fused")
# per-expert names: family -> (module prefix, gate, up, down)
_PER_EXPERT_NAMES = {
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


def route_topk(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool,
               weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k] in weights_dtype, topk_ids [T, k] int64)`` of the router logits
    ``[T, E]``: float32 softmax, top-k, renormalized when ``norm_topk_prob``."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class SparseMoeBlock(nn.Module):
    """Router (``gate``: ``[E, H]``, no bias) + experts ``w13 [E, 2I, H]``, ``w2 [E, H, I]``."""

    def __init__(self, hidden_size: int, moe: MoeConfig, family: str, *, dtype=None, device=None):
        super().__init__()
        if family not in _PER_EXPERT_NAMES:
            raise ValueError(f"no MoE checkpoint naming for family {family!r}")
        self.family = family
        self.num_experts = moe.num_experts
        self.top_k = moe.top_k
        self.intermediate_size = moe.intermediate_size
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_model_dtype = moe.weights_dtype == "model"
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size
        self.gate = Linear(h, e, bias=False, dtype=dtype, device=device)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype, device=device), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, dtype=dtype, device=device), requires_grad=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights, topk_ids)`` of the tokens ``x [T, H]``."""
        wdtype = x.dtype if self.weights_in_model_dtype else torch.float32
        return route_topk(self.gate(x), self.top_k, self.norm_topk_prob, wdtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if x.device.type == "cuda":
            from pagedkv.kernels.fused_moe import fused_moe

            return fused_moe(x, self.w13, self.w2, weights, ids)
        return fused_moe_ref(x, self.w13, self.w2, weights, ids)

    def hf_entries(self, prefix: str, layout: str) -> dict:
        """This block's Hugging Face tensors (``prefix`` = ``model.layers.{i}.``) in ``layout``
        (``per_expert`` or ``fused``, see the module docstring) -> (tensor, rows)."""
        if layout == "fused":
            p = prefix + "mlp."
            return {p + "gate.weight": (self.gate.weight, None),
                    p + "experts.gate_up_proj": (self.w13, None),
                    p + "experts.down_proj": (self.w2, None)}
        if layout != "per_expert":
            raise ValueError(f"unknown MoE checkpoint layout {layout!r}; one of {LAYOUTS}")
        module, gate, up, down = _PER_EXPERT_NAMES[self.family]
        p = f"{prefix}{module}."
        i = self.intermediate_size
        m = {p + "gate.weight": (self.gate.weight, None)}
        for e in range(self.num_experts):
            w13 = self.w13.data[e]
            m[f"{p}experts.{e}.{gate}.weight"] = (w13, (0, i))
            m[f"{p}experts.{e}.{up}.weight"] = (w13, (i, i))
            m[f"{p}experts.{e}.{down}.weight"] = (self.w2.data[e], None)
        return m


__all__ = ["LAYOUTS", "SparseMoeBlock", "route_topk"]
