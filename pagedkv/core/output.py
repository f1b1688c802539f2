"""SchedulerOutput: what the scheduler (CPU) hands the worker each step.

New requests carry their full per-group block ids; cached (already running) requests carry
only the blocks allocated this step, except resumed ones, whose ``new_block_ids`` entry is
the full table and replaces the worker's copy. Null blocks appear as id 0.

Pure Python (control plane).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Per-group block ids: one list per KV-cache group, in group-id order.
BlockIds = tuple[list[int], ...]


@dataclass
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    block_ids: BlockIds
    # The hit length: the first position computed this step.
    num_computed_tokens: int
    lora_request: Any = None
    mm_features: list = field(default_factory=list)


@dataclass
class CachedRequestData:
    """Parallel lists, one entry per scheduled already-running request."""

    req_ids: list[str] = field(default_factory=list)
    # Requests coming back from preemption: their new_block_ids entry is the full table.
    resumed_req_ids: set[str] = field(default_factory=set)
    # Only used when the worker did not sample the tokens itself (pipeline parallel).
    new_token_ids: list[list[int]] = field(default_factory=list)
    # Full token lists of requests that were not scheduled in the previous step (resumed).
    all_token_ids: dict[str, list[int]] = field(default_factory=dict)
    new_block_ids: list[BlockIds | None] = field(default_factory=list)
    # Value before this step's tokens: the start position of this step.
    num_computed_tokens: list[int] = field(default_factory=list)
    num_output_tokens: list[int] = field(default_factory=list)

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    @classmethod
    def make_empty(cls) -> "CachedRequestData":
        return cls()


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens scheduled this step, in scheduling order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Finished since the previous step; the worker drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Block ids the worker must zero before the forward pass (Mamba / mixed precision).
    new_block_ids_to_zero: list[int] | None = None
    # Copy-on-write pairs (src, dst), applied after zeroing, before the forward pass.
    kv_cache_block_copies: list[tuple[int, int]] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls([], CachedRequestData(), {}, 0)
