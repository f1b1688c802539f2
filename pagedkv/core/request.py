"""Request: one generation request as the scheduler and the KV-cache manager see it.

Token ids are plain Python ints (block hashes pickle them; numpy ints would pickle to
different bytes). ``block_hashes`` grows incrementally: each time the token list gains a
full ``hash_block_size`` chunk, the block hasher hashes just the new chunks. The prompt's
hashes are made at the first read of ``block_hashes`` (in practice when the scheduler first
looks the request up in the prefix cache), not when the request is made: a batch of long
prompts added at once (W3: 256 x ~2,200 tokens, ~35,000 blocks) would otherwise hash them all
before the first step, while hashed at scheduling the work overlaps the device's steps.

Pure Python (control plane).
"""

from __future__ import annotations

import enum
import numbers
import time
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, Sequence

from pagedkv.errors import InvalidRequestError


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after PREEMPTED is a finished state.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_IGNORED = 6

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_IGNORED: FinishReason.LENGTH,
}


@dataclass
class StopParams:
    """The parts of sampling parameters the scheduler needs to decide when to stop."""

    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be an int in [0, max_tokens], got {self.min_tokens!r}"
            )
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


# A block hasher returns the hashes of the full chunks not yet hashed for a request.
BlockHasher = Callable[["Request"], list[bytes]]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None  # engine-level params; the scheduler reads ``stop``
    stop: StopParams = field(default_factory=StopParams)
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    lora_request: Any = None  # anything with ``lora_name`` and ``lora_path`` (hash extra key)
    cache_salt: str | None = None
    mm_features: list = field(default_factory=list)  # objects with identifier/offset/length
    skip_reading_prefix_cache: bool = False
    block_hasher: BlockHasher | None = None
    # Optional prompt embeddings (rows = prompt positions): numpy array or torch tensor.
    # Their bytes enter the block hashes as ("prompt_embeds", sha256 digest) extra keys.
    prompt_embeds: Any = None
    # True: ``prompt_token_ids`` is already a list of plain ints that this request may own (the
    # engine's ``validate_request`` made it), so it is taken as it is instead of converted
    # (one pass over the prompt less: ~0.11 ms for 2,000 tokens on the project's CPU)
    prompt_ids_checked: InitVar[bool] = False

    def __post_init__(self, prompt_ids_checked: bool = False) -> None:
        if not prompt_ids_checked:
            # Plain Python ints (numpy ints would pickle to other bytes in block hashes).
            self.prompt_token_ids = list(map(int, self.prompt_token_ids))
        if not self.prompt_token_ids:
            raise InvalidRequestError(f"request {self.request_id!r} has an empty prompt")
        self.status = RequestStatus.WAITING
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens scheduled but whose step has not reported back yet.
        self.num_in_flight_tokens = 0
        self.num_output_placeholders = 0
        self.spec_token_ids: list[int] = []
        self.num_preemptions = 0
        self.is_prefill_chunk = False
        self.stop_reason: int | str | None = None
        # block_hashes: made at its first read (__getattr__; module docstring)

    def __getattr__(self, name: str):
        # only for attributes not set yet: ``block_hashes`` before its first read
        if name == "block_hashes":
            hashes: list[bytes] = []
            self.__dict__["block_hashes"] = hashes
            if self.block_hasher is not None:
                hashes.extend(self.block_hasher(self))
            return hashes
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def defer_block_hashes(self) -> None:
        """Hash the prompt at the next read of ``block_hashes`` (after the block hasher was
        set on a request that had none: its list is empty)."""
        if not self.__dict__.get("block_hashes"):
            self.__dict__.pop("block_hashes", None)

    # ----- token views -------------------------------------------------------------------
    @property
    def output_token_ids(self) -> Sequence[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> Sequence[int]:
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.stop.max_tokens

    # ----- mutation ----------------------------------------------------------------------
    def append_output_token_ids(self, token_ids: int | Sequence[int]) -> None:
        if type(token_ids) is int:
            token_ids = (token_ids,)
        elif isinstance(token_ids, numbers.Integral):  # e.g. a numpy integer scalar
            token_ids = (int(token_ids),)
        else:  # plain ints only: numpy ints would hash to other bytes
            token_ids = [int(t) for t in token_ids]
        self._output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)
        self.update_block_hashes()

    def update_block_hashes(self) -> None:
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    # ----- status ------------------------------------------------------------------------
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    # Priority-queue order: lower priority value first, then earlier arrival, then id.
    def __lt__(self, other: "Request") -> bool:
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"tokens={self.num_tokens}, computed={self.num_computed_tokens})"
        )
