"""Qwen3-Next end to end (CPU, fp32, the torch reference attention, the sanitizer on every step):
greedy tokens of ``pagedkv.LLM`` equal transformers' ``generate`` for batches of prompts of
different lengths (3 checkpoint variants), with chunked prefill on a small token budget
(prefill chunks beside decode rows), prefix caching in mode ``align`` (a request sharing a
long prefix resumes from the state checkpoint of a block boundary: a prefix hit, same tokens)
and off (mode ``none``: one state block per request covering ``max_model_len``), preemption on
a small pool (recomputation, with and without prefix caching); the engine's groups: a state
group per linear-attention layer beside the attention group. The Gated-DeltaNet kernels run as
their torch twins here (``twins``), and once through the Triton interpreter (bf16 on the CPU:
``test_engine_bf16_cpu.py``). On a GPU (not run here): fp32 tokens with decode CUDA graphs and bf16 parity (teacher-forced top-1)."""

import pytest
from engine_helpers import (
    TEXTS,
    check_bf16_teacher_forced,
    check_greedy,
    log_scheduled_steps,
    make_llm,
)

from pagedkv.core.spec import FullAttentionSpec, MambaCacheMode, MambaSpec

VARIANTS = {
    "default": {},  # linear, full; both sparse
    "3-layers-dense-bias": dict(num_layers=3, mlp_only_layers=(2,),
                                linear_options={"attention_bias": True}),
    "4-layers-stacked": dict(num_layers=4, decoder_sparse_step=2, save_original_format=False,
                             linear_options={"linear_conv_kernel_dim": 3}),
}


@pytest.fixture
def twins(monkeypatch):
    """The mixer's kernels as their torch twins (tested against the kernels elsewhere)."""
    import pagedkv.models.gated_deltanet as gd
    from pagedkv.kernels import causal_conv1d as cc
    from pagedkv.kernels import gated_delta_rule as gdr

    monkeypatch.setattr(gd, "causal_conv1d", cc.causal_conv1d_ref)
    monkeypatch.setattr(gd, "chunk_gated_delta_rule", gdr.chunk_gated_delta_rule_ref)
    monkeypatch.setattr(gd, "recurrent_gated_delta_rule", gdr.recurrent_gated_delta_rule_ref)


def groups_of(llm):
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    state = [g for g in groups if isinstance(g.kv_cache_spec, MambaSpec)]
    attn = [g for g in groups if isinstance(g.kv_cache_spec, FullAttentionSpec)]
    assert len(state) + len(attn) == len(groups)
    return state, attn


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_batched_greedy_matches_transformers(tiny_dir, hf_ref, twins, name):
    path = tiny_dir("qwen3_next", **VARIANTS[name])
    llm = make_llm(path)
    model = llm.engine.model
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    outs = check_greedy(llm, hf_ref(path), TEXTS, 12)
    assert len({len(o.prompt_token_ids) for o in outs}) == len(TEXTS)
    state, attn = groups_of(llm)
    assert sorted(n for g in state for n in g.layer_names) == sorted(
        n for n in model.kv_cache_specs(16) if n.endswith(".linear_attn"))
    assert sorted(n for g in attn for n in g.layer_names) == sorted(
        n for n in model.kv_cache_specs(16) if n.endswith(".self_attn"))


def align_llm(path):
    llm = make_llm(path, max_num_batched_tokens=16, max_num_seqs=4)
    state, attn = groups_of(llm)
    spec, block = state[0].kv_cache_spec, llm.get_kv_stats()["block_size"]
    assert spec.mamba_cache_mode == MambaCacheMode.ALIGN and spec.block_size == block
    # the attention block grew to hold a state page (conv 3 x 128 + recurrent 4 x 16 x 16 fp32)
    assert spec.state_bytes == 4 * (3 * 128 + 4 * 16 * 16)
    assert attn[0].kv_cache_spec.block_size == block > 16
    assert attn[0].kv_cache_spec.page_size_bytes >= spec.state_bytes
    return llm, block


