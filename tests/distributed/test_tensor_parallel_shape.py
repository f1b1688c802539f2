"""Tensor parallelism by shape (benchmarks): ``LLM.from_shape(name, tensor_parallel_size=2)``
starts two CPU worker processes, each building its shard at the local sizes with random
weights (``random_shard``). The shards' layout equals ``shard_decoder``'s of a whole model
(dense, MoE, a replicated KV head, DCP), the vocabulary padding rows are zero, replicated
tensors agree across the ranks; the engine serves the model the two shards make up (its greedy
tokens equal a one-process engine over the shards put back together by hand), every request
gets its max_tokens, each rank's pool holds half the KV bytes per block; bad options still fail
before a process starts."""

import dataclasses
import time

import pytest
import torch

from pagedkv import LLM, SamplingParams
from pagedkv.distributed.group import TPGroup
from pagedkv.distributed.shard import random_shard, shard_decoder
from pagedkv.distributed.worker import WorkerSpec
from pagedkv.errors import ConfigError
from pagedkv.models.config import load_model_config, shape_config
from pagedkv.models.registry import get_model_class

OPTS = dict(device="cpu", max_num_seqs=4, max_model_len=256)
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], list(range(20, 61)), [200, 201, 3]]
MAX_TOKENS = [8, 5, 12]


def _shards(cfg, world=2, dcp=1, seed=0):
    return [random_shard(cfg, TPGroup(r, world), dcp=dcp, seed=seed) for r in range(world)]


def _shapes(model):
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


