"""The whole engine (Scheduler + ModelRunner + TorchRefBackend, fp32, CPU) against transformers'
greedy ``generate``: token for token, over batches of prompts of different lengths, for every
family, block sizes 1/16/32, chunked prefill with a small token budget, prefix-cache hits and
preemption with a pool too small for the batch."""

import os

import pytest
from engine_helpers import FAMILIES, TEXTS, make_llm, pool_is_idle

from pagedkv import SamplingParams

NEW = 12


def greedy(n=NEW, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def check_against_hf(ref, outs, n=NEW):
    for o in outs:
        want = ref.greedy(o.prompt_token_ids, n)
        assert o.outputs[0].token_ids == want, f"prompt {o.prompt!r}"
        assert o.outputs[0].finish_reason == "length" and o.finished


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_matches_transformers(tiny_dir, hf_ref, family):
    path = tiny_dir(family)
    llm = make_llm(path)
    outs = llm.generate(TEXTS, greedy(), use_tqdm=False)
    assert [o.prompt for o in outs] == TEXTS  # input order
    assert len({len(o.prompt_token_ids) for o in outs}) == len(TEXTS)  # different lengths
    check_against_hf(hf_ref(path), outs)
    assert pool_is_idle(llm)
    # text is the detokenized output
    tok = llm.tokenizer
    assert outs[1].outputs[0].text == tok.decode(outs[1].outputs[0].token_ids)


@pytest.mark.parametrize("block_size", [1, 32])
def test_block_sizes(tiny_dir, hf_ref, block_size):
    path = tiny_dir("llama")
    llm = make_llm(path, block_size=block_size)
    outs = llm.generate(TEXTS, greedy(), use_tqdm=False)
    check_against_hf(hf_ref(path), outs)
    assert llm.get_kv_stats()["block_size"] == block_size
    assert pool_is_idle(llm)


def test_triton_kernels_at_pages_of_64(tiny_dir, hf_ref):
    """Pages of 64 (tried as the CUDA default in the twenty-seventh session) through the Triton
    kernels (interpreted on CPU): the batch of ``test_balanced_graph_variants_match_eager`` (6
    prompts of 40 tokens, each within one page for its whole run) with the balanced one-range
    decode forced on, then TEXTS; greedy tokens equal transformers'."""
    import dataclasses

    import torch

    from pagedkv.attention.triton_backend import TritonAttentionBackend
    from pagedkv.attention.triton_decode import default_decode_config

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton kernels on CPU tensors need the interpreter")
    path = tiny_dir("qwen3")
    cfg = dataclasses.replace(default_decode_config(torch.device("cpu")),
                              balanced_min_programs_per_sm=0.0, wave_programs_per_sm=1.0)
    llm = make_llm(path, block_size=64, attention_backend=TritonAttentionBackend(decode_config=cfg))
    equal = [[5 + (i * 7 + j) % 300 for j in range(40)] for i in range(6)]
    outs = llm.generate(equal, greedy(), use_tqdm=False) + llm.generate(TEXTS, greedy(), use_tqdm=False)
    check_against_hf(hf_ref(path), outs)
    assert llm.get_kv_stats()["block_size"] == 64
    assert pool_is_idle(llm)


def _record_steps(llm):
    """Wrap the runner so every (scheduled tokens, sampled tokens) pair is kept."""
    runner = llm.runner
    inner = runner.execute_model
    log = []

    def execute_model(so):
        out = inner(so)
        sampled = {rid: out.sampled_token_ids[i] for rid, i in out.req_id_to_index.items()}
        log.append((dict(so.num_scheduled_tokens), sampled))
        return out

    runner.execute_model = execute_model
    return log


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_chunked_prefill_small_budget(tiny_dir, hf_ref, family):
    path = tiny_dir(family)
    llm = make_llm(path, max_num_batched_tokens=16, max_num_seqs=4)
    log = _record_steps(llm)
    outs = llm.generate(TEXTS, greedy(), use_tqdm=False)
    check_against_hf(hf_ref(path), outs)
    assert all(sum(s.values()) <= 16 for s, _ in log)
    # partial prefill chunks were scheduled and sampled nothing
    partial = [(rid, n) for s, sampled in log for rid, n in s.items() if not sampled[rid]]
    assert partial and all(n > 1 for _, n in partial)
    # some step mixed decode tokens with a prompt chunk
    assert any(1 in s.values() and max(s.values()) > 1 for s, _ in log)
    assert pool_is_idle(llm)


def test_prefix_cache_hits_keep_tokens(tiny_dir, hf_ref):
    path = tiny_dir("qwen2")
    llm = make_llm(path)
    tok = llm.tokenizer
    prefix = tok.encode(TEXTS[3])[:40]  # 2 full blocks of 16 and a partial one
    tails = [tok.encode(t)[:k] for t, k in zip(TEXTS[1:], (3, 5, 9))]
    first = llm.generate([prefix + [7, 8]], greedy(), use_tqdm=False)
    assert llm.get_kv_stats()["prefix_cache_hits"] == 0
    prompts = [prefix + t for t in tails] + [prefix + [7, 8]]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    stats = llm.get_kv_stats()
    assert stats["prefix_cache_hits"] >= 32 * len(prompts)
    assert all(o.metrics.num_cached_tokens >= 32 for o in outs)
    # a repeated prompt reads its whole prefix from the cache and still produces the same tokens
    assert outs[-1].outputs[0].token_ids == first[0].outputs[0].token_ids
    check_against_hf(hf_ref(path), first + outs)
    assert pool_is_idle(llm)


def test_preemption_with_a_small_pool(tiny_dir, hf_ref):
    path = tiny_dir("llama")
    n = 40
    # 4 requests of ~10-50 prompt tokens + 40 outputs need far more than 12 blocks of 16
    llm = make_llm(path, num_gpu_blocks_override=13, max_model_len=192, kv_cache_memory_bytes=None)
    outs = llm.generate(TEXTS, greedy(n), use_tqdm=False)
    stats = llm.get_kv_stats()
    assert stats["preemptions"] > 0
    assert sum(o.metrics.num_preemptions for o in outs) == stats["preemptions"]
    check_against_hf(hf_ref(path), outs, n)
    assert pool_is_idle(llm)


def test_no_prefix_caching_same_tokens(tiny_dir, hf_ref):
    path = tiny_dir("qwen3")
    llm = make_llm(path, enable_prefix_caching=False, block_size=16)
    outs = llm.generate(TEXTS + TEXTS[:2], greedy(), use_tqdm=False)
    assert llm.get_kv_stats()["prefix_cache_hits"] == 0
    check_against_hf(hf_ref(path), outs)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("family,async_scheduling,fused", [
    ("qwen3", False, True), ("qwen3", True, True), ("qwen3", False, False), ("llama", True, True),
])
def test_triton_backend_through_the_engine(tiny_dir, hf_ref, family, async_scheduling, fused):
    """The Triton attention backend (interpreted on CPU) in the engine: chunked prefill, prompt
    chunks over cached context, decode rows in mixed batches (with and without async
    scheduling); with the fused q/k-norm + RoPE + KV-write kernel (Qwen3: with q/k norms,
    Llama: without) and without it (the backend's own KV write)."""
    path = tiny_dir(family)
    llm = make_llm(path, attention_backend="triton", max_num_batched_tokens=16, max_num_seqs=4,
                   async_scheduling=async_scheduling)
    model = llm.engine.model
    assert model.attn_backend.name == "triton"
    model.fuse_kv_write = fused
    assert model.fused_kv_write_usable(llm.engine.runner.kv_caches[0]) is fused
    outs = llm.generate(TEXTS, greedy(8), use_tqdm=False)
    check_against_hf(hf_ref(path), outs, 8)
    assert pool_is_idle(llm)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("family,async_scheduling,fused,spec", [
    ("qwen3", True, "qkv", {"head_dim": 32}),
    ("qwen2", False, "qkv", {"head_dim": 32}),
    ("llama", True, "gate_up", {"mlp_bias": True}),
    ("qwen3", False, "both", {"head_dim": 32}),
    ("qwen3", True, "chain", {"head_dim": 32}),
    ("llama", False, "chain", {"head_dim": 32, "mlp_bias": True, "attention_bias": True}),
])
def test_fused_projections_through_the_engine(tiny_dir, hf_ref, monkeypatch, family,
                                              async_scheduling, fused, spec):
    """The fused decode projections (interpreted) in the engine: every step of at most their
    row limit takes them (chunked prefill, mixed batches, decode). ``qkv``: GEMM + q/k norms +
    RoPE + KV write in one kernel (Qwen3 with q/k norms, Qwen2 with q/k/v bias); ``gate_up``:
    the MLP's gate/up GEMM with SiLU in its epilogue (Llama with MLP bias); greedy tokens
    equal transformers'. ``chain``: every layer as the fused decode chain (the norms inside
    the QKV and gate/up kernels, the residual adds in the o / down split-K epilogues; Llama
    with q/k/v/o and MLP biases)."""
    from pagedkv.kernels import gate_up_silu as gu
    from pagedkv.kernels import qkv_rope_cache as qr
    from pagedkv.kernels import splitk_gemm as sk

    calls = {"qkv": [], "gate_up": [], "residual": []}
    for mod, name, key in ((qr, "qkv_rope_cache", "qkv"), (gu, "fused_gate_up_silu", "gate_up"),
                           (sk, "splitk_residual", "residual")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda x, *a, _r=real, _k=key, **k:
                            calls[_k].append(x.shape[0]) or _r(x, *a, **k))
    monkeypatch.setattr(gu, "FUSED_GATE_UP_ENABLED", fused in ("gate_up", "both"))
    path = tiny_dir(family, **spec)
    llm = make_llm(path, attention_backend="triton", max_num_batched_tokens=16, max_num_seqs=4,
                   async_scheduling=async_scheduling)
    model = llm.engine.model
    model.fuse_qkv_projection = fused in ("qkv", "both")
    model.fuse_decode_chain = fused == "chain"
    caches = llm.engine.runner.kv_caches
    assert model.fused_qkv_usable(4, caches[0]) is model.fuse_qkv_projection
    assert model.decode_chain_usable(4, caches[0]) is model.fuse_decode_chain
    outs = llm.generate(TEXTS, greedy(8), use_tqdm=False)
    check_against_hf(hf_ref(path), outs, 8)
    assert pool_is_idle(llm)
    layers = model.config.num_hidden_layers
    used = {"qkv": ("qkv", "both", "chain"), "gate_up": ("gate_up", "both", "chain"),
            "residual": ("chain",)}
    for name, rows in calls.items():
        if fused in used[name]:
            per_layer = 2 if name == "residual" else 1
            assert rows and len(rows) % (per_layer * layers) == 0 and max(rows) <= 16, (name,
                                                                                      rows[:8])
        else:
            assert not rows, name


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("family,async_scheduling,spec", [
    ("qwen3", True, {"head_dim": 32}),
    ("qwen2", False, {"head_dim": 32}),
    ("llama", True, {"head_dim": 32}),
])
def test_persistent_decode_through_the_engine(tiny_dir, hf_ref, monkeypatch, family,
                                              async_scheduling, spec):
    """The persistent decode layer (interpreted: one program through every phase and
    barrier) in the engine: every step of at most 16 rows runs each layer after its attention
    as one launch (the next layer's QKV with q/k norms, RoPE and the K/V write inside it:
    Qwen3 with q/k norms, Qwen2 with q/k/v bias, Llama with neither); greedy tokens equal
    transformers'; the pool is idle after."""
    from pagedkv.kernels import persistent_layer as pl

    rows, real = [], pl.persistent_layer
    monkeypatch.setattr(pl, "persistent_layer",
                        lambda h, *a, **k: rows.append(h.shape[0]) or real(h, *a, **k))
    llm = make_llm(tiny_dir(family, **spec), attention_backend="triton",
                   max_num_batched_tokens=16, max_num_seqs=4,
                   async_scheduling=async_scheduling)
    model = llm.engine.model
    model.fuse_persistent_decode = True
    assert model.persistent_decode_usable(4, llm.engine.runner.kv_caches[0])
    outs = llm.generate(TEXTS, greedy(8), use_tqdm=False)
    check_against_hf(hf_ref(tiny_dir(family, **spec)), outs, 8)
    assert pool_is_idle(llm)
    layers = model.config.num_hidden_layers
    assert rows and len(rows) % layers == 0 and max(rows) <= 16, rows[:8]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("family,async_scheduling,spec", [
    ("qwen3", True, {"head_dim": 32}),
    ("llama", False, {}),
])
def test_decode_prologue_through_the_engine(tiny_dir, hf_ref, monkeypatch, family,
                                            async_scheduling, spec):
    """The decode kernels' fused prologue (``DecoderForCausalLM.fuse_decode_prologue``: the
    q/k norms, RoPE and K/V write inside the decode launch, ``QKPrologue``) in the engine:
    every decode-only step's launches take it (the mixed steps keep ``qk_norm_rope_cache``),
    greedy tokens equal transformers' (Qwen3 with q/k norms, Llama without), the pool is idle
    after."""
    import pagedkv.attention.triton_backend as tb

    seen, real = [], tb.paged_decode_attention
    monkeypatch.setattr(tb, "paged_decode_attention",
                        lambda *a, **k: seen.append(k.get("prologue") is not None)
                        or real(*a, **k))
    llm = make_llm(tiny_dir(family, **spec), attention_backend="triton",
                   max_num_batched_tokens=16, max_num_seqs=4,
                   async_scheduling=async_scheduling)
    llm.engine.model.fuse_decode_prologue = True
    outs = llm.generate(TEXTS, greedy(8), use_tqdm=False)
    check_against_hf(hf_ref(tiny_dir(family, **spec)), outs, 8)
    assert pool_is_idle(llm)
    layers = llm.engine.model.config.num_hidden_layers
    assert sum(seen) >= layers and sum(seen) % layers == 0, seen[:8]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
def test_fused_decode_paths_apply_where_documented(tiny_dir):
    """Where the opt-in fused decode paths apply: their switch, at most 256 rows, a head size
    the QKV kernel serves, the fused-KV-write path (the Triton backend), no tensor-parallel
    shard."""
    from pagedkv.models.decoder import FUSED_DECODE_MAX_ROWS, FUSED_QKV_MAX_ROWS

    llm = make_llm(tiny_dir("qwen3", head_dim=32), attention_backend="triton")
    model, cache = llm.engine.model, llm.engine.runner.kv_caches[0]
    assert not model.fused_qkv_usable(4, cache) and not model.decode_chain_usable(4, cache)
    model.fuse_qkv_projection = model.fuse_decode_chain = True
    assert model.fused_qkv_usable(FUSED_QKV_MAX_ROWS, cache)
    assert not model.fused_qkv_usable(FUSED_QKV_MAX_ROWS + 1, cache)
    assert model.decode_chain_usable(FUSED_DECODE_MAX_ROWS, cache)
    assert not model.decode_chain_usable(FUSED_DECODE_MAX_ROWS + 1, cache)
    model.fuse_kv_write = False  # the backend writes K/V itself: no fused path at all
    assert not model.fused_qkv_usable(4, cache) and not model.decode_chain_usable(4, cache)
    # head size 16: half of it is below tl.dot's 16
    small = make_llm(tiny_dir("qwen3"), attention_backend="triton").engine
    small.model.fuse_qkv_projection = small.model.fuse_decode_chain = True
    assert not small.model.fused_qkv_usable(4, small.runner.kv_caches[0])
    assert not small.model.decode_chain_usable(4, small.runner.kv_caches[0])
    # the torch reference backend has no fused KV write
    ref = make_llm(tiny_dir("qwen3", head_dim=32)).engine
    ref.model.fuse_decode_chain = True
    assert not ref.model.decode_chain_usable(4, ref.runner.kv_caches[0])


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
def test_persistent_decode_applies_where_documented(tiny_dir):
    """Where the persistent decode layer applies: its switch, 1-256 rows, the fused-KV-write
    path, a head size the QKV tiles serve, no o_proj / MLP bias, one norm epsilon."""
    from pagedkv.models.decoder import PERSISTENT_DECODE_MAX_ROWS

    llm = make_llm(tiny_dir("qwen3", head_dim=32), attention_backend="triton")
    model, cache = llm.engine.model, llm.engine.runner.kv_caches[0]
    assert not model.persistent_decode_usable(4, cache)
    model.fuse_persistent_decode = True
    assert model.persistent_decode_usable(PERSISTENT_DECODE_MAX_ROWS, cache)
    assert not model.persistent_decode_usable(PERSISTENT_DECODE_MAX_ROWS + 1, cache)
    assert not model.persistent_decode_usable(0, cache)
    model.layers[1].post_attention_layernorm.eps *= 2  # two epsilons: the kernel has one
    assert not model.persistent_decode_usable(4, cache)
    model.layers[1].post_attention_layernorm.eps /= 2
    model.fuse_kv_write = False
    assert not model.persistent_decode_usable(4, cache)
    small = make_llm(tiny_dir("qwen3"), attention_backend="triton").engine  # head size 16
    small.model.fuse_persistent_decode = True
    assert not small.model.persistent_decode_usable(4, small.runner.kv_caches[0])
    biased = make_llm(tiny_dir("llama", head_dim=32, attention_bias=True),  # o_proj bias
                      attention_backend="triton").engine
    biased.model.fuse_persistent_decode = True
    assert not biased.model.persistent_decode_usable(4, biased.runner.kv_caches[0])
