"""Sampler: greedy, distributions (seeded statistical tests), per-request seeds, logprobs."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedkv.errors import SamplingError
from pagedkv.sampling import SamplingParams
from pagedkv.sampling.metadata import SamplingMetadata, make_generator
from pagedkv.sampling.sampler import Sampler

def sample(logits, params, sampler=None, generators=None):
    md = SamplingMetadata.build(params, logits.device, generators)
    return (sampler or Sampler())(logits, md)


# ----- reference distribution (float64 numpy, written from the documented semantics) ------------
def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    e = np.where(finite, np.exp(x - x[finite].max()), 0.0)
    return e / e.sum()


def reference_probs(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0):
    """Expected sampling distribution, and the smallest distance of any keep/drop decision
    from its threshold (the test requires it to be comfortably nonzero)."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    margin = math.inf
    if min_p > 0:
        p = softmax(x)
        thr = min_p * p.max()
        margin = min(margin, np.abs(p - thr).min())
        x = np.where(p >= thr, x, -np.inf)
    if top_k > 0 and top_k < len(x):
        order = np.sort(x)[::-1]
        kth = order[top_k - 1]
        assert not np.isfinite(kth) or order[top_k] < kth  # no tie at the k-th value
        x = np.where(x >= kth, x, -np.inf)
    if top_p < 1.0:
        p = softmax(x)
        order = np.argsort(-p, kind="stable")
        above = np.concatenate([[0.0], np.cumsum(p[order])[:-1]])
        live = p[order] > 0
        margin = min(margin, np.abs(above[live] - top_p).min())
        drop = above >= top_p
        drop[0] = False
        x[order[drop]] = -np.inf
    return softmax(x), margin


def chi2_critical(df, z=3.719):  # upper 1e-4 quantile (Wilson-Hilferty)
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def check_distribution(tokens, expected, n):
    counts = np.bincount(np.asarray(tokens), minlength=len(expected)).astype(np.float64)
    assert counts[expected == 0].sum() == 0, "a filtered-out token was sampled"
    support = expected > 0
    exp_counts = expected[support] * n
    stat = ((counts[support] - exp_counts) ** 2 / exp_counts).sum()
    df = int(support.sum()) - 1
    if df > 0:
        assert stat < chi2_critical(df), (stat, counts, exp_counts)
    tv = 0.5 * np.abs(counts / n - expected).sum()
    assert tv < 0.02, tv


LOGITS10 = np.random.default_rng(7).normal(0.0, 1.5, size=10).astype(np.float32)

CASES = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.3, top_p=0.8),
    dict(temperature=0.9, min_p=0.1),
    dict(temperature=0.8, top_k=6, top_p=0.9, min_p=0.02),  # 10 -> 8 -> 6 -> 4 tokens
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_unseeded_distribution_matches_restricted_softmax(case):
    expected, margin = reference_probs(LOGITS10, **case)
    assert margin > 1e-3  # the example is far from every threshold
    n = 40_000
    logits = torch.from_numpy(np.tile(LOGITS10, (n, 1)))
    out = sample(logits, [SamplingParams(**case)] * n,
                 sampler=Sampler(generator=torch.Generator().manual_seed(1234)))
    check_distribution(out.tolist(), expected, n)


@pytest.mark.parametrize("case", CASES[1:3], ids=["top_k", "top_p"])
def test_seeded_rows_distribution_across_seeds(case):
    expected, _ = reference_probs(LOGITS10, **case)
    n = 3_000
    logits = torch.from_numpy(np.tile(LOGITS10, (n, 1)))
    out = sample(logits, [SamplingParams(seed=10_000 + i, **case) for i in range(n)])
    counts = np.bincount(np.asarray(out.tolist()), minlength=10) / n
    assert counts[expected == 0].sum() == 0
    assert 0.5 * np.abs(counts - expected).sum() < 0.05


def test_seeded_stream_over_steps_follows_the_distribution():
    # One request, many steps: its own generator advances, so its tokens are i.i.d. draws.
    case = dict(temperature=1.1, top_k=7)
    expected, _ = reference_probs(LOGITS10, **case)
    params = [SamplingParams(seed=99, **case)]
    gens = {0: make_generator(99, "cpu")}
    md = SamplingMetadata.build(params, "cpu", gens)
    sampler = Sampler()
    logits = torch.from_numpy(LOGITS10[None, :].copy())
    tokens = [sampler(logits, md).tolist()[0] for _ in range(4_000)]
    counts = np.bincount(np.asarray(tokens), minlength=10) / len(tokens)
    assert counts[expected == 0].sum() == 0
    assert 0.5 * np.abs(counts - expected).sum() < 0.05


