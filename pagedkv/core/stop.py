"""Stop rules: when a request ends, in one place.

* The request's :class:`~pagedkv.core.request.StopParams` (``max_tokens``, ``min_tokens``,
  ``ignore_eos``, ``stop_token_ids``) come from its ``SamplingParams`` through
  ``SamplingParams.to_stop_params``, with the model's EOS ids resolved into them once per
  request by the engine (``SamplingParams.resolved``): the request's ``eos_token_id`` is the
  first EOS id and the others join ``stop_token_ids`` unless ``ignore_eos``, as vLLM folds a
  generation config's EOS list into its ``_all_stop_token_ids``.
* :func:`check_stop` decides after a token was appended: length first (``max_tokens``
  outputs or ``max_model_len`` tokens), then, once ``min_tokens`` outputs exist, EOS (unless
  ``ignore_eos``) and the stop token ids (recorded as ``stop_reason``). The scheduler's
  per-token loop skips the call when a token plainly cannot end the request (no length cap
  reached, not EOS, not a stop id); ``tests/property/test_fast_paths.py`` holds that shortcut
  to this rule.
* Before ``min_tokens`` the runner keeps every stop token from being sampled
  (``SamplingParams.all_stop_token_ids``: the same resolved set).
* Stop strings are matched in the text by the detokenizer after the step
  (``pagedkv.sampling.detokenizer``); the engine then finishes the request.

Pure Python (control plane).
"""

from __future__ import annotations

from pagedkv.core.request import Request, RequestStatus, StopParams

_LENGTH_CAPPED = RequestStatus.FINISHED_LENGTH_CAPPED
_STOPPED = RequestStatus.FINISHED_STOPPED


def check_stop(request: Request, max_model_len: int) -> bool:
    """Stop conditions after a token was appended; sets the finished status.

    Order: length (``num_tokens >= max_model_len`` or ``max_tokens`` outputs) first, then,
    once ``min_tokens`` outputs exist, EOS (unless ``ignore_eos``) and ``stop_token_ids``
    (recorded as ``stop_reason``).
    """
    stop = request.stop
    n_out = len(request._output_token_ids)
    if n_out >= stop.max_tokens or len(request._all_token_ids) >= max_model_len:
        request.status = _LENGTH_CAPPED
        return True
    if n_out < stop.min_tokens:
        return False
    last = request._output_token_ids[-1]
    if last == request.eos_token_id and not stop.ignore_eos:
        request.status = _STOPPED
        return True
    if stop.stop_token_ids and last in stop.stop_token_ids:
        request.status = _STOPPED
        request.stop_reason = last
        return True
    return False


__all__ = ["StopParams", "check_stop"]
