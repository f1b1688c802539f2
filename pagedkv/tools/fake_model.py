"""A model without weights for the engine's own runner: what ``pagedkv trace`` and the
index-layer driver run, so that what they print and check is what the engine does (the same
``Scheduler``, the same ``ModelRunner`` step: state update, block-table commit, slot mappings
in one launch, per-group metadata builders, padding, sampling).

:class:`TraceModel` declares one attention layer per entry of the KV-cache groups it is given
(any geometry: full, sliding-window, chunked-local, MLA latent, compressed), reads no KV data
and writes none (its backend's ``forward`` is never called), and "samples" the token
``next_token(tokens, positions)`` (vectorized; default :func:`fake_next_tokens`) for the last
scheduled token of each row: its forward returns that token per input row and its logits are
one-hot there, so the runner's greedy argmax picks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from pagedkv.attention.backend import AttentionBackend, AttentionLayout
from pagedkv.core.spec import KVCacheConfig, KVCacheGroupSpec
from pagedkv.errors import ConfigError

NextTokens = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def fake_next_tokens(tokens: torch.Tensor, positions: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """A deterministic stand-in for a model: the token after ``tokens`` at ``positions``."""
    t = tokens.to(torch.int64)
    p = positions.to(torch.int64)
    return (t * 1_000_003 + p * 7919 + 12345) % vocab_size


class TraceBackend(AttentionBackend):
    """Plans are the metadata as built (the runner's builders run as for a real model);
    ``forward`` is never called: the trace model reads no KV."""

    name = "trace"
    reorder_batch_threshold = 1

    def forward(self, layer_idx, q, k, v, kv_cache, plan, scale):  # pragma: no cover
        raise ConfigError("the trace model runs no attention")


@dataclass
class _Config:
    vocab_size: int
    eos_token_ids: tuple = ()
    hidden_size: int = 1


class TraceModel:
    """See the module docstring. ``groups``: the KV-cache groups as the caller names them;
    :meth:`kv_cache_config` gives the same groups under the runner's layer names."""

    def __init__(self, groups: Sequence[KVCacheGroupSpec], vocab_size: int,
                 next_token: NextTokens | None = None, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.dtype = torch.float32
        self.config = _Config(vocab_size)
        self.attn_backend = TraceBackend()
        self._groups = list(groups)
        names = [n for g in self._groups for n in g.layer_names]
        if len(set(names)) != len(names):
            raise ConfigError(f"layer names repeat across the groups: {names}")
        self.layers = [None] * len(names)
        runner_names = [f"model.layers.{i}.self_attn" for i in range(len(names))]
        self.layer_name_of = dict(zip(names, runner_names))
        self._specs = {self.layer_name_of[n]: g.kv_cache_spec
                       for g in self._groups for n in g.layer_names}
        self._next = next_token or (lambda t, p: fake_next_tokens(t, p, vocab_size))

    def kv_cache_config(self, num_blocks: int) -> KVCacheConfig:
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[
            KVCacheGroupSpec(tuple(self.layer_name_of[n] for n in g.layer_names), g.kv_cache_spec)
            for g in self._groups])

    def kv_cache_specs(self, block_size: int) -> dict:
        return dict(self._specs)

    def attention_layout(self, spec=None) -> AttentionLayout:
        heads = getattr(spec, "num_kv_heads", 1) or 1
        return AttentionLayout(heads, heads, getattr(spec, "head_size", 1), self.dtype,
                               self.device, sliding_window=getattr(spec, "sliding_window", None))

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, attention):
        n = input_ids.shape[0]
        return self._next(input_ids[:n], positions[:n]).to(torch.float32)[:, None]

    def compute_logits(self, hidden: torch.Tensor, indices=None, widen: bool = True):
        rows = hidden[:, 0] if indices is None else hidden[indices, 0]
        toks = rows.to(torch.int64).clamp_(0, self.config.vocab_size - 1)
        logits = torch.zeros(rows.shape[0], self.config.vocab_size, device=hidden.device)
        logits[torch.arange(rows.shape[0], device=hidden.device), toks] = 1.0
        return logits


__all__ = ["TraceBackend", "TraceModel", "fake_next_tokens"]
