"""Helpers of the Mamba-2 hybrid model tests (Bamba, Falcon-H1): a tiny checkpoint loaded both
by pagedkv and by transformers, ``MambaMetadata`` built by hand, NaN-poisoned state slots, and
:class:`HybridHarness`, the paged harness for models with state layers."""

from __future__ import annotations

import torch

from pagedkv.attention.backend import StepAttention
from pagedkv.core.spec import MambaSpec
from pagedkv.models.harness import PagedHarness
from pagedkv.models.loader import load_checkpoint
from pagedkv.models.tiny import CORPUS
from pagedkv.worker.attn_builders import MambaMetadata

_LINES = CORPUS.splitlines()
# prompts of 1 to ~45 tokens: a word, a line, two lines
TEXTS = ["Hello", _LINES[2][:34], _LINES[7], _LINES[6] + " " + _LINES[5]]
NAN = float("nan")


class Pair:
    """The same tiny checkpoint in pagedkv (``ck``) and in transformers (``hf``), fp32."""

    def __init__(self, path: str):
        import transformers

        self.path = path
        self.ck = load_checkpoint(path, dtype="float32")
        self.model = self.ck.model
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.prompts = [self.ck.tokenizer.encode(t) for t in TEXTS]
        self._gen: dict = {}

    def generate(self, prompt, n: int) -> list[int]:
        """transformers' greedy ``generate`` (its decode branch: the cached recurrent step)."""
        key = (tuple(prompt), n)
        if key not in self._gen:
            ids = torch.tensor([list(prompt)])
            with torch.no_grad():
                out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                       do_sample=False, eos_token_id=None, pad_token_id=0)
            self._gen[key] = out[0, len(prompt):].tolist()
        return self._gen[key]

    def mixers(self, layer: int = 0):
        """(pagedkv's, transformers') mixer of ``layer``."""
        return self.model.layers[layer].mamba, self.hf.model.layers[layer].mamba

    def check_parameter_count(self) -> None:
        """pagedkv's parameter count of the config equals transformers' model's."""
        assert self.model.config.num_parameters() == sum(t.numel() for t in self.hf.parameters())


class Pairs:
    """A test module's tiny checkpoints by variant name: ``pairs(name)`` is the :class:`Pair`
    of ``build(name)`` (a checkpoint path), loaded once (a module-scoped fixture holds it)."""

    def __init__(self, build):
        self._build = build
        self._pairs: dict = {}

    def __call__(self, name: str) -> Pair:
        if name not in self._pairs:
            self._pairs[name] = Pair(self._build(name))
        return self._pairs[name]


def mamba_metadata(query_lens, computed, slots, *, pad_rows: int = 0,
                   device="cpu") -> MambaMetadata:
    """A step's ``MambaMetadata`` for rows with ``query_lens[r]`` new tokens after
    ``computed[r]`` computed ones, their states in ``slots[r]``, then ``pad_rows`` padded rows
    (no tokens, seq_len 0, state PAD_SLOT_ID). The leading one-token rows are the decodes (as
    the runner splits them: a one-token prompt is one, its zeroed state the fresh start);
    every later real row a prefill."""
    n = len(query_lens)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    nd = 0
    while nd < n and query_lens[nd] == 1:
        nd += 1
    rows = n + pad_rows
    qsl += [qsl[-1]] * pad_rows
    seq = [c + q for c, q in zip(computed, query_lens)] + [0] * pad_rows
    idx = torch.tensor(list(slots) + [-1] * pad_rows, dtype=torch.int32)[:, None]
    return MambaMetadata(
        num_reqs=rows, num_actual_tokens=qsl[-1],
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq, dtype=torch.int32, device=device),
        state_indices=idx.to(device),
        has_initial_state=torch.tensor([c > 0 for c in computed] + [False] * pad_rows,
                                       device=device),
        block_table=idx.to(device), num_actual_reqs=n, num_decodes=nd, num_decode_tokens=nd,
        num_prefills=n - nd, num_prefill_tokens=qsl[-1] - nd)


def poisoned_states(mixer, num_slots: int, dtype=torch.float32):
    """``(conv, ssm)`` state tensors of ``num_slots`` slots, all NaN."""
    conv_shape, ssm_shape = mixer.state_shapes()
    return (torch.full((num_slots, *conv_shape), NAN, dtype=dtype),
            torch.full((num_slots, *ssm_shape), NAN, dtype=torch.float32))


