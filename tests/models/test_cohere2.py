"""Cohere2 (``pagedkv.models.cohere2``): config parsing (a Command-R7B-sized config.json, the
defaults of ``Cohere2Config``, errors), the parameter count against transformers' model, the
LayerNorm and the interleaved RoPE against transformers' functions, and the tiny checkpoint
through the paged harness (NaN-poisoned pool, shuffled blocks) against transformers: every
layer's output (three sliding layers with RoPE, then a full layer without), prompt logits
(logit scale), batched greedy tokens (block sizes 16 and 32, chunked prefill mixed with
decodes, prompts longer than the window)."""

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.models.cohere2 import CohereLayerNorm, rotate_interleaved
from pagedkv.models.config import ModelArchConfig

transformers = pytest.importorskip("transformers")
from test_deepseek_v3 import Ref  # noqa: E402 - the tiny-checkpoint reference
# the harness-vs-transformers tests (every layer, prompt logits, greedy tokens) on ``ref``
from tiny_parity_helpers import (  # noqa: E402, F401
    test_every_layer_matches_transformers,
    test_greedy_tokens_match_transformers,
    test_prompt_logits_match_transformers,
)

W = 8

# a Command-R7B-sized config.json (sliding_window_pattern instead of layer_types)
R7B = {
    "architectures": ["Cohere2ForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 256000, "sliding_window": 4096, "sliding_window_pattern": 4,
    "layer_norm_eps": 1e-05, "logit_scale": 0.25, "rope_theta": 50000.0,
    "max_position_embeddings": 132096, "tie_word_embeddings": True, "bos_token_id": 5,
    "eos_token_id": 255001, "pad_token_id": 0, "torch_dtype": "bfloat16",
}


def test_r7b_config_and_parameter_count():
    cfg = ModelArchConfig.from_dict(dict(R7B))
    assert cfg.family == "cohere2" and cfg.tie_word_embeddings
    assert cfg.layer_windows == (4096, 4096, 4096, None) * 8
    assert (cfg.head_dim, cfg.cohere.layer_norm_eps, cfg.cohere.logit_scale) == (128, 1e-5, 0.25)
    assert cfg.rope.rope_theta == 50000.0 and not cfg.qkv_bias
    hf_cfg = transformers.Cohere2Config(**{k: v for k, v in R7B.items() if k not in (
        "architectures", "rope_theta", "torch_dtype")},
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0})
    with torch.device("meta"):
        hf = transformers.Cohere2ForCausalLM(hf_cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())


def test_defaults_and_errors():
    d = {k: R7B[k] for k in ("architectures", "hidden_size", "intermediate_size",
                             "num_hidden_layers", "num_attention_heads", "vocab_size")}
    cfg = ModelArchConfig.from_dict(d)  # Cohere2Config's defaults
    assert cfg.layer_windows == (4096, 4096, 4096, None) * 8
    assert (cfg.cohere.layer_norm_eps, cfg.cohere.logit_scale) == (1e-5, 0.0625)
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (5, (255001,))
    for bad, match in [({"logit_scale": 0}, "logit_scale"), ({"layer_norm_eps": "x"}, "layer_norm_eps"),
                       ({"layer_types": ["full_attention"]}, "layer_types")]:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict({**d, **bad})


def test_layer_norm_and_interleaved_rope_match_transformers():
    from transformers.models.cohere2.modeling_cohere2 import Cohere2LayerNorm, apply_rotary_pos_emb

    torch.manual_seed(0)
    theirs = Cohere2LayerNorm(24, eps=1e-5)
    ours = CohereLayerNorm(24, 1e-5)
    with torch.no_grad():
        theirs.weight.normal_(1, 0.2)
        ours.weight.copy_(theirs.weight)
    x = torch.randn(5, 24) * 3 + 1
    torch.testing.assert_close(ours(x), theirs(x))
    # RoPE: ours rotates de-interleaved dimensions; every q . k equals transformers'
    t, h, d = 7, 3, 16
    q, k = torch.randn(t, h, d), torch.randn(t, h, d)
    pos = torch.arange(100, 100 + t)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos[:, None].float() * inv
    cos, sin = freqs.cos(), freqs.sin()
    emb = torch.repeat_interleave(freqs, 2, dim=-1)
    tq, tk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                  emb.cos()[None], emb.sin()[None])
    want = torch.einsum("hqd,hkd->hqk", tq[0], tk[0])
    oq, ok = rotate_interleaved(q, cos, sin), rotate_interleaved(k, cos, sin)
    torch.testing.assert_close(torch.einsum("qhd,khd->hqk", oq, ok), want, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return Ref(tiny_dir("cohere2", num_layers=4, sliding_window=W))


def test_tiny_config(ref):
    cfg = ref.ck.config
    assert type(ref.ck.model).__name__ == "Cohere2ForCausalLM"
    assert cfg.layer_windows == (W, W, W, None) and cfg.tie_word_embeddings
    assert cfg.cohere.logit_scale == 0.5
    assert max(len(p) for p in ref.prompts) > 3 * W
    assert cfg.num_parameters() == sum(p.numel() for p in ref.hf.parameters())
