"""Tensor parallelism for the mixture-of-experts decoders (Qwen3-MoE, Mixtral;
``pagedkv.distributed.shard_moe``): every expert's intermediate columns split over the ranks,
the router replicated.

* the layout by hand (rows and columns a rank holds, local sizes, refused configs);
* the experts' shards sum to the whole block (the torch twin and the Triton fused-MoE kernel,
  interpreted, on local sizes that are not a multiple of the kernel's tile), every rank
  routing alike;
* over a real gloo group of two processes: a sparse layer's ``post_moe`` on each rank's shard
  with ``TPGroup.all_reduce`` gives the whole layer's output, with exactly two all-reduces
  (``o_proj``, the block; ``o_proj``'s bias added once);
* each rank's ``shard_decoder`` shard
  gives the full model's logits (fp32, 1e-4) and greedy tokens through the paged harness, with
  ``1 + 2 L`` all-reduces per forward, and ``LLM(path, tensor_parallel_size=2)`` greedy
  tokens equal ``tensor_parallel_size=1``'s (chunked prefill, prefix hits).
"""

import dataclasses
import os
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp
from test_tensor_parallel import PROMPTS, run

from pagedkv.distributed.group import TPGroup
from pagedkv.distributed.shard import local_config
from pagedkv.distributed.shard_moe import (
    check_moe_tensor_parallel,
    local_moe_config,
    shard_sparse_block,
)
from pagedkv.errors import ConfigError
from pagedkv.kernels.fused_moe import fused_moe, fused_moe_ref
from pagedkv.models.config import MoeConfig, load_model_config
from pagedkv.models.harness import PagedHarness
from pagedkv.models.loader import load_model
from pagedkv.models.moe import SparseMoeBlock
from pagedkv.models.moe_decoder import MoeDecoderLayer

# Qwen3-MoE: layer 0 dense (mlp_only_layers), layer 1 sparse, o_proj with a bias
# (attention_bias); Mixtral: both layers sparse, no biases
CHECKPOINTS = {"qwen3_moe": dict(num_layers=2, mlp_only_layers=(0,), attention_bias=True),
               "mixtral": dict(num_layers=2)}
LONG = list(range(30, 71))  # 41 tokens


def _checkpoint(tiny_dir, family):
    return tiny_dir(family, **CHECKPOINTS[family])


def _put(module, name, value):
    setattr(module, name, None if value is None else torch.nn.Parameter(
        value.contiguous().clone(), requires_grad=False))


def _moe(family, e, k, inter, layers=1):
    return MoeConfig(num_experts=e, top_k=k, intermediate_size=inter,
                     norm_topk_prob=family == "mixtral",
                     weights_dtype="float32" if family == "mixtral" else "model",
                     sparse_layers=(True,) * layers)


def _random_block(family, h, e, k, inter, seed):
    block = SparseMoeBlock(h, _moe(family, e, k, inter), family)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in (block.gate.weight, block.w13, block.w2):
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return block


def _block_shard(block, rank, world):
    moe = local_moe_config(block.moe, world)
    dst = SparseMoeBlock(block.w13.shape[2], moe, block.family, device="meta")
    shard_sparse_block(block, dst, rank, world, _put)
    return dst


# ---- the layout, by hand


def test_layout_by_hand(tiny_dir):
    cfg = load_model_config(_checkpoint(tiny_dir, "qwen3_moe"))  # 8 experts of 32 units
    loc = local_moe_config(cfg.moe, 2)
    assert loc == dataclasses.replace(cfg.moe, intermediate_size=16)
    assert loc.sparse_layers == (False, True) and loc.num_experts == 8
    check_moe_tensor_parallel(cfg, 2)
    check_moe_tensor_parallel(cfg, 4)
    with pytest.raises(ConfigError, match=r"must divide the experts' intermediate size \(32"):
        check_moe_tensor_parallel(cfg, 3)
    shared = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, shared_intermediate_size=16))
    with pytest.raises(ConfigError, match="shared experts.*not supported yet"):
        check_moe_tensor_parallel(shared, 2)
    biased = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, expert_bias=True,
                                                              scoring="topk_softmax"))
    with pytest.raises(ConfigError, match="expert biases, topk_softmax routing"):
        check_moe_tensor_parallel(biased, 2)

    # 3 experts of 4 units over 2 ranks: w13[e, j, h] = 100 e + 10 j + h (rows 0-3 gate,
    # 4-7 up), w2[e, h, i] = 100 e + 10 i + h
    block = SparseMoeBlock(2, _moe("qwen3_moe", 3, 2, 4), "qwen3_moe")
    e, j, h = torch.meshgrid(torch.arange(3.0), torch.arange(8.0), torch.arange(2.0), indexing="ij")
    with torch.no_grad():
        block.w13.copy_(100 * e + 10 * j + h)
        block.w2.copy_(block.w13[:, :4, :].transpose(1, 2))
        block.gate.weight.copy_(torch.arange(6.0).view(3, 2))
    one = _block_shard(block, 1, 2)
    assert one.intermediate_size == 2 and one.w13.shape == (3, 4, 2) and one.w2.shape == (3, 2, 2)
    # rank 1: gate units 2, 3 and up units 2, 3 (rows 6, 7) of every expert
    assert one.w13[:, :, 0].tolist() == [[100 * x + 10 * r for r in (2, 3, 6, 7)] for x in range(3)]
    assert one.w2[:, 1, :].tolist() == [[100 * x + 10 * i + 1 for i in (2, 3)] for x in range(3)]
    assert torch.equal(one.gate.weight, block.gate.weight)  # the router, replicated
    assert one.gate.weight.data_ptr() != block.gate.weight.data_ptr()
    with pytest.raises(ConfigError, match="cannot split this block"):
        _block_shard(block, 0, 3)


