"""Bamba and Falcon-H1 end to end (CPU, fp32, the torch reference attention, Triton kernels
interpreted, the sanitizer on every step): greedy tokens of ``pagedkv.LLM`` equal
transformers' ``generate`` for batches of prompts of different lengths, with chunked prefill
on a small token budget (prefill chunks beside decode rows), prefix caching in mode ``align``
(a request sharing a long prefix resumes from the state checkpoint of a block boundary: a
prefix hit, same tokens) and off (mode ``none``: one state block per request covering
``max_model_len``), preemption on a small pool (recomputation); the engine's KV-cache groups:
state groups of ``MambaSpec`` beside the attention group, the attention block raised to hold
a state page. On a GPU (not run here): bf16 parity (teacher-forced top-1 agreement) and fp32
tokens with decode CUDA graphs."""

import pytest
from engine_helpers import (
    needs_reference_transformers,
    TEXTS,
    check_bf16_teacher_forced,
    check_greedy,
    greedy,
    log_scheduled_steps,
    make_llm,
)

from pagedkv.core.spec import FullAttentionSpec, MambaCacheMode, MambaSpec

FAMILIES = {
    "bamba": dict(num_layers=3),
    "bamba-biases": dict(num_layers=2, tie_word_embeddings=True, mamba_options={
        "mamba_proj_bias": True, "mamba_n_groups": 1, "mamba_conv_bias": False,
        "mamba_d_conv": 3, "attn_layer_indices": [0], "mlp_bias": True, "attention_bias": True}),
    "falcon_h1": dict(),
    "falcon_h1-multipliers": dict(head_dim=8, mamba_options={
        "mamba_rms_norm": True, "mamba_norm_before_gate": False, "mamba_d_ssm": 96,
        "mamba_proj_bias": True, "projectors_bias": True, "mamba_n_groups": 1,
        "embedding_multiplier": 0.8, "lm_head_multiplier": 1.3, "attention_in_multiplier": 0.9,
        "attention_out_multiplier": 1.1, "key_multiplier": 0.7, "ssm_in_multiplier": 1.2,
        "ssm_out_multiplier": 0.6, "ssm_multipliers": [0.9, 1.1, 0.8, 1.2, 0.7],
        "mlp_multipliers": [1.3, 0.7]}),
}


def checkpoint(tiny_dir, name):
    return tiny_dir(name.split("-")[0], **FAMILIES[name])


def state_groups(llm):
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    return [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_batched_greedy_matches_transformers(tiny_dir, hf_ref, name):
    path = checkpoint(tiny_dir, name)
    llm = make_llm(path)
    model = llm.engine.model
    assert type(model).__name__ == ("FalconH1ForCausalLM" if name.startswith("falcon")
                                    else "BambaForCausalLM")
    outs = check_greedy(llm, hf_ref(path), TEXTS, 10)
    assert len({len(o.prompt_token_ids) for o in outs}) == len(TEXTS)
    # every mixer in a state group, every attention layer in an attention group
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    names = {n: type(g.kv_cache_spec) for g in groups for n in g.layer_names}
    want = {n: MambaSpec if n.endswith(".mamba") else FullAttentionSpec
            for n in model.kv_cache_specs(16)}
    assert {n: (MambaSpec if issubclass(t, MambaSpec) else FullAttentionSpec)
            for n, t in names.items()} == want


@pytest.mark.parametrize("name", ["bamba", "falcon_h1"])
def test_chunked_prefill_and_prefix_hits_in_align_mode(tiny_dir, hf_ref, name):
    path = checkpoint(tiny_dir, name)
    ref = hf_ref(path)
    llm = make_llm(path, max_num_batched_tokens=16, max_num_seqs=4)
    spec = state_groups(llm)[0].kv_cache_spec
    block = llm.get_kv_stats()["block_size"]
    assert spec.mamba_cache_mode == MambaCacheMode.ALIGN and spec.block_size == block
    # the attention block grew to hold a state page
    attn = next(g.kv_cache_spec for g in llm.scheduler.kv_cache_config.kv_cache_groups
                if isinstance(g.kv_cache_spec, FullAttentionSpec))
    assert attn.block_size == block > 16 and attn.page_size_bytes >= spec.state_bytes
    steps = log_scheduled_steps(llm.scheduler)
    long = TEXTS[3]
    prompts = [long, TEXTS[2], long + " And more after the shared part.", TEXTS[1]]
    check_greedy(llm, ref, prompts, 10)
    assert all(sum(s.values()) <= 16 for s in steps)
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)  # decodes beside chunks
    hits = llm.get_kv_stats()["prefix_cache_hits"]
    assert hits >= block, hits
    # the same prompt again: a hit, the same tokens
    check_greedy(llm, ref, [long + " And more after the shared part."], 10)
    assert llm.get_kv_stats()["prefix_cache_hits"] >= hits + block


