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
    # Per KV-cache group: the leading blocks every running request shares (the common prefix
    # of their block tables, ``KVCacheManager.get_num_common_prefix_blocks``), for cascade
    # attention. Empty when nothing runs (vLLM 0.33 always leaves it empty: it removed
    # cascade attention; older vLLM filled it as here).
    num_common_prefix_blocks: list[int] = field(default_factory=list)

    @classmethod
    def make_empty(cls) -> "SchedulerOutput":
        return cls([], CachedRequestData(), {}, 0)


@dataclass
class ModelRunnerOutput:
    """What the worker reports back for one ``SchedulerOutput``.

    ``sampled_token_ids[req_id_to_index[id]]`` are the tokens sampled for request ``id``:
    one token for a normal step, up to ``1 + drafts`` with speculative decoding, and ``[]``
    for a partial-prefill chunk (it samples nothing).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]

    @classmethod
    def from_sampled(cls, sampled: dict[str, list[int]]) -> "ModelRunnerOutput":
        """Build from ``{req_id: sampled tokens}`` (dict order = row order)."""
        ids = list(sampled)
        return cls(ids, {rid: i for i, rid in enumerate(ids)}, list(sampled.values()))


class EngineCoreOutput:
    """One request's result of a step: the tokens it gained and, if it finished, why."""

    __slots__ = ("req_id", "new_token_ids", "finish_reason", "stop_reason")

    def __init__(self, req_id: str, new_token_ids: list[int], finish_reason: Any = None,
                 stop_reason: int | str | None = None) -> None:
        self.req_id = req_id
        self.new_token_ids = new_token_ids
        self.finish_reason = finish_reason  # FinishReason or None while running
        self.stop_reason = stop_reason

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (f"EngineCoreOutput({self.req_id!r}, new={self.new_token_ids}, "
                f"finish={self.finish_reason})")


@dataclass
class SchedulerStats:
    """Scheduler state after a step's ``update_from_output``.

    ``prefix_cache_stats`` covers the prefix-cache lookups since the previous stats (the
    KV-cache manager's ``make_prefix_cache_stats()``); ``num_preempted_reqs`` counts the
    preemptions of the step that produced the output.
    """

    step: int
    num_running_reqs: int
    num_waiting_reqs: int
    kv_cache_usage: float
    num_free_blocks: int
    num_preempted_reqs: int
    num_preemptions_total: int
    prefix_cache_stats: Any = None


@dataclass
class EngineCoreOutputs:
    """Result of ``Scheduler.update_from_output``: per-request outputs (scheduling order),
    the ids that finished in this update, and the stats (None when stats are off)."""

    outputs: list[EngineCoreOutput]
    finished_req_ids: list[str]
    scheduler_stats: SchedulerStats | None = None
