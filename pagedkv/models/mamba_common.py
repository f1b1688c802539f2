"""What the Mamba mixers (``mamba_mixer``: Mamba-1, ``mamba2_mixer``: Mamba-2) share: their
interface (:class:`MambaMixerBase`) and how they read a step's rows from its ``MambaMetadata``
(``pagedkv.worker.attn_builders``): the first ``num_reqs`` rows, each row's state in the block
``state_indices[r, 0]``, decode rows first."""

from __future__ import annotations

import torch
from torch import nn

from pagedkv.kernels.causal_conv1d import causal_conv1d
from pagedkv.models.config import MambaConfig


class MambaMixerBase(nn.Module):
    """A layer's Mamba mixer over per-request state slots (``mc``: its ``MambaConfig``).

    Subclasses define ``forward(hidden, states, meta)``: the mixer's output ``[T, hidden]`` for
    the normed input ``hidden [T, hidden]``, updating the rows' states in ``states`` (``(conv,
    ssm)``) at the slots of ``meta``, a ``MambaMetadata`` (see each mixer's module docstring)."""

    mc: MambaConfig

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-slot shapes of the conv state and the SSM state."""
        return self.mc.conv_state_shape, self.mc.ssm_state_shape

    def in_conv_hf_entries(self, prefix: str) -> dict:
        """The Hugging Face tensors of ``in_proj`` and the conv (``conv1d.weight``, and
        ``conv1d.bias`` when the mixer has one) under ``prefix``."""
        m = self.in_proj.hf_entries(prefix + "in_proj")
        m[prefix + "conv1d.weight"] = (self.conv_weight, None)
        if self.conv_bias is not None:
            m[prefix + "conv1d.bias"] = (self.conv_bias, None)
        return m


def conv_rows(x: torch.Tensor, conv_state: torch.Tensor, conv_weight: torch.Tensor,
              conv_bias: torch.Tensor | None, meta):
    """The causal conv1d with SiLU of the step's packed tokens ``x [T, channels]`` over the
    rows of ``meta`` (each from its conv state where ``has_initial_state``, which it
    advances); ``conv_weight`` as the checkpoint holds it, ``[channels, 1, width]``.

    Returns ``(y, query_start_loc [n + 1], slots [n], has_initial_state [n])``: the conv's
    output and the rows' views the scan kernels take next."""
    n = meta.num_reqs
    qsl = meta.query_start_loc[: n + 1]
    slots = meta.state_indices[:n, 0].contiguous()
    init = meta.has_initial_state[:n]
    y = causal_conv1d(x, conv_state, conv_weight[:, 0], conv_bias, qsl, slots, init, "silu")
    return y, qsl, slots, init


def has_prefill_rows(meta) -> bool:
    """Whether the chunked scan runs this step: rows after the decodes (metadata without a
    decode / prefill split counts every row a prefill)."""
    return bool(meta.num_prefills or (meta.num_decodes == 0 and meta.num_reqs))


__all__ = ["MambaMixerBase", "conv_rows", "has_prefill_rows"]
