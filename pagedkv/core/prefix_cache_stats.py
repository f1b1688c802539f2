"""PrefixCacheStats: prefix-cache lookup counters between two scheduler reports.

Fresh requests and requests resumed after preemption are counted apart (a resumed request
recomputes its outputs too, and its hits say little about prompt sharing).

Pure Python (control plane).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class PrefixCacheStats:
    requests: int = 0
    queries: int = 0  # tokens looked up
    hits: int = 0  # tokens found
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    reset: bool = False  # the prefix cache was reset since the last report

    def record(self, num_tokens: int, num_hits: int, preempted: bool) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits

    def as_dict(self) -> dict:
        return asdict(self)
