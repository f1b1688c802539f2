"""CUDA graphs of mixed prefill / decode steps (``pagedkv.worker.cuda_graphs``): the token
counts by hand, the padded capture inputs, which runners may capture them, and the replay path
against eager steps: on CPU through the capture stand-in (each "replay" re-plans from the
capture's metadata, so the Triton backend's mixed-graph plan runs, interpreted) with the same
greedy tokens and logits as without graphs, cascade on and off; on the GPU the engine's real
graphs (the default) against an engine without mixed graphs."""

import pytest
import torch
from engine_helpers import make_llm, record_replays
from test_cascade_engine import TINY, record, w3_prompts
from test_model_runner import EagerReplay

from pagedkv.attention.triton_backend import CASCADE, TritonAttentionBackend
from pagedkv.sampling.params import SamplingParams
from pagedkv.worker.cuda_graphs import CudaGraphManager, default_mixed_capture_sizes


def test_default_mixed_capture_sizes_by_hand():
    assert default_mixed_capture_sizes(16384) == [512, 1024, 2048, 4096, 6144, 8192, 10240,
                                                  12288, 14336, 16384]
    assert default_mixed_capture_sizes(8192) == [512, 1024, 2048, 4096, 6144, 8192]
    assert default_mixed_capture_sizes(7000) == [512, 1024, 2048, 4096, 6144, 7000]
    assert default_mixed_capture_sizes(600) == [512, 600]
    assert default_mixed_capture_sizes(256) == [256]
    assert default_mixed_capture_sizes(2) == [2]
    assert default_mixed_capture_sizes(1) == []


def _llm(path, device, cascade=TINY, **kw):
    # eager: the engine captures nothing of its own (on CUDA); the test's graphs are the stand-in's
    opts = dict(max_num_seqs=4, max_num_batched_tokens=128, device=device, enforce_eager=True,
                attention_backend=TritonAttentionBackend(cascade=cascade))
    opts.update(kw)
    return make_llm(path, **opts)


def test_mixed_padded_sizes_and_capture_inputs(tiny_dir, kernel_device):
    llm = _llm(tiny_dir("qwen3"), kernel_device)
    runner = llm.runner
    mgr = CudaGraphManager(runner, [2, 4], graph_capture=EagerReplay(), mixed_sizes=[96, 32, 128])
    assert mgr.mixed_sizes == [32, 96, 128] and mgr.mixed_reqs == 4
    assert mgr.mixed_variants == (None, CASCADE)  # TINY: cascade from 2 requests
    assert mgr.num_graphs == 2 * 2 + 3 * 2  # two decode sizes (plain, cascade), three mixed
    assert [mgr.mixed_padded_size(t, 3) for t in (0, 1, 2, 32, 33, 96, 97, 128, 129)] == \
        [None, 32, 32, 32, 96, 96, 128, 128, None]
    assert mgr.mixed_padded_size(40, 5) is None  # more requests than the graphs hold
    assert mgr.mixed_variant(True) == CASCADE and mgr.mixed_variant(False) is None
    # stale values in the persistent buffers: the capture's padding must overwrite them
    bt = runner.input_batch.block_table
    bt.block_table.gpu.fill_(7)
    bt.slot_mappings.fill_(5)
    runner.preparer.seq_lens.gpu.fill_(9)
    runner.preparer.positions.gpu.fill_(3)
    ids, pos, step, md = mgr._mixed_capture_inputs(96, CASCADE)
    assert md.query_start_loc.tolist() == [0] * 5 and md.seq_lens.tolist() == [0] * 4
    assert md.block_table_tensor.tolist() == [[0] * bt.block_table.gpu.shape[1]] * 4
    assert md.slot_mapping.tolist() == [-1] * 96 and pos.tolist() == [0] * 96
    assert ids.tolist() == [0] * 96
    assert (md.num_reqs, md.num_actual_reqs, md.num_actual_tokens, md.max_query_len,
            md.max_seq_len, md.mixed_graph, md.use_cascade, md.decode_balanced) == \
        (4, 4, 96, 96, runner.max_model_len, True, True, False)
    # the Triton plan of a mixed graph: the capture's bounds, every request maybe a decode
    plan = runner.attention_for(step, md, for_cudagraph_capture=True).plans[0]
    assert (plan.n, plan.end, plan.max_q, plan.has_decode, plan.decode_only, plan.varlen,
            plan.cascade) == (4, 96, 96, True, False, False, True)
    with pytest.raises(Exception, match="mixed CUDA-graph sizes"):
        CudaGraphManager(runner, [2], graph_capture=EagerReplay(), mixed_sizes=[256])


def test_which_runners_capture_mixed_steps(tiny_dir, monkeypatch):
    """Full attention through the Triton backend: yes; the torch reference backend, a
    sliding window, a Triton backend asked for the varlen fresh-prefill path (the graphs
    would silently run the Triton kernel instead), or no CUDA: no. cuDNN's paged prefill
    launch is captured in them: yes."""
    from pagedkv.worker.model_runner import ModelRunner

    monkeypatch.setattr(ModelRunner, "cuda_graphs_supported", lambda self: True)
    assert _llm(tiny_dir("qwen3"), "cpu").runner.mixed_cuda_graphs_supported()
    for kw, graphs in ((dict(fresh_prefill="auto"), True), (dict(fresh_prefill="triton"), True),
                       (dict(fresh_prefill="varlen"), False), (dict(paged_prefill="cudnn"), True)):
        backend = TritonAttentionBackend(cascade=TINY, **kw)
        assert backend.supports_mixed_cuda_graphs is graphs
        assert _llm(tiny_dir("qwen3"), "cpu", attention_backend=backend
                    ).runner.mixed_cuda_graphs_supported() is graphs
    assert not make_llm(tiny_dir("qwen3")).runner.mixed_cuda_graphs_supported()  # torch_ref
    swa = tiny_dir("mistral", sliding_window=32)
    assert not _llm(swa, "cpu").runner.mixed_cuda_graphs_supported()
    monkeypatch.undo()
    assert not _llm(tiny_dir("qwen3"), "cpu").runner.mixed_cuda_graphs_supported()  # CPU


