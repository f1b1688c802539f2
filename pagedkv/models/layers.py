"""Building blocks of the decoder: RMSNorm, linear layers, the fused QKV projection and the
SiLU-gated MLP.

Parameters are created uninitialized (``torch.empty``): weights come from a checkpoint or from
``DecoderForCausalLM.init_random_weights``. Forward functions are plain tensor code without
data-dependent Python control flow, so ``torch.compile`` can be applied to them.

Fused projections keep one weight per GEMM (``qkv_proj`` = q|k|v rows, ``gate_up_proj`` =
gate|up rows); ``shards`` names the row range each Hugging Face tensor fills.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.kernels.activation import silu_and_mul_op, silu_and_mul_partials_op
from pagedkv.kernels.gate_up_silu import fused_gate_up_applies, gate_up_silu_op
from pagedkv.kernels.splitk_gemm import gate_up_partials


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)``; the statistics in float32, the product in ``x``'s dtype."""
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


def rms_norm_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / rms(x)`` wholly in float32, rounded once to ``x``'s dtype (GPT-OSS, whose
    norms transformers keeps in float32: the weight multiplies before the rounding)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(torch.float32) * xf).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` without a weight (DeepSeek-V4's per-head query norm and mHC input norm):
    the statistics in float32, rounded to ``x``'s dtype, the product in ``x``'s dtype."""
    return x * torch.rsqrt(x.to(torch.float32).square().mean(-1, keepdim=True) + eps).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension: on CUDA one
    Triton kernel (``pagedkv.kernels.activation``, a custom op that compiled regions keep as one
    launch), elsewhere the eager expression ``F.silu(gate) * up``."""
    if gate_up.device.type == "cuda" and gate_up.dim() == 2:
        return silu_and_mul_op(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def gate_up_silu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """``silu_and_mul(x @ weight^T + bias)``: the MLP's gate/up projection and activation. For
    decode-sized batches with ``FUSED_GATE_UP_ENABLED`` (off by default), one kernel with the
    activation in the GEMM's epilogue (``pagedkv.kernels.gate_up_silu``); on CUDA with
    ``SPLITK_GATE_UP_ENABLED`` (off by default), split-K partials summed by the activation's
    kernel (``silu_and_mul_partials``); otherwise ``F.linear`` then :func:`silu_and_mul`."""
    if fused_gate_up_applies(x, weight):
        return gate_up_silu_op(x, weight, bias)
    parts = gate_up_partials(x, weight, bias)
    if parts is not None:
        return silu_and_mul_partials_op(parts, x.dtype)
    return silu_and_mul(F.linear(x, weight, bias))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with ``W: [out_features, in_features]``."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype=None, device=None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def hf_entries(self, name: str) -> dict:
        """This projection's Hugging Face tensors (``name.weight``, ``name.bias`` if any) ->
        ``(parameter, None)`` (the whole parameter), for a model's ``hf_weight_map``."""
        m = {f"{name}.weight": (self.weight, None)}
        if self.bias is not None:
            m[f"{name}.bias"] = (self.bias, None)
        return m


class MergedLinear(Linear):
    """Several projections of the same input stacked into one weight (one GEMM).

    ``shards``: name -> (first row, number of rows).
    """

    def __init__(self, in_features: int, sizes: dict[str, int], *, bias: bool, dtype=None, device=None):
        super().__init__(in_features, sum(sizes.values()), bias=bias, dtype=dtype, device=device)
        self.shards: dict[str, tuple[int, int]] = {}
        start = 0
        for name, n in sizes.items():
            self.shards[name] = (start, n)
            start += n
        self.split_sizes = list(sizes.values())

    def hf_entries_of_shards(self, names: dict[str, str]) -> dict:
        """Each shard's Hugging Face tensors (``names[shard]`` + ``.weight`` / ``.bias``) ->
        ``(fused parameter, its row range)``."""
        m = {}
        for shard, name in names.items():
            rows = self.shards[shard]
            m[f"{name}.weight"] = (self.weight, rows)
            if self.bias is not None:
                m[f"{name}.bias"] = (self.bias, rows)
        return m


class QKVProjection(MergedLinear):
    """q, k, v projections fused; returns ``q [T, H, D]``, ``k [T, Hkv, D]``, ``v [T, Hkv, D]``."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 bias: bool, dtype=None, device=None):
        super().__init__(
            hidden_size,
            {"q": num_heads * head_dim, "k": num_kv_heads * head_dim, "v": num_kv_heads * head_dim},
            bias=bias, dtype=dtype, device=device,
        )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = F.linear(x, self.weight, self.bias)
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        t = x.shape[0]
        return (
            q.reshape(t, self.num_heads, self.head_dim),
            k.reshape(t, self.num_kv_heads, self.head_dim),
            v.reshape(t, self.num_kv_heads, self.head_dim),
        )


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool, dtype=None, device=None):
        super().__init__()
        self.gate_up_proj = MergedLinear(
            hidden_size, {"gate": intermediate_size, "up": intermediate_size},
            bias=bias, dtype=dtype, device=device,
        )
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))

    def hf_entries(self, name: str) -> dict:
        """The Hugging Face tensors of this MLP (:func:`gated_mlp_hf_entries`)."""
        return gated_mlp_hf_entries(name, self.gate_up_proj, self.down_proj)


def gated_mlp_hf_entries(name: str, gate_up_proj: MergedLinear, down_proj: Linear) -> dict:
    """The Hugging Face tensors of a gated MLP: ``{name}.gate_proj`` / ``.up_proj`` (rows of
    the fused ``gate_up_proj``) and ``{name}.down_proj`` (``name``: e.g.
    ``model.layers.{i}.mlp``)."""
    m = gate_up_proj.hf_entries_of_shards({"gate": name + ".gate_proj", "up": name + ".up_proj"})
    m.update(down_proj.hf_entries(name + ".down_proj"))
    return m


__all__ = ["GatedMLP", "Linear", "MergedLinear", "QKVProjection", "RMSNorm", "gated_mlp_hf_entries",
           "rms_norm", "rms_norm_fp32", "silu_and_mul", "unweighted_rms_norm"]
