"""The runner's sampling state: what sampling a batch composition needs, built once per
composition and kept on the device.

Keyed by the request ids of the rows that sample (in row order), rebuilt only when that key
changes (or when ``invalidate`` is called, e.g. after the EOS ids change):

- the :class:`~pagedkv.sampling.metadata.SamplingMetadata` (temperature, filters, seeded
  generators; a request's generator lives in its ``CachedRequestState`` so its stream continues
  across rebuilds);
- the ``min_tokens`` rows: a request below its minimum length cannot sample its stop tokens
  (its ``stop_token_ids`` and, unless ``ignore_eos``, the model's EOS ids);
- the penalty counts (:class:`~pagedkv.sampling.penalties.PenaltyCounts`) of the rows that use
  repetition / frequency / presence penalties: built from the host token lists plus, with
  async scheduling, the previous step's sampled tokens still on the device; then advanced on the
  device by every sampled token. Each step checks the host count of outputs per penalized row
  against the request's list (plus its token in flight) and rebuilds on any difference (outputs
  the scheduler discarded, a request resumed with new tokens).

``plain_greedy`` says whether the batch can skip the sampler altogether (every row greedy, no
logprobs, no min_tokens, no penalties): the runner then takes one argmax of the model-dtype
logits.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from pagedkv.sampling.metadata import SamplingMetadata
from pagedkv.sampling.params import GREEDY_EPS, SamplingParams
from pagedkv.sampling.penalties import PenaltyCounts
from pagedkv.sampling.sampler import Sampler, SamplerOutput

_GREEDY = SamplingParams(temperature=0.0)


def params_of(state) -> SamplingParams:
    """A request state's sampling parameters (greedy when it carries none)."""
    p = state.sampling_params
    return p if isinstance(p, SamplingParams) else _GREEDY


