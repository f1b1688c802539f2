"""Synthetic workloads for the index layer: prompts with shared prefixes, arrivals, a fake model.

Everything is seeded and pure Python, so a workload replays identically anywhere.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from pagedkv.errors import ConfigError


@dataclass(frozen=True)
class WorkloadSpec:
    """``num_requests`` prompts; ``round(shared_prefix_ratio * num_requests)`` of them (chosen
    at random) start with one of ``num_prefixes`` shared prefixes of ``prefix_len`` tokens,
    the prefixes dealt round-robin so that each is shared as evenly as possible; the rest of
    each prompt is random with a length drawn from ``tail_len``; ``max_tokens`` drawn from its
    range; on average ``arrival_rate`` requests arrive per step (0: all at step 0)."""

    num_requests: int = 8
    shared_prefix_ratio: float = 0.5
    num_prefixes: int = 2
    prefix_len: int = 48
    tail_len: tuple[int, int] = (8, 64)
    max_tokens: tuple[int, int] = (4, 24)
    arrival_rate: float = 1.0
    vocab_size: int = 32000
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1:
            raise ConfigError(f"num_requests must be >= 1, got {self.num_requests}")
        if not 0.0 <= self.shared_prefix_ratio <= 1.0:
            raise ConfigError(
                f"shared_prefix_ratio must lie in [0, 1], got {self.shared_prefix_ratio}"
            )
        for name in ("tail_len", "max_tokens"):
            lo, hi = getattr(self, name)
            if lo > hi or lo < (1 if name == "max_tokens" else 0):
                raise ConfigError(f"{name} must be a range (lo, hi) with lo <= hi, got {(lo, hi)}")
        if self.prefix_len < 0 or self.num_prefixes < 1:
            raise ConfigError("prefix_len must be >= 0 and num_prefixes >= 1")
        if self.arrival_rate < 0:
            raise ConfigError(f"arrival_rate must be >= 0, got {self.arrival_rate}")
        if self.vocab_size < 2:
            raise ConfigError(f"vocab_size must be >= 2, got {self.vocab_size}")


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_step: int


def make_workload(spec: WorkloadSpec, max_len: int | None = None) -> list[WorkloadRequest]:
    """Requests in arrival order. With ``max_len``, prompt + max_tokens is kept <= max_len."""
    rng = random.Random(spec.seed)
    tok = lambda n: [rng.randrange(spec.vocab_size) for _ in range(n)]  # noqa: E731
    prefixes = [tok(spec.prefix_len) for _ in range(spec.num_prefixes)]
    n_shared = round(spec.shared_prefix_ratio * spec.num_requests)
    sharing = sorted(rng.sample(range(spec.num_requests), n_shared))
    prefix_of = {r: prefixes[k % spec.num_prefixes] for k, r in enumerate(sharing)}
    out: list[WorkloadRequest] = []
    t = 0.0
    for i in range(spec.num_requests):
        prompt = list(prefix_of.get(i, ())) + tok(rng.randint(*spec.tail_len))
        prompt = prompt or tok(1)
        max_tokens = rng.randint(*spec.max_tokens)
        if max_len is not None:
            if max_len < 2:
                raise ConfigError(f"max_len must be >= 2, got {max_len}")
            prompt = prompt[: max_len - 1]
            max_tokens = max(1, min(max_tokens, max_len - len(prompt)))
        out.append(WorkloadRequest(f"req{i:04d}", prompt, max_tokens, int(t)))
        if spec.arrival_rate:
            t += rng.expovariate(spec.arrival_rate)
    return out


def fake_next_token(request_id: str, position: int, vocab_size: int) -> int:
    """A deterministic stand-in for a model: the token sampled at sequence index ``position``."""
    h = hashlib.blake2b(f"{request_id}#{position}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") % vocab_size