class _Planned:
    """A model seen through the harness: each step's one metadata object becomes the
    :class:`StepAttention` a runner would pass (the backend's plan for the attention layers, a
    ``MambaMetadata`` for the state layers: each request's state in its first block, as mode
    ``none`` puts it; a request's state slot is zeroed in its first step, as the runner zeroes
    new blocks). Everything else is the model's."""

    def __init__(self, model, harness_block_size: int):
        self._model = model
        self._block_size = harness_block_size

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, positions, kv_caches, meta):
        model = self._model
        qsl = meta.query_start_loc_cpu.tolist()
        seq = meta.seq_lens_cpu.tolist()
        ql = [b - a for a, b in zip(qsl, qsl[1:])]
        computed = [s - q for s, q in zip(seq, ql)]
        slots = meta.block_table_tensor[:, 0].tolist()
        specs = list(model.kv_cache_specs(self._block_size).values())
        fresh = torch.tensor([s for s, c in zip(slots, computed) if c == 0], dtype=torch.int64)
        for spec, cache in zip(specs, kv_caches):
            if isinstance(spec, MambaSpec) and fresh.numel():
                for t in cache:
                    t[fresh] = 0
        mm = mamba_metadata(ql, computed, slots, device=model.device)
        plans, attn_plan = [], None
        for spec in specs:
            if isinstance(spec, MambaSpec):
                plans.append(mm)
            else:
                attn_plan = attn_plan or model.attn_backend.plan(meta, model.attention_layout(spec))
                plans.append(attn_plan)
        return model(input_ids, positions, kv_caches, StepAttention(meta, plans))


class HybridHarness(PagedHarness):
    """:class:`PagedHarness` (shuffled blocks, NaN-poisoned pool, mixed steps, greedy
    decoding with chunked prefill) for a model with state layers: its state layers get the
    ``MambaMetadata`` of each step (the leading one-token rows of a step are decodes)."""

    def __init__(self, model, *, block_size: int, num_blocks: int, **kw):
        super().__init__(_Planned(model, block_size), block_size=block_size,
                         num_blocks=num_blocks, **kw)


# ---- checks shared by test_bamba.py, test_falcon_h1.py and test_jamba.py

# two sequences step by step: seq 1 starts with a one-token chunk (a decode row from its zeroed
# state), continues with a prefill chunk while seq 0 decodes; then both prefill, then both decode
MIXED_SCHEDULE = [[(1, 1), (0, 12)], [(0, 1), (1, 19)], [(0, 17), (1, 5)], [(0, 1), (1, 1)],
                  [(0, 1), (1, 1)], [(1, 1), (0, 1)]]


@torch.no_grad()
def check_mixer_varlen_batch(pair: Pair, layer: int = 0, lens=(9, 1, 20, 33), seed: int = 0):
    """Fresh prompts of different lengths as one varlen batch (slots out of order, two padded
    rows, three padding tokens) through pagedkv's mixer equal transformers' mixer on each prompt
    alone; slots of no row stay NaN, padding tokens give ``out_proj(0)``."""
    ours, theirs = pair.mixers(layer)
    gen = torch.Generator().manual_seed(seed)
    h = pair.model.config.hidden_size
    xs = [torch.randn(n, h, generator=gen) for n in lens]
    want = torch.cat([theirs(x[None])[0] for x in xs])
    states = poisoned_states(ours, 8)
    slots = [5, 2, 7, 0][: len(lens)]
    meta = mamba_metadata(list(lens), [0] * len(lens), slots, pad_rows=2)
    # fresh one-token prompts are decode rows from a zeroed state (the runner zeroes new blocks)
    for r in range(meta.num_decodes):
        for s in states:
            s[slots[r]] = 0
    pad = 3
    got = ours(torch.cat(xs + [torch.randn(pad, h, generator=gen)]), states, meta)
    torch.testing.assert_close(got[: sum(lens)], want, atol=2e-5, rtol=2e-5)
    zero_out = ours.out_proj(torch.zeros(1, ours.mc.intermediate_size))
    torch.testing.assert_close(got[sum(lens):], zero_out.expand(pad, -1))
    untouched = [i for i in range(8) if i not in slots]
    for s in states:
        assert torch.isnan(s[untouched]).all()
        assert not torch.isnan(s[slots]).any()


