"""Sliding-window models end to end on one runner (CPU, fp32, sanitizer on every step):
Mistral with ``sliding_window`` (every layer windowed: one sliding-window group), Qwen2 with
``use_sliding_window`` + ``max_window_layers`` (full layers beside windowed ones: a hybrid of
two KV-cache groups in one block pool), Gemma 2 (alternating local / global layers, attention
and final logit soft-capping, sandwich norms, GeGLU, ``query_pre_attn_scalar``) and Gemma 3
text (five local : one global, local and global RoPE bases, q/k norms: seven groups of one
layer) and Cohere2 (three local : one global layer, RoPE on the local ones only, the parallel
block on one LayerNorm, logit scale, tied embeddings: four groups of one layer). Greedy tokens
equal transformers' ``generate`` with
prompts longer than the window, chunked prefill crossing the window edge, prefix hits (the
sliding-window hit rule), preemption on a small pool, block sizes 16 and 32, both attention
backends (the Triton kernels through the interpreter); blocks the window left behind are
released while a request runs."""

import pytest
from engine_helpers import TEXTS, check_greedy, greedy, make_llm, pool_is_idle

from pagedkv.core.spec import FullAttentionSpec, SlidingWindowSpec

W = 8
FAMILIES = {
    "mistral": dict(sliding_window=W),
    "qwen2": dict(sliding_window=W, max_window_layers=1),  # layer 0 full, layer 1 windowed
    "gemma2": dict(sliding_window=W, num_layers=4),  # local, global, local, global
    "gemma3": dict(sliding_window=W, num_layers=7),  # 5 local : 1 global, then local
    "cohere2": dict(sliding_window=W, num_layers=4),  # local, local, local, global
}
GROUP_KINDS = {
    "mistral": ["SlidingWindowSpec"],
    "qwen2": ["FullAttentionSpec", "SlidingWindowSpec"],
    "gemma2": ["FullAttentionSpec", "SlidingWindowSpec"],
    "gemma3": ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 6,
    "cohere2": ["FullAttentionSpec"] + ["SlidingWindowSpec"] * 3,
}


@pytest.mark.parametrize("backend", ["torch_ref", "triton"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_matches_transformers_across_the_window(tiny_dir, hf_ref, family, backend):
    path = tiny_dir(family, **FAMILIES[family])
    llm = make_llm(path, attention_backend=backend, block_size=16, max_num_batched_tokens=16)
    groups = llm.scheduler.kv_cache_config.kv_cache_groups
    kinds = sorted(type(g.kv_cache_spec).__name__ for g in groups)
    assert kinds == GROUP_KINDS[family]  # hybrids: one pool, one block table per group
    assert llm.runner.input_batch.block_table.num_groups == len(groups)
    assert max(len(llm.tokenizer.encode(t)) for t in TEXTS) > 3 * W
    # lengths 3..58 against W = 8; chunks of 16 cross it
    check_greedy(llm, hf_ref(path), TEXTS, 16)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefix_hits_preemption_and_block_sizes(tiny_dir, hf_ref, family, block_size):
    path = tiny_dir(family, **FAMILIES[family])
    ref = hf_ref(path)
    long = TEXTS[3]
    prompts = [long, TEXTS[2], long, long + " And more after the shared part.", TEXTS[1]]
    groups = len(GROUP_KINDS[family])
    # the smallest pool one max-length request fits in: the others must wait or be preempted
    llm = make_llm(path, block_size=block_size, max_num_batched_tokens=16, max_num_seqs=4,
                   num_gpu_blocks_override=1 + groups * -(-96 // block_size), max_model_len=96)
    check_greedy(llm, ref, prompts, 20)
    s = llm.get_kv_stats()
    assert s["prefix_cache_hits"] > 0, s
    assert s["preemptions"] > 0, s


def test_window_releases_blocks_while_decoding(tiny_dir, hf_ref):
    """After the prefill, every step's allocation first releases the blocks wholly behind the
    window: a decode holds at most cdiv(W - 1 + 1, B) + 1 live blocks, the older entries of its
    table are the null block, and the tokens are still transformers'."""
    path = tiny_dir("mistral", **FAMILIES["mistral"])
    llm = make_llm(path, block_size=4)
    engine = llm.engine
    params = greedy(40)
    rid = engine.add_request(TEXTS[3], params)
    live, nulls, final = [], [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            final = o
        if rid in engine.scheduler.requests:
            (held,) = engine.scheduler.kv_cache_manager.get_block_ids(rid)
            live.append(sum(1 for b in held if b != 0))
            nulls.append(sum(1 for b in held if b == 0))
    assert live[0] == -(-(58 + 1) // 4)  # the prefill step holds the whole prompt
    assert max(live[2:]) <= -(-(W - 1 + 1) // 4) + 1  # decode: the window's blocks only
    assert nulls[-1] >= (58 + 40 - W) // 4 - 1
    assert final.outputs[0].token_ids == hf_ref(path).greedy(final.prompt_token_ids, 40)
    assert pool_is_idle(llm)


def test_specs_follow_transformers_layer_rules(tiny_dir):
    from pagedkv.models.config import load_model_config

    m = load_model_config(tiny_dir("mistral", **FAMILIES["mistral"]))
    assert m.layer_windows == (W, W)
    q = load_model_config(tiny_dir("qwen2", **FAMILIES["qwen2"]))
    assert q.layer_windows == (None, W)
    g2 = load_model_config(tiny_dir("gemma2", **FAMILIES["gemma2"]))
    assert g2.layer_windows == (W, None, W, None)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.attn_scale) == (50.0, 30.0, 16 ** -0.5)
    g3 = load_model_config(tiny_dir("gemma3", **FAMILIES["gemma3"]))
    assert g3.layer_windows == (W,) * 5 + (None, W) and g3.qk_norm
    assert (g3.rope.rope_theta, g3.local_rope.rope_theta) == (1_000_000.0, 10_000.0)
    llm = make_llm(tiny_dir("qwen2", **FAMILIES["qwen2"]))
    specs = llm.engine.model.kv_cache_specs(16)
    assert isinstance(specs["model.layers.0.self_attn"], FullAttentionSpec)
    assert specs["model.layers.1.self_attn"] == SlidingWindowSpec(
        block_size=16, num_kv_heads=2, head_size=16, dtype="float32", sliding_window=W)


def test_capacity_is_reported_per_group(tiny_dir):
    """A hybrid pool reports per group the blocks one max-length request holds (full: the
    whole context; a window W: W - 1 + a step's tokens, plus one), and the concurrency over
    their sum: the groups share the pool."""
    from pagedkv.core.spec import cdiv

    path = tiny_dir("gemma2", sliding_window=16)
    llm = make_llm(path, max_model_len=256, max_num_batched_tokens=64, block_size=16)
    s = llm.kv_cache_sizing
    kinds = {g["kind"]: g for g in s.groups}
    assert set(kinds) == {"full", "sliding_window 16"}
    assert kinds["full"]["blocks_per_request"] == 256 // 16
    assert kinds["sliding_window 16"]["blocks_per_request"] == cdiv(15 + 64, 16) + 1
    assert s.blocks_per_request == 16 + 6
    assert s.max_concurrency == s.num_usable_blocks / 22
    text = s.describe()
    assert "group 0" in text and "blocks per request" in text
    assert s.as_dict()["groups"][0]["num_layers"] >= 1