# ---- the experts' shards sum to the block


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_shards_sum_to_the_block(family, world):
    block = _random_block(family, h=48, e=6, k=2, inter=40, seed=world)
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = block(x)
        weights, ids = block.route(x)
        parts = []
        for rank in range(world):
            shard = _block_shard(block, rank, world)
            w, i = shard.route(x)  # every rank routes alike
            assert torch.equal(i, ids) and torch.equal(w, weights)
            part = shard(x)
            assert part.shape == want.shape and not torch.allclose(part, want, atol=1e-3)
            parts.append(part)
    torch.testing.assert_close(sum(parts), want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernel on CPU tensors needs the Triton interpreter")
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_expert_shards_through_the_triton_kernel(family):
    """Local intermediate size 10 (40 over 4 ranks): a partial tile of the kernel's 32."""
    block = _random_block(family, h=48, e=6, k=2, inter=40, seed=7)
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        weights, ids = block.route(x)
        want = fused_moe_ref(x, block.w13, block.w2, weights, ids)
        parts = [fused_moe(x, s.w13, s.w2, weights, ids)
                 for s in (_block_shard(block, r, 4) for r in range(4))]
    torch.testing.assert_close(sum(parts), want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_gpu_expert_shards_through_the_kernel(dtype, tol):
    """The compiled kernel on the GPU, shards of Qwen3-30B-A3B's expert width (768 over 4
    ranks: 192 units)."""
    block = _random_block("qwen3_moe", h=256, e=16, k=4, inter=768, seed=3).to("cuda", dtype)
    x = torch.randn(70, 256, device="cuda").to(dtype)
    with torch.no_grad():
        weights, ids = block.route(x)
        want = fused_moe_ref(x.float(), block.w13.float(), block.w2.float(), weights.float(), ids)
        parts = [fused_moe(x, s.w13, s.w2, weights, ids).float()
                 for s in (_block_shard(block, r, 4) for r in range(4))]
    err = float((sum(parts) - want).norm() / want.norm())
    assert err < tol


# ---- over a gloo group of two processes


class CountingTP(TPGroup):
    """A ``TPGroup`` that counts its all-reduces."""

    def __init__(self, rank, world_size):
        self.calls = 0
        super().__init__(rank, world_size)

    def all_reduce(self, x):
        self.calls += 1
        return super().all_reduce(x)


def _rank_main(rank, world, tmp, task, args):
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                            world_size=world, timeout=timedelta(seconds=120))
    try:
        with torch.no_grad():
            out = task(CountingTP(rank, world), *args)
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path, task, *args, world=2):
    """``task(tp, *args)`` on each of ``world`` ranks (spawned processes, gloo); their results."""
    mp.spawn(_rank_main, args=(world, str(tmp_path), task, args), nprocs=world, join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _layer_inputs(cfg):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(7, cfg.hidden_size, generator=gen),
            torch.randn(7, cfg.q_size, generator=gen))


def _sparse_layers_task(tp, paths):
    """Each checkpoint's sparse layers, ``post_moe`` on this rank's share: the block's
    experts (``shard_sparse_block``) and ``o_proj``'s input columns of the rank's heads."""
    rank, world = tp.rank, tp.world_size
    out = {}
    for path in paths:
        full = load_model(path, device="cpu")
        cfg = full.config
        local = dataclasses.replace(local_config(cfg, world), moe=local_moe_config(cfg.moe, world))
        hq = cfg.q_size // world
        cols = slice(rank * hq, (rank + 1) * hq)
        hidden, attn_out = _layer_inputs(cfg)
        for i, src in enumerate(full.layers):
            if not isinstance(src, MoeDecoderLayer):
                continue
            dst = MoeDecoderLayer(local, i, device="meta")
            shard_sparse_block(src.mlp, dst.mlp, rank, world, _put)
            o_weight, o_bias, ln_weight, eps = src.post_args()
            before = tp.calls
            h, moe_out = dst.post_moe(hidden, attn_out[:, cols], o_weight[:, cols], o_bias,
                                      ln_weight, eps, reduce=tp.all_reduce)
            out[path, i] = (h, moe_out, tp.calls - before)
    return out