class SamplingState:
    def __init__(self, device: torch.device, vocab_size: int,
                 to_device: Callable[[np.ndarray], torch.Tensor],
                 eos_token_ids: Sequence[int] = ()) -> None:
        self.device = device
        self.vocab_size = vocab_size
        self._to_device = to_device
        self._eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self.key: tuple[str, ...] | None = None
        self.metadata: SamplingMetadata | None = None
        self.wants_logprobs: list[int | None] = []
        # rows with a min_tokens bound: (row, prompt length, min_tokens, stop ids)
        self.min_tokens_rows: list[tuple[int, int, int, list[int]]] = []
        self.penalties: PenaltyCounts | None = None
        self._penalty_rids: list[str] = []
        self._plain_version = -1
        self._plain = False

    # ----- configuration -------------------------------------------------------------------
    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids: Sequence[int]) -> None:
        self._eos_token_ids = tuple(ids)
        self.invalidate()  # the per-row stop ids change

    def invalidate(self) -> None:
        self.key = None
        self.penalties = None

    def stop_token_ids_of(self, params: SamplingParams) -> list[int]:
        """The tokens that end ``params``' request, within the vocabulary: the set the engine
        resolved into the request's params (``all_stop_token_ids``); for params nobody
        resolved (a runner driven directly), ``stop_token_ids`` and, unless ``ignore_eos``,
        this state's EOS ids."""
        if params._eos_token_ids is not None:
            ids = set(params.all_stop_token_ids)
        else:
            ids = set(params.stop_token_ids)
            if not params.ignore_eos:
                ids.update(self._eos_token_ids)
        return sorted(t for t in ids if 0 <= t < self.vocab_size)

    # ----- per step ------------------------------------------------------------------------
    def plain_greedy(self, req_ids: Sequence[str], requests: Mapping[str, Any],
                     version: int) -> bool:
        """Whether every request of the batch decodes greedily with no logprobs, min_tokens or
        penalties (cached per batch ``version``)."""
        if self._plain_version != version:
            plain = True
            for rid in req_ids:
                p = requests[rid].sampling_params
                if isinstance(p, SamplingParams) and (p.temperature >= GREEDY_EPS
                                                      or p.logprobs is not None
                                                      or p.min_tokens > 0
                                                      or p.uses_penalties):
                    plain = False
                    break
            self._plain = plain
            self._plain_version = version
        return self._plain

    def sample(self, sampler: Sampler, logits: torch.Tensor, key: tuple[str, ...],
               requests: Mapping[str, Any], positions: np.ndarray | None,
               pending: tuple[Sequence[str], torch.Tensor] | None = None) -> SamplerOutput:
        """Sample the rows ``key`` (request ids, one per logits row). ``positions``: the
        position each sampled token takes. ``pending``: ``(request ids, device tokens)`` of the
        step still in flight (async scheduling: sampled, not in the host lists yet)."""
        if key != self.key:
            self._rebuild(key, requests)
        banned = None
        if self.min_tokens_rows and positions is not None:
            banned = self._min_tokens_banned(positions)
        penalties = None
        if self._penalty_rids:
            penalties = self._current_penalties(requests, pending)
        out = sampler(logits, self.metadata, banned, penalties)
        if penalties is not None:
            penalties.add_sampled(out.sampled_token_ids)
        return out

    # ----- internals -----------------------------------------------------------------------
    def _rebuild(self, key: tuple[str, ...], requests: Mapping[str, Any]) -> None:
        states = [requests[rid] for rid in key]
        params = [params_of(st) for st in states]
        gens = {i: st.generator for i, st in enumerate(states) if st.generator is not None}
        md = SamplingMetadata.build(params, self.device, gens)
        for i, g in md.generators.items():
            states[i].generator = g
        self.key = key
        self.metadata = md
        self.wants_logprobs = [p.logprobs for p in params]
        self.min_tokens_rows = [
            (j, len(st.prompt_token_ids), p.min_tokens, self.stop_token_ids_of(p))
            for j, (st, p) in enumerate(zip(states, params)) if p.min_tokens > 0
        ]
        self._penalty_rids = [rid for rid, p in zip(key, params) if p.uses_penalties]
        self.penalties = None

    def _current_penalties(self, requests: Mapping[str, Any],
                           pending_step: tuple[Sequence[str], torch.Tensor] | None
                           ) -> PenaltyCounts:
        pen = self.penalties
        rids = self._penalty_rids
        pending: dict[str, int] = {}
        if pending_step is not None:
            pending = {rid: i for i, rid in enumerate(pending_step[0])}
        if pen is not None:
            for j, rid in enumerate(rids):
                want = len(requests[rid].output_token_ids) + (1 if rid in pending else 0)
                if pen.num_outputs[j] != want:
                    pen = None
                    break
        if pen is None:
            index = {rid: j for j, rid in enumerate(self.key)}
            states = [requests[rid] for rid in rids]
            params = [params_of(st) for st in states]
            in_flight = None
            js = [j for j, rid in enumerate(rids) if rid in pending]
            if js:
                src = self._to_device(np.asarray([pending[rids[j]] for j in js]))
                in_flight = (js, pending_step[1].index_select(0, src))
            pen = PenaltyCounts(
                [index[rid] for rid in rids],
                [st.prompt_token_ids for st in states],
                [st.output_token_ids for st in states],
                [p.repetition_penalty for p in params],
                [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params],
                self.vocab_size, self.device, pending=in_flight,
            )
            self.penalties = pen
        return pen

    def _min_tokens_banned(self, positions: np.ndarray):
        """``(rows, token_ids)`` device tensors of the stop tokens banned this step: a request
        whose new token would be output number ``positions[row] - prompt length`` (0-based)
        below its ``min_tokens`` cannot end there (vLLM's min-tokens rule). None if none."""
        rows: list[int] = []
        toks: list[int] = []
        for j, prompt_len, min_tokens, stop_ids in self.min_tokens_rows:
            if stop_ids and int(positions[j]) - prompt_len < min_tokens:
                rows.extend([j] * len(stop_ids))
                toks.extend(stop_ids)
        if not rows:
            return None
        return self._to_device(np.asarray(rows)), self._to_device(np.asarray(toks))


__all__ = ["SamplingState", "params_of"]
