"""SamplingParams: what a user asks of one request's decoding, validated at the boundary.

Names and defaults follow vLLM's ``SamplingParams`` so users can switch. Normalization
(applied in ``__post_init__``, as vLLM does):

- ``temperature < 1e-5`` (``GREEDY_EPS``; 0 in practice) means greedy: ``top_p``, ``top_k``
  and ``min_p`` are reset to their disabled values.
- ``1e-5 <= temperature < 1e-2`` is raised to ``1e-2`` (vLLM's ``_MAX_TEMP``) with a warning:
  dividing logits by a tinier temperature overflows. Deliberate difference from vLLM: vLLM also
  raises ``0 < temperature < 1e-5`` to ``1e-2``; pagedkv treats that range as greedy.
- ``top_k == -1`` is stored as ``0``; both mean "disabled".
- ``seed == -1`` is stored as ``None`` (unseeded), ``logprobs is True`` as ``1``.
- ``stop`` becomes a list of strings, ``stop_token_ids`` a list of ints.

Every out-of-range value raises ``InvalidRequestError`` naming the parameter and its valid range.
"""

from __future__ import annotations

import logging
import math
import numbers
import copy
from dataclasses import dataclass, field
from typing import Sequence

from pagedkv.core.request import StopParams
from pagedkv.errors import InvalidRequestError

logger = logging.getLogger(__name__)

# Below this temperature a request is sampled greedily (argmax).
GREEDY_EPS = 1e-5
# Positive temperatures below this are raised to it (as vLLM does).
MIN_TEMPERATURE = 1e-2
# Most top alternatives a request may ask for with ``logprobs`` (vLLM's default max_logprobs).
MAX_LOGPROBS = 20
# torch.Generator.manual_seed accepts seeds in [-2**63, 2**64).
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_real(v) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def _need_int(name: str, v, rule: str) -> int:
    if not _is_int(v):
        raise InvalidRequestError(f"{name} must be an int ({rule}), got {v!r}")
    return int(v)


def _need_real(name: str, v, rule: str) -> float:
    if not _is_real(v) or not math.isfinite(float(v)):
        raise InvalidRequestError(f"{name} must be a finite number ({rule}), got {v!r}")
    return float(v)


def _need_bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise InvalidRequestError(f"{name} must be True or False, got {v!r}")
    return v


