"""Mixture-of-experts models end to end (Qwen3-MoE and Mixtral; CPU, fp32, torch reference
attention, the sanitizer on every step): greedy tokens equal transformers' ``generate`` for
batches of prompts of different lengths, with chunked prefill on a small token budget, prefix
hits, preemption on a small pool, block sizes 16 and 32, dense layers between sparse ones
(``mlp_only_layers`` / ``decoder_sparse_step``), ``norm_topk_prob``, the stacked-experts
checkpoint layout, Mixtral's sliding window, and the Triton attention backend with the fused
q/k-norm + RoPE + KV-write kernel (interpreted)."""

import os

import pytest
from engine_helpers import TEXTS, log_scheduled_steps, make_llm, pool_is_idle

from pagedkv import SamplingParams
from pagedkv.models.moe_decoder import MoeDecoderLayer

MOE = ["qwen3_moe", "mixtral"]
VARIANTS = {
    "qwen3_moe": {},
    "mixtral": {},
    # layers 0 and 2 dense, 1 sparse; renormalized top-k; 4 experts, top-3
    "qwen3_moe-dense-layers": dict(num_layers=3, decoder_sparse_step=2, norm_topk_prob=True,
                                   num_experts=4, num_experts_per_tok=3),
    "qwen3_moe-mlp-only": dict(num_layers=3, mlp_only_layers=(0,), attention_bias=True),
    "mixtral-stacked-experts": dict(save_original_format=False, num_experts=4),
}


def greedy(n=12):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def check(llm, ref, prompts, n=12):
    outs = llm.generate(prompts, greedy(n), use_tqdm=False)
    for o in outs:
        assert o.outputs[0].token_ids == ref.greedy(o.prompt_token_ids, n), \
            f"prompt of {len(o.prompt_token_ids)} tokens"
        assert o.finished and o.outputs[0].finish_reason == "length"
    assert pool_is_idle(llm)
    return outs


def _variant(tiny_dir, name):
    return tiny_dir(name.split("-")[0], **VARIANTS[name])


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_batched_greedy_matches_transformers(tiny_dir, hf_ref, name):
    path = _variant(tiny_dir, name)
    llm = make_llm(path)
    model = llm.engine.model
    cfg = model.config
    assert [isinstance(layer, MoeDecoderLayer) for layer in model.layers] == list(cfg.moe.sparse_layers)
    outs = check(llm, hf_ref(path), TEXTS)
    assert [o.prompt for o in outs] == TEXTS
    assert len({len(o.prompt_token_ids) for o in outs}) == len(TEXTS)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("family", MOE)
def test_chunked_prefill_prefix_hits_and_block_sizes(tiny_dir, hf_ref, family, block_size):
    path = tiny_dir(family)
    ref = hf_ref(path)
    llm = make_llm(path, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=4)
    steps = log_scheduled_steps(llm.scheduler)
    long = TEXTS[3]
    check(llm, ref, [long, TEXTS[2], long + " And more after the shared part.", TEXTS[1]])
    assert all(sum(s.values()) <= 16 for s in steps)
    # some step mixed decode tokens with a prompt chunk
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)
    assert llm.get_kv_stats()["block_size"] == block_size
    assert llm.get_kv_stats()["prefix_cache_hits"] >= block_size


@pytest.mark.parametrize("family", MOE)
def test_preemption_with_a_small_pool(tiny_dir, hf_ref, family):
    path = tiny_dir(family)
    n = 40
    llm = make_llm(path, num_gpu_blocks_override=13, max_model_len=192, kv_cache_memory_bytes=None)
    outs = check(llm, hf_ref(path), TEXTS, n)
    stats = llm.get_kv_stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]


def test_mixtral_sliding_window(tiny_dir, hf_ref):
    """Mixtral's sliding_window (every layer, as Mistral): one sliding-window group; prompts
    longer than the window, chunks crossing it."""
    path = tiny_dir("mixtral", sliding_window=8)
    llm = make_llm(path, block_size=16, max_num_batched_tokens=16)
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    assert [type(g.kv_cache_spec).__name__ for g in groups] == ["SlidingWindowSpec"]
    check(llm, hf_ref(path), TEXTS, 16)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
def test_triton_backend_and_fused_kv_write(tiny_dir, hf_ref):
    path = tiny_dir("qwen3_moe")
    llm = make_llm(path, attention_backend="triton", max_num_batched_tokens=16, max_num_seqs=4)
    model = llm.engine.model
    assert model.fused_kv_write_usable(llm.engine.runner.kv_caches[0])
    check(llm, hf_ref(path), TEXTS[:3], 8)
