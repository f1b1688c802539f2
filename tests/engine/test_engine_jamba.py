"""Jamba end to end (``pagedkv.LLM`` on a tiny random Jamba checkpoint; CPU, fp32, torch
reference attention, the mixers' kernels through the Triton interpreter, the sanitizer on every
step): greedy tokens equal transformers' ``generate`` for batches of prompts of different
lengths with prefix caching off (state groups in mode ``none``) and on (mode ``align``), chunked
prefill on a small token budget (decodes mixed with prompt chunks), preemption on a small pool
(recomputed from a zeroed state), prefix hits resumed from the state checkpoint at a block
boundary (seen in the engine's stats)."""

import os
import sys

import pytest
from engine_helpers import (
    TEXTS,
    check_bf16_teacher_forced,
    check_greedy,
    log_scheduled_steps,
    make_llm,
)

from pagedkv.core.spec import FullAttentionSpec, MambaCacheMode, MambaSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
from jamba_helpers import build_tiny_jamba  # noqa: E402

LONG = TEXTS[3]


@pytest.fixture(scope="module")
def jamba(tiny_cache):
    return build_tiny_jamba(tiny_cache)


def _state_modes(llm):
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec) for g in groups]
    assert kinds.count(MambaSpec) == 3 and kinds.count(FullAttentionSpec) == 1
    return {g.kv_cache_spec.mamba_cache_mode for g in groups
            if isinstance(g.kv_cache_spec, MambaSpec)}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_batched_greedy_matches_transformers(jamba, hf_ref, prefix_caching):
    llm = make_llm(jamba, enable_prefix_caching=prefix_caching)
    assert _state_modes(llm) == {MambaCacheMode.ALIGN if prefix_caching else MambaCacheMode.NONE}
    outs = check_greedy(llm, hf_ref(jamba), TEXTS, 10)
    assert len({len(o.prompt_token_ids) for o in outs}) == len(TEXTS)


def test_chunked_prefill_mixes_decodes_and_chunks(jamba, hf_ref):
    llm = make_llm(jamba, max_num_batched_tokens=16, max_num_seqs=4, enable_prefix_caching=False)
    steps = log_scheduled_steps(llm.scheduler)
    check_greedy(llm, hf_ref(jamba), [LONG, TEXTS[2], TEXTS[1], TEXTS[0]], 10)
    assert all(sum(s.values()) <= 16 for s in steps)
    # some step mixed decode tokens with a prompt chunk; the long prompt took several chunks
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)
    assert sum(1 for s in steps if s.get("0", 0) > 1) >= 6


def test_preemption_with_a_small_pool(jamba, hf_ref):
    # 12 blocks of 32 tokens (the null block, 3 state blocks per request): each request fits
    # alone, the four together do not
    n = 24
    llm = make_llm(jamba, num_gpu_blocks_override=12, max_model_len=192,
                   kv_cache_memory_bytes=None, enable_prefix_caching=False)
    check_greedy(llm, hf_ref(jamba), TEXTS, n)
    assert llm.get_kv_stats()["preemptions"] > 0


def test_prefix_hit_resumes_from_the_state_checkpoint(jamba, hf_ref):
    """Block-aligned chunks (the token budget is one block) leave state checkpoints at the
    block boundaries; later prompts sharing the long prompt's first blocks resume from them."""
    llm = make_llm(jamba, max_num_batched_tokens=32, max_num_seqs=4)
    block = llm.get_kv_stats()["block_size"]
    assert block == 32 and _state_modes(llm) == {MambaCacheMode.ALIGN}
    ref = hf_ref(jamba)
    check_greedy(llm, ref, [LONG], 10)
    assert llm.get_kv_stats()["prefix_cache_hits"] == 0
    check_greedy(llm, ref, [LONG + " And more after the shared part.", LONG[:70]], 10)
    assert llm.get_kv_stats()["prefix_cache_hits"] >= 2 * block


def test_prefix_hit_after_chunks_on_a_budget_that_is_not_a_block_multiple(jamba, hf_ref):
    """Align mode on a 40-token budget (blocks of 32): the scheduler cuts prefill chunks to
    block boundaries (vLLM's Mamba-align split), so the cached blocks' states are the states at
    their ends and the hit resumes correctly (without the split, tokens differ)."""
    llm = make_llm(jamba, max_num_batched_tokens=40, max_num_seqs=4)
    ref = hf_ref(jamba)
    check_greedy(llm, ref, [LONG], 10)
    check_greedy(llm, ref, [LONG + " And more after the shared part.", LONG[:70]], 10)
    assert llm.get_kv_stats()["prefix_cache_hits"] > 0


# ---- on a CUDA GPU


@pytest.mark.gpu
def test_gpu_fp32_engine_with_cuda_graphs_matches_transformers(jamba, hf_ref):
    """fp32 on the GPU: the Triton attention backend, causal_conv1d and the selective scan
    kernels natively (decode rows through selective_scan_update), the fused-MoE kernel,
    decode CUDA graphs (padded rows skipped by state index -1); greedy tokens equal
    transformers' on the CPU."""
    llm = make_llm(jamba, device="cuda", attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=64)
    check_greedy(llm, hf_ref(jamba), TEXTS + TEXTS[:3], 16)
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("variant", [{}, dict(num_hidden_layers=2, attn_layer_period=2,
                                              attn_layer_offset=1, expert_layer_period=1,
                                              expert_layer_offset=0)])
def test_gpu_bf16_teacher_forced_top1(tiny_cache, variant):
    """bf16 on the GPU (Triton attention, native kernels, CUDA graphs) against transformers
    in bf16 on the GPU fed our own tokens: the fraction of our greedy tokens that are
    transformers' top-1 (printed; at least 0.9), every token within a logit margin of 1.0 of
    its top-1 (MoE routing near-ties flip under one bf16 rounding)."""
    path = build_tiny_jamba(tiny_cache, dtype="bfloat16", **variant)
    llm = make_llm(path, device="cuda", dtype="bfloat16", attention_backend="triton",
                   max_num_seqs=8, max_num_batched_tokens=64)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 100)]
    check_bf16_teacher_forced(llm, path, prompts, f"jamba {variant or 'default'}")
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0
