"""The Mamba-1 mixer (Jamba) on per-request state slots.

As transformers' ``JambaMambaMixer`` computes it (``MambaConfig``, variant ``"jamba"``, has the
formulas), over one step's packed tokens of any mix of decode rows and prefill chunks:

1. ``in_proj`` -> ``x | z``;
2. the causal conv1d (SiLU) over ``x`` of every row in one launch
   (``pagedkv.kernels.causal_conv1d``), from the row's conv state when it has one;
3. ``x_proj(x) -> dt | B | C``, each RMS-normed (Jamba's ``dt_layernorm``, ``b_layernorm``,
   ``c_layernorm``), ``dt = dt_proj.weight @ dt`` (its bias enters the softplus);
4. the selective scan with the gate ``y * silu(z)`` (``pagedkv.kernels.selective_scan``):
   decode rows (the first ``num_decodes`` rows, one token each) through the single-step
   kernel (``selective_scan_update``), prefill rows through the chunked scan
   (``selective_scan``: continuing from the slot's state when ``has_initial_state``), both
   reading and writing the state in place at ``state_indices[:, 0]``;
5. ``out_proj``.

States: ``states = (conv [num_blocks, d_conv - 1, intermediate_size] in the model dtype, ssm
[num_blocks, intermediate_size, d_state] float32)``, strided views into the engine's pool
(block stride = the page); the step's ``MambaMetadata`` (``pagedkv.worker.attn_builders``) says
which block holds each row's state. Padded rows (state index ``PAD_SLOT_ID``) and padded tokens
are never read or written; the outputs of padded tokens are ``out_proj(0)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.errors import ConfigError
from pagedkv.kernels.selective_scan import selective_scan, selective_scan_update
from pagedkv.models.config import MambaConfig
from pagedkv.models.layers import Linear, RMSNorm
from pagedkv.models.mamba_common import MambaMixerBase, conv_rows, has_prefill_rows


class MambaMixer(MambaMixerBase):
    """One layer's Mamba-1 mixer (HF module ``model.layers.{i}.mamba``); see the module
    docstring. Parameters keep the checkpoint's names and shapes (``conv1d.weight``
    ``[intermediate_size, 1, d_conv]``, ``A_log [intermediate_size, d_state]``)."""

    def __init__(self, hidden_size: int, mc: MambaConfig, eps: float, *, dtype=None,
                 device=None):
        super().__init__()
        if not mc.mamba1:
            raise ConfigError(f"MambaMixer is the Mamba-1 mixer; variant {mc.variant!r} has "
                              "Mamba-2 mixers (pagedkv.models.mamba2_mixer)")
        self.mc = mc
        kw = dict(dtype=dtype, device=device)
        inter, rank, ds = mc.intermediate_size, mc.dt_rank, mc.d_state

        def param(*shape):
            return nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)

        self.in_proj = Linear(hidden_size, mc.in_proj_size, bias=mc.in_proj_bias, **kw)
        self.conv_weight = param(inter, 1, mc.d_conv)
        self.conv_bias = param(inter) if mc.conv_bias else None
        self.x_proj = Linear(inter, rank + 2 * ds, bias=False, **kw)
        self.dt_proj = Linear(rank, inter, bias=True, **kw)
        self.A_log = param(inter, ds)
        self.D = param(inter)
        self.dt_layernorm = RMSNorm(rank, eps, **kw)
        self.b_layernorm = RMSNorm(ds, eps, **kw)
        self.c_layernorm = RMSNorm(ds, eps, **kw)
        self.out_proj = Linear(inter, hidden_size, bias=mc.out_proj_bias, **kw)

    def forward(self, hidden: torch.Tensor, states: tuple[torch.Tensor, torch.Tensor],
                meta) -> torch.Tensor:
        mc = self.mc
        conv_state, ssm_state = states
        t, inter, ds = hidden.shape[0], mc.intermediate_size, mc.d_state
        x, gate = self.in_proj(hidden).split([inter, inter], dim=-1)

        nd = meta.num_decodes
        x, qsl, slots, init = conv_rows(x, conv_state, self.conv_weight, self.conv_bias, meta)
        dt, B, C = self.x_proj(x).split([mc.dt_rank, ds, ds], dim=-1)
        dt = F.linear(self.dt_layernorm(dt), self.dt_proj.weight)
        B, C = self.b_layernorm(B), self.c_layernorm(C)

        A = -torch.exp(self.A_log.float())
        bias = self.dt_proj.bias
        y = torch.empty(t, inter, dtype=x.dtype, device=x.device)
        y[meta.num_actual_tokens:] = 0  # padding tokens: no kernel writes them
        if nd:
            selective_scan_update(ssm_state, x[:nd], dt[:nd], bias, A, B[:nd], C[:nd], self.D,
                                  gate[:nd], slots[:nd], out=y[:nd])
        if has_prefill_rows(meta):
            selective_scan(ssm_state, x, dt, bias, A, B, C, self.D, gate, qsl[nd:], slots[nd:],
                           init[nd:], out=y)
        return self.out_proj(y)

    def hf_entries(self, prefix: str) -> dict:
        """This mixer's Hugging Face tensors (``prefix`` = ``model.layers.{i}.mamba.``)."""
        m = self.in_conv_hf_entries(prefix)
        for name in ("x_proj", "dt_proj", "out_proj"):
            m.update(getattr(self, name).hf_entries(prefix + name))
        for name in ("A_log", "D"):
            m[prefix + name] = (getattr(self, name), None)
        for name in ("dt_layernorm", "b_layernorm", "c_layernorm"):
            m[f"{prefix}{name}.weight"] = (getattr(self, name).weight, None)
        return m

    @torch.no_grad()
    def init_state_space(self) -> None:
        """transformers' initialisation of ``A_log`` (``log(1..d_state)`` in every channel)
        and ``D`` (ones), for random-weight models."""
        ds = self.mc.d_state
        a = torch.arange(1, ds + 1, dtype=torch.float32, device=self.A_log.device)
        self.A_log.copy_(torch.log(a).expand_as(self.A_log))
        self.D.fill_(1.0)


__all__ = ["MambaMixer"]
