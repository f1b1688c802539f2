"""GPT-OSS end to end on one runner (CPU, fp32, the sanitizer on every step): a tiny random
checkpoint written by transformers' ``GptOssForCausalLM`` (sliding-window and full layers
alternating: two KV-cache groups in one pool; attention sinks; q/k/v/o biases; YaRN RoPE; MoE
with router and expert biases, interleaved gate/up, the clamped SwiGLU). Greedy tokens of
``pagedkv.LLM`` equal transformers' ``generate`` for batches of prompts of different lengths,
prompts longer than the window, chunked prefill crossing the window edge, prefix hits,
preemption on a small pool, block sizes 16 and 32, with the torch reference attention and the
Triton kernels (interpreted)."""

import pytest
from engine_helpers import (
    TEXTS,
    check_bf16_teacher_forced,
    check_greedy,
    greedy,
    log_scheduled_steps,
    make_llm,
    needs_reference_transformers,
    pool_is_idle,
)

W = 8


@pytest.fixture(scope="module")
def path(tiny_dir):
    return tiny_dir("gpt_oss", sliding_window=W)


@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
def test_greedy_matches_transformers_across_the_window(path, hf_ref, backend):
    llm = make_llm(path, attention_backend=backend, block_size=16, max_num_batched_tokens=16)
    assert type(llm.engine.model).__name__ == "GptOssForCausalLM"
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    assert sorted(type(g.kv_cache_spec).__name__ for g in groups) == [
        "FullAttentionSpec", "SlidingWindowSpec"]
    assert llm.runner.input_batch.block_table.num_groups == 2
    steps = log_scheduled_steps(llm.scheduler)
    lengths = [len(llm.tokenizer.encode(t)) for t in TEXTS]
    assert len(set(lengths)) == len(TEXTS) and max(lengths) > 3 * W
    check_greedy(llm, hf_ref(path), TEXTS, 16)
    # prompts were cut into chunks of at most 16 tokens (crossing the window's edge W = 8),
    # and some step mixed decode tokens with a prompt chunk
    assert all(sum(s.values()) <= 16 for s in steps)
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)


@pytest.mark.parametrize("block_size", [16, 32])
def test_prefix_hits_preemption_and_block_sizes(path, hf_ref, block_size):
    ref = hf_ref(path)
    long = TEXTS[3]
    prompts = [long, TEXTS[2], long, long + " And more after the shared part.", TEXTS[1]]
    # the smallest pool one max-length request fits in (two groups): the others must wait or
    # be preempted
    llm = make_llm(path, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=4,
                   num_gpu_blocks_override=1 + 2 * -(-96 // block_size), max_model_len=96)
    check_greedy(llm, ref, prompts, 20)
    s = llm.get_kv_stats()
    assert s["block_size"] == block_size
    assert s["prefix_cache_hits"] > 0, s
    assert s["preemptions"] > 0, s


def test_triton_backend_prefix_hits_and_preemption(path, hf_ref):
    """The Triton decode and prefill kernels (sinks, window) on prefix hits and a preempted,
    recomputed request."""
    long = TEXTS[3]
    llm = make_llm(path, attention_backend="triton", block_size=16, max_num_batched_tokens=16,
                   max_num_seqs=3, num_gpu_blocks_override=1 + 2 * 6, max_model_len=96)
    check_greedy(llm, hf_ref(path), [long, long + " And more.", TEXTS[2]], 20)
    s = llm.get_kv_stats()
    assert s["prefix_cache_hits"] > 0 and s["preemptions"] > 0, s


def test_window_releases_blocks_while_decoding(path, hf_ref):
    """The sliding-window layers' group holds only the window's blocks once decoding: older
    entries of its table are the null block; the full layers' group holds every block."""
    llm = make_llm(path, block_size=4)
    engine = llm.engine
    params = greedy(30)
    rid = engine.add_request(TEXTS[3], params)
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    swa = next(i for i, g in enumerate(groups) if type(g.kv_cache_spec).__name__ == "SlidingWindowSpec")
    live, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
        if rid in engine.scheduler.requests:
            held = engine.scheduler.kv_cache_manager.get_block_ids(rid)
            live.append((sum(1 for b in held[swa] if b != 0), sum(1 for b in held[1 - swa] if b != 0)))
    assert max(n for n, _ in live[2:]) <= -(-(W - 1 + 1) // 4) + 1
    assert live[-1][1] >= (len(final.prompt_token_ids) + 29) // 4
    assert final.outputs[0].token_ids == hf_ref(path).greedy(final.prompt_token_ids, 30)
    assert pool_is_idle(llm)


# ---- on a CUDA GPU: the Triton attention (sinks, window) and fused-MoE kernels in the engine


@pytest.mark.gpu
def test_gpu_engine_equals_the_cpu_engine(path):
    """fp32 on the GPU (Triton attention with sinks and windows, decode CUDA graphs, the
    fused-MoE kernel) gives the CPU engine's greedy tokens (the CPU engine equals transformers
    5.24's, tested above), whatever transformers the GPU machine has."""
    from pagedkv import SamplingParams

    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = TEXTS + TEXTS[:3]
    want = [o.outputs[0].token_ids for o in make_llm(path).generate(prompts, p, use_tqdm=False)]
    llm = make_llm(path, device="cuda", attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=64)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)] == want
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0


@pytest.mark.gpu
@needs_reference_transformers
def test_gpu_fp32_engine_matches_transformers(path, hf_ref, monkeypatch):
    """fp32 on the GPU (Triton attention with sinks and windows, decode CUDA graphs, the
    fused-MoE kernel with biases / interleaved gate-up / clamped SwiGLU in every layer):
    greedy tokens equal transformers' on the CPU."""
    import pagedkv.kernels.fused_moe as fm

    calls = []
    inner = fm.fused_moe

    def counted(*args, **kw):
        calls.append(kw.get("activation"))
        return inner(*args, **kw)

    monkeypatch.setattr(fm, "fused_moe", counted)
    llm = make_llm(path, device="cuda", attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=64)
    check_greedy(llm, hf_ref(path), TEXTS + TEXTS[:3], 16)
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0
    assert calls and all(a is not None and a.name == "swiglu_clamp" for a in calls)


@pytest.mark.gpu
@needs_reference_transformers
def test_gpu_bf16_engine_matches_transformers_teacher_forced(tiny_cache):
    """bf16 through the default engine (Triton attention, decode CUDA graphs, the fused-MoE
    kernel): our tokens are transformers' bf16 argmax on our own sequence nearly everywhere
    (the bound of the MoE families' bf16 test: a routing near-tie may flip one expert)."""
    from pagedkv import LLM
    from pagedkv.models.tiny import build_tiny_checkpoint

    p = build_tiny_checkpoint("gpt_oss", tiny_cache, dtype="bfloat16", sliding_window=W)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 100)]
    llm = LLM(p, dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=8,
              max_num_batched_tokens=64, num_gpu_blocks_override=256, sanitize=True)
    check_bf16_teacher_forced(llm, p, prompts, "gpt_oss")
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0
