"""The logits filters against hand-computed masks, and the order the sampler applies them in."""

import math

import pytest
import torch

from pagedkv.sampling import SamplingParams
from pagedkv.sampling.filters import apply_min_p, apply_temperature, apply_top_k, apply_top_p
from pagedkv.sampling.metadata import SamplingMetadata
from pagedkv.sampling.sampler import Sampler

NEG = float("-inf")


def kept(logits: torch.Tensor) -> list[list[int]]:
    return [[i for i, v in enumerate(row) if v != NEG] for row in logits.tolist()]


def logits_of(probs):
    return [math.log(p) for p in probs]


P4 = [0.5, 0.3, 0.15, 0.05]


def test_temperature_divides_each_row():
    x = torch.tensor([[2.0, 4.0], [1.0, -3.0]])
    apply_temperature(x, torch.tensor([2.0, 0.5]))
    assert x.tolist() == [[1.0, 2.0], [2.0, -6.0]]


def test_top_k_hand_examples():
    x = torch.tensor([
        [1.0, 3.0, 2.0, 5.0, 4.0],   # k=2 -> {3, 4}
        [1.0, 3.0, 2.0, 5.0, 4.0],   # k=0 -> disabled
        [1.0, 3.0, 2.0, 5.0, 4.0],   # k=9 > vocab -> everything
        [0.0, 2.0, 2.0, 1.0, -1.0],  # k=1 with a tie at the top: both tied tokens stay
        [0.0, 2.0, 2.0, 1.0, -1.0],  # k=3 -> {1, 2, 3}
    ])
    before = x.clone()
    apply_top_k(x, torch.tensor([2, 0, 9, 1, 3]), max_top_k=9)
    assert kept(x) == [[3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [1, 2], [1, 2, 3]]
    finite = x != NEG
    assert torch.equal(x[finite], before[finite])  # kept logits untouched


@pytest.mark.parametrize("p, expected", [(0.45, [0]), (0.55, [0, 1]), (0.81, [0, 1, 2]),
                                         (0.96, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])])
def test_top_p_hand_examples(p, expected):
    # Shuffled vocabulary order: probs 0.15, 0.5, 0.05, 0.3 at ids 0..3.
    perm = [2, 0, 3, 1]  # sorted rank of each id
    x = torch.tensor([[logits_of(P4)[r] for r in perm]])
    apply_top_p(x, torch.tensor([p]))
    assert sorted(kept(x)[0]) == sorted(perm.index(r) for r in expected)


def test_top_p_keeps_the_most_likely_token_and_whole_tail_when_disabled():
    # One dominant token, a long tail of tiny probabilities whose fp32 cumsum reaches 1.0 early.
    row = [20.0] + [-5.0] * 4000
    x = torch.tensor([row, row])
    apply_top_p(x, torch.tensor([1e-6, 1.0]))
    assert kept(x)[0] == [0]
    assert kept(x)[1] == list(range(4001))


@pytest.mark.parametrize("min_p, expected", [(0.0, [0, 1, 2, 3]), (0.2, [0, 1, 2]),
                                             (0.5, [0, 1]), (0.7, [0]), (1.0, [0])])
def test_min_p_hand_examples(min_p, expected):
    x = torch.tensor([logits_of(P4)])
    apply_min_p(x, torch.tensor([min_p]))
    assert kept(x)[0] == expected


def processed_support(probs, **kwargs) -> list[int]:
    """Tokens the sampler's processing leaves, read from its processed logprobs over the whole
    vocabulary (-inf exactly where a filter masked)."""
    return kept(processed_logprobs(probs, **kwargs))[0]


def processed_logprobs(probs, **kwargs) -> torch.Tensor:
    params = SamplingParams(logprobs=len(probs), **kwargs)
    out = Sampler(logprobs_mode="processed_logprobs")(
        torch.tensor([logits_of(probs)]), SamplingMetadata.build([params])
    )
    ids, lps, _ = out.logprobs.tolists()
    row = [NEG] * len(probs)
    for t, lp in zip(ids[0][1:], lps[0][1:]):
        row[t] = lp
    assert row[ids[0][0]] != NEG  # the sampled token survived the filters
    return torch.tensor([row])


def test_temperature_is_applied_before_min_p():
    # T=1: min_p=0.5 keeps p >= 0.25 -> {0, 1}. T=2 flattens to ~[.379 .294 .208 .120]:
    # threshold .19 -> {0, 1, 2}. The sampler must apply temperature first.
    assert processed_support(P4, temperature=1.0, min_p=0.5) == [0, 1]
    assert processed_support(P4, temperature=2.0, min_p=0.5) == [0, 1, 2]


def test_top_k_is_applied_before_top_p_on_the_renormalized_distribution():
    probs = [0.4, 0.3, 0.2, 0.1]
    # top-k 2 -> [4/7, 3/7]; top-p 0.5: mass above token 1 is 0.571 >= 0.5 -> only token 0.
    # (top-p first would keep {0, 1}.)
    assert processed_support(probs, top_k=2, top_p=0.5) == [0]
    assert processed_support(probs, top_k=3, top_p=0.65) == [0, 1]


def test_min_p_is_applied_before_top_p():
    probs = [0.4, 0.3, 0.2, 0.1]
    # min_p 0.3: threshold .12 -> {0, 1, 2} renormalized [4/9, 3/9, 2/9]; top_p .75: mass above
    # token 2 = 7/9 = .778 >= .75 -> {0, 1}. (top-p first: mass above token 2 = .7 < .75 ->
    # {0, 1, 2}, and min-p keeps all three.)
    assert processed_support(probs, min_p=0.3, top_p=0.75) == [0, 1]


def test_processed_logprobs_are_the_renormalized_restricted_distribution():
    probs = [0.4, 0.3, 0.2, 0.1]
    full = processed_logprobs(probs, top_k=2, temperature=0.5)
    # T=0.5 squares the probabilities: .16 .09 .04 .01 -> top-2 -> [16/25, 9/25].
    got = full[0, :2].exp().tolist()
    assert got == pytest.approx([16 / 25, 9 / 25], rel=1e-5)
