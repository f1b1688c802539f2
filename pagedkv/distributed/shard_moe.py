"""The mixture-of-experts part of a tensor-parallel shard: Qwen3-MoE and Mixtral
(``MoeForCausalLM``).

Every expert is split as the dense MLP is (``pagedkv.distributed.shard``): over ``N`` ranks,
rank ``r`` holds the intermediate units ``[r I/N, (r+1) I/N)`` of every expert, i.e. those
rows of the gate half and of the up half of ``w13 [E, 2I, H]`` (column-parallel) and those
columns of ``w2 [E, H, I]`` (row-parallel). The router is replicated, so every rank routes each
token to the same ``k`` experts with the same weights; a rank's block output is its units'
share of every chosen expert's down projection, weighted as in one process (the weighted sum
is linear), and the sum over the ranks, one all-reduce per sparse layer
(``MoeDecoderLayer.post_moe``'s ``reduce``, before the residual add), is the block's output.
No token moves between ranks; each rank's experts run the same kernels (``fused_moe`` or its
torch twin) with ``I / N`` columns. In bf16 each rank rounds its partial output once before
the sum (as the dense shard's ``down_proj``).

Attention, the embedding, the LM head, the norms and the dense layers of Qwen3-MoE
(``mlp_only_layers`` / ``decoder_sparse_step``) are cut by ``shard_decoder`` as for the dense
decoder; the shard is a ``MoeForCausalLM`` of the local sizes (``local_moe_config``: the
experts' ``intermediate_size / N``).

Refused (``check_moe_tensor_parallel``; the families on ``MoeForCausalLM`` have none of
them): expert biases (they would be added on every rank), shared experts, other routings or
activations.
"""

from __future__ import annotations

import dataclasses

import torch

from pagedkv.errors import ConfigError
from pagedkv.models.config import ModelArchConfig, MoeConfig


def check_moe_tensor_parallel(config: ModelArchConfig, world_size: int) -> None:
    """Raise ``ConfigError`` unless ``world_size`` ranks can split the experts of
    ``config`` (attention and the dense MLP: ``check_tensor_parallel``): the experts'
    intermediate size divisible, plain routed SiLU experts."""
    moe = config.moe
    if moe is None:
        raise ConfigError(f"{config.architecture} has no mixture-of-experts config")
    unsupported = [what for what, on in (
        ("expert biases", moe.expert_bias),
        ("shared experts", moe.shared_intermediate_size > 0 or moe.shared_expert_gate),
        (f"{moe.scoring} routing", moe.scoring != "softmax"),
        (f"the {moe.activation} activation", moe.activation != "silu")) if on]
    if unsupported:
        raise ConfigError(f"tensor_parallel_size={world_size}: experts with "
                          f"{', '.join(unsupported)} ({config.architecture}) are not supported "
                          "yet; tensor parallelism covers softmax-routed SiLU experts "
                          "(Qwen3-MoE, Mixtral)")
    if moe.intermediate_size % world_size:
        raise ConfigError(f"tensor_parallel_size={world_size} must divide the experts' "
                          f"intermediate size ({moe.intermediate_size}: moe_intermediate_size, "
                          "Mixtral's intermediate_size)")


def local_moe_config(moe: MoeConfig, world_size: int) -> MoeConfig:
    """One rank's sparse block: every expert with ``intermediate_size / world_size`` units
    (router, experts and routing unchanged)."""
    return dataclasses.replace(moe, intermediate_size=moe.intermediate_size // world_size)


def shard_sparse_block(src, dst, rank: int, world_size: int, put) -> None:
    """Install rank ``rank``'s share of the ``SparseMoeBlock`` ``src`` into ``dst`` (a block
    of :func:`local_moe_config`'s sizes) with ``put(module, name, tensor)`` (``shard_decoder``'s:
    a parameter on the rank's device): the router replicated, each expert's gate and up rows
    and down columns ``[rank I_l, (rank + 1) I_l)``."""
    inter = src.intermediate_size
    il = inter // world_size
    if src.w13_bias is not None or src.shared_experts is not None or src.gate_up_interleaved \
            or il * world_size != inter or dst.intermediate_size != il:
        raise ConfigError(f"shard_sparse_block: cannot split this block ({inter} units, "
                          f"{world_size} ranks; see check_moe_tensor_parallel)")
    cols = slice(rank * il, (rank + 1) * il)
    gate, up = src.w13.split([inter, inter], dim=1)
    put(dst.gate, "weight", src.gate.weight)
    put(dst.gate, "bias", src.gate.bias)
    put(dst, "w13", torch.cat([gate[:, cols], up[:, cols]], dim=1))
    put(dst, "w2", src.w2[:, :, cols])


__all__ = ["check_moe_tensor_parallel", "local_moe_config", "shard_sparse_block"]
