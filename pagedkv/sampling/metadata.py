"""SamplingMetadata: the per-row sampling parameters of one batch composition, as device tensors.

Built once when the set (or order) of requests in the persistent batch changes, reused for every
step until then, so a step's sampling issues no host-to-device copies. Filters that no row uses
have ``None`` tensors and are skipped entirely (``max_top_k``, ``all_greedy``, ``all_random``,
``has_unseeded_random`` and ``max_num_logprobs`` are host values, so the sampler branches without
reading the device).

Seeded rows draw from their own ``torch.Generator``. The generator belongs to the request, not to
the batch: create it once per request with ``make_generator`` and pass the same object every time
the metadata is rebuilt, so the request's random stream continues across steps and does not depend
on which other requests share the batch or at which row it sits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch

from pagedkv.errors import SamplingError
from pagedkv.sampling.params import GREEDY_EPS, SamplingParams


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A generator on ``device`` seeded with a request's ``seed``."""
    g = torch.Generator(device=torch.device(device))
    g.manual_seed(seed)
    return g


@dataclass
class SamplingMetadata:
    num_reqs: int
    device: torch.device
    # float32 [num_reqs]: the divisor applied to the logits (greedy rows hold 1.0, so they can be
    # divided harmlessly in a mixed batch); None when every row is greedy.
    temperature: torch.Tensor | None
    # bool [num_reqs]: rows sampled by argmax; None when no row is greedy.
    greedy_mask: torch.Tensor | None
    # float32 [num_reqs] in [0, 1], 0 = disabled; None when no row uses min-p.
    min_p: torch.Tensor | None
    # int64 [num_reqs], 0 = disabled; None when no row uses top-k. ``max_top_k`` is its maximum.
    top_k: torch.Tensor | None
    max_top_k: int
    # float32 [num_reqs] in (0, 1], 1 = disabled; None when no row uses top-p.
    top_p: torch.Tensor | None
    all_greedy: bool
    all_random: bool
    # True when some random row has no seed (it draws from the sampler's shared stream).
    has_unseeded_random: bool
    # row -> generator, for seeded random rows only.
    generators: dict[int, torch.Generator] = field(default_factory=dict)
    # Largest ``logprobs`` of the batch (top alternatives to compute); None: nobody asked.
    max_num_logprobs: int | None = None

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        device: torch.device | str = "cpu",
        generators: Mapping[int, torch.Generator] | None = None,
    ) -> "SamplingMetadata":
        """Metadata for a batch whose row ``i`` samples with ``params[i]``.

        ``generators`` maps rows to the requests' own generators (see ``make_generator``). A
        seeded random row without one gets a fresh generator from its seed; it is returned in
        ``.generators`` and the caller must keep it for the next rebuild, or the stream restarts.
        """
        device = torch.device(device)
        n = len(params)
        if n == 0:
            raise SamplingError("cannot build sampling metadata for an empty batch")
        for i, p in enumerate(params):
            if not isinstance(p, SamplingParams):
                raise SamplingError(f"row {i}: expected SamplingParams, got {type(p).__name__}")
        greedy = [p.temperature < GREEDY_EPS for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        gens: dict[int, torch.Generator] = {}
        given = generators or {}
        for i, p in enumerate(params):
            if greedy[i] or p.seed is None:
                continue
            g = given.get(i)
            if g is None:
                g = make_generator(p.seed, device)
            elif g.device.type != device.type:
                raise SamplingError(
                    f"row {i}: generator lives on {g.device}, the batch samples on {device}; "
                    "create it with make_generator(seed, device)"
                )
            gens[i] = g
        has_unseeded_random = any(
            not greedy[i] and params[i].seed is None for i in range(n)
        )

        def f32(values):
            return torch.tensor(values, dtype=torch.float32, device=device)

        temperature = greedy_mask = min_p = top_k = top_p = None
        max_top_k = 0
        if not all_greedy:
            temperature = f32([1.0 if greedy[i] else p.temperature for i, p in enumerate(params)])
            if not all_random:
                greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
            if any(p.min_p > 0.0 for p in params):
                min_p = f32([p.min_p for p in params])
            if any(p.top_k > 0 for p in params):
                top_k = torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device)
                max_top_k = max(p.top_k for p in params)
            if any(p.top_p < 1.0 for p in params):
                top_p = f32([p.top_p for p in params])

        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_reqs=n,
            device=device,
            temperature=temperature,
            greedy_mask=greedy_mask,
            min_p=min_p,
            top_k=top_k,
            max_top_k=max_top_k,
            top_p=top_p,
            all_greedy=all_greedy,
            all_random=all_random,
            has_unseeded_random=has_unseeded_random,
            generators=gens,
            max_num_logprobs=max(asked) if asked else None,
        )


__all__ = ["SamplingMetadata", "make_generator"]
