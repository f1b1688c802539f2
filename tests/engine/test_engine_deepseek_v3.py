"""DeepSeek-V3 end to end (CPU, fp32, the torch reference MLA backend, the sanitizer on every
step): greedy tokens equal transformers' ``generate`` for batches of prompts of different
lengths, with chunked prefill on a small token budget, prefix hits, preemption on a small
pool, block sizes 16 and 32, the model variants (plain q_proj and halves RoPE, YaRN with mscale
and attention bias, three layers with four groups and two shared experts, the stacked experts
layout); the runner holds one MLA group of latent tensors sized by their page; block zeroing
and copies on the latent layout; the Triton MLA backend (the latent decode kernel, interpreted
on CPU); on a GPU (not run here): fp32 tokens with decode CUDA graphs."""

import os

import pytest
import torch
from engine_helpers import TEXTS, check_greedy, log_scheduled_steps, make_llm

from pagedkv.attention.mla_torch_ref import TorchRefMLABackend
from pagedkv.attention.mla_triton_backend import TritonMLABackend
from pagedkv.config import SchedulerConfig
from pagedkv.core.output import SchedulerOutput
from pagedkv.core.spec import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec
from pagedkv.models.loader import load_checkpoint
from pagedkv.worker.model_runner import ModelRunner, attention_layer_names, kv_cache_spec_for

VARIANTS = {
    "default": {},
    "q-proj-halves": dict(q_lora_rank=None, rope_interleave=False),
    "yarn-bias": dict(attention_bias=True, max_position_embeddings=256,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64, "mscale": 1.0,
                                    "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
    "3-layers-no-norm": dict(num_layers=3, norm_topk_prob=False, n_group=4, topk_group=2,
                             n_shared_experts=2, routed_scaling_factor=1.0),
    "stacked-experts": dict(save_original_format=False),
}


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_batched_greedy_matches_transformers(tiny_dir, hf_ref, name):
    path = tiny_dir("deepseek_v3", **VARIANTS[name])
    llm = make_llm(path)
    model = llm.engine.model
    assert isinstance(model.attn_backend, TorchRefMLABackend)
    assert [layer.sparse for layer in model.layers] == list(model.config.moe.sparse_layers)
    outs = check_greedy(llm, hf_ref(path), TEXTS, 12)
    assert [o.prompt for o in outs] == TEXTS
    assert len({len(o.prompt_token_ids) for o in outs}) == len(TEXTS)


def test_runner_holds_one_latent_group_sized_by_its_page(tiny_dir):
    llm = make_llm(tiny_dir("deepseek_v3"), kv_cache_memory_bytes=1 << 20)
    cfg = llm.engine.model.config
    (group,) = llm.scheduler.kv_cache_config.kv_cache_groups
    spec = group.kv_cache_spec
    assert spec == MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=cfg.mla.latent_dim,
                                    dtype="float32")
    caches = llm.engine.runner.kv_caches
    s = llm.kv_cache_sizing
    assert [tuple(t.shape) for t in caches] == [(s.num_blocks, 16, cfg.mla.latent_dim)] * len(caches)
    # one latent (no V) per token and layer
    assert s.bytes_per_block == len(caches) * 16 * cfg.mla.latent_dim * 4 == len(caches) * spec.page_size_bytes
    assert s.num_blocks == (1 << 20) // s.bytes_per_block
    assert sum(t.numel() * t.element_size() for t in caches) == s.kv_cache_bytes


@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_prefix_hits_and_block_sizes(tiny_dir, hf_ref, block_size):
    path = tiny_dir("deepseek_v3")
    ref = hf_ref(path)
    llm = make_llm(path, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=4)
    steps = log_scheduled_steps(llm.scheduler)
    long = TEXTS[3]
    prompts = [long, TEXTS[2], long + " And more after the shared part.", TEXTS[1]]
    check_greedy(llm, ref, prompts, 12)
    assert all(sum(s.values()) <= 16 for s in steps)
    # some step mixed decode tokens with a prompt chunk
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)
    assert llm.get_kv_stats()["block_size"] == block_size
    assert llm.get_kv_stats()["prefix_cache_hits"] >= block_size


def test_preemption_with_a_small_pool(tiny_dir, hf_ref):
    path = tiny_dir("deepseek_v3")
    n = 40
    llm = make_llm(path, num_gpu_blocks_override=13, max_model_len=192, kv_cache_memory_bytes=None)
    outs = check_greedy(llm, hf_ref(path), TEXTS, n)
    stats = llm.get_kv_stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]


def test_block_zeroing_and_copy_on_write_on_latent_caches(tiny_dir):
    model = load_checkpoint(tiny_dir("deepseek_v3"), dtype="float32").model
    spec = kv_cache_spec_for(model, 16)
    assert isinstance(spec, MLAAttentionSpec)
    kv = KVCacheConfig(num_blocks=8, kv_cache_groups=(
        KVCacheGroupSpec(attention_layer_names(len(model.layers)), spec),))
    runner = ModelRunner(model, kv, SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16,
                                                    max_model_len=64))
    for t in runner.kv_caches:
        t.normal_()
    before = [t.clone() for t in runner.kv_caches]
    so = SchedulerOutput.make_empty()
    so.new_block_ids_to_zero = [3, 5]
    so.kv_cache_block_copies = [(1, 4)]
    runner.execute_model(so)
    for t, b in zip(runner.kv_caches, before):
        assert torch.all(t[[3, 5]] == 0)
        assert torch.equal(t[4], b[1])
        keep = [0, 1, 2, 6, 7]
        assert torch.equal(t[keep], b[keep])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
def test_triton_mla_backend(tiny_dir, hf_ref, monkeypatch):
    """attention_backend="triton": decodes through the latent kernel (counted), prefill chunks
    through the up-projected path; tokens equal transformers'."""
    import pagedkv.attention.mla_triton_backend as tb

    calls = []
    inner = tb.mla_decode_attention

    def counted(*args, **kw):
        calls.append(args[5])
        return inner(*args, **kw)

    monkeypatch.setattr(tb, "mla_decode_attention", counted)
    path = tiny_dir("deepseek_v3")
    llm = make_llm(path, attention_backend="triton", max_num_batched_tokens=16, max_num_seqs=4)
    assert isinstance(llm.engine.model.attn_backend, TritonMLABackend)
    check_greedy(llm, hf_ref(path), TEXTS[:3], 8)
    assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default", "yarn-bias"])
def test_gpu_fp32_engine_with_cuda_graphs_matches_transformers(tiny_dir, hf_ref, name):
    """fp32 on the GPU: the Triton MLA backend, decode CUDA graphs, the fused-MoE kernel;
    greedy tokens equal transformers' on the CPU."""
    path = tiny_dir("deepseek_v3", **VARIANTS[name])
    llm = make_llm(path, device="cuda", attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=64)
    assert isinstance(llm.engine.model.attn_backend, TritonMLABackend)
    check_greedy(llm, hf_ref(path), TEXTS + TEXTS[:3], 16)
    assert llm.get_kv_stats()["cuda_graph_steps"] > 0
