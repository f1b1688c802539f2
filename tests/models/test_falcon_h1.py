"""Falcon-H1 (``pagedkv.models.falcon_h1``: Bamba's model with hybrid layers, a Mamba-2 mixer
and attention in parallel, and muP multipliers) against transformers, model level (no
engine): config parsing (defaults, the multipliers, ``mamba_d_ssm``, errors), the two cache
layers of every layer, the mixer's three gate variants (``mamba_rms_norm`` off, norm before /
after the gate) on a varlen batch and across chunked prefill + decode steps, and the tiny
checkpoints through the hybrid paged harness: prompt logits, decode-step logits, batched greedy
tokens with chunked prefill and padding; one variant with every multiplier away from 1,
projection biases, a head_dim that is not hidden / heads and a mixer width from
``mamba_d_ssm``."""

import math

import mamba2_helpers as mh
import pytest
import torch

from pagedkv.core.spec import FullAttentionSpec, MambaSpec
from pagedkv.errors import ConfigError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.mamba2_mixer import gated_rms_norm, mup_vector

transformers = pytest.importorskip("transformers")

MULTIPLIERS = {
    "embedding_multiplier": 0.8, "lm_head_multiplier": 1.3, "attention_in_multiplier": 0.9,
    "attention_out_multiplier": 1.1, "key_multiplier": 0.7, "ssm_in_multiplier": 1.2,
    "ssm_out_multiplier": 0.6, "ssm_multipliers": [0.9, 1.1, 0.8, 1.2, 0.7],
    "mlp_multipliers": [1.3, 0.7],
}
VARIANTS = {
    "default": dict(),  # mamba_rms_norm false: y * silu(z)
    "rms-norm": dict(mamba_options={"mamba_rms_norm": True}),
    "multipliers": dict(head_dim=8, mamba_options={
        "mamba_rms_norm": True, "mamba_norm_before_gate": False, "mamba_d_ssm": 96,
        "mamba_proj_bias": True, "projectors_bias": True, "mamba_n_groups": 1, **MULTIPLIERS}),
}

@pytest.fixture(scope="module")
def pair(tiny_dir):
    return mh.Pairs(lambda name: tiny_dir("falcon_h1", **VARIANTS[name]))


