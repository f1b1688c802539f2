"""Repetition / frequency / presence penalties: a hand-computed row, the device counts against
the plain twin over random rows (subsets, in-flight tokens, several steps), the sampler's order
(raw logprobs before penalties, greedy after) and the parameter checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import InvalidRequestError
from pagedkv.sampling.metadata import SamplingMetadata
from pagedkv.sampling.params import SamplingParams
from pagedkv.sampling.penalties import PenaltyCounts, penalize_reference
from pagedkv.sampling.sampler import Sampler


def test_hand_computed_row():
    # logits of 5 tokens; prompt {0, 3}; output 2, 2, 4; r=2, f=0.5, p=0.25
    logits = [2.0, -1.0, 0.5, 0.0, 3.0]
    # t0 seen in the prompt: 2/2 = 1.0 (no output count)
    # t1 unseen: -1.0
    # t2 twice in the output: 0.5/2 - 0.5*2 - 0.25 = -1.0
    # t3 seen, logit 0: 0*2 = 0.0
    # t4 once in the output: 3/2 - 0.5 - 0.25 = 0.75
    want = [1.0, -1.0, -1.0, 0.0, 0.75]
    assert penalize_reference(logits, [0, 3], [2, 2, 4], 2.0, 0.5, 0.25) == want
    pc = PenaltyCounts([0], [[0, 3]], [[2, 2, 4]], [2.0], [0.5], [0.25], 5, "cpu")
    x = torch.tensor([logits])
    got = pc.apply(x)
    assert got[0].tolist() == want
    assert x[0].tolist() == logits  # not modified
    # a negative logit of a seen token is multiplied: -1 for token 1 once in the output
    pc2 = PenaltyCounts([0], [[]], [[1]], [2.0], [0.0], [0.0], 5, "cpu")
    assert pc2.apply(x)[0, 1].item() == -2.0


@st.composite
def batches(draw):
    vocab = draw(st.integers(3, 12))
    m = draw(st.integers(1, 5))
    rows = sorted(draw(st.sets(st.integers(0, m - 1), min_size=1)))
    tok = st.integers(0, vocab - 1)
    prompts = [draw(st.lists(tok, max_size=6)) for _ in rows]
    outputs = [draw(st.lists(tok, max_size=6)) for _ in rows]
    rep = [draw(st.sampled_from([1.0, 0.5, 1.3, 2.0])) for _ in rows]
    freq = [draw(st.sampled_from([0.0, -1.5, 0.4, 2.0])) for _ in rows]
    pres = [draw(st.sampled_from([0.0, -0.7, 1.1])) for _ in rows]
    pending = sorted(draw(st.sets(st.sampled_from(range(len(rows))))))
    pending_toks = [draw(tok) for _ in pending]
    steps = [[draw(tok) for _ in range(m)] for _ in range(draw(st.integers(0, 3)))]
    seed = draw(st.integers(0, 2**16))
    return vocab, m, rows, prompts, outputs, rep, freq, pres, pending, pending_toks, steps, seed


@settings(max_examples=80, deadline=None)
@given(batches())
def test_counts_match_the_twin(case):
    vocab, m, rows, prompts, outputs, rep, freq, pres, pending, pending_toks, steps, seed = case
    pc = PenaltyCounts(rows, prompts, outputs, rep, freq, pres, vocab, "cpu",
                       pending=(pending, torch.tensor(pending_toks)))
    outs = [list(o) for o in outputs]
    for j, t in zip(pending, pending_toks):
        outs[j].append(t)
    g = torch.Generator().manual_seed(seed)
    for step in [None] + steps:
        if step is not None:  # tokens sampled by every row of the step
            pc.add_sampled(torch.tensor(step))
            for j, r in enumerate(rows):
                outs[j].append(step[r])
        assert pc.num_outputs == [len(o) for o in outs]
        logits = torch.randn(m, vocab, generator=g)
        logits[0, 0] = 0.0
        got = pc.apply(logits)
        for r in range(m):
            if r in rows:
                j = rows.index(r)
                want = penalize_reference(logits[r].tolist(), prompts[j], outs[j], rep[j],
                                          freq[j], pres[j])
                assert got[r].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6)
            else:
                assert torch.equal(got[r], logits[r])


def test_sampler_greedy_after_penalties_raw_logprobs_before():
    logits = torch.tensor([[0.0, 3.0, 2.9, 1.0]])
    md = SamplingMetadata.build([SamplingParams(temperature=0, logprobs=2)])
    plain = Sampler()(logits, md)
    assert plain.sampled_token_ids.tolist() == [1]
    # token 1 already in the output once: 3.0 - 0.5 = 2.5 < 2.9
    pc = PenaltyCounts([0], [[]], [[1]], [1.0], [0.5], [0.0], 4, "cpu")
    out = Sampler()(logits, md, penalties=pc)
    assert out.sampled_token_ids.tolist() == [2]
    raw = torch.log_softmax(logits, -1)[0]
    assert out.logprobs.logprobs[0, 0].item() == pytest.approx(raw[2].item())
    assert out.logprobs.token_ids[0, 1].item() == 1  # the top alternative is the model's
    # processed logprobs see the penalized logits
    out2 = Sampler(logprobs_mode="processed_logprobs")(logits, md, penalties=pc)
    pen = torch.log_softmax(torch.tensor([0.0, 2.5, 2.9, 1.0]), -1)
    assert out2.logprobs.logprobs[0, 0].item() == pytest.approx(pen[2].item())


def test_random_rows_sample_from_the_penalized_distribution():
    # presence 2 on a token that holds almost all the mass moves it below the others
    logits = torch.tensor([[5.0, 0.0, 0.0]] * 2)
    md = SamplingMetadata.build([SamplingParams(temperature=1.0, seed=1)] * 2)
    pc = PenaltyCounts([1], [[]], [[0]], [1.0], [2.0], [2.0], 3, "cpu")
    counts = torch.zeros(2, 3)
    s = Sampler()
    for _ in range(300):
        counts[torch.arange(2), s(logits, md, penalties=pc).sampled_token_ids] += 1
    p0 = math.exp(5) / (math.exp(5) + 2)
    assert counts[0, 0] / 300 > 0.95 and p0 > 0.98
    # row 1: logit 5 - 2 - 2 = 1 against two 0s: p = e / (e + 2) = 0.576
    assert 0.45 < counts[1, 0].item() / 300 < 0.70


@pytest.mark.parametrize("kw,match", [
    (dict(presence_penalty=2.5), "presence_penalty must be in"),
    (dict(frequency_penalty=-2.01), "frequency_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than 0"),
    (dict(repetition_penalty=float("nan")), "repetition_penalty must be a finite number"),
    (dict(presence_penalty="1"), "presence_penalty must be a finite number"),
])
def test_bad_penalties_are_refused(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


def test_penalty_flags():
    assert not SamplingParams().uses_penalties
    assert SamplingParams(repetition_penalty=1.1).uses_penalties
    assert SamplingParams(temperature=0, presence_penalty=-2).uses_penalties  # kept for greedy


@pytest.mark.gpu
def test_counts_on_cuda_match_cpu():
    g = torch.Generator().manual_seed(0)
    vocab, m = 1000, 6
    rows = [0, 2, 3, 5]
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 0, 40, 9)]
    outputs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 20, 0, 7)]
    args = (rows, prompts, outputs, [1.3, 0.7, 1.0, 2.0], [0.5, 0.0, -1.0, 2.0],
            [0.0, 1.5, 0.3, -2.0], vocab)
    cpu = PenaltyCounts(*args, "cpu", pending=([1], torch.tensor([7])))
    gpu = PenaltyCounts(*args, "cuda", pending=([1], torch.tensor([7], device="cuda")))
    for _ in range(3):
        logits = torch.randn(m, vocab, generator=g)
        assert torch.allclose(gpu.apply(logits.cuda()).cpu(), cpu.apply(logits), atol=1e-6)
        step = torch.randint(0, vocab, (m,), generator=g)
        cpu.add_sampled(step)
        gpu.add_sampled(step.cuda())
    assert torch.equal(gpu.counts.cpu(), cpu.counts)