LONG = TEXTS[3]
LONGER = LONG + " And more after the shared part."


def test_prefix_hit_in_align_mode(tiny_dir, hf_ref, twins):
    """One request after the other on a 16-token budget: the second resumes from the first's
    state checkpoint at the 32-token block boundary (its chunks ended there), same tokens."""
    path = tiny_dir("qwen3_next")
    ref = hf_ref(path)
    llm, block = align_llm(path)
    check_greedy(llm, ref, [LONG], 12)
    assert llm.get_kv_stats()["prefix_cache_hits"] == 0
    check_greedy(llm, ref, [LONGER], 12)
    assert llm.get_kv_stats()["prefix_cache_hits"] == block


def test_chunked_prefill_and_prefix_hits_in_align_mode(tiny_dir, hf_ref, twins):
    """Four prompts on a 16-token budget (chunks of several requests share steps, decodes
    beside chunks), two of them sharing a long prefix; then the longer one again: a hit past a
    block whose chunks did not end at its boundary."""
    path = tiny_dir("qwen3_next")
    ref = hf_ref(path)
    llm, block = align_llm(path)
    steps = log_scheduled_steps(llm.scheduler)
    check_greedy(llm, ref, [LONG, TEXTS[2], LONGER, TEXTS[1]], 12)
    assert all(sum(s.values()) <= 16 for s in steps)
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)  # decodes beside chunks
    hits = llm.get_kv_stats()["prefix_cache_hits"]
    assert hits >= block, hits
    # the same prompt again: a hit, the same tokens
    check_greedy(llm, ref, [LONGER], 12)
    assert llm.get_kv_stats()["prefix_cache_hits"] >= hits + block


def test_align_mode_at_pages_of_64(tiny_dir, hf_ref, twins):
    """Pages of 64 (the block size the GPU default was tried at, twenty-seventh session): the
    state page fits, so the attention block stays 64 and the align-mode checkpoints fall every
    64 tokens; the prompts of the GPU bf16 test (5, 40 and 100 tokens) on a 64-token budget,
    chunked across block boundaries, then the longest again (a hit at its 64-token block)."""
    path = tiny_dir("qwen3_next")
    ref = hf_ref(path)
    llm = make_llm(path, block_size=64, max_num_batched_tokens=64, max_num_seqs=8,
                   kv_cache_memory_bytes=8 << 20)
    state, attn = groups_of(llm)
    assert state[0].kv_cache_spec.mamba_cache_mode == MambaCacheMode.ALIGN
    assert state[0].kv_cache_spec.block_size == attn[0].kv_cache_spec.block_size == 64
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 100)]
    check_greedy(llm, ref, prompts, 24)
    assert llm.get_kv_stats()["prefix_cache_hits"] == 0
    check_greedy(llm, ref, prompts[2:], 8)
    assert llm.get_kv_stats()["prefix_cache_hits"] == 64


def test_prefix_caching_off_mode_none(tiny_dir, hf_ref, twins):
    path = tiny_dir("qwen3_next", **VARIANTS["4-layers-stacked"])
    llm = make_llm(path, enable_prefix_caching=False, max_num_batched_tokens=24,
                   max_model_len=128)
    state, _ = groups_of(llm)
    assert sorted(n for g in state for n in g.layer_names) == [
        "model.layers.0.linear_attn", "model.layers.2.linear_attn"]
    for g in state:
        assert g.kv_cache_spec.mamba_cache_mode == MambaCacheMode.NONE
        assert g.kv_cache_spec.block_size == 128  # one state block covers max_model_len
    check_greedy(llm, hf_ref(path), TEXTS + [TEXTS[3]], 12)
    assert llm.get_kv_stats()["prefix_cache_hits"] == 0


