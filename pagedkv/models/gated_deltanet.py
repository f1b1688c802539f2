"""The Gated-DeltaNet mixer of Qwen3-Next's linear-attention layers on per-request state slots.

As transformers' ``Qwen3NextGatedDeltaNet`` (``LinearAttnConfig`` names the sizes): per key
head ``in_proj_qkvz`` gives ``[q | k | v | z]`` and ``in_proj_ba`` gives ``[b | a]`` (the
value heads of one key head side by side); ``[q | k | v]`` of all heads (``conv_dim``
channels) go through the causal depthwise conv1d with SiLU, then the gated delta rule (q and k
L2-normed in the kernels, ``beta = sigmoid(b)``, ``g = -exp(A_log) softplus(a + dt_bias)`` in
float32), an RMSNorm of each value head (weight ``norm.weight``, statistics in float32) times
``silu(z)``, and ``out_proj``.

State, per request (the slot its state index names, one pair per layer, see
``GatedDeltaNet.state_shapes``): the conv state ``[W - 1, conv_dim]`` in the model dtype (the
last ``W - 1`` inputs of the convolution, ``pagedkv.kernels.causal_conv1d``'s layout) and the
recurrent state ``[HV, K, V]`` in float32 (``pagedkv.kernels.gated_delta_rule``'s). A step
reads them as the runner's state interface gives them: ``(conv_state [S, W - 1, conv_dim],
recurrent_state [S, HV, K, V])`` (strided views into the pool; the kernels take strides) and a
``MambaMetadata`` (``pagedkv.worker.attn_builders``) whose rows come decodes first: the conv
kernel runs over every row in one launch, the decode rows ``[0, num_decodes)`` then go through
the recurrent (single-token) kernel and the other rows through the chunked kernel, which
continues from the slot where ``has_initial_state`` says so and starts from zeros otherwise.
Rows with state index ``PAD_SLOT_ID`` (CUDA-graph padding) are skipped by every kernel;
tokens no row covers get undefined outputs (as attention's padding tokens).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.kernels.causal_conv1d import causal_conv1d
from pagedkv.kernels.gated_delta_rule import chunk_gated_delta_rule, recurrent_gated_delta_rule
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.layers import Linear, rms_norm


class GatedDeltaNet(nn.Module):
    """One linear-attention layer's mixer (HF module ``model.layers.{i}.linear_attn``)."""

    def __init__(self, cfg: ModelArchConfig, layer_idx: int, *, dtype=None, device=None):
        super().__init__()
        la = cfg.linear_attn
        self.layer_idx = layer_idx
        self.num_k_heads, self.num_v_heads = la.num_key_heads, la.num_value_heads
        self.head_k_dim, self.head_v_dim = la.key_head_dim, la.value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = la.key_dim, la.value_dim, la.conv_dim
        self.conv_kernel_dim = la.conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        h = cfg.hidden_size
        kw = dict(dtype=dtype, device=device)
        self.in_proj_qkvz = Linear(h, 2 * la.key_dim + 2 * la.value_dim, bias=False, **kw)
        self.in_proj_ba = Linear(h, 2 * la.num_value_heads, bias=False, **kw)
        # transformers' Conv1d weight [conv_dim, 1, W] (depthwise)
        self.conv_weight = nn.Parameter(torch.empty(la.conv_dim, 1, la.conv_kernel_dim, **kw),
                                        requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(la.num_value_heads, **kw), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(la.num_value_heads, **kw), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(la.value_head_dim, **kw), requires_grad=False)
        self.out_proj = Linear(la.value_dim, h, bias=False, **kw)

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per state slot: the conv state ``(W - 1, conv_dim)`` and the recurrent state
        ``(HV, K, V)``."""
        return ((self.conv_kernel_dim - 1, self.conv_dim),
                (self.num_v_heads, self.head_k_dim, self.head_v_dim))

    def project(self, x: torch.Tensor):
        """``(mixed_qkv [T, conv_dim], z [T, HV, V], b [T, HV], a [T, HV])`` of ``x [T, H]``:
        the projections with each key head's ``[q | k | v | z]`` / ``[b | a]`` regrouped into
        all heads' ``[q | k | v]``, ``z``, ``b``, ``a`` (transformers'
        ``fix_query_key_value_ordering``)."""
        t = x.shape[0]
        hk, per = self.num_k_heads, self.num_v_heads // self.num_k_heads
        kd, vd = self.head_k_dim, self.head_v_dim
        qkvz = self.in_proj_qkvz(x).view(t, hk, 2 * kd + 2 * per * vd)
        q, k, v, z = qkvz.split([kd, kd, per * vd, per * vd], dim=-1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        b, a = self.in_proj_ba(x).view(t, hk, 2 * per).split([per, per], dim=-1)
        return (mixed, z.reshape(t, self.num_v_heads, vd), b.reshape(t, -1), a.reshape(t, -1))

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor],
                meta) -> torch.Tensor:
        """``[T, H]`` output for the packed tokens ``x [T, H]`` of the step's rows (``meta``: a
        ``MambaMetadata``); advances each row's ``state`` (conv, recurrent) in place."""
        conv_state, rec_state = state
        t = x.shape[0]
        hk, hv, kd, vd = self.num_k_heads, self.num_v_heads, self.head_k_dim, self.head_v_dim
        mixed, z, b, a = self.project(x)
        n, nd = int(meta.num_reqs), int(meta.num_decodes)
        qsl = meta.query_start_loc[: n + 1]
        idx = meta.state_indices[:n, 0]
        init = meta.has_initial_state[:n]
        mixed = causal_conv1d(mixed, conv_state, self.conv_weight[:, 0], None, qsl, idx, init,
                              "silu")
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.view(t, hk, kd), k.view(t, hk, kd), v.view(t, hv, vd)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = torch.empty_like(v)
        if nd:
            recurrent_gated_delta_rule(rec_state, q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd],
                                       idx[:nd], out=out[:nd])
        if n > nd:
            chunk_gated_delta_rule(rec_state, q, k, v, g, beta, qsl[nd:], idx[nd:], init[nd:],
                                   out=out)
        out = (rms_norm(out, self.norm_weight, self.eps) * F.silu(z.float())).to(x.dtype)
        return self.out_proj(out.reshape(t, self.value_dim))

    def hf_entries(self, prefix: str) -> dict:
        """This mixer's Hugging Face tensors (``prefix`` = ``model.layers.{i}.linear_attn.``)."""
        m = {prefix + "conv1d.weight": (self.conv_weight, None),
             prefix + "dt_bias": (self.dt_bias, None),
             prefix + "A_log": (self.A_log, None),
             prefix + "norm.weight": (self.norm_weight, None)}
        m.update(self.in_proj_qkvz.hf_entries(prefix + "in_proj_qkvz"))
        m.update(self.in_proj_ba.hf_entries(prefix + "in_proj_ba"))
        m.update(self.out_proj.hf_entries(prefix + "out_proj"))
        return m


__all__ = ["GatedDeltaNet"]
