"""A minimal paged-KV driver for parity checks (not the engine).

``PagedHarness`` owns a KV pool, hands each request distinct physical blocks (shuffled, never
the null block 0, returned to the pool when the request finishes so later requests reuse stale
blocks), builds the block table and the slot mapping with plain torch
(``slot = table[r, pos // B] * B + pos % B``) and runs mixed steps through the model: any mix
of prefill chunks and decode tokens, optionally padded with ``slot = -1`` tokens.
``greedy_generate`` drives batched greedy decoding with optional chunked prefill.

Unused pool memory and the null block are filled with NaN (``poison=True``): a backend that
reads a slot it must not read turns the output into NaN.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch

from pagedkv.attention.metadata import build_attention_metadata
from pagedkv.errors import InvalidRequestError, NoFreeBlocksError, UnknownRequestError
from pagedkv.models.decoder import DecoderForCausalLM


@dataclass
class _Req:
    tokens: list[int]
    prompt_len: int
    max_new_tokens: int
    blocks: list[int] = field(default_factory=list)
    computed: int = 0

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def finished(self) -> bool:
        return len(self.tokens) - self.prompt_len >= self.max_new_tokens


class PagedHarness:
    def __init__(
        self,
        model: DecoderForCausalLM,
        *,
        block_size: int,
        num_blocks: int,
        max_blocks_per_req: int | None = None,
        seed: int = 0,
        poison: bool = True,
        kv_dtype: torch.dtype | None = None,
    ):
        if num_blocks < 2:
            raise InvalidRequestError("the harness needs at least 2 blocks (block 0 is the null block)")
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.width = max_blocks_per_req or (num_blocks - 1)
        self.kv_caches = model.allocate_kv_caches(
            num_blocks, block_size, dtype=kv_dtype, fill=float("nan") if poison else 0.0
        )
        free = list(range(1, num_blocks))
        random.Random(seed).shuffle(free)
        self.free_blocks = free
        self.reqs: dict[int, _Req] = {}
        self._next_id = 0
        # one entry per step: [(request id, tokens computed before, new tokens, prompt length)]
        self.step_log: list[list[tuple[int, int, int, int]]] = []

    # ---- requests
    def add_request(self, prompt: Sequence[int], max_new_tokens: int = 0) -> int:
        if len(prompt) == 0:
            raise InvalidRequestError("empty prompt")
        rid = self._next_id
        self._next_id += 1
        self.reqs[rid] = _Req(tokens=list(prompt), prompt_len=len(prompt), max_new_tokens=max_new_tokens)
        return rid

    def free_request(self, rid: int) -> None:
        req = self.reqs.pop(rid)
        self.free_blocks.extend(reversed(req.blocks))

    def _ensure_blocks(self, req: _Req, num_tokens: int) -> None:
        need = -(-num_tokens // self.block_size)
        if need > self.width:
            raise InvalidRequestError(f"request needs {need} blocks, the table width is {self.width}")
        while len(req.blocks) < need:
            if not self.free_blocks:
                raise NoFreeBlocksError("the harness's KV pool is exhausted; give it more blocks")
            req.blocks.append(self.free_blocks.pop(0))

    # ---- one step
    @torch.no_grad()
    def step(
        self, schedule: Sequence[tuple[int, int]], *, pad_tokens: int = 0, all_logits: bool = False
    ) -> dict[int, torch.Tensor]:
        """Run ``schedule`` = [(request id, number of new tokens)] as one packed batch.

        Returns logits for each request whose known tokens are now all computed: the last
        token's ``[vocab]`` logits, or ``[n, vocab]`` for all its scheduled tokens when
        ``all_logits``. ``pad_tokens`` appends padding tokens (slot -1) after the real ones.
        """
        device = self.model.device
        for rid, _ in schedule:
            if rid not in self.reqs:
                raise UnknownRequestError(f"request {rid} is not in the harness (finished or never added)")
        self.step_log.append([(rid, self.reqs[rid].computed, n, self.reqs[rid].prompt_len)
                              for rid, n in schedule])
        ids, pos, query_lens, seq_lens, rows = [], [], [], [], []
        for rid, n in schedule:
            req = self.reqs[rid]
            if n <= 0 or req.computed + n > len(req.tokens):
                raise InvalidRequestError(
                    f"request {rid}: cannot schedule {n} tokens ({req.computed} of {len(req.tokens)} computed)"
                )
            self._ensure_blocks(req, req.computed + n)
            ids.extend(req.tokens[req.computed : req.computed + n])
            pos.extend(range(req.computed, req.computed + n))
            query_lens.append(n)
            seq_lens.append(req.computed + n)
            rows.append(req.blocks + [0] * (self.width - len(req.blocks)))
        table = torch.tensor(rows, dtype=torch.int32)
        positions = torch.tensor(pos, dtype=torch.int64)
        row_of_token = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(query_lens))
        block = table[row_of_token, positions // self.block_size].to(torch.int64)
        slots = block * self.block_size + positions % self.block_size
        if pad_tokens:
            ids.extend([0] * pad_tokens)
            positions = torch.cat([positions, torch.zeros(pad_tokens, dtype=torch.int64)])
            slots = torch.cat([slots, torch.full((pad_tokens,), -1, dtype=torch.int64)])
        meta = build_attention_metadata(query_lens, seq_lens, table, slots, device=device)
        hidden = self.model(
            torch.tensor(ids, dtype=torch.int64, device=device), positions.to(device), self.kv_caches, meta
        )
        out: dict[int, torch.Tensor] = {}
        start = 0
        for (rid, n) in schedule:
            req = self.reqs[rid]
            req.computed += n
            if req.computed == len(req.tokens):
                idx = list(range(start, start + n)) if all_logits else [start + n - 1]
                logits = self.model.compute_logits(hidden, idx)
                out[rid] = logits if all_logits else logits[0]
            start += n
        return out

    # ---- drivers
    def prompt_logits(self, prompt: Sequence[int]) -> torch.Tensor:
        """Logits ``[len(prompt), vocab]`` of a one-step prefill (the request is freed after)."""
        rid = self.add_request(prompt)
        logits = self.step([(rid, len(prompt))], all_logits=True)[rid]
        self.free_request(rid)
        return logits

    def greedy_generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        chunk_size: int | None = None,
        token_budget: int | None = None,
        pad_tokens: int = 0,
    ) -> list[list[int]]:
        """Batched greedy decoding: every step schedules each unfinished request (prompt chunks
        of at most ``chunk_size`` tokens, one token when decoding) within ``token_budget``
        tokens; finished requests free their blocks."""
        rids = [self.add_request(p, max_new_tokens) for p in prompts]
        results: dict[int, list[int]] = {}
        active = list(rids)
        while active:
            budget = token_budget if token_budget is not None else 1 << 30
            schedule = []
            for rid in active:
                req = self.reqs[rid]
                n = len(req.tokens) - req.computed
                if chunk_size is not None:
                    n = min(n, chunk_size)
                n = min(n, budget)
                if n <= 0:
                    break
                schedule.append((rid, n))
                budget -= n
            logits = self.step(schedule, pad_tokens=pad_tokens)
            for rid, lg in logits.items():
                req = self.reqs[rid]
                req.tokens.append(int(torch.argmax(lg)))
                if req.finished:
                    results[rid] = req.generated
                    active.remove(rid)
                    self.free_request(rid)
        return [results[r] for r in rids]


__all__ = ["PagedHarness"]


@dataclass
class TeacherForcedCheck:
    """How our greedy tokens rank under a reference model fed our own sequence.

    ``margins[i]``: the reference's top logit minus its logit of our token ``i`` (0 when our
    token is its argmax). On random bf16 weights near-ties are common, so the two greedy paths
    part after a few tokens and then are different texts; checking our whole sequence
    teacher-forced instead says whether every token we chose was one the reference also
    (nearly) chose, which is what a correct bf16 engine guarantees."""

    margins: list[float]

    @property
    def exact(self) -> int:
        return sum(m == 0.0 for m in self.margins)

    @property
    def max_margin(self) -> float:
        return max(self.margins) if self.margins else 0.0

    @property
    def mean_margin(self) -> float:
        return sum(self.margins) / len(self.margins) if self.margins else 0.0

    def count_over(self, bound: float) -> int:
        """How many of our tokens sit more than ``bound`` below the reference's top-1."""
        return sum(m > bound for m in self.margins)


