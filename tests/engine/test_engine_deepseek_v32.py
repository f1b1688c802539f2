"""DeepSeek-V3.2 (DSA) end to end (CPU, fp32, the DSA torch twins, the sanitizer on every
step): greedy tokens equal transformers' ``generate`` for batches of prompts of different
lengths, chunked prefill on a small token budget, prefix hits, preemption on a small pool,
block sizes 16 and 32, model variants; the runner holds the latent and the indexer caches as
two cache layers per layer in one UniformTypeKVCacheSpecs group (byte slots of their own page
sizes); the step check of the indexer channel during real runs: every token's top-k holds
exactly ``min(topk, p + 1)`` positions ``<= p`` of its own request, in blocks the scheduler
gave that request, and they are the best-scoring positions when the scores are recomputed in
float64 from the indexer cache; the Triton kernels (interpreted on CPU); on a GPU (not run
here): fp32 and bf16 tokens."""

import os

import pytest
import torch
from engine_helpers import TEXTS, check_greedy, log_scheduled_steps, make_llm

from pagedkv.attention.mla_sparse import DSABackend
from pagedkv.config import SchedulerConfig
from pagedkv.core.spec import KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec, UniformTypeKVCacheSpecs
from pagedkv.errors import ConfigError
from pagedkv.models.loader import load_checkpoint
from pagedkv.worker.model_runner import ModelRunner, kv_cache_groups_for

VARIANTS = {
    "default": {},
    "yarn-bias": dict(attention_bias=True, index_topk=5, index_n_heads=12, index_head_dim=24,
                      max_position_embeddings=256,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64, "mscale": 1.0,
                                    "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
    "3-layers": dict(num_layers=3, index_topk=12, n_group=4, topk_group=2),
}


class TopkCheck:
    """Wraps the engine's ``DSABackend.index_topk``: after every call (the step's keys are
    written), each real token's selection is checked against the scheduler's blocks of its
    request and against float64 scores recomputed from the indexer cache."""

    def __init__(self, llm):
        self.llm = llm
        backend = llm.engine.model.attn_backend
        assert isinstance(backend, DSABackend)
        self.inner = backend.index_topk
        backend.index_topk = self
        self.calls = self.tokens = self.sparse = 0

    def __call__(self, q, weights, keys, index_cache, plan, topk, scale):
        out = self.inner(q, weights, keys, index_cache, plan, topk, scale)
        self.calls += 1
        runner, manager = self.llm.engine.runner, self.llm.scheduler.kv_cache_manager
        req, pos = plan.token_rows(q.shape[0])
        table = plan.metadata.block_table_tensor
        bs = index_cache.shape[1]
        for t in range(q.shape[0]):
            r, p = int(req[t]), int(pos[t])
            row = out[t].tolist()
            if r < 0:
                assert all(v == -1 for v in row)
                continue
            k = min(topk, p + 1)
            sel = row[:k]
            assert all(v == -1 for v in row[k:]) and len(set(sel)) == k
            assert all(0 <= v <= p for v in sel)
            # the positions' blocks belong to this token's request (the scheduler's view)
            owned = set(manager.get_block_ids(runner.input_batch.req_ids[r])[0])
            blocks = [int(table[r, v // bs]) for v in range(p + 1)]
            assert set(blocks) <= owned and 0 not in blocks
            # the selection is the top-k of the float64 scores from the cache
            keys_r = torch.stack([index_cache[b, v % bs] for v, b in enumerate(blocks)]).double()
            s = (torch.relu(q[t].double() @ keys_r.T * scale) * weights[t, :, None].double()).sum(0)
            chosen = torch.zeros(p + 1, dtype=torch.bool)
            chosen[sel] = True
            if k < p + 1:
                assert float(s[chosen].min()) >= float(s[~chosen].max()) - 1e-6
                self.sparse += 1
            self.tokens += 1
        return out


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_batched_greedy_matches_transformers(tiny_dir, hf_ref, name):
    path = tiny_dir("deepseek_v32", **VARIANTS[name])
    llm = make_llm(path)
    model = llm.engine.model
    assert type(model).__name__ == "DeepseekV32ForCausalLM"
    assert isinstance(model.attn_backend, DSABackend) and model.attn_backend.kernels == "ref"
    steps = TopkCheck(llm)
    outs = check_greedy(llm, hf_ref(path), TEXTS, 12)
    assert len({len(o.prompt_token_ids) for o in outs}) == len(TEXTS)
    assert steps.calls and steps.sparse > 20  # tokens whose top-k drops positions


def test_runner_holds_latent_and_indexer_caches_in_one_group(tiny_dir):
    llm = make_llm(tiny_dir("deepseek_v32"), kv_cache_memory_bytes=1 << 20)
    cfg = llm.engine.model.config
    runner = llm.engine.runner
    (group,) = runner.kv_cache_config.kv_cache_groups
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    latent = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=cfg.mla.latent_dim,
                              dtype="float32")
    keys = MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=cfg.indexer.head_dim,
                            dtype="float32")
    assert group.layer_spec("model.layers.1.self_attn") == latent
    assert group.layer_spec("model.layers.1.self_attn.indexer") == keys
    # the scheduler manages one full-attention-like group (the representative member)
    (sched_group,) = llm.scheduler.kv_cache_config.kv_cache_groups
    assert sched_group.kv_cache_spec == latent
    s = llm.kv_cache_sizing
    caches = runner.kv_caches
    layers = cfg.num_hidden_layers
    assert [tuple(t.shape) for t in caches] == [(s.num_blocks, 16, cfg.mla.latent_dim),
                                                (s.num_blocks, 16, cfg.indexer.head_dim)] * layers
    # a block id's bytes: every layer's latent page and indexer-key page
    assert s.bytes_per_block == layers * 16 * (cfg.mla.latent_dim + cfg.indexer.head_dim) * 4
    assert s.num_blocks == (1 << 20) // s.bytes_per_block
    assert len({t.untyped_storage().data_ptr() for t in caches}) == len(caches)


def test_runner_checks_member_specs(tiny_dir):
    """The runner accepts the group of member specs and names a layer whose member spec is
    not the one the model declares."""
    model = load_checkpoint(tiny_dir("deepseek_v32"), dtype="float32").model
    (group,) = kv_cache_groups_for(model, 16)
    sc = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64)
    ModelRunner(model, KVCacheConfig(num_blocks=8, kv_cache_groups=(group,)), sc)
    members = dict(group.kv_cache_spec.specs)
    members["model.layers.0.self_attn.indexer"] = MLAAttentionSpec(16, num_kv_heads=1,
                                                                   head_size=8, dtype="float32")
    bad = KVCacheGroupSpec(group.layer_names, UniformTypeKVCacheSpecs(
        block_size=16, specs=tuple((n, members[n]) for n in group.layer_names)))
    with pytest.raises(ConfigError, match="model.layers.0.self_attn.indexer"):
        ModelRunner(model, KVCacheConfig(num_blocks=8, kv_cache_groups=(bad,)), sc)


@pytest.mark.parametrize("block_size", [16, 32])
def test_chunked_prefill_prefix_hits_and_block_sizes(tiny_dir, hf_ref, block_size):
    path = tiny_dir("deepseek_v32")
    llm = make_llm(path, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=4)
    steps = log_scheduled_steps(llm.scheduler)
    topk = TopkCheck(llm)
    long = TEXTS[3]
    prompts = [long, TEXTS[2], long + " And more after the shared part.", TEXTS[1]]
    check_greedy(llm, hf_ref(path), prompts, 12)
    assert all(sum(s.values()) <= 16 for s in steps)
    assert any(1 in s.values() and max(s.values()) > 1 for s in steps)
    assert llm.get_kv_stats()["prefix_cache_hits"] >= block_size
    assert topk.sparse > 0


def test_preemption_with_a_small_pool(tiny_dir, hf_ref):
    path = tiny_dir("deepseek_v32")
    n = 40
    llm = make_llm(path, num_gpu_blocks_override=13, max_model_len=192, kv_cache_memory_bytes=None)
    topk = TopkCheck(llm)
    outs = check_greedy(llm, hf_ref(path), TEXTS, n)
    stats = llm.get_kv_stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]
    assert topk.sparse > 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on CPU tensors need the Triton interpreter")