@dataclass
class SamplingParams:
    """Decoding parameters of one request (vLLM-compatible subset).

    ``n``: outputs per prompt (only 1 for now). ``temperature``: >= 0, 0 = greedy.
    ``top_p``: nucleus mass in (0, 1]. ``top_k``: keep the k most likely tokens; 0 or -1
    disables. ``min_p``: drop tokens less likely than ``min_p`` times the most likely one, in
    [0, 1]. ``seed``: per-request random stream (reproducible regardless of the batch).
    ``max_tokens`` / ``min_tokens``: output length bounds; ``max_tokens=None`` means "until the
    context is full". ``stop``: stop strings; ``stop_token_ids``: extra stop tokens (EOS is
    always one unless ``ignore_eos``). ``logprobs``: return the sampled token's log-probability
    plus this many top alternatives (0..20). ``presence_penalty`` / ``frequency_penalty``
    (in [-2, 2], 0 = off): subtract ``presence`` from the logit of every token the output
    already holds and ``frequency`` times its count; ``repetition_penalty`` (> 0, 1 = off):
    divide positive logits (multiply negative ones) of tokens seen in the prompt or the output
    (see ``pagedkv.sampling.penalties``). ``include_stop_str_in_output``: keep the matched
    stop string in the text. ``skip_special_tokens``: drop special tokens when detokenizing.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # The model's EOS ids, resolved into a per-request copy by the engine (``resolved``);
    # None on the caller's object.
    _eos_token_ids: tuple[int, ...] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = _need_int("n", self.n, "n == 1")
        if n < 1:
            raise InvalidRequestError(f"n must be at least 1, got {n}")
        if n != 1:
            raise InvalidRequestError(
                f"n must be 1: pagedkv does not implement parallel sampling yet, got n={n}; "
                "submit the prompt several times with different seeds instead"
            )
        self.n = n

        t = _need_real("temperature", self.temperature, "temperature >= 0")
        if t < 0:
            raise InvalidRequestError(f"temperature must be >= 0 (0 = greedy), got {t}")
        if GREEDY_EPS <= t < MIN_TEMPERATURE:
            logger.warning(
                "temperature %s is below %s and may overflow the logits; raised to %s",
                t, MIN_TEMPERATURE, MIN_TEMPERATURE,
            )
            t = MIN_TEMPERATURE
        self.temperature = t

        p = _need_real("top_p", self.top_p, "0 < top_p <= 1")
        if not 0.0 < p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {p}")
        self.top_p = p

        k = _need_int("top_k", self.top_k, "top_k == 0 or -1 to disable, or top_k >= 1")
        if k < -1:
            raise InvalidRequestError(
                f"top_k must be 0 or -1 (disabled) or at least 1, got {k}"
            )
        self.top_k = 0 if k == -1 else k

        mp = _need_real("min_p", self.min_p, "0 <= min_p <= 1")
        if not 0.0 <= mp <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {mp}")
        self.min_p = mp

        if self.seed is not None:
            s = _need_int("seed", self.seed, f"seed in [{_SEED_MIN}, {_SEED_MAX}] or None")
            if not _SEED_MIN <= s <= _SEED_MAX:
                raise InvalidRequestError(
                    f"seed must be in [{_SEED_MIN}, {_SEED_MAX}] (or None / -1 for unseeded), "
                    f"got {s}"
                )
            self.seed = None if s == -1 else s

        if self.max_tokens is not None:
            mt = _need_int("max_tokens", self.max_tokens, "max_tokens >= 1 or None")
            if mt < 1:
                raise InvalidRequestError(f"max_tokens must be at least 1 (or None), got {mt}")
            self.max_tokens = mt

        mn = _need_int("min_tokens", self.min_tokens, "0 <= min_tokens <= max_tokens")
        if mn < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {mn}")
        if self.max_tokens is not None and mn > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens must be <= max_tokens, got min_tokens={mn}, "
                f"max_tokens={self.max_tokens}"
            )
        self.min_tokens = mn

        self.stop = self._check_stop(self.stop)
        self.stop_token_ids = self._check_stop_token_ids(self.stop_token_ids)
        self.ignore_eos = _need_bool("ignore_eos", self.ignore_eos)
        self.include_stop_str_in_output = _need_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.skip_special_tokens = _need_bool("skip_special_tokens", self.skip_special_tokens)

        if self.logprobs is True:
            self.logprobs = 1
        if self.logprobs is not None:
            lp = _need_int("logprobs", self.logprobs, f"0 <= logprobs <= {MAX_LOGPROBS} or None")
            if not 0 <= lp <= MAX_LOGPROBS:
                raise InvalidRequestError(
                    f"logprobs must be in [0, {MAX_LOGPROBS}] (number of top alternatives "
                    f"returned beside the sampled token) or None, got {lp}"
                )
            self.logprobs = lp

        for name in ("presence_penalty", "frequency_penalty"):
            v = _need_real(name, getattr(self, name), f"-2 <= {name} <= 2")
            if not -2.0 <= v <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {v}")
            setattr(self, name, v)
        rp = _need_real("repetition_penalty", self.repetition_penalty, "repetition_penalty > 0")
        if rp <= 0.0:
            raise InvalidRequestError(
                f"repetition_penalty must be greater than 0 (1 = off), got {rp}")
        self.repetition_penalty = rp

        if self.temperature < GREEDY_EPS:
            # Greedy: the filters cannot change the argmax; store them disabled.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @staticmethod
    def _check_stop(stop) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        elif not isinstance(stop, Sequence):
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
        out: list[str] = []
        for s in stop:
            if not isinstance(s, str):
                raise InvalidRequestError(f"stop strings must be str, got {s!r}")
            if not s:
                raise InvalidRequestError("stop strings must be non-empty, got ''")
            out.append(s)
        return out

    @staticmethod
    def _check_stop_token_ids(ids) -> list[int]:
        if ids is None:
            return []
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise InvalidRequestError(f"stop_token_ids must be a list of ints, got {ids!r}")
        out = []
        for t in ids:
            if not _is_int(t) or t < 0:
                raise InvalidRequestError(f"stop_token_ids must be ints >= 0, got {t!r}")
            out.append(int(t))
        return out

    # ----- derived views ------------------------------------------------------------------
    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    def check_vocab(self, vocab_size: int) -> None:
        """Reject stop token ids outside ``[0, vocab_size)`` (called when the model is known)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise InvalidRequestError(
                f"stop_token_ids {bad} are outside the vocabulary [0, {vocab_size})"
            )

    @property
    def stop_buffer_length(self) -> int:
        """Characters of output text held back while streaming: a stop string may still be
        completing there and, unless it is to be included, must never have been emitted."""
        if self.stop and not self.include_stop_str_in_output:
            return max(len(s) for s in self.stop) - 1
        return 0

    def resolved(self, eos_token_ids) -> "SamplingParams":
        """A copy for one request with the model's EOS ids resolved into it (the engine calls
        this once per request; see ``pagedkv.core.stop``). The caller's object is unchanged."""
        out = copy.copy(self)
        out.stop = list(self.stop)
        out.stop_token_ids = list(self.stop_token_ids)
        out._eos_token_ids = tuple(int(t) for t in eos_token_ids)
        return out

    @property
    def all_stop_token_ids(self) -> tuple[int, ...]:
        """Every token id that ends the request: ``stop_token_ids`` and, unless
        ``ignore_eos``, the resolved EOS ids (what ``min_tokens`` keeps from being sampled)."""
        ids = list(dict.fromkeys(self.stop_token_ids))
        if not self.ignore_eos and self._eos_token_ids:
            ids += [t for t in self._eos_token_ids if t not in ids]
        return tuple(ids)

    def to_stop_params(self, max_model_len: int | None = None) -> StopParams:
        """The scheduler's view. ``max_tokens=None`` becomes ``max_model_len`` (the scheduler
        also caps at ``max_model_len`` total tokens); without either, an error. With resolved
        EOS ids, the ones after the first (the request's ``eos_token_id``) join
        ``stop_token_ids`` unless ``ignore_eos``."""
        max_tokens = self.max_tokens
        if max_tokens is None:
            if max_model_len is None:
                raise InvalidRequestError(
                    "max_tokens=None needs the engine's max_model_len; pass it to to_stop_params"
                )
            max_tokens = max(max_model_len, self.min_tokens, 1)
        stop_ids = list(self.stop_token_ids)
        if not self.ignore_eos and self._eos_token_ids:
            stop_ids += [t for t in self._eos_token_ids[1:] if t not in stop_ids]
        return StopParams(
            max_tokens=max_tokens,
            ignore_eos=self.ignore_eos,
            stop_token_ids=tuple(stop_ids),
            min_tokens=self.min_tokens,
        )


__all__ = ["SamplingParams", "GREEDY_EPS", "MIN_TEMPERATURE", "MAX_LOGPROBS"]