@pytest.mark.parametrize("prefix", [True, False])
def test_preemption_with_a_small_pool(tiny_dir, hf_ref, twins, prefix):
    path = tiny_dir("qwen3_next")
    n = 40
    llm = make_llm(path, num_gpu_blocks_override=12, max_model_len=144,
                   kv_cache_memory_bytes=None, enable_prefix_caching=prefix)
    outs = check_greedy(llm, hf_ref(path), TEXTS, n)
    stats = llm.get_kv_stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]


def test_interpreted_kernels_in_the_engine(tiny_dir, hf_ref):
    """The causal conv1d and both gated-delta-rule kernels (Triton interpreter on CPU) in the
    engine: a prompt chunked beside a decoding one."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels on CPU tensors need the Triton interpreter")
    path = tiny_dir("qwen3_next")
    llm = make_llm(path, max_num_batched_tokens=12, max_num_seqs=2)
    check_greedy(llm, hf_ref(path), [TEXTS[0], TEXTS[1]], 4)


# ---- on a CUDA GPU


@pytest.mark.gpu
def test_gpu_fp32_engine_with_cuda_graphs_matches_transformers(tiny_dir, hf_ref):
    """fp32 on the GPU: the Triton attention backend, the Gated-DeltaNet kernels natively,
    the fused-MoE kernel, decode CUDA graphs (padded rows skipped by state index -1); greedy
    tokens equal transformers' on the CPU."""
    path = tiny_dir("qwen3_next")
    llm = make_llm(path, device="cuda", attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=64)
    check_greedy(llm, hf_ref(path), TEXTS + TEXTS[:3], 16)
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0


@pytest.mark.gpu
@pytest.mark.parametrize("name,block_size", [("default", 16), ("4-layers-stacked", None)])
def test_gpu_bf16_teacher_forced_top1(tiny_cache, name, block_size):
    """bf16 on the GPU (Triton attention, native kernels, CUDA graphs) against transformers
    in bf16 on the GPU fed our own tokens: the fraction of our greedy tokens that are
    transformers' top-1 (printed; at least 0.9), every token within a logit margin of 1.0 of
    its top-1 (the MoE bound of test_engine_moe: a near-tie of two experts' router
    probabilities flips under one bf16 rounding). The stacked variant's bound is 1.25: on the
    H200 its decode launches' reduction order alone moves its worst token's margin (the flat
    split: 69/72, 1.078; the per-request split: 70/72, 0.656), while in fp32 on the GPU every
    launch policy gives 72/72 at margin 0.000 (the fp32 test above checks the tokens).

    The default variant runs at pages of 16 (the hybrid spec rounds them up to 48 in bf16), where
    its bound was calibrated; the stacked one at the device's default (64 on CUDA). At pages of 64
    the default variant gave 70/72 with margin 2.297 on the H200 (cab5814 and d69309b: the same
    number twice, so deterministic, and not the staging race fixed in 6b97d13). On the CPU the
    engine at pages of 64 gives these prompts' fp32 tokens exactly (72/72, margin 0, on this
    checkpoint; ``test_align_mode_at_pages_of_64`` checks the same prompts on the fp32 one), and
    transformers' own bf16 greedy tokens score a margin of 1.09 under its fp32 model: bf16
    noise on this tiny model already passes the bound of 1.0 (BENCHMARKS.md, twenty-ninth
    session)."""
    from pagedkv.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint("qwen3_next", tiny_cache, dtype="bfloat16", **VARIANTS[name])
    llm = make_llm(path, device="cuda", dtype="bfloat16", attention_backend="triton",
                   max_num_seqs=8, max_num_batched_tokens=64, block_size=block_size)
    prompts = [list(range(3, 3 + n)) for n in (5, 40, 100)]
    check_bf16_teacher_forced(llm, path, prompts, f"qwen3_next {name}",
                              max_margin=1.25 if name == "4-layers-stacked" else 1.0)
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0