# ----- greedy -------------------------------------------------------------------------------------
def test_all_greedy_is_argmax_and_draws_no_randomness():
    torch.manual_seed(0)
    logits = torch.randn(16, 300)
    state = torch.get_rng_state()
    out = sample(logits, [SamplingParams(temperature=0.0, top_k=3, logprobs=None)] * 16)
    assert torch.equal(out.sampled_token_ids, logits.argmax(-1))
    assert out.logprobs is None
    assert torch.equal(torch.get_rng_state(), state)


def test_mixed_batch_greedy_rows_are_argmax():
    torch.manual_seed(1)
    logits = torch.randn(12, 500)
    params = [SamplingParams(temperature=0.0) if i % 3 == 0 else
              SamplingParams(temperature=5.0, seed=i if i % 2 else None) for i in range(12)]
    for _ in range(5):
        got = sample(logits, params).tolist()
        for i in range(0, 12, 3):
            assert got[i] == int(logits[i].argmax())


def test_input_logits_are_not_modified_and_bf16_is_accepted():
    torch.manual_seed(2)
    logits = torch.randn(4, 64)
    before = logits.clone()
    params = [SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, logprobs=3)] * 4
    sample(logits, params)
    assert torch.equal(logits, before)
    out = sample(logits.bfloat16(), [SamplingParams(temperature=0.0)] * 4)
    assert torch.equal(out.sampled_token_ids, logits.bfloat16().float().argmax(-1))


# ----- per-request seeds --------------------------------------------------------------------------
SEEDED = SamplingParams(temperature=0.9, top_k=20, top_p=0.95, seed=42)
OTHER_SEEDED = SamplingParams(temperature=1.2, min_p=0.02, seed=7)


def run_steps(layout, steps=6, vocab=64):
    """Rows of ``layout`` are (name, params); every named request keeps its own generator
    across steps. Logits per (name, step) are fixed; returns {name: tokens}."""
    gens = {}
    for row, (name, p) in enumerate(layout):
        if p.seed is not None and not p.is_greedy:
            gens[row] = make_generator(p.seed, "cpu")
    sampler = Sampler(generator=torch.Generator().manual_seed(len(layout)))
    tokens = {name: [] for name, _ in layout}
    for step in range(steps):
        rows = []
        for name, _ in layout:
            g = torch.Generator().manual_seed(int.from_bytes(name.encode(), "little") * 1000 + step)
            rows.append(torch.randn(vocab, generator=g) * 3)
        md = SamplingMetadata.build([p for _, p in layout], "cpu", gens)
        for name, tok in zip([n for n, _ in layout], sampler(torch.stack(rows), md).tolist()):
            tokens[name].append(tok)
    return tokens


def test_seeded_rows_do_not_depend_on_the_batch_or_their_row():
    alone = run_steps([("R", SEEDED)])["R"]
    b = run_steps([("u", SamplingParams(temperature=1.0)), ("g", SamplingParams(temperature=0)),
                   ("R", SEEDED), ("S", OTHER_SEEDED)])
    c = run_steps([("S", OTHER_SEEDED), ("R", SEEDED), ("v", SamplingParams(top_p=0.5)),
                   ("w", SamplingParams(top_k=3, temperature=2.0))])
    assert b["R"] == alone and c["R"] == alone
    assert b["S"] == c["S"]
    assert len(set(alone)) > 1  # really random


def test_seeded_row_keeps_its_stream_when_the_batch_is_rebuilt_and_reordered():
    torch.manual_seed(3)
    steps = [torch.randn(32) * 2 for _ in range(5)]
    ref_gen = make_generator(42, "cpu")
    ref = [sample(s[None], [SEEDED], generators={0: ref_gen}).tolist()[0] for s in steps]

    g = make_generator(42, "cpu")
    got = []
    for i, s in enumerate(steps):
        filler = [torch.randn(32) for _ in range(i)]  # batch grows; R moves to row i
        logits = torch.stack(filler + [s])
        params = [SamplingParams()] * i + [SEEDED]
        got.append(sample(logits, params, generators={i: g}).tolist()[i])
    assert got == ref


