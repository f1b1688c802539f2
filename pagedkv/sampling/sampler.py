"""Sampler: one token per request row from float32 logits ``[num_reqs, vocab]``.

Order of operations (vLLM V1's):

1. logprobs, if any row asked (``logprobs_mode="raw_logprobs"``, vLLM's default): log_softmax
   of the logits exactly as the model produced them, before temperature and filters.
2. banned tokens (``min_tokens``) to ``-inf``, then the repetition / frequency / presence
   penalties (``pagedkv.sampling.penalties``) of the rows that use them,
3. greedy rows: argmax of those logits. If every row is greedy, stop here.
4. temperature (greedy rows divide by 1 in a mixed batch),
5. min-p (argmax-invariant; vLLM applies it as a logits processor right after temperature),
6. top-k, 7. top-p (on the distribution renormalized after top-k),
8. softmax, then the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)`` drawn per row from
   the row's own generator when the request is seeded,
9. mixed batches: ``where(greedy_row, argmax, sampled)``.

``logprobs_mode="processed_logprobs"`` instead reports log_softmax of the logits after steps 2-7
(greedy rows: after step 2).

Nothing here reads a device value on the host: the only host sync of a step is the caller's
``.tolist()`` of the sampled ids (``SamplerOutput.tolist``). The input logits are not modified.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv.errors import SamplingError
from pagedkv.kernels.argmax import argmax_rows
from pagedkv.sampling.filters import (
    apply_min_p,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    exponential_race,
)
from pagedkv.sampling.metadata import SamplingMetadata
from pagedkv.sampling.penalties import PenaltyCounts

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")


@dataclass
class LogprobsTensors:
    """Per row: column 0 is the sampled token, columns 1.. its top ``max_num_logprobs``
    alternatives (most likely first). A request that asked for ``k`` alternatives reads
    columns ``[0, k]``. ``ranks``: the sampled token's rank (1 = most likely; counts every token
    whose log-probability is >= the sampled one's)."""

    token_ids: torch.Tensor  # int64 [num_reqs, 1 + max_num_logprobs]
    logprobs: torch.Tensor  # float32 [num_reqs, 1 + max_num_logprobs]
    ranks: torch.Tensor  # int64 [num_reqs]

    def tolists(self) -> tuple[list[list[int]], list[list[float]], list[int]]:
        return self.token_ids.tolist(), self.logprobs.tolist(), self.ranks.tolist()


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # int64 [num_reqs]
    logprobs: LogprobsTensors | None = None

    def tolist(self) -> list[int]:
        """The sampled ids on the host (the step's one device-to-host sync)."""
        return self.sampled_token_ids.tolist()


class Sampler:
    """Stateless apart from ``generator``, the stream unseeded random rows draw from (torch's
    default generator of the logits' device when None)."""

    def __init__(self, logprobs_mode: str = "raw_logprobs",
                 generator: torch.Generator | None = None):
        if logprobs_mode not in LOGPROBS_MODES:
            raise SamplingError(
                f"logprobs_mode must be one of {LOGPROBS_MODES}, got {logprobs_mode!r}"
            )
        self.logprobs_mode = logprobs_mode
        self.generator = generator

    def __call__(self, logits: torch.Tensor, metadata: SamplingMetadata,
                 banned: tuple[torch.Tensor, torch.Tensor] | None = None,
                 penalties: PenaltyCounts | None = None) -> SamplerOutput:
        return self.forward(logits, metadata, banned, penalties)

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata,
                banned: tuple[torch.Tensor, torch.Tensor] | None = None,
                penalties: PenaltyCounts | None = None) -> SamplerOutput:
        """Sample one token per row. ``banned``: ``(rows, token_ids)`` (int64, same length)
        pairs that cannot be sampled this step (``min_tokens``: a request's stop tokens before
        its minimum length); their logits become ``-inf`` after the raw logprobs are taken
        (as vLLM's min-tokens logits processor: raw logprobs are those of the model).
        ``penalties``: the penalized rows' token counts; applied after ``banned``."""
        self._check(logits, metadata)
        logits = logits.float()  # no copy when already float32; never modified below
        k = metadata.max_num_logprobs
        raw_logprobs = None
        if k is not None and self.logprobs_mode == "raw_logprobs":
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        if banned is not None:
            logits = logits.index_put(banned, torch.tensor(float("-inf"), device=logits.device))
        if penalties is not None:
            logits = penalties.apply(logits)

        greedy = None if metadata.all_random else argmax_rows(logits)
        processed = logits
        if metadata.all_greedy:
            sampled = greedy
        else:
            processed = apply_temperature(logits.clone(), metadata.temperature)
            if metadata.min_p is not None:
                apply_min_p(processed, metadata.min_p)
            if metadata.top_k is not None:
                apply_top_k(processed, metadata.top_k, metadata.max_top_k)
            if metadata.top_p is not None:
                apply_top_p(processed, metadata.top_p)
            probs = torch.softmax(processed, dim=-1)
            sampled = exponential_race(
                probs,
                metadata.generators,
                shared_generator=self.generator,
                fill_shared=metadata.has_unseeded_random,
            )
            if greedy is not None:
                sampled = torch.where(metadata.greedy_mask, greedy, sampled)

        out_logprobs = None
        if k is not None:
            if raw_logprobs is None:  # processed_logprobs
                source = processed
                if metadata.greedy_mask is not None:
                    source = torch.where(metadata.greedy_mask.unsqueeze(1), logits, processed)
                raw_logprobs = torch.log_softmax(source, dim=-1)
            out_logprobs = gather_logprobs(raw_logprobs, sampled, k)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=out_logprobs)

    @staticmethod
    def _check(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
        if logits.dim() != 2:
            raise SamplingError(
                f"logits must be [num_reqs, vocab], got shape {tuple(logits.shape)}"
            )
        if logits.shape[0] != metadata.num_reqs:
            raise SamplingError(
                f"logits have {logits.shape[0]} rows but the sampling metadata was built for "
                f"{metadata.num_reqs} requests; rebuild it when the batch changes"
            )
        if not logits.is_floating_point():
            raise SamplingError(f"logits must be floating point, got {logits.dtype}")
        if logits.device.type != metadata.device.type or (
            metadata.device.index is not None and logits.device != metadata.device
        ):
            raise SamplingError(
                f"logits live on {logits.device}, the sampling metadata on {metadata.device}"
            )


def gather_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, k: int) -> LogprobsTensors:
    """The sampled token's log-probability and rank, followed by the top ``k`` alternatives
    (at most the vocabulary size)."""
    sampled_col = sampled.unsqueeze(1)
    sampled_lp = logprobs.gather(1, sampled_col)
    ranks = (logprobs >= sampled_lp).sum(dim=-1)
    k = min(k, logprobs.shape[-1])
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)
        token_ids = torch.cat([sampled_col, top_ids], dim=1)
        values = torch.cat([sampled_lp, top_lp], dim=1)
    else:
        token_ids, values = sampled_col, sampled_lp
    return LogprobsTensors(token_ids=token_ids, logprobs=values, ranks=ranks)


__all__ = ["Sampler", "SamplerOutput", "LogprobsTensors", "gather_logprobs", "LOGPROBS_MODES"]