@torch.no_grad()
def teacher_forced_check(ref_model, prompt: Sequence[int], ours: Sequence[int]) -> TeacherForcedCheck:
    """Run ``ref_model`` (a transformers causal LM) once on ``prompt + ours[:-1]`` and compare
    its prediction at every generated position with our token (see
    :class:`TeacherForcedCheck`)."""
    device = next(ref_model.parameters()).device
    ids = torch.tensor([list(prompt) + list(ours[:-1])], device=device)
    logits = ref_model(ids).logits[0].float()[len(prompt) - 1:]  # row i predicts our token i
    top = logits.max(-1).values
    mine = logits.gather(1, torch.tensor(list(ours), device=device)[:, None])[:, 0]
    return TeacherForcedCheck((top - mine).tolist())


def teacher_forced_checks(ref_model, prompts: Sequence[Sequence[int]],
                          outs: Sequence[Sequence[int]]) -> TeacherForcedCheck:
    """:func:`teacher_forced_check` of every prompt (``outs[i]``: our tokens after
    ``prompts[i]``), their margins in one :class:`TeacherForcedCheck`."""
    margins: list[float] = []
    for prompt, ours in zip(prompts, outs, strict=True):
        margins += teacher_forced_check(ref_model, prompt, ours).margins
    return TeacherForcedCheck(margins)
