"""DeepSeek-V4's mixture-of-experts MLP: hash-routed or top-k routed experts plus one shared
expert, as transformers' ``DeepseekV4SparseMoeBlock``.

Routing (``route_dsv4``), in the model dtype: ``logits = x W_gate^T``, ``scores =
scoring(logits)`` (``sqrtsoftplus``: ``sqrt(softplus(x))``, or ``sigmoid``); the experts are

* ``hash_moe`` layers: ``tid2eid[token id]`` (a fixed ``[vocab, k]`` table of the checkpoint,
  an int64 buffer) -- the token decides, not the router;
* ``moe`` layers: the top-k of ``scores + e_score_correction_bias`` (float32 bias);

weighted by their scores divided by their sum (``+ 1e-20``, always) times
``routed_scaling_factor``. The experts (stacked ``w13 [E, 2I, H]`` gate rows then up rows,
``w2 [E, H, I]``) and the shared expert (``shared_experts``, ``moe_intermediate_size`` wide)
use the clamped SwiGLU ``silu(min(gate, limit)) * clamp(up, -limit, limit)``
(``GatedActivation("silu_clamp")``); the experts run in ``pagedkv.kernels.fused_moe`` (Triton
on CUDA, the torch twin elsewhere).

Checkpoint names: transformers' module layout (``fused``: ``mlp.gate.weight``,
``mlp.gate.tid2eid`` / ``mlp.gate.e_score_correction_bias``, ``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``, ``mlp.shared_experts.{gate,up,down}_proj.weight``) or DeepSeek's
(``original``, what ``save_pretrained`` writes: ``ffn.gate.{weight,tid2eid,bias}``,
``ffn.experts.{e}.w1`` (gate) / ``w3`` (up) / ``w2`` (down), ``ffn.shared_experts.w1/w3/w2``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.kernels.fused_moe import GatedActivation, fused_moe_ref
from pagedkv.models.config import Dsv4Config, MoeConfig
from pagedkv.models.layers import GatedMLP, Linear


def dsv4_scores(logits: torch.Tensor, scoring: str) -> torch.Tensor:
    """The router's per-expert scores (in the logits' dtype)."""
    if scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if scoring == "sigmoid":
        return torch.sigmoid(logits)
    raise ConfigError(f"unknown DeepSeek-V4 scoring function {scoring!r}")


def route_dsv4(logits: torch.Tensor, scoring: str, top_k: int, routed_scaling_factor: float,
               correction_bias: torch.Tensor | None = None,
               hash_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights [T, k], topk_ids [T, k] int64)`` of the router logits ``[T, E]``: the
    experts ``hash_ids [T, k]`` (a hash layer's ``tid2eid`` rows) or the top-k of ``scores +
    correction_bias``, weighted as the module docstring says."""
    scores = dsv4_scores(logits, scoring)
    if hash_ids is not None:
        ids = hash_ids.to(torch.int64)
    else:
        choice = scores if correction_bias is None else scores + correction_bias
        ids = torch.topk(choice, top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class Dsv4MoE(nn.Module):
    """The MLP of layer ``layer_idx`` (see the module docstring)."""

    def __init__(self, hidden_size: int, vocab_size: int, moe: MoeConfig, x: Dsv4Config,
                 layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        e, i, h = moe.num_experts, moe.intermediate_size, hidden_size
        self.num_experts, self.top_k, self.intermediate_size = e, moe.top_k, i
        self.scoring, self.scaling = x.scoring_func, moe.routed_scaling_factor
        self.is_hash = x.is_hash(layer_idx)
        kw = dict(dtype=dtype, device=device)
        self.gate = Linear(h, e, bias=False, **kw)
        if self.is_hash:
            self.register_buffer("tid2eid", torch.zeros(vocab_size, moe.top_k, dtype=torch.int64,
                                                        device=device))
            self.e_score_correction_bias = None
        else:
            self.tid2eid = None
            self.e_score_correction_bias = nn.Parameter(
                torch.empty(e, dtype=torch.float32, device=device), requires_grad=False)
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h, **kw), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(e, h, i, **kw), requires_grad=False)
        self.activation = GatedActivation("silu_clamp", limit=moe.swiglu_limit)
        self.shared_experts = GatedMLP(h, moe.shared_intermediate_size, bias=False, **kw)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(topk_weights, topk_ids)`` of the tokens ``x [T, H]`` with ids ``input_ids [T]``."""
        hash_ids = self.tid2eid[input_ids] if self.is_hash else None
        return route_dsv4(self.gate(x), self.scoring, self.top_k, self.scaling,
                          self.e_score_correction_bias, hash_ids)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x, input_ids)
        if x.device.type == "cuda":
            from pagedkv.kernels.fused_moe import fused_moe

            out = fused_moe(x, self.w13, self.w2, weights, ids, activation=self.activation)
        else:
            out = fused_moe_ref(x, self.w13, self.w2, weights, ids, activation=self.activation)
        shared = self.shared_experts
        gate, up = shared.gate_up_proj(x).chunk(2, dim=-1)
        return out + shared.down_proj(self.activation(gate, up))

    def hf_entries(self, prefix: str, layout: str) -> dict:
        """This block's tensors (``prefix`` = ``model.layers.{i}.``) in ``layout``: ``fused``
        (transformers' module names) or ``original`` (DeepSeek's, as ``save_pretrained``
        writes them)."""
        i = self.intermediate_size
        gate_up = self.shared_experts.gate_up_proj.weight
        down = self.shared_experts.down_proj.weight
        if layout == "fused":
            p = prefix + "mlp."
            m = {p + "gate.weight": (self.gate.weight, None),
                 p + "experts.gate_up_proj": (self.w13, None),
                 p + "experts.down_proj": (self.w2, None),
                 p + "shared_experts.gate_proj.weight": (gate_up, (0, i)),
                 p + "shared_experts.up_proj.weight": (gate_up, (i, i)),
                 p + "shared_experts.down_proj.weight": (down, None)}
            bias_name = "gate.e_score_correction_bias"
        elif layout == "original":
            p = prefix + "ffn."
            m = {p + "gate.weight": (self.gate.weight, None),
                 p + "shared_experts.w1.weight": (gate_up, (0, i)),
                 p + "shared_experts.w3.weight": (gate_up, (i, i)),
                 p + "shared_experts.w2.weight": (down, None)}
            for e in range(self.num_experts):
                m[f"{p}experts.{e}.w1.weight"] = (self.w13.data[e], (0, i))
                m[f"{p}experts.{e}.w3.weight"] = (self.w13.data[e], (i, i))
                m[f"{p}experts.{e}.w2.weight"] = (self.w2.data[e], None)
            bias_name = "gate.bias"
        else:
            raise ConfigError(f"unknown DeepSeek-V4 MoE layout {layout!r}; fused or original")
        if self.is_hash:
            m[p + "gate.tid2eid"] = (self.tid2eid, None)
        else:
            m[p + bias_name] = (self.e_score_correction_bias, None)
        return m


__all__ = ["Dsv4MoE", "dsv4_scores", "route_dsv4"]
