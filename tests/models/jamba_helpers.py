"""Tiny random Jamba checkpoints for the model and engine tests, written by transformers' own
``JambaForCausalLM`` (``save_pretrained``), with the tiny llama checkpoint's byte-level BPE
tokenizer (``pagedkv.models.tiny``), through ``checkpoint_helpers.build_hf_checkpoint``.

Weights come from one seeded generator in parameter-name order: matrices ~ N(0, 0.1), biases
~ N(0, 0.1), norm weights and ``D`` 1 + N(0, 0.1), and for the mixers values that make their
state matter: ``A_log = log(U(0.05, 2))`` for every channel and state entry (not transformers'
``log(1..N)`` in every channel, so a channel / state index mix-up shows), ``dt_proj.bias ~
N(-2, 0.3)`` (slow decays: a state carries many tokens, so a lost or stale state shows), conv
kernels ~ N(0, 0.4) (the SiLU then is not almost linear), routers ~ N(0, 0.5) (spread
routing). Built once per option set into the test cache (keyed by a hash of the options)."""

from __future__ import annotations

import torch
from checkpoint_helpers import build_hf_checkpoint

# a 4-layer Jamba: layer 0 mixer + MLP, 1 mixer + MoE, 2 attention + MLP, 3 mixer + MoE
JAMBA_TINY = dict(
    vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2,
    expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, mamba_conv_bias=True,
    mamba_proj_bias=False, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _fill(model, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed * 1000 + 991)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("A_log"):
                vals = torch.log(0.05 + 1.95 * torch.rand(p.shape, generator=gen))
            elif name.endswith("dt_proj.bias"):
                vals = -2.0 + 0.3 * torch.randn(p.shape, generator=gen)
            elif name.endswith("conv1d.weight"):
                vals = 0.4 * torch.randn(p.shape, generator=gen)
            elif name.endswith("router.weight"):
                vals = 0.5 * torch.randn(p.shape, generator=gen)
            elif p.dim() >= 2:
                vals = 0.1 * torch.randn(p.shape, generator=gen)
            elif name.endswith("bias"):
                vals = 0.1 * torch.randn(p.shape, generator=gen)
            else:  # norm weights, D
                vals = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
            p.copy_(vals.to(p.dtype))


def build_tiny_jamba(cache_dir: str, *, seed: int = 0, dtype: str = "float32",
                     save_original_format: bool = True, **config) -> str:
    """Path of the tiny Jamba checkpoint with ``JambaConfig`` keys ``config`` over
    :data:`JAMBA_TINY` (``save_original_format=False``: transformers' stacked experts layout)."""
    return build_hf_checkpoint(cache_dir, "jamba", "JambaForCausalLM", {**JAMBA_TINY, **config},
                               _fill, seed=seed, dtype=dtype,
                               save_original_format=save_original_format)