def test_align_mode_hit_after_a_chunk_across_a_block_boundary(tiny_dir, hf_ref):
    path = checkpoint(tiny_dir, "bamba")
    ref = hf_ref(path)
    llm = make_llm(path, max_num_batched_tokens=16, max_num_seqs=4)
    steps = log_scheduled_steps(llm.scheduler)
    long = TEXTS[3]
    # a short request decoding beside the long prompt: the prompt's chunks are 14 + 15 + 15
    # tokens, then the one that would cross the 48-token block boundary (13 tokens) ends on it
    # (vLLM's Mamba-align split), so the block's checkpoint is the state after token 48
    llm.generate([TEXTS[0], long], [greedy(30), greedy(2)], use_tqdm=False)
    assert [s.get("1") for s in steps[:5]] == [14, 15, 15, 4, 9]
    hits = llm.get_kv_stats()["prefix_cache_hits"]
    check_greedy(llm, ref, [long + " And more after the shared part."], 10)
    assert llm.get_kv_stats()["prefix_cache_hits"] == hits + 48


@pytest.mark.parametrize("name", ["bamba", "falcon_h1-multipliers"])
def test_prefix_caching_off_mode_none(tiny_dir, hf_ref, name):
    path = checkpoint(tiny_dir, name)
    llm = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=24, max_model_len=128)
    for g in state_groups(llm):
        assert g.kv_cache_spec.mamba_cache_mode == MambaCacheMode.NONE
        assert g.kv_cache_spec.block_size == 128  # one state block covers max_model_len
    check_greedy(llm, hf_ref(path), TEXTS + [TEXTS[3]], 10)
    assert llm.get_kv_stats()["prefix_cache_hits"] == 0


@pytest.mark.parametrize("prefix,blocks", [(True, 12), (False, 10)])
def test_preemption_with_a_small_pool(tiny_dir, hf_ref, prefix, blocks):
    path = checkpoint(tiny_dir, "bamba")
    n = 40
    llm = make_llm(path, num_gpu_blocks_override=blocks, max_model_len=144,
                   kv_cache_memory_bytes=None, enable_prefix_caching=prefix)
    outs = check_greedy(llm, hf_ref(path), TEXTS, n)
    stats = llm.get_kv_stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bamba", "falcon_h1-multipliers"])
def test_gpu_engine_equals_the_cpu_engine(tiny_dir, name):
    """fp32 on the GPU (Triton attention, the Mamba-2 kernels natively, decode CUDA graphs)
    gives the CPU engine's greedy tokens (the CPU engine equals transformers 5.24's, tested
    above), whatever transformers the GPU machine has."""
    from pagedkv import SamplingParams

    path = checkpoint(tiny_dir, name)
    p = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = TEXTS + TEXTS[:3]
    want = [o.outputs[0].token_ids for o in make_llm(path).generate(prompts, p, use_tqdm=False)]
    llm = make_llm(path, device="cuda", attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=64)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, p, use_tqdm=False)]
    assert got == want
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0


@pytest.mark.gpu
@needs_reference_transformers
@pytest.mark.parametrize("name", ["bamba", "falcon_h1-multipliers"])
def test_gpu_fp32_engine_with_cuda_graphs_matches_transformers(tiny_dir, hf_ref, name):
    """fp32 on the GPU: the Triton attention backend, the Mamba-2 kernels natively, decode
    CUDA graphs (padded rows skipped by state index -1); greedy tokens equal transformers' on
    the CPU."""
    path = checkpoint(tiny_dir, name)
    llm = make_llm(path, device="cuda", attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=64)
    check_greedy(llm, hf_ref(path), TEXTS + TEXTS[:3], 16)
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0


@pytest.mark.gpu
@needs_reference_transformers
@pytest.mark.parametrize("name", ["bamba", "falcon_h1-multipliers"])
def test_gpu_bf16_teacher_forced_top1(tiny_dir, name):
    """bf16 on the GPU (Triton attention, native Mamba-2 kernels, CUDA graphs) against
    transformers in bf16 on the GPU fed our own tokens: the fraction of our greedy tokens that
    are transformers' top-1 (printed; at least 0.9), and every token within a small logit
    margin (1.0) of its top-1."""
    path = checkpoint(tiny_dir, name)
    llm = make_llm(path, device="cuda", dtype="bfloat16", attention_backend="triton",
                   max_num_seqs=8, max_num_batched_tokens=64)
    check_bf16_teacher_forced(llm, path, TEXTS, name)