def test_sparse_layers_over_gloo(tiny_dir, tmp_path):
    paths = [_checkpoint(tiny_dir, f) for f in CHECKPOINTS]
    ranks = _spawn(tmp_path, _sparse_layers_task, paths)
    checked = 0
    for path in paths:
        full = load_model(path, device="cpu")
        hidden, attn_out = _layer_inputs(full.config)
        assert (full.layers[0].self_attn.o_proj.bias is not None) == (full.config.family == "qwen3_moe")
        for i, layer in enumerate(full.layers):
            if not isinstance(layer, MoeDecoderLayer):
                continue
            with torch.no_grad():
                want_h, want_out = layer.post_moe(hidden, attn_out, *layer.post_args())
            for r in ranks:
                h, moe_out, calls = r[path, i]
                assert calls == 2  # o_proj, then the block: once each
                torch.testing.assert_close(h, want_h, atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(moe_out, want_out, atol=1e-5, rtol=1e-5)
            checked += 1
    assert checked == 3  # qwen3_moe layer 1, mixtral layers 0 and 1


def _full_model_task(tp, path, prompts):
    from pagedkv.distributed.shard import shard_decoder

    shard = shard_decoder(load_model(path, device="cpu"), tp)
    h = PagedHarness(shard, block_size=16, num_blocks=40)
    logits = h.prompt_logits(LONG)
    calls = tp.calls
    tokens = h.greedy_generate(prompts, 6, chunk_size=7, token_budget=16, pad_tokens=3)
    experts = [tuple(layer.mlp.w2.shape) for layer in shard.layers
               if isinstance(layer, MoeDecoderLayer)]
    return type(shard).__name__, logits, calls, tokens, experts


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_shards_give_the_full_models_logits(tiny_dir, tmp_path, family):
    path = _checkpoint(tiny_dir, family)
    full = load_model(path, device="cpu")
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[1]]
    with torch.no_grad():
        want_logits = PagedHarness(full, block_size=16, num_blocks=40).prompt_logits(LONG)
        want_tokens = PagedHarness(full, block_size=16, num_blocks=40).greedy_generate(
            prompts, 6, chunk_size=7, token_budget=16, pad_tokens=3)
    cfg = full.config
    for name, logits, calls, tokens, experts in _spawn(tmp_path, _full_model_task, path, prompts):
        assert name == "MoeForCausalLM"
        assert experts == [(cfg.moe.num_experts, cfg.hidden_size, cfg.moe.intermediate_size // 2)
                           ] * cfg.moe.num_sparse_layers
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
        assert calls == 1 + 2 * cfg.num_hidden_layers  # the embedding, o_proj and MLP per layer
        assert tokens == want_tokens


@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_tp2_greedy_equals_tp1(tiny_dir, family):
    path = _checkpoint(tiny_dir, family)
    kw = dict(max_num_seqs=4, max_num_batched_tokens=16)  # the 41-token prompt: 3 chunks
    one = run(path, **kw)
    two = run(path, tensor_parallel_size=2, **kw)
    assert two[0] == one[0] and two[1] == one[1] == two[0]
    assert two[2]["prefix_cache_hits"] > 0 and two[2]["prefix_cache_hits"] == one[2]["prefix_cache_hits"]
    assert two[3].bytes_per_block * 2 == one[3].bytes_per_block  # 2 KV heads over 2 ranks


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("family", list(CHECKPOINTS))
def test_gpu_tp2_greedy_equals_tp1(tiny_dir, family):
    """Two GPUs over NCCL: the fused-MoE kernel on each rank's experts (local sizes), Triton
    attention, CUDA graphs; fp32 greedy tokens equal one GPU's."""
    path = _checkpoint(tiny_dir, family)
    kw = dict(device="cuda", dtype="float32", attention_backend="triton", max_num_seqs=4,
              max_num_batched_tokens=16)
    from pagedkv import LLM
    from test_tensor_parallel import tokens

    outs = []
    for tp in (1, 2):
        llm = LLM(path, tensor_parallel_size=tp, **kw)
        try:
            outs.append((tokens(llm, PROMPTS), tokens(llm, PROMPTS),
                         llm.get_kv_stats()["cuda_graph_steps"]))
        finally:
            llm.shutdown()
    assert outs[1][0] == outs[0][0] and outs[1][1] == outs[0][1]
    assert outs[1][2] > 0