@pytest.mark.parametrize("case", ["odd-vocab", "one-kv-head", "dcp2", "moe"])
def test_random_shard_layout(tiny_dir, case):
    """Each rank's parameters have the shapes shard_decoder gives that rank of a whole model;
    rows past the vocabulary are zero; replicated tensors are equal on both ranks; the same
    seed gives the same shard."""
    cfg, dcp = shape_config("llama-tiny"), 1
    if case == "odd-vocab":
        cfg = dataclasses.replace(cfg, vocab_size=255)
    elif case == "one-kv-head":
        cfg = dataclasses.replace(cfg, num_key_value_heads=1)
    elif case == "dcp2":
        dcp = 2
    else:
        cfg = load_model_config(tiny_dir("qwen3_moe"))
    full = get_model_class(cfg.architecture)(cfg).init_random_weights(3)
    shards = _shards(cfg, dcp=dcp)
    for r, shard in enumerate(shards):
        want = shard_decoder(full, TPGroup(r, 2), dcp=dcp)
        assert _shapes(shard) == _shapes(want)
        assert shard.tp.rank == r and type(shard) is type(full)
        assert shard.rotary.inv_freq.device.type == "cpu"
        torch.testing.assert_close(shard.rotary.inv_freq, full.rotary.inv_freq)
    per = -(-cfg.vocab_size // 2)
    assert shards[0].embed_tokens.shape[0] == per
    pad = 2 * per - cfg.vocab_size
    for t in ("embed_tokens", "lm_head"):
        last = getattr(shards[1], t)
        if last is None:
            continue
        assert bool((last[per - pad:] == 0).all()) and bool((last[:per - pad] != 0).any())
        assert bool((getattr(shards[0], t) != 0).any(dim=1).all())  # no zero row below V
    assert pad == (1 if case == "odd-vocab" else 0)
    params = [dict(s.named_parameters()) for s in shards]
    replicated = [n for n in params[0] if "norm" in n or n.endswith("mlp.gate.weight")]
    assert replicated and (case != "moe" or any("mlp.gate" in n for n in replicated))
    for n in replicated:
        assert torch.equal(params[0][n], params[1][n]), n
    again = _shards(cfg, dcp=dcp)
    for a, b in zip(shards, again):
        for (n, p), q in zip(a.named_parameters(), b.parameters()):
            assert torch.equal(p, q), n
    # a shard is drawn at the local sizes, not cut from the one-process random model
    cut = shard_decoder(get_model_class(cfg.architecture)(cfg).init_random_weights(0),
                        TPGroup(0, 2), dcp=dcp)
    assert not torch.equal(cut.layers[0].self_attn.qkv_proj.weight,
                           shards[0].layers[0].self_attn.qkv_proj.weight)


def _gather(shards, cfg):
    """The one-process Llama the two dense shards make up (KV heads split, no padding):
    column-parallel rows and row-parallel columns concatenated in rank order."""
    full = get_model_class(cfg.architecture)(cfg)
    cat = torch.cat
    with torch.no_grad():
        full.embed_tokens.copy_(cat([s.embed_tokens for s in shards])[:cfg.vocab_size])
        full.lm_head.copy_(cat([s.lm_head for s in shards])[:cfg.vocab_size])
        full.norm.weight.copy_(shards[0].norm.weight)
        loc = shards[0].config
        split = [loc.q_size, loc.kv_size, loc.kv_size]
        half = loc.intermediate_size
        for i, layer in enumerate(full.layers):
            parts = [s.layers[i] for s in shards]
            for norm in ("input_layernorm", "post_attention_layernorm"):
                getattr(layer, norm).weight.copy_(getattr(parts[0], norm).weight)
            qkv = [p.self_attn.qkv_proj.weight.split(split) for p in parts]
            layer.self_attn.qkv_proj.weight.copy_(cat([cat([x[j] for x in qkv]) for j in range(3)]))
            layer.self_attn.o_proj.weight.copy_(cat([p.self_attn.o_proj.weight for p in parts], 1))
            gu = [p.mlp.gate_up_proj.weight.split([half, half]) for p in parts]
            layer.mlp.gate_up_proj.weight.copy_(cat([cat([x[j] for x in gu]) for j in range(2)]))
            layer.mlp.down_proj.weight.copy_(cat([p.mlp.down_proj.weight for p in parts], 1))
    return full.eval()


def _generate(llm):
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def test_from_shape_tensor_parallel_serves_the_shards_model():
    cfg = shape_config("llama-tiny")
    one_process = LLM.from_model(_gather(_shards(cfg), cfg), **{k: v for k, v in OPTS.items()
                                                                 if k != "device"})
    want = [c.token_ids for c in _generate(one_process)]
    one_sizing = one_process.kv_cache_sizing
    one_process.shutdown()
    llm = LLM.from_shape("llama-tiny", tensor_parallel_size=2, **OPTS)
    try:
        got = _generate(llm)
        assert [len(c.token_ids) for c in got] == MAX_TOKENS
        assert {c.finish_reason for c in got} == {"length"}
        assert [c.token_ids for c in got] == want
        sizing = llm.kv_cache_sizing
        assert "min over 2 ranks" in sizing.source
        # each rank holds one of the two KV heads: half the bytes per block
        assert sizing.bytes_per_block * 2 == one_sizing.bytes_per_block
        assert llm.model_name == "shape:llama-tiny"
        assert len(llm.engine.runner.worker_pids) == 2
    finally:
        llm.shutdown()


def test_from_shape_tensor_parallel_bad_options_fail_before_a_process_starts():
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="attention heads"):
        LLM.from_shape("llama-tiny", tensor_parallel_size=3, **OPTS)
    with pytest.raises(ConfigError, match="sanitize"):
        LLM.from_shape("llama-tiny", tensor_parallel_size=2, sanitize=True, **OPTS)
    with pytest.raises(ConfigError, match="not supported yet"):
        LLM.from_shape("bamba-tiny", tensor_parallel_size=2, **OPTS)
    with pytest.raises(ConfigError, match="tokenizer must be"):
        LLM.from_shape("llama-tiny", tensor_parallel_size=2, tokenizer="gpt2", **OPTS)
    with pytest.raises(ConfigError, match="unknown model shape"):
        LLM.from_shape("llama-huge", tensor_parallel_size=2, **OPTS)
    assert time.monotonic() - t0 < 10  # no worker was started
    for both in (dict(model_dir="x", shape="llama-tiny"), dict(model_dir=None)):
        with pytest.raises(ConfigError, match="one of them"):
            WorkerSpec(dtype=torch.float32, device_type="cpu", attention_backend="auto",
                       engine_config=None, **both)


@pytest.mark.gpu
def test_from_shape_tensor_parallel_on_two_gpus():
    """qwen3-0.6b by shape over two GPUs (NCCL): every request gets its max_tokens, each
    rank's pool holds half the KV bytes per block of the one-GPU engine's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    kw = dict(device="cuda", max_num_seqs=8, max_model_len=1024, kv_cache_memory_bytes=1 << 30)
    one = LLM.from_shape("qwen3-0.6b", **kw)
    one_bytes = one.kv_cache_sizing.bytes_per_block
    one.shutdown()
    llm = LLM.from_shape("qwen3-0.6b", tensor_parallel_size=2, **kw)
    try:
        got = _generate(llm)
        assert [len(c.token_ids) for c in got] == MAX_TOKENS
        assert llm.kv_cache_sizing.bytes_per_block * 2 == one_bytes
        assert "min over 2 ranks" in llm.kv_cache_sizing.source
    finally:
        llm.shutdown()
