"""Batched logits filters and the exponential-race sampler.

Each filter works in place on float32 logits ``[num_reqs, vocab]`` with one parameter per row
and replaces the logits of excluded tokens by ``-inf``; a row whose parameter holds the disabled
value is left unchanged. None of them reads a device value on the host.

Semantics (vLLM's):
- temperature: ``logits / T``.
- min-p: drop tokens whose probability (softmax of the current logits) is below
  ``min_p * max_prob``.
- top-k: keep the tokens whose logit is >= the row's k-th largest logit (ties at the k-th value
  are all kept, so a row can keep more than k tokens); ``k >= vocab`` keeps everything.
- top-p: keep the smallest set of most likely tokens whose probability mass (of the distribution
  after the earlier filters) reaches ``p``: a token is kept when the mass of the tokens ranked
  strictly above it is below ``p``; the most likely token is always kept. Ties in probability
  are ranked by token id (stable sort), so the kept set does not depend on the batch.
"""

from __future__ import annotations

import torch

_NEG_INF = float("-inf")
_TINY = torch.finfo(torch.float32).tiny


def apply_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / temperature[:, None]`` in place (temperatures must be > 0)."""
    return logits.div_(temperature.unsqueeze(1))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True).mul_(min_p.unsqueeze(1))
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """``top_k``: int64 per row, 0 = disabled; ``max_top_k``: its maximum (a host int, so the
    k-th values come from one ``topk`` of width ``max_top_k`` instead of a full sort)."""
    vocab = logits.shape[-1]
    width = min(max(int(max_top_k), 1), vocab)
    top_values = logits.topk(width, dim=-1, sorted=True).values
    kth_index = top_k.clamp(1, width).sub(1).unsqueeze(1)
    kth_value = top_values.gather(1, kth_index)
    disabled = (top_k <= 0).unsqueeze(1)
    kth_value = kth_value.masked_fill_(disabled, _NEG_INF)
    return logits.masked_fill_(logits < kth_value, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``top_p``: float per row in (0, 1]; 1 = disabled (exactly: no tail token is dropped by
    rounding of the cumulative sum)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True, stable=True)
    sorted_probs = torch.softmax(sorted_logits, dim=-1)
    # Mass of the tokens ranked strictly above each one: the exclusive cumulative sum.
    mass_above = sorted_probs.cumsum(dim=-1).roll(1, dims=-1)
    mass_above[:, 0] = 0.0
    drop_sorted = mass_above >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False
    drop_sorted &= (top_p < 1.0).unsqueeze(1)
    drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
    return logits.masked_fill_(drop, _NEG_INF)


def exponential_race(
    probs: torch.Tensor,
    generators: dict[int, torch.Generator],
    *,
    shared_generator: torch.Generator | None = None,
    fill_shared: bool = True,
) -> torch.Tensor:
    """Sample one token per row: ``argmax(probs / q)`` with ``q ~ Exp(1)`` i.i.d. per token,
    which picks token i with probability ``probs[i]``. Seeded rows draw their ``q`` from their
    own generator (so their tokens depend only on their logits and their generator's state);
    the other rows from ``shared_generator`` (torch's default stream when None), drawn only when
    ``fill_shared``. Rows filled by neither get q = 1 (their result is meant to be discarded).
    ``probs`` is overwritten."""
    q = torch.empty_like(probs)
    if fill_shared:
        q.exponential_(generator=shared_generator)
    elif len(generators) != probs.shape[0]:
        q.fill_(1.0)
    for row, g in generators.items():
        q[row].exponential_(generator=g)
    # Exp(1) may round to 0; a zero over a masked (zero) probability would give NaN.
    q.clamp_min_(_TINY)
    return probs.div_(q).argmax(dim=-1)


__all__ = [
    "apply_temperature",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "exponential_race",
]
