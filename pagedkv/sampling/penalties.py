"""Repetition, frequency and presence penalties (vLLM's semantics), and the per-row token counts
they read.

For a row with ``repetition_penalty`` r, ``frequency_penalty`` f and ``presence_penalty`` p, and
a token t whose logit is x:

1. repetition (t in the prompt or in the output so far): ``x / r`` if ``x > 0`` else ``x * r``;
2. frequency: ``x -= f * c`` with c the number of times t occurs in the output so far;
3. presence: ``x -= p`` if t occurs in the output (``c > 0``).

Frequency and presence count output tokens only; repetition counts the prompt as well (as vLLM,
and as transformers' ``RepetitionPenaltyLogitsProcessor`` whose ``input_ids`` hold prompt and
output). The sampler applies them to the logits after the raw logprobs are taken and before
greedy argmax, temperature and the filters.

:class:`PenaltyCounts` owns the device tensors of one batch composition: per penalized row a
prompt-token mask and the output-token counts, built from the host token lists once and then
updated on the device with every sampled token (``add_sampled``), so a decode step issues no
host-to-device copy of token lists. :func:`penalize_reference` is the plain twin: the same rule
over Python lists, one token at a time.
"""

from __future__ import annotations

from typing import Sequence

import torch

from pagedkv.errors import SamplingError


class PenaltyCounts:
    """Penalty state of the rows ``rows`` (indices into the sampled rows of a step) of one
    batch composition.

    ``prompts[j]`` / ``outputs[j]``: row ``rows[j]``'s prompt and output tokens known on the
    host; ``pending``: optional ``(j_indices, token_tensor)``, output tokens already sampled on
    the device but not on the host yet (async scheduling), one per listed row."""

    def __init__(self, rows: Sequence[int], prompts: Sequence[Sequence[int]],
                 outputs: Sequence[Sequence[int]], repetition: Sequence[float],
                 frequency: Sequence[float], presence: Sequence[float], vocab_size: int,
                 device: torch.device | str,
                 pending: tuple[Sequence[int], torch.Tensor] | None = None) -> None:
        device = torch.device(device)
        p = len(rows)
        if not (p == len(prompts) == len(outputs) == len(repetition) == len(frequency)
                == len(presence)):
            raise SamplingError("penalty rows, token lists and penalty values differ in length")
        self.num_rows = p
        self.vocab_size = vocab_size
        self.device = device
        self.rows = torch.tensor(list(rows), dtype=torch.int64, device=device)
        self._row_list = list(rows)
        self.repetition = torch.tensor(list(repetition), dtype=torch.float32, device=device)
        self.frequency = torch.tensor(list(frequency), dtype=torch.float32, device=device)
        self.presence = torch.tensor(list(presence), dtype=torch.float32, device=device)
        self.uses_repetition = any(r != 1.0 for r in repetition)
        self.prompt_mask = torch.zeros(p, vocab_size, dtype=torch.bool, device=device)
        self.counts = torch.zeros(p, vocab_size, dtype=torch.int32, device=device)
        # host count of the output tokens accounted per row (the owner checks it against its
        # token lists each step and rebuilds on a mismatch, e.g. outputs truncated)
        self.num_outputs = [len(o) for o in outputs]
        if self.uses_repetition:
            r, t = _flatten(prompts, vocab_size, "prompt")
            if r.size(0):
                self.prompt_mask[r.to(device), t.to(device)] = True
        r, t = _flatten(outputs, vocab_size, "output")
        if r.size(0):
            self.counts.index_put_((r.to(device), t.to(device)),
                                   torch.ones(r.size(0), dtype=torch.int32, device=device),
                                   accumulate=True)
        if pending is not None:
            js, toks = pending
            js = list(js)
            if js:
                jt = torch.tensor(js, dtype=torch.int64, device=device)
                self.counts.index_put_((jt, toks.to(device=device, dtype=torch.int64)),
                                       torch.ones(len(js), dtype=torch.int32, device=device),
                                       accumulate=True)
                for j in js:
                    self.num_outputs[j] += 1
        # rows are 0..p-1: apply needs no gather/scatter when the step samples p rows
        self._leading = self._row_list == list(range(p))

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The penalized logits (a new tensor; ``logits`` is not modified)."""
        m = logits.shape[0]
        if self.counts.shape[1] != logits.shape[1]:
            raise SamplingError(f"penalty counts cover {self.counts.shape[1]} tokens, the logits "
                                f"{logits.shape[1]}")
        whole = self._leading and self.num_rows == m
        sub = logits if whole else logits.index_select(0, self.rows)
        counts = self.counts
        seen_out = counts > 0
        if self.uses_repetition:
            rep = self.repetition.unsqueeze(1)
            hit = self.prompt_mask | seen_out
            sub = torch.where(hit, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - self.frequency.unsqueeze(1) * counts - self.presence.unsqueeze(1) * seen_out
        if whole:
            return sub
        return logits.index_copy(0, self.rows, sub)

    def add_sampled(self, sampled: torch.Tensor) -> None:
        """Count this step's sampled tokens (``sampled[rows[j]]`` for every row j), on the
        device."""
        toks = sampled.index_select(0, self.rows).to(torch.int64)
        j = torch.arange(self.num_rows, device=self.device)
        self.counts.index_put_((j, toks), torch.ones_like(j, dtype=torch.int32), accumulate=True)
        for i in range(self.num_rows):
            self.num_outputs[i] += 1


def _flatten(lists: Sequence[Sequence[int]], vocab_size: int, what: str):
    rows = [j for j, ids in enumerate(lists) for _ in ids]
    toks = [t for ids in lists for t in ids]
    r = torch.tensor(rows, dtype=torch.int64)
    t = torch.tensor(toks, dtype=torch.int64)
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab_size):
        raise SamplingError(f"an {what} token is outside the vocabulary [0, {vocab_size})")
    return r, t


def penalize_reference(logits: Sequence[float], prompt: Sequence[int], output: Sequence[int],
                       repetition: float = 1.0, frequency: float = 0.0,
                       presence: float = 0.0) -> list[float]:
    """One row's penalized logits, token by token over plain lists (the twin of
    :meth:`PenaltyCounts.apply`)."""
    out = [float(x) for x in logits]
    seen = set(prompt) | set(output)
    counts: dict[int, int] = {}
    for t in output:
        counts[t] = counts.get(t, 0) + 1
    for t in range(len(out)):
        x = out[t]
        if t in seen:
            x = x / repetition if x > 0 else x * repetition
        c = counts.get(t, 0)
        x -= frequency * c
        if c > 0:
            x -= presence
        out[t] = x
    return out


__all__ = ["PenaltyCounts", "penalize_reference"]