@pytest.mark.parametrize("cascade", [TINY, None], ids=["cascade", "plain"])
def test_mixed_graph_replays_equal_eager_steps(tiny_dir, kernel_device, cascade):
    """Chunked prefills beside decodes (a shared system prompt: cascade where on), every
    mixed step replayed from the stand-in's graphs; the same tokens and logits as the eager
    engine, the sanitizer checking every padded step."""
    path = tiny_dir("qwen3")
    # 5 prompts of a 48-token system prompt + tails, then a fresh 70-token prompt; 4 run at
    # once and with 64 tokens a step the prefills are chunked and meet the first ones'
    # decodes: the later ones extend the cached system prompt (cascade where on)
    prompts = w3_prompts(5, seed=5) + [list(range(3, 73))]
    kw = dict(max_num_batched_tokens=64)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    llm = _llm(path, kernel_device, cascade, **kw)
    runner = llm.runner
    mgr = CudaGraphManager(runner, [1, 2, 4], graph_capture=EagerReplay(),
                           mixed_sizes=[16, 32, 64])
    mgr.capture()
    runner.cuda_graphs = mgr
    seen = record_replays(mgr, mixed=True)
    calls = record(llm)
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [o.outputs[0].token_ids for o in outs]
    assert runner.num_mixed_graph_steps == len(seen) > 0
    assert {t for t, _ in seen} <= {16, 32, 64} and 64 in {t for t, _ in seen}
    if cascade is not None:
        assert CASCADE in {v for _, v in seen}
    assert llm.get_kv_stats()["mixed_cuda_graph_steps"] == len(seen)

    eager = _llm(path, kernel_device, cascade, **kw)
    calls_e = record(eager)
    ref = [o.outputs[0].token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    assert got == ref
    assert len(calls["logits"]) == len(calls_e["logits"]) > 0
    for a, b in zip(calls["logits"], calls_e["logits"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
def test_engine_mixed_graphs_equal_eager_mixed_steps_gpu():
    """Qwen3-0.6B's shape (random weights, 28 layers, async scheduling, CUDA graphs, eager
    regions for a shorter build) in float32 with 2,048 tokens a step: 24 W3-like prompts
    (a 512-token system prompt + 50-200 tokens) and 8 fresh ones of 100-900 tokens, so that
    chunked prefills meet decodes. Mixed graphs on (the default) against off: the same
    schedule, logits within 1e-3 up to each request's first greedy flip (the padded GEMMs
    and decode splits round differently), tokens equal. (In bf16, with compiled regions, the
    two differed by 7% in one step's logits on random weights, eleventh session: the padded
    GEMMs' rounding; float32 separates rounding from a wrong result. Passed on the H200 in
    the twenty-first and twenty-second sessions.)"""
    import random

    from test_cascade_engine import logits_until_first_flip

    from pagedkv import LLM

    rng = random.Random(1)
    system = [rng.randrange(10, 10000) for _ in range(512)]
    prompts = [system + [rng.randrange(10, 10000) for _ in range(rng.randint(50, 200))]
               for _ in range(24)]
    prompts += [[rng.randrange(10, 10000) for _ in range(rng.randint(100, 900))]
                for _ in range(8)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    toks, calls, stats, seen = {}, {}, {}, None
    for mixed in (True, False):
        llm = LLM.from_shape("qwen3-0.6b", dtype="float32", max_model_len=2048,
                             max_num_seqs=32, max_num_batched_tokens=2048,
                             compile_model=False, mixed_cuda_graphs=mixed)
        calls[mixed] = record(llm)
        mgr = llm.runner.cuda_graphs
        if mixed:
            seen = record_replays(mgr, mixed=True)
        toks[mixed] = {o.request_id: list(o.outputs[0].token_ids)
                       for o in llm.generate(prompts, params, use_tqdm=False)}
        stats[mixed] = llm.get_kv_stats()
        llm.shutdown()
    assert stats[True]["mixed_cuda_graph_sizes"] == [512, 1024, 2048]
    assert stats[True]["mixed_cuda_graph_steps"] == len(seen) > 0
    assert stats[False]["mixed_cuda_graph_steps"] == 0 and not stats[False]["mixed_cuda_graph_sizes"]
    assert calls[True]["req_ids"] == calls[False]["req_ids"]  # the same schedule, row for row
    compared, total = logits_until_first_flip(calls[True], calls[False], toks[True], toks[False],
                                              rtol=1e-3)
    assert compared >= 0.9 * total, (compared, total)
    same = sum(x == y for rid, a in toks[True].items() for x, y in zip(a, toks[False][rid]))
    assert same >= 0.95 * 32 * 12, same