@torch.no_grad()
def check_mixer_steps(pair: Pair, schedule, layer: int = 0, seed: int = 1):
    """Two sequences run step by step (``schedule``: per step ``[(seq, new tokens)]``, decodes
    listed first as the runner orders them), prefill chunks and decode steps mixed, each
    carrying its conv and SSM state from step to step: the outputs equal transformers' mixer
    over each whole sequence in one pass."""
    ours, theirs = pair.mixers(layer)
    gen = torch.Generator().manual_seed(seed)
    h = pair.model.config.hidden_size
    totals = {}
    for step in schedule:
        for s, n in step:
            totals[s] = totals.get(s, 0) + n
    seqs = {s: torch.randn(n, h, generator=gen) for s, n in totals.items()}
    states = poisoned_states(ours, 4)
    slot = {s: 3 - i for i, s in enumerate(sorted(seqs))}
    done = {s: 0 for s in seqs}
    outs = {s: [] for s in seqs}
    for step in schedule:
        for s, _ in step:
            if done[s] == 0:  # a new request's state block is zeroed
                for t in states:
                    t[slot[s]] = 0
        meta = mamba_metadata([n for _, n in step], [done[s] for s, _ in step],
                              [slot[s] for s, _ in step])
        x = torch.cat([seqs[s][done[s]: done[s] + n] for s, n in step])
        y = ours(x, states, meta)
        start = 0
        for s, n in step:
            outs[s].append(y[start: start + n])
            done[s] += n
            start += n
    for s, x in seqs.items():
        torch.testing.assert_close(torch.cat(outs[s]), theirs(x[None])[0], atol=3e-5, rtol=3e-5)


def check_prompt_logits(pair: Pair, block_size: int = 16):
    """Each prompt's logits in one prefill step equal transformers' forward."""
    need = sum(-(-len(p) // block_size) for p in pair.prompts)
    harness = HybridHarness(pair.model, block_size=block_size, num_blocks=need + 3)
    for p in pair.prompts:
        with torch.no_grad():
            want = pair.hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(harness.prompt_logits(p), want, atol=1e-4, rtol=1e-4)


@torch.no_grad()
def check_decode_steps(pair: Pair, prompt, steps: int = 6, block_size: int = 16):
    """A prefill then ``steps`` decode steps (each token the argmax of the last logits): every
    step's logits equal transformers' forward over the whole sequence at that position, and the
    tokens equal transformers' ``generate`` (its cached decode branch)."""
    harness = HybridHarness(pair.model, block_size=block_size, num_blocks=8)
    rid = harness.add_request(prompt)
    logits = [harness.step([(rid, len(prompt))])[rid]]
    req = harness.reqs[rid]
    for _ in range(steps):
        req.tokens.append(int(torch.argmax(logits[-1])))
        logits.append(harness.step([(rid, 1)])[rid])
    want = pair.hf(torch.tensor([req.tokens])).logits[0, len(prompt) - 1:]
    torch.testing.assert_close(torch.stack(logits), want, atol=1e-4, rtol=1e-4)
    assert req.tokens[len(prompt):] == pair.generate(prompt, steps)


def check_batched_greedy(pair: Pair, new_tokens: int = 10, **kw):
    """Batched greedy decoding through the harness (``kw``: chunk_size, token_budget,
    pad_tokens) equals transformers' ``generate`` per prompt; with ``chunk_size``, some step
    mixed decodes with a later chunk of a prompt."""
    block = kw.pop("block_size", 16)
    need = sum(-(-(len(p) + new_tokens) // block) for p in pair.prompts)
    harness = HybridHarness(pair.model, block_size=block, num_blocks=need + 3)
    got = harness.greedy_generate(pair.prompts, new_tokens, **kw)
    assert got == [pair.generate(p, new_tokens) for p in pair.prompts]
    if "chunk_size" in kw:
        assert any(any(done >= plen for _, done, _, plen in s)
                   and any(0 < done < plen for _, done, _, plen in s) for s in harness.step_log)
    return harness