def test_different_seeds_differ_and_same_seed_repeats():
    logits = torch.zeros(1, 1000)
    a = sample(logits, [SamplingParams(seed=1)]).tolist()
    b = sample(logits, [SamplingParams(seed=1)]).tolist()
    c = [sample(logits, [SamplingParams(seed=s)]).tolist()[0] for s in range(2, 8)]
    assert a == b
    assert len(set(c)) > 1


def test_missing_generators_are_created_and_returned():
    md = SamplingMetadata.build([SamplingParams(seed=5), SamplingParams(), SamplingParams(
        temperature=0, seed=6)])
    assert set(md.generators) == {0}  # greedy rows need no generator
    assert md.generators[0].initial_seed() == 5
    assert md.has_unseeded_random and not md.all_random and not md.all_greedy


# ----- logprobs -----------------------------------------------------------------------------------
def test_raw_logprobs_at_sampled_ids_and_top_alternatives():
    torch.manual_seed(4)
    logits = torch.randn(6, 50) * 2
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(logprobs=5),
              SamplingParams(temperature=0.5, top_k=3, logprobs=0),
              SamplingParams(top_p=0.3, seed=3), SamplingParams(min_p=0.2, logprobs=1),
              SamplingParams(temperature=2.0, logprobs=4, seed=8)]
    out = sample(logits, params)
    lp = torch.log_softmax(logits.double(), dim=-1).float()
    sampled = out.sampled_token_ids
    ids, vals, ranks = out.logprobs.tolists()
    assert out.logprobs.token_ids.shape == (6, 6)  # sampled + max(logprobs)=5 alternatives
    top = lp.topk(5, dim=-1)
    for r in range(6):
        assert ids[r][0] == int(sampled[r])
        assert vals[r][0] == pytest.approx(float(lp[r, sampled[r]]), abs=1e-5)
        assert ids[r][1:] == top.indices[r].tolist()
        assert vals[r][1:] == pytest.approx(top.values[r].tolist(), abs=1e-5)
        assert ranks[r] == int((lp[r] >= lp[r, sampled[r]]).sum())
    assert ranks[0] == 1  # greedy


def test_processed_logprobs_mode_reports_the_sampling_distribution():
    torch.manual_seed(5)
    logits = torch.randn(3, 40)
    params = [SamplingParams(temperature=0.0, logprobs=3),
              SamplingParams(temperature=0.5, logprobs=3),
              SamplingParams(top_k=4, logprobs=3)]
    out = sample(logits, params, sampler=Sampler(logprobs_mode="processed_logprobs"))
    vals = out.logprobs.logprobs
    exp0 = torch.log_softmax(logits[0], -1).topk(3).values  # greedy row: raw
    exp1 = torch.log_softmax(logits[1] / 0.5, -1).topk(3).values
    top4 = logits[2].topk(4).values
    exp2 = torch.log_softmax(top4, -1)[:3]
    assert torch.allclose(vals[0, 1:], exp0, atol=1e-5)
    assert torch.allclose(vals[1, 1:], exp1, atol=1e-5)
    assert torch.allclose(vals[2, 1:], exp2, atol=1e-5)


def test_logprobs_wider_than_vocab_are_clamped():
    out = sample(torch.randn(2, 3), [SamplingParams(logprobs=20)] * 2)
    assert out.logprobs.token_ids.shape == (2, 4)


# ----- errors -------------------------------------------------------------------------------------
def test_inconsistent_inputs_raise_sampling_errors():
    md = SamplingMetadata.build([SamplingParams()] * 2)
    with pytest.raises(SamplingError, match="3 rows but the sampling metadata was built for 2"):
        Sampler()(torch.randn(3, 5), md)
    with pytest.raises(SamplingError, match="must be \\[num_reqs, vocab\\]"):
        Sampler()(torch.randn(10), md)
    with pytest.raises(SamplingError, match="floating point"):
        Sampler()(torch.ones(2, 5, dtype=torch.int64), md)
    with pytest.raises(SamplingError, match="live on meta"):
        Sampler()(torch.empty(2, 5, device="meta"), md)
    with pytest.raises(SamplingError, match="logprobs_mode"):
        Sampler(logprobs_mode="processed_logits")
    with pytest.raises(SamplingError, match="empty batch"):
        SamplingMetadata.build([])
    with pytest.raises(SamplingError, match="expected SamplingParams"):
        SamplingMetadata.build([{"temperature": 1.0}])


