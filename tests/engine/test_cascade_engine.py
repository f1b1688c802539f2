"""Cascade attention through the engine: a W3-like batch (one system prompt of whole blocks +
short unique tails, greedy) on a tiny Qwen3 checkpoint with the Triton backend (interpreted on
CPU), cascade forced on (thresholds lowered to the tiny shapes) against cascade off: the same
greedy tokens and the same logits at every step, with the sanitizer on; the runner's prefix
lengths by hand; the CASCADE decode graph replayed (CPU stand-in for the capture) for every
shared prefix length. GPU: the same at the Qwen3-0.6B shape in bf16 with real CUDA graphs."""

import random

import numpy as np
import pytest
import torch
from engine_helpers import make_llm

from pagedkv.attention.triton_backend import CASCADE, CascadeConfig, TritonAttentionBackend
from pagedkv.sampling.params import SamplingParams
from pagedkv.worker.metadata import cascade_prefix_lens

# the tiny model's thresholds: any shared block, any two requests, no saving required
TINY = CascadeConfig(min_prefix_tokens=16, min_reqs=2, min_saved_us=0.0)


def w3_prompts(num, system_len=48, seed=0, tail=(3, 12)):
    """W3 in miniature: ``num`` prompts of one ``system_len``-token system prompt + a unique
    tail of U[tail] tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 250) for _ in range(system_len)]
    return [system + [rng.randrange(3, 250) for _ in range(rng.randint(*tail))]
            for _ in range(num)]


def record(llm):
    """Wrap the runner: count cascade forwards, keep each sampling step's logits (also on the
    all-greedy path, where the fused LM head + argmax makes none) and its sampled request
    ids."""
    runner = llm.runner
    backend = runner.attn_backend
    calls = {"cascade": 0, "logits": []}
    inner_fwd = backend._forward_cascade

    def fwd(*a, **k):
        calls["cascade"] += 1
        return inner_fwd(*a, **k)

    backend._forward_cascade = fwd
    inner_logits = runner._compute_logits

    def logits(*a, **k):
        out = inner_logits(*a, **k)
        calls["logits"].append(out.float().clone())
        return out

    runner._compute_logits = logits
    inner_greedy = runner._greedy_tokens

    def greedy(hidden, indices):
        # the all-greedy path: with the fused LM head + argmax (CUDA) no logits are made, so
        # the step's logits are computed here from the same hidden rows (recorded once: without
        # the fused op the inner call goes through ``logits`` above)
        if runner._greedy_tokens_fn is not None:
            calls["logits"].append(inner_logits(hidden, indices, widen=True).float().clone())
        return inner_greedy(hidden, indices)

    runner._greedy_tokens = greedy
    calls["req_ids"] = []  # each step's sampled request ids: row i of that step's logits
    push = runner.outputs.push

    def pushed(h):
        calls["req_ids"].append(list(h.sampled_req_ids or ()))
        return push(h)

    runner.outputs.push = pushed
    return calls


def generate(path, cascade, prompts, max_tokens, **kw):
    """Greedy tokens of ``prompts`` with cascade ``cascade`` (``kw``: engine options, e.g. the
    device: the CPU through the interpreter, or CUDA natively)."""
    llm = make_llm(path, attention_backend=TritonAttentionBackend(cascade=cascade), **kw)
    calls = record(llm)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], calls, llm


def test_cascade_prefix_lens_by_hand():
    comp = np.array([48, 50, 61], dtype=np.int32)
    assert cascade_prefix_lens([3], [16], comp) == [48]  # 3 blocks, every context >= 48
    assert cascade_prefix_lens([4], [16], comp) == [48]  # capped by the smallest context
    assert cascade_prefix_lens([4], [16], np.array([60, 47])) == [32]  # whole blocks below 47
    assert cascade_prefix_lens([2, 0], [16, 16], comp) == [32, 0]
    assert cascade_prefix_lens([0], [16], comp) is None
    assert cascade_prefix_lens([], [16], comp) is None
    assert cascade_prefix_lens([3], [16], np.array([0, 60])) is None  # a fresh prefill
    assert cascade_prefix_lens([5, 10], [32, 16], np.array([100])) == [96, 96]


def test_w3_like_batch_cascade_on_equals_off(tiny_dir, kernel_device):
    path = tiny_dir("qwen3")
    prompts = w3_prompts(6)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=256, device=kernel_device)
    on, calls_on, llm = generate(path, TINY, prompts, 8, **kw)
    off, calls_off, _ = generate(path, None, prompts, 8, **kw)
    assert calls_on["cascade"] > 0 and calls_off["cascade"] == 0
    assert on == off
    assert len(calls_on["logits"]) == len(calls_off["logits"]) > 0
    for a, b in zip(calls_on["logits"], calls_off["logits"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # the scheduler saw the shared system prompt (3 blocks) while all six ran
    assert llm.runner.attn_backend.cascade is TINY


def test_cascade_with_async_scheduling(tiny_dir, kernel_device):
    """Async scheduling (step k enqueued before step k-1's tokens reach the host): the
    runner's prefix lengths from its own batch; cascade on == off (synchronous)."""
    path = tiny_dir("qwen3")
    prompts = w3_prompts(5, seed=3)
    kw = dict(max_num_seqs=8, max_num_batched_tokens=256, device=kernel_device)
    on, calls, _ = generate(path, TINY, prompts, 6, async_scheduling=True, **kw)
    off, _, _ = generate(path, None, prompts, 6, **kw)
    assert calls["cascade"] > 0 and on == off


def test_cascade_decode_graph_variant_on_cpu(tiny_dir, kernel_device):
    """Decode steps replay the CASCADE graph (CPU stand-in capture, re-planned from the
    capture metadata at every replay: use_cascade baked, the prefix read from the group's
    device scalar the runner writes), for prefixes of 3 and then 2 blocks; tokens equal the
    eager run without cascade."""
    from test_model_runner import EagerReplay

    from pagedkv.worker.cuda_graphs import CudaGraphManager

    path = tiny_dir("qwen3")
    # eager: the engine captures no graphs of its own (on CUDA); the stand-in's are the test's
    kw = dict(max_num_seqs=4, max_num_batched_tokens=256, device=kernel_device,
              enforce_eager=True)
    llm = make_llm(path, attention_backend=TritonAttentionBackend(cascade=TINY), **kw)
    runner = llm.runner
    mgr = CudaGraphManager(runner, [2, 4], graph_capture=EagerReplay())
    assert [mgr.variants(s)[-1] for s in mgr.sizes] == [CASCADE, CASCADE]
    mgr.capture()
    runner.cuda_graphs = mgr
    seen = []
    replay = mgr.replay
    mgr.replay = lambda size, variant=None: seen.append(variant) or replay(size, variant)
    calls = record(llm)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for system_len in (48, 32):
        prompts = w3_prompts(4, system_len=system_len, seed=system_len)
        seen.clear()
        outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert seen and set(seen) == {CASCADE}, seen
        assert int(runner.attn_groups[0][0].common_prefix_len_device[0]) == system_len
        off, _, _ = generate(path, None, prompts, 5, **kw)
        assert outs == off
    assert calls["cascade"] > 0


def first_flips(toks_on: dict, toks_off: dict) -> dict:
    """Each request's first token index where the two engines' sampled tokens differ (its
    token count where none does)."""
    return {rid: next((i for i, (x, y) in enumerate(zip(a, toks_off[rid])) if x != y), len(a))
            for rid, a in toks_on.items()}


def logits_until_first_flip(on: dict, off: dict, toks_on: dict, toks_off: dict,
                            rtol: float = 2e-2) -> tuple[int, int]:
    """Compare two engines' recorded logits (``record``) row by row, each request up to the
    step that sampled its first differing token (its later inputs differ; the other requests'
    do not: attention is per request). The flip is read off the sampled tokens ``toks_*``
    (request id -> token ids): an argmax of the recorded logits can miss a near-tie that the
    sampler resolved the other way. Asserts each compared step's relative error < ``rtol``;
    returns (rows compared, rows in all)."""
    for rec in (on, off):  # one logits tensor a sampling step: no step left unrecorded
        assert len(rec["logits"]) == len(rec["req_ids"]) > 0, (len(rec["logits"]),
                                                               len(rec["req_ids"]))
    first_diff = first_flips(toks_on, toks_off)
    made = dict.fromkeys(first_diff, 0)  # tokens each request sampled before this step
    compared = total = 0
    for ids, a, b in zip(on["req_ids"], on["logits"], off["logits"]):
        total += len(ids)
        live = [i for i, rid in enumerate(ids) if made[rid] <= first_diff[rid]]
        for rid in ids:
            made[rid] += 1
        if live:
            a, b = a[:len(ids)][live], b[:len(ids)][live]
            err = float((a - b).norm() / b.norm())
            assert err < rtol, (err, [ids[i] for i in live])
            compared += len(live)
    return compared, total


def test_logits_until_first_flip_by_hand():
    """Request "b" flips at its 2nd token on a tie the argmax does not show; its 3rd step
    (different inputs, wild logits) is left out; "a" is compared at every step."""
    row = lambda *v: torch.tensor(v, dtype=torch.float32)  # noqa: E731
    on = {"req_ids": [["a", "b"], ["a", "b"], ["a", "b"]],
          "logits": [torch.stack([row(1, 0), row(0, 1)]), torch.stack([row(1, 0), row(1, 1)]),
                     torch.stack([row(1, 0), row(9, -9)])]}
    off = {"req_ids": on["req_ids"],
           "logits": [torch.stack([row(1, 0), row(0, 1)]), torch.stack([row(1, 0), row(1, 1)]),
                      torch.stack([row(1, 0), row(-9, 9)])]}
    toks_on, toks_off = {"a": [0, 0, 0], "b": [1, 0, 0]}, {"a": [0, 0, 0], "b": [1, 1, 1]}
    assert logits_until_first_flip(on, off, toks_on, toks_off) == (5, 6)
    with pytest.raises(AssertionError):  # without the flip the third step's rows differ
        logits_until_first_flip(on, off, toks_on, toks_on)
    empty = {"req_ids": on["req_ids"], "logits": []}  # a recorder that saw no logits
    with pytest.raises(AssertionError):
        logits_until_first_flip(empty, empty, toks_on, toks_off)


@pytest.mark.gpu
def test_w3_small_variant_cascade_on_equals_off_gpu():
    """Qwen3-0.6B's shape (random weights, bf16, 28 layers) on a small W3 variant (32
    requests, a 512-token system prompt + 50-200 unique tokens, 24 greedy tokens) with CUDA
    graphs: cascade on (the default thresholds: 31 x 512 shared positions save ~15 us of
    reads per layer) replays the CASCADE graphs, and its logits equal the plain engine's at
    every step up to the first greedy flip (bf16: the two paths round differently), with most
    tokens equal."""
    from pagedkv import LLM

    rng = random.Random(0)
    system = [rng.randrange(10, 10000) for _ in range(512)]
    prompts = [system + [rng.randrange(10, 10000) for _ in range(rng.randint(50, 200))]
               for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    toks, calls = {}, {}
    for name, cascade in (("on", CascadeConfig()), ("off", None)):
        llm = LLM.from_shape("qwen3-0.6b", dtype="bfloat16", max_model_len=1024, max_num_seqs=32,
                             attention_backend=TritonAttentionBackend(cascade=cascade))
        calls[name] = record(llm)
        mgr = llm.runner.cuda_graphs
        seen = []
        replay = mgr.replay
        mgr.replay = lambda size, variant=None: seen.append(variant) or replay(size, variant)
        toks[name] = {o.request_id: list(o.outputs[0].token_ids)
                      for o in llm.generate(prompts, params, use_tqdm=False)}
        assert (CASCADE in seen) == (cascade is not None), set(seen)
        llm.shutdown()
    on, off = calls["on"], calls["off"]
    assert on["req_ids"] == off["req_ids"]  # the same schedule, row for row
    compared, total = logits_until_first_flip(on, off, toks["on"], toks["off"])
    assert compared >= 0.5 * total, (compared, total)
    same = sum(x == y for rid, a in toks["on"].items() for x, y in zip(a, toks["off"][rid]))
    flips = sorted(first_flips(toks["on"], toks["off"]).values())
    print(f"same {same} of {32 * 24}, logit rows compared {compared} of {total}, "
          f"first flips {flips}")
    assert same >= 0.75 * 32 * 24, (same, compared, total, flips)