def test_triton_kernels_in_the_engine(tiny_dir, hf_ref, monkeypatch):
    """attention_backend="triton" maps to the DSA kernels ("auto": CUDA tensors only); forced
    to "kernel" here, the interpreted indexer-score and sparse-attention kernels serve every
    step (counted); tokens equal transformers'."""
    import pagedkv.attention.mla_sparse as ms

    calls = []
    inner = ms.sparse_mla_attention

    def counted(*args, **kw):
        calls.append(args[0].shape[0])
        return inner(*args, **kw)

    monkeypatch.setattr(ms, "sparse_mla_attention", counted)
    path = tiny_dir("deepseek_v32")
    llm = make_llm(path, attention_backend="triton", max_num_batched_tokens=16, max_num_seqs=4)
    backend = llm.engine.model.attn_backend
    assert isinstance(backend, DSABackend) and backend.kernels == "auto"
    backend.kernels = "kernel"
    check_greedy(llm, hf_ref(path), TEXTS[:3], 8)
    assert calls


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["default", "yarn-bias"])
def test_gpu_fp32_engine_matches_transformers(tiny_dir, hf_ref, name):
    """fp32 on the GPU: the DSA Triton kernels (indexer scores, sparse latent attention), the
    fused-MoE kernel; greedy tokens equal transformers' on the CPU."""
    path = tiny_dir("deepseek_v32", **VARIANTS[name])
    llm = make_llm(path, device="cuda", attention_backend="triton", max_num_seqs=8,
                   max_num_batched_tokens=64)
    backend = llm.engine.model.attn_backend
    assert isinstance(backend, DSABackend) and backend.kernels == "auto"
    check_greedy(llm, hf_ref(path), TEXTS + TEXTS[:3], 16)
