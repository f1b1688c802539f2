"""Incremental detokenization of one request's output, with stop strings.

Text of new tokens (prefix-offset / read-offset technique): the detokenizer keeps two offsets into
its token list. ``ids[prefix_offset:read_offset]`` are the tokens whose text was already emitted,
kept as left context; each new token decodes the window ``ids[prefix_offset:]`` and emits what it
adds to the text of the context alone. Decoding a window rather than the token alone keeps
context-dependent decoders right (SentencePiece's leading-space rule, byte-level pieces that
only form a character together). When the window's text ends with U+FFFD, the last token(s)
hold an incomplete UTF-8 sequence: nothing is emitted and the offsets stay until a later token
completes the character, so a partial replacement character is never emitted. At finish, any
text still pending (a sequence that never completed) is flushed, so the concatenated deltas equal
``tokenizer.decode(output_ids)``. The window starts with up to five prompt tokens of context.

Stop strings (vLLM's semantics): checked only once more than ``min_tokens`` tokens were produced,
and only for occurrences that overlap text added in this update, so a stop string spanning token
boundaries is found. When several stop strings match in one update, the one completed first (its
end earliest in the text; then the longest) wins; deliberately different from vLLM, which takes
the first in list order. The output text is truncated before the stop string (after it with
``include_stop_str_in_output``). While streaming, the last ``max(len(stop)) - 1`` characters are
held back (unless the stop string is included) so text that turns out to start a stop string is
never emitted.

A request finished by a stop token (EOS or ``stop_token_ids``; ``stop_terminated=True``) does not
detokenize that last token unless ``include_stop_str_in_output`` (vLLM's rule).

The tokenizer is anything with ``decode(ids, skip_special_tokens=...)``: a ``tokenizers.Tokenizer``,
a transformers fast tokenizer, or ``pagedkv.models.tokenizer.Tokenizer``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from pagedkv.errors import SamplingError
from pagedkv.sampling.params import SamplingParams

# Prompt tokens kept as left context of the first output token.
INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class DetokenizerStep:
    delta: str  # new text, safe to show (never retracted)
    stop_string: str | None  # the stop string that matched, when one did
    finished: bool  # no more text will come

    @property
    def stopped(self) -> bool:
        """A stop string ended the request."""
        return self.stop_string is not None


def find_stop_string(
    text: str, new_from: int, stops: Sequence[str]
) -> tuple[str, int] | None:
    """The stop string completed first among occurrences overlapping ``text[new_from:]``:
    ``(stop_string, start_index)``, or None."""
    best: tuple[int, int, str] | None = None  # (end, -length, stop)
    for s in stops:
        start = text.find(s, max(0, new_from - len(s) + 1))
        if start < 0:
            continue
        key = (start + len(s), -len(s), s)
        if best is None or key[:2] < best[:2]:
            best = key
    if best is None:
        return None
    end, neg_len, s = best
    return s, end + neg_len


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        params: SamplingParams | None = None,
        prompt_token_ids: Sequence[int] = (),
    ):
        params = params if params is not None else SamplingParams()
        self.tokenizer = tokenizer
        self.stop: list[str] = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.skip_special_tokens = params.skip_special_tokens
        self.min_tokens = params.min_tokens
        self.stop_buffer_length = params.stop_buffer_length

        context = [int(t) for t in prompt_token_ids][-INITIAL_CONTEXT_TOKENS:]
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text: str | None = None  # decode(ids[prefix:read]), computed lazily
        self.num_output_tokens = 0  # output tokens fed (the engine's request owns the list)
        self.output_text = ""
        self._emitted = 0  # characters of output_text already returned
        self.stop_string: str | None = None
        self.finished = False

    @property
    def emitted_text(self) -> str:
        """The text that may be shown now: ``output_text`` less what is held back while a
        stop string could still be completing there (all of it once finished)."""
        return self.output_text[:self._emitted]

    # ----- decoding ------------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, final: bool) -> str:
        """Text the tokens after ``read_offset`` add; "" while it would end with an incomplete
        character (unless ``final``)."""
        if self._read_offset >= len(self._ids):
            return ""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if new_text.endswith(_REPLACEMENT) and not final:
            return ""
        delta = new_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self._prefix_text = None
        return delta

    # ----- the step ------------------------------------------------------------------------
    def update(
        self,
        new_token_ids: Sequence[int],
        *,
        stop_terminated: bool = False,
        finished: bool = False,
    ) -> DetokenizerStep:
        """Feed one step's new tokens. ``stop_terminated``: the last token is a stop token (EOS
        or a ``stop_token_ids`` entry) that ended the request. ``finished``: the request ended
        for another reason (length); the text is flushed. Returns the text to emit now."""
        if self.finished:
            raise SamplingError(
                "detokenizer update after the request finished"
                + (f" (stop string {self.stop_string!r})" if self.stop_string else "")
                + "; drop its remaining tokens"
            )
        ids = [int(t) for t in new_token_ids]
        finished = finished or stop_terminated
        skipped = None
        if stop_terminated and ids and not self.include_stop_str_in_output:
            skipped = ids.pop()

        check_from = len(self.output_text)
        for t in ids:
            self.num_output_tokens += 1
            self._ids.append(t)
            self.output_text += self._advance(final=False)
            if self.num_output_tokens <= self.min_tokens:
                check_from = len(self.output_text)
        if skipped is not None:
            self.num_output_tokens += 1
        if finished:
            self.output_text += self._advance(final=True)

        if (self.stop and self.num_output_tokens > self.min_tokens
                and len(self.output_text) > check_from):
            match = find_stop_string(self.output_text, check_from, self.stop)
            if match is not None:
                s, start = match
                cut = start + len(s) if self.include_stop_str_in_output else start
                self.output_text = self.output_text[:cut]
                self.stop_string = s
                finished = True

        hold = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - hold, self._emitted)
        delta = self.output_text[self._emitted:end]
        self._emitted = end
        self.finished = finished
        return DetokenizerStep(delta=delta, stop_string=self.stop_string, finished=finished)


__all__ = ["IncrementalDetokenizer", "DetokenizerStep", "find_stop_string",
           "INITIAL_CONTEXT_TOKENS"]