# ----- property: the sampled token always survives the filters -----------------------------------
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    n=st.integers(1, 6),
    vocab=st.integers(1, 40),
)
def test_sampled_token_is_always_in_the_filtered_support(data, n, vocab):
    params = []
    for _ in range(n):
        params.append(SamplingParams(
            temperature=data.draw(st.sampled_from([0.0, 0.05, 0.5, 1.0, 3.0])),
            top_k=data.draw(st.integers(0, vocab + 2)),
            top_p=data.draw(st.floats(0.01, 1.0)),
            min_p=data.draw(st.floats(0.0, 1.0)),
            seed=data.draw(st.one_of(st.none(), st.integers(0, 2**32))),
            logprobs=vocab if vocab <= 20 else None,
        ))
    values = data.draw(st.lists(st.floats(-30, 30, allow_nan=False, width=32),
                                min_size=n * vocab, max_size=n * vocab))
    logits = torch.tensor(values, dtype=torch.float32).view(n, vocab)
    out = sample(logits, params, sampler=Sampler(logprobs_mode="processed_logprobs"))
    sampled = out.tolist()
    for r, p in enumerate(params):
        assert 0 <= sampled[r] < vocab
        if p.is_greedy:
            assert logits[r, sampled[r]] == logits[r].max()
    if vocab <= 20:
        ids, vals, _ = out.logprobs.tolists()
        for r in range(n):
            assert math.isfinite(vals[r][0])  # the sampled token was not masked
            assert not any(math.isnan(v) for v in vals[r])


# ----- GPU ----------------------------------------------------------------------------------------
@pytest.mark.gpu
def test_cuda_sampling_is_seeded_and_sync_free():
    dev = torch.device("cuda")
    torch.manual_seed(6)
    logits = torch.randn(8, 32000, device=dev)
    params = [SamplingParams(temperature=0.0, logprobs=2), SamplingParams(seed=1, top_k=50),
              SamplingParams(top_p=0.9, min_p=0.05, logprobs=5),
              SamplingParams(seed=2, top_p=0.8)] * 2
    md = SamplingMetadata.build(params, dev)
    sampler = Sampler()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = sampler(logits, md)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    got = out.tolist()
    assert got[0] == int(logits[0].argmax())
    # The seeded rows reproduce alone and in another batch, on fresh generators.
    alone = Sampler()(logits[1:2], SamplingMetadata.build([params[1]], dev)).tolist()
    assert alone[0] == got[1]
    other = torch.randn(5, 32000, device=dev)
    mixed = torch.cat([other[:2], logits[3:4], other[2:], logits[1:2]])
    mixed_params = [params[0], params[2], params[3], params[2], params[0], params[2], params[1]]
    again = Sampler()(mixed, SamplingMetadata.build(mixed_params, dev)).tolist()
    assert (again[2], again[6]) == (got[3], got[1])
    # Logprobs on the device agree with log_softmax at the sampled ids.
    lp = torch.log_softmax(logits, dim=-1).gather(1, out.sampled_token_ids[:, None])[:, 0]
    assert torch.allclose(out.logprobs.logprobs[:, 0], lp, atol=1e-5)


def test_banned_tokens_are_never_sampled_and_raw_logprobs_unchanged():
    """``banned`` (min_tokens): the listed (row, token) pairs cannot be sampled, greedy takes
    the best remaining token, random rows never draw them; raw logprobs are the model's."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 12, generator=g)
    logits[0, 5] = 50.0  # row 0's greedy token
    logits[1, 7] = 50.0  # row 1 would draw 7 almost surely
    params = [SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=1.0, seed=3, logprobs=1),
              SamplingParams(temperature=0.0, logprobs=1)]
    banned = (torch.tensor([0, 1, 1]), torch.tensor([5, 7, 2]))
    md = SamplingMetadata.build(params, "cpu")
    for _ in range(20):
        out = Sampler()(logits, md, banned)
        ids = out.sampled_token_ids.tolist()
        masked = logits.clone()
        masked[0, 5] = float("-inf")
        assert ids[0] == int(masked[0].argmax()) and ids[1] not in (7, 2)
        assert ids[2] == int(logits[2].argmax())  # row 2 untouched
        raw = torch.log_softmax(logits, -1)
        tok, lp, _ = out.logprobs.tolists()
        assert tok[0][1] == 5 and math.isclose(lp[0][1], float(raw[0, 5]), rel_tol=1e-5)