BASE = {"architectures": ["FalconH1ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 300, "mamba_n_heads": 8, "mamba_d_state": 16}


def test_falcon_h1_config_defaults_and_multipliers():
    cfg = ModelArchConfig.from_dict(dict(BASE))
    m = cfg.mamba
    assert m.variant == "falcon_h1" and m.layer_types == ("hybrid",) * 3
    assert all(m.has_mixer(i) and m.has_attention(i) for i in range(3))
    # FalconH1Config's defaults: mamba_d_ssm 1024 (not expand * hidden), eps 1e-5, full RoPE,
    # mamba_rms_norm false, norm before the gate, no projector bias
    assert m.intermediate_size == 1024 and m.head_dim == 128
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 8192
    assert m.rotary_dim == cfg.head_dim == 16
    assert (m.gated_norm, m.norm_before_gate, m.out_proj_bias) == (False, True, False)
    assert m.ssm_multipliers == (1.0,) * 5 and m.mlp_multipliers == (1.0, 1.0)
    cfg = ModelArchConfig.from_dict(dict(BASE, mamba_d_ssm=None, head_dim=32, **MULTIPLIERS))
    m = cfg.mamba
    assert m.intermediate_size == 128 and m.head_dim == 16 and cfg.head_dim == 32
    assert (m.embedding_multiplier, m.lm_head_multiplier, m.key_multiplier) == (0.8, 1.3, 0.7)
    assert (m.attention_in_multiplier, m.attention_out_multiplier) == (0.9, 1.1)
    assert (m.ssm_in_multiplier, m.ssm_out_multiplier) == (1.2, 0.6)
    assert m.ssm_multipliers == (0.9, 1.1, 0.8, 1.2, 0.7) and m.mlp_multipliers == (1.3, 0.7)
    assert m.time_step_limit == (0.0, math.inf)
    bad = [
        (dict(ssm_multipliers=[1.0, 1.0]), "ssm_multipliers"),
        (dict(mlp_multipliers="x"), "mlp_multipliers"),
        (dict(key_multiplier=None), "key_multiplier"),
        (dict(mamba_rms_norm=1), "mamba_rms_norm"),
        (dict(mamba_d_ssm=100), "must divide"),
        (dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                               "partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    ]
    for extra, match in bad:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict(dict(BASE, **extra))


def test_mup_vector_and_gated_norm_by_hand():
    cfg = ModelArchConfig.from_dict(dict(BASE, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_state=2,
                                         mamba_n_groups=1, **MULTIPLIERS))
    v = mup_vector(cfg.mamba)
    # [z 32 | x 32 | B 2 | C 2 | dt 4]
    assert v.shape == (72,) and v[:32].eq(0.9).all() and v[32:64].eq(1.1).all()
    assert v[64:66].eq(0.8).all() and v[66:68].eq(1.2).all() and v[68:].eq(0.7).all()
    assert mup_vector(ModelArchConfig.from_dict(dict(BASE)).mamba) is None
    # two groups of two: rms of [3, 4] is sqrt(12.5), of [0, 2] sqrt(2)
    y = torch.tensor([[3.0, 4.0, 0.0, 2.0]])
    gate = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    w = torch.tensor([1.0, 2.0, 3.0, 4.0])
    silu = gate * torch.sigmoid(gate)
    before = torch.tensor([3 / 12.5 ** 0.5, 8 / 12.5 ** 0.5, 0.0, 8 / 2 ** 0.5]) * silu[0]
    torch.testing.assert_close(gated_rms_norm(y, gate, w, 0.0, 2, True)[0], before)
    g = y * silu  # [0, 4 s(1), 0, -2 s(-1)] normed per group
    after = torch.stack([g[0, :2] / g[0, :2].pow(2).mean().sqrt(),
                         g[0, 2:] / g[0, 2:].pow(2).mean().sqrt()]).reshape(4) * w
    torch.testing.assert_close(gated_rms_norm(y, gate, w, 0.0, 2, False)[0], after)


def test_two_cache_layers_per_layer(pair):
    model = pair("default").model
    assert type(model).__name__ == "FalconH1ForCausalLM"
    specs = model.kv_cache_specs(32)
    assert list(specs) == ["model.layers.0.mamba", "model.layers.0.self_attn",
                           "model.layers.1.mamba", "model.layers.1.self_attn"]
    assert isinstance(specs["model.layers.1.mamba"], MambaSpec)
    assert isinstance(specs["model.layers.1.self_attn"], FullAttentionSpec)
    mc = model.config.mamba
    assert specs["model.layers.0.mamba"].shapes == ((3, mc.conv_dim), (4, 32, 16))


def test_parameter_count(pair):
    for name in VARIANTS:
        pair(name).check_parameter_count()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_mixer_varlen_batch_matches_transformers(pair, name):
    mh.check_mixer_varlen_batch(pair(name), layer=1, lens=(1, 9, 20, 33))


@pytest.mark.parametrize("name", ["default", "multipliers"])
def test_mixer_chunked_prefill_and_decodes_equal_one_pass(pair, name):
    schedule = [[(1, 1), (0, 12)], [(0, 1), (1, 19)], [(0, 17), (1, 5)], [(0, 1), (1, 1)],
                [(1, 1), (0, 1)]]
    mh.check_mixer_steps(pair(name), schedule, layer=0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prompt_logits_match_transformers(pair, name):
    mh.check_prompt_logits(pair(name))


@pytest.mark.parametrize("name", ["default", "multipliers"])
def test_decode_step_logits_match_transformers(pair, name):
    p = pair(name)
    mh.check_decode_steps(p, p.prompts[1], steps=6)


@pytest.mark.parametrize("name", ["rms-norm", "multipliers"])
def test_batched_greedy_with_chunked_prefill_matches_generate(pair, name):
    mh.check_batched_greedy(pair(name), 10, chunk_size=7, token_budget=16, pad_tokens=3)
