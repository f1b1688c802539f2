"""What ``LLM.generate`` returns, shaped like vLLM's outputs so users can switch.

``RequestOutput`` (one per prompt, in input order) holds the prompt, its token ids, one
``CompletionOutput`` (``outputs[0]``), whether it finished and its ``RequestMetrics``.
``CompletionOutput.logprobs`` (when ``SamplingParams.logprobs`` is set): one dict per generated
token, ``token id -> Logprob``, holding the sampled token and the top ``logprobs`` alternatives.

Pure Python (no torch).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Times are ``time.monotonic()`` seconds; counts in tokens."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))

    def __repr__(self) -> str:
        o = self.outputs[0] if self.outputs else None
        text = None if o is None else (o.text if len(o.text) <= 40 else o.text[:37] + "...")
        return (f"RequestOutput(request_id={self.request_id!r}, prompt_tokens="
                f"{len(self.prompt_token_ids)}, generated={0 if o is None else len(o.token_ids)}, "
                f"text={text!r}, finish_reason={None if o is None else o.finish_reason!r})")


class OutputDelta(tuple):
    """What one step added to a request, for consumers in another process (the engine-core
    process of ``pagedkv serve``): a plain tuple (cheap to pickle) of ``request_id``,
    ``token_ids`` (the new ones), ``text`` (the new text), ``logprobs`` (the new tokens'
    entries, or None), ``cumulative_logprob``, ``finish_reason``, ``stop_reason`` and the
    request's times ``first_scheduled_time``, ``first_token_time``, ``last_token_time``,
    ``finished_time``, ``num_cached_tokens``, ``num_preemptions``."""

    __slots__ = ()
    FIELDS = ("request_id", "token_ids", "text", "logprobs", "cumulative_logprob",
              "finish_reason", "stop_reason", "first_scheduled_time", "first_token_time",
              "last_token_time", "finished_time", "num_cached_tokens", "num_preemptions")

    def __getattr__(self, name: str):
        try:
            return self[OutputDelta.FIELDS.index(name)]
        except ValueError:
            raise AttributeError(name) from None

    def __reduce__(self):
        return (OutputDelta, (tuple(self),))

    @property
    def finished(self) -> bool:
        return self[5] is not None


__all__ = ["CompletionOutput", "Logprob", "OutputDelta", "RequestMetrics", "RequestOutput"]
