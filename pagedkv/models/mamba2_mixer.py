"""The Mamba-2 mixer of the hybrid families (Bamba, Falcon-H1) on per-request state slots.

As transformers' ``BambaMixer`` / ``FalconH1Mixer`` compute it (``MambaConfig`` has the
formulas), over one step's packed tokens of any mix of decode rows and prefill chunks:

1. ``in_proj`` (Falcon-H1: of ``x * ssm_in_multiplier``, its output times the muP vector of
   ``ssm_multipliers``) -> ``z | xBC | dt``;
2. the causal conv1d (SiLU) over ``xBC`` of every row in one launch
   (``pagedkv.kernels.causal_conv1d``), from the row's conv state when it has one;
3. the recurrence: decode rows (the first ``num_decodes`` rows, one token each) through the
   single-step kernel (``selective_state_update``: ``dt`` unclamped, as transformers' decode
   branch), prefill rows through the chunked scan (``ssd_chunk_scan``: ``dt`` clamped to
   ``time_step_limit``, continuing from the slot's state when ``has_initial_state``), both
   reading and writing the state in place at ``state_indices[:, 0]``;
4. the gate / gated RMSNorm (:func:`gated_rms_norm`), ``out_proj``.

States: ``states = (conv [num_blocks, d_conv - 1, conv_dim] in the model dtype, ssm
[num_blocks, num_heads, head_dim, d_state] float32)``, strided views into the engine's pool
(block stride = the page); the step's ``MambaMetadata`` (``pagedkv.worker.attn_builders``) says
which block holds each row's state. Padded rows (state index ``PAD_SLOT_ID``) and padded tokens
are never read or written; the outputs of padded tokens are ``out_proj(0)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.kernels.selective_state_update import selective_state_update
from pagedkv.kernels.ssd_chunk_scan import ssd_chunk_scan
from pagedkv.models.config import MambaConfig
from pagedkv.models.layers import Linear
from pagedkv.models.mamba_common import MambaMixerBase, conv_rows, has_prefill_rows


def gated_rms_norm(y: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                   n_groups: int, norm_before_gate: bool) -> torch.Tensor:
    """The mixer's gated RMSNorm over ``n_groups`` equal groups of the last dimension, in
    float32, rounded to ``y``'s dtype at the end: ``RMSNorm_g(y * silu(gate)) * weight``, or
    with ``norm_before_gate`` ``RMSNorm_g(y) * weight * silu(gate)``."""
    g = F.silu(gate.float())
    h = y.float()
    if not norm_before_gate:
        h = h * g
    t, d = h.shape
    groups = h.view(t, n_groups, d // n_groups)
    h = (groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + eps)).view(t, d)
    h = h * weight.float()
    if norm_before_gate:
        h = h * g
    return h.to(y.dtype)


def mup_vector(mc: MambaConfig) -> torch.Tensor | None:
    """Falcon-H1's per-channel multipliers of ``in_proj``'s output (``ssm_multipliers`` on
    its ``z``, ``x``, ``B``, ``C`` and ``dt`` parts), float32 ``[in_proj_size]``; None when
    they are all 1."""
    if all(m == 1.0 for m in mc.ssm_multipliers):
        return None
    gs = mc.n_groups * mc.d_state
    sizes = (mc.intermediate_size, mc.intermediate_size, gs, gs, mc.num_heads)
    return torch.cat([torch.full((n,), float(m)) for n, m in zip(sizes, mc.ssm_multipliers)])


class Mamba2Mixer(MambaMixerBase):
    """One layer's Mamba-2 mixer (HF module ``model.layers.{i}.mamba``); see the module
    docstring. Parameters keep the checkpoint's shapes (``conv1d.weight`` ``[conv_dim, 1,
    d_conv]``)."""

    def __init__(self, hidden_size: int, mc: MambaConfig, eps: float, *, dtype=None,
                 device=None):
        super().__init__()
        self.mc = mc
        self.eps = eps
        kw = dict(dtype=dtype, device=device)

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

        self.in_proj = Linear(hidden_size, mc.in_proj_size, bias=mc.in_proj_bias, **kw)
        self.conv_weight = param(mc.conv_dim, 1, mc.d_conv)
        self.conv_bias = param(mc.conv_dim) if mc.conv_bias else None
        self.dt_bias = param(mc.num_heads)
        self.A_log = param(mc.num_heads)
        self.D = param(mc.num_heads)
        self.norm_weight = param(mc.intermediate_size) if mc.gated_norm else None
        self.out_proj = Linear(mc.intermediate_size, hidden_size, bias=mc.out_proj_bias, **kw)
        mup = mup_vector(mc)
        self.register_buffer("mup", None if mup is None else mup.to(**kw), persistent=False)

    def forward(self, hidden: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor],
                meta) -> torch.Tensor:
        mc = self.mc
        conv_state, ssm_state = states
        t = hidden.shape[0]
        inter, nh, ng, ds = mc.intermediate_size, mc.num_heads, mc.n_groups, mc.d_state
        if mc.ssm_in_multiplier != 1.0:
            hidden = hidden * mc.ssm_in_multiplier
        proj = self.in_proj(hidden)
        if self.mup is not None:
            proj = proj * self.mup
        gate, xbc, dt = proj.split([inter, mc.conv_dim, nh], dim=-1)

        nd = meta.num_decodes
        xbc, qsl, slots, init = conv_rows(xbc, conv_state, self.conv_weight, self.conv_bias, meta)
        x, B, C = xbc.split([inter, ng * ds, ng * ds], dim=-1)
        x, B, C = x.view(t, nh, mc.head_dim), B.view(t, ng, ds), C.view(t, ng, ds)

        A = -torch.exp(self.A_log.float())
        # zeros: the rows no kernel writes (padding tokens, rows of padded requests, also in a
        # captured graph) give out_proj(0)
        y = torch.zeros(t, nh, mc.head_dim, dtype=x.dtype, device=x.device)
        if nd:
            selective_state_update(ssm_state, x[:nd], dt[:nd], self.dt_bias, A, B[:nd], C[:nd],
                                   self.D, slots[:nd], dt_softplus=True, out=y[:nd])
        if has_prefill_rows(meta):
            lo, hi = mc.time_step_limit
            ssd_chunk_scan(ssm_state, x, dt, self.dt_bias, A, B, C, self.D, qsl[nd:],
                           slots[nd:], init[nd:], dt_softplus=True, dt_min=lo, dt_max=hi,
                           out=y)
        y = y.view(t, inter)
        if self.norm_weight is not None:
            y = gated_rms_norm(y, gate, self.norm_weight, self.eps, ng, mc.norm_before_gate)
        else:
            y = (y.float() * F.silu(gate.float())).to(y.dtype)
        return self.out_proj(y)

    def hf_entries(self, prefix: str) -> dict:
        """This mixer's Hugging Face tensors (``prefix`` = ``model.layers.{i}.mamba.``)."""
        m = self.in_conv_hf_entries(prefix)
        for name in ("dt_bias", "A_log", "D"):
            m[prefix + name] = (getattr(self, name), None)
        if self.norm_weight is not None:
            m[prefix + "norm.weight"] = (self.norm_weight, None)
        m.update(self.out_proj.hf_entries(prefix + "out_proj"))
        return m


__all__ = ["Mamba2Mixer", "gated_rms_norm", "mup_vector"]
