"""Manifold-constrained hyper-connections (mHC): DeepSeek-V4's residual streams.

The residual of every token is ``N = hc_mult`` streams ``[T, N, H]`` (the embedding copied N
times). Around each block (attention, MLP) a :class:`HyperConnection` derives three mixing
weights from the streams, as transformers' ``DeepseekV4HyperConnection`` (all in float32):

* ``x = unweighted_rms_norm(streams.flatten())`` (``[T, N * H]``), ``m = x fn^T``
  (``fn [(2 + N) N, N H]``), split into ``pre [N]``, ``post [N]``, ``comb [N, N]`` logits;
* ``pre = sigmoid(m_pre * scale[0] + base_pre) + eps`` collapses the streams into the block's
  input ``sum_n pre[n] streams[n]`` (rounded to the streams' dtype);
* ``post = 2 sigmoid(m_post * scale[1] + base_post)`` spreads the block's output back;
* ``comb = softmax(m_comb * scale[2] + base_comb, rows) + eps``, then made (nearly)
  doubly stochastic by Sinkhorn-Knopp: columns normalized once, then ``sinkhorn_iters - 1``
  times rows then columns (each sum ``+ eps``);
* the new streams (:func:`mix_streams`): ``post[n] out + sum_j comb[j, n] streams[j]`` in the
  streams' dtype.

:class:`HyperHead` collapses the streams once more before the final norm: ``pre =
sigmoid(x hc_fn^T * hc_scale + hc_base) + eps``, ``sum_n pre[n] streams[n]``.

Parameters stay float32 whatever the model dtype (transformers keeps ``attn_hc``, ``ffn_hc``
and ``hc_head`` in float32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedkv.models.layers import unweighted_rms_norm


def _param(*shape, device=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device), requires_grad=False)


def collapse_streams(pre: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """``sum_n pre[:, n] streams[:, n]`` (``pre [T, N]`` float32, ``streams [T, N, H]``), in
    float32, rounded to the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def mix_streams(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor) -> torch.Tensor:
    """The streams after a block: ``post[n] out + sum_j comb[j, n] streams[j]`` (``out [T, H]``
    the block's output, ``post [T, N]``, ``comb [T, N, N]``), in the streams' dtype."""
    dtype = streams.dtype
    return (post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2)
            + torch.matmul(comb.to(dtype).transpose(-1, -2), streams))


class HyperConnection(nn.Module):
    """One mHC site (``attn_hc`` or ``ffn_hc`` of a layer), see the module docstring."""

    def __init__(self, hc_mult: int, hidden_size: int, sinkhorn_iters: int, hc_eps: float,
                 norm_eps: float, *, device=None):
        super().__init__()
        n = hc_mult
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = _param((2 + n) * n, n * hidden_size, device=device)
        self.base = _param((2 + n) * n, device=device)
        self.scale = _param(3, device=device)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(post [T, N], comb [T, N, N], collapsed [T, H])`` of ``streams [T, N, H]``
        (``post`` and ``comb`` float32, ``collapsed`` in the streams' dtype)."""
        n, eps = self.hc_mult, self.hc_eps
        flat = unweighted_rms_norm(streams.flatten(1).to(torch.float32), self.norm_eps)
        mix = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n), dim=-1) + eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        for _ in range(self.sinkhorn_iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
        return post, comb, collapse_streams(pre, streams)


class HyperHead(nn.Module):
    """The final collapse of the streams (``model.hc_head``), see the module docstring."""

    def __init__(self, hc_mult: int, hidden_size: int, hc_eps: float, norm_eps: float, *,
                 device=None):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.hc_fn = _param(hc_mult, hc_mult * hidden_size, device=device)
        self.hc_base = _param(hc_mult, device=device)
        self.hc_scale = _param(1, device=device)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).to(torch.float32), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.hc_eps
        return collapse_streams(pre, streams)


__all__ = ["HyperConnection", "HyperHead", "collapse_streams", "mix_streams"]
