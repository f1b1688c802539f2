"""Tiny random Jamba checkpoints for the model and engine tests, written by transformers' own
``JambaForCausalLM`` (``save_pretrained``), with the tiny llama checkpoint's byte-level BPE
tokenizer (``pagedkv.models.tiny``).

Weights come from one seeded generator in parameter-name order: matrices ~ N(0, 0.1), biases
~ N(0, 0.1), norm weights and ``D`` 1 + N(0, 0.1), and for the mixers values that make their
state matter: ``A_log = log(U(0.05, 2))`` for every channel and state entry (not transformers'
``log(1..N)`` in every channel, so a channel / state index mix-up shows), ``dt_proj.bias ~
N(-2, 0.3)`` (slow decays: a state carries many tokens, so a lost or stale state shows), conv
kernels ~ N(0, 0.4) (the SiLU then is not almost linear), routers ~ N(0, 0.5) (spread
routing). Built once per option set into the test cache (keyed by a hash of the options)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import torch

from pagedkv.models.tiny import build_tiny_checkpoint

# a 4-layer Jamba: layer 0 mixer + MLP, 1 mixer + MoE, 2 attention + MLP, 3 mixer + MoE
JAMBA_TINY = dict(
    vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, attn_layer_period=4, attn_layer_offset=2,
    expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
    mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, mamba_conv_bias=True,
    mamba_proj_bias=False, max_position_embeddings=512, rms_norm_eps=1e-6,
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
_MARKER = "pagedkv_tiny_jamba.json"


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
    import transformers

    cfg = {**JAMBA_TINY, **config}
    blob = json.dumps([cfg, seed, dtype, save_original_format, transformers.__version__],
                      sort_keys=True).encode()
    target = os.path.join(cache_dir, "jamba-" + hashlib.sha256(blob).hexdigest()[:12])
    if os.path.isfile(os.path.join(target, _MARKER)):
        return target
    os.makedirs(cache_dir, exist_ok=True)
    tok_dir = build_tiny_checkpoint("llama", cache_dir, vocab_size=cfg["vocab_size"],
                                    num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1,
                                    head_dim=8, intermediate_size=16)
    tmp = tempfile.mkdtemp(prefix=".jamba-building-", dir=cache_dir)
    try:
        model = transformers.JambaForCausalLM(transformers.JambaConfig(**cfg))
        _fill(model, seed)
        model = model.to(getattr(torch, dtype))
        model.save_pretrained(tmp, **({} if save_original_format
                                      else {"save_original_format": False}))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(os.path.join(tok_dir, f), tmp)
        with open(os.path.join(tmp, _MARKER), "w", encoding="utf-8") as fh:
            json.dump({"config": cfg, "seed": seed, "dtype": dtype}, fh)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, _MARKER)):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
