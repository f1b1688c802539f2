"""Request validation, with no engine: the prompt forms accepted, ids inside the vocabulary,
room for one output token. One home for the check that ``LLMEngine.add_request`` and the serving
front's process (``pagedkv.entrypoints.engine_core.EngineFront``) both run.

Imports nothing heavy (no torch): the front process validates every request with it, and its
first request used to import the whole engine module for this function (1.1 s on the 2-core
CPU machine, inside the event loop, so every request of a server's first burst waited for it).
"""

from __future__ import annotations

import numbers
from typing import Any, Sequence

from pagedkv.errors import InvalidRequestError
from pagedkv.sampling.params import SamplingParams

PromptType = str | Sequence[int]


def validate_request(prompt: PromptType, params: SamplingParams, *, tokenizer: Any,
                 vocab_size: int, max_model_len: int
                 ) -> tuple[str | None, list[int], SamplingParams]:
    """``(prompt text or None, prompt token ids, params)`` of one request, or
    ``InvalidRequestError``: the prompt forms vLLM accepts (a string, token ids,
    ``{"prompt": ...}``, ``{"prompt_token_ids": ...}``), ids inside the vocabulary, room for
    one output token within ``max_model_len``, stop strings only with a tokenizer. Needs no
    engine (the server's front process validates with it before anything is queued)."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(
            f"sampling_params must be a SamplingParams, got {type(params).__name__}"
        )
    params.check_vocab(vocab_size)
    if isinstance(prompt, dict):  # vLLM's TextPrompt / TokensPrompt
        keys = set(prompt)
        if keys == {"prompt"}:
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise InvalidRequestError("{'prompt': ...} takes a string")
        elif keys == {"prompt_token_ids"}:
            prompt = prompt["prompt_token_ids"]
            if isinstance(prompt, str):
                raise InvalidRequestError("{'prompt_token_ids': ...} takes a list of ints")
        else:
            raise InvalidRequestError(
                f"a dict prompt has exactly one key, 'prompt' or 'prompt_token_ids'; got {sorted(keys)}"
            )
    if params.stop and tokenizer is None:
        raise InvalidRequestError(
            "stop strings need a tokenizer; this model has none (use stop_token_ids)"
        )
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer; pass prompts as lists of token ids"
            )
        text: str | None = prompt
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (bytes, bytearray)) or not (
            isinstance(prompt, Sequence) or hasattr(prompt, "tolist")):
        raise InvalidRequestError(
            f"a prompt is a string or a list of token ids, got {type(prompt).__name__}"
        )
    else:
        text = None
        raw = prompt.tolist() if hasattr(prompt, "tolist") else list(prompt)
        if raw and set(map(type, raw)) == {int}:  # the common case: plain ints, checked in C
            ids = raw  # already a copy of the caller's sequence
            in_vocab = 0 <= min(ids) and max(ids) < vocab_size
        else:
            bad = [t for t in raw if not isinstance(t, numbers.Integral) or isinstance(t, bool)]
            if bad:
                raise InvalidRequestError(f"prompt token ids must be ints, got {bad[:5]!r}")
            ids = [int(t) for t in raw]
            in_vocab = all(0 <= t < vocab_size for t in ids)
        out = [] if in_vocab else [t for t in ids if not 0 <= t < vocab_size]
        if out:
            raise InvalidRequestError(
                f"prompt token ids {out[:5]} are outside the vocabulary [0, {vocab_size})"
            )
    if not ids:
        raise InvalidRequestError("the prompt is empty" + (" (it encodes to no tokens)" if text else ""))
    if len(ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(ids)} tokens; with max_model_len={max_model_len} at "
            f"most {max_model_len - 1} leave room for one output token. Shorten the "
            "prompt or raise max_model_len"
        )
    return text, ids, params


__all__ = ["PromptType", "validate_request"]
