"""Bamba (``pagedkv.models.bamba`` + ``mamba2_mixer``) against transformers, model level (no
engine): config parsing (Bamba-9B's values, defaults, errors), the cache layers it declares,
the Mamba-2 mixer on a varlen batch and across chunked prefill + decode steps with its states
in NaN-poisoned slots and ``MambaMetadata`` built by hand, and the tiny checkpoints through the
hybrid paged harness: prompt logits, decode-step logits, batched greedy tokens with chunked
prefill and padding, for variants (2 groups / 1 group, conv bias or not, conv width 3,
projection and attention biases, tied embeddings, a time-step limit)."""

import math

import mamba2_helpers as mh
import pytest
import torch
from checkpoint_helpers import copy_without_tensor

from pagedkv.core.spec import FullAttentionSpec, MambaSpec
from pagedkv.errors import CheckpointError, ConfigError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.loader import load_checkpoint

transformers = pytest.importorskip("transformers")

# ibm-ai-platform/Bamba-9B's config.json (the values that matter here)
BAMBA_9B = {
    "architectures": ["BambaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "attn_layer_indices": [9, 18, 27], "mamba_n_heads": 128, "mamba_d_head": 64,
    "mamba_n_groups": 1, "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
    "mamba_chunk_size": 256, "mamba_conv_bias": True, "mamba_proj_bias": False,
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0,
}

VARIANTS = {
    "default": dict(num_layers=3),
    "biases-1group-w3-tied": dict(num_layers=2, tie_word_embeddings=True,
                                  mamba_options={"mamba_proj_bias": True, "mamba_n_groups": 1,
                                                 "mamba_conv_bias": False, "mamba_d_conv": 3,
                                                 "attn_layer_indices": [0], "mlp_bias": True,
                                                 "attention_bias": True}),
    "time-step-limit": dict(num_layers=2, mamba_options={"time_step_limit": [0.05, 0.5]}),
}

@pytest.fixture(scope="module")
def pair(tiny_dir):
    return mh.Pairs(lambda name: tiny_dir("bamba", **VARIANTS[name]))


def test_bamba_9b_config():
    cfg = ModelArchConfig.from_dict(dict(BAMBA_9B))
    m = cfg.mamba
    assert type(m).__name__ == "MambaConfig" and m.variant == "bamba"
    assert [i for i, t in enumerate(m.layer_types) if t == "attention"] == [9, 18, 27]
    assert set(m.layer_types) == {"mamba", "attention"}
    assert (m.num_heads, m.head_dim, m.n_groups, m.d_state, m.d_conv) == (128, 64, 1, 128, 4)
    assert m.intermediate_size == 8192 and m.conv_dim == 8192 + 2 * 128
    assert m.in_proj_size == 8192 + m.conv_dim + 128
    assert m.conv_state_shape == (3, 8448) and m.ssm_state_shape == (128, 64, 128)
    assert (cfg.head_dim, m.rotary_dim) == (128, 64)  # RoPE on half of each head
    assert m.time_step_limit == (0.0, math.inf) and m.gated_norm and not m.norm_before_gate
    assert (m.conv_bias, m.in_proj_bias, m.out_proj_bias) == (True, False, False)
    assert (m.embedding_multiplier, m.lm_head_multiplier, m.ssm_multipliers) == (1.0, 1.0, (1.0,) * 5)
    # the parameter count: a hand sum (9.8 B; the published size is "9B")
    h, L, inter = 4096, 32, 14336
    attn = h * (4096 + 2 * 1024) + 4096 * h
    mixer = h * m.in_proj_size + m.conv_dim * 5 + 3 * 128 + 8192 + 8192 * h
    want = 3 * attn + 29 * mixer + L * (3 * h * inter + 2 * h) + 2 * 128256 * h + h
    assert cfg.num_parameters() == want
    assert 9.7e9 < want < 9.9e9


def test_bamba_defaults_and_errors():
    base = {"architectures": ["BambaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 300}
    cfg = ModelArchConfig.from_dict(dict(base, mamba_n_heads=8, mamba_d_state=16))
    m = cfg.mamba
    # BambaConfig's defaults: eps 1e-5, no attention layer, d_head "auto" = 2 * 64 / 8
    assert cfg.rms_norm_eps == 1e-5 and cfg.max_position_embeddings == 262144
    assert m.layer_types == ("mamba", "mamba") and m.head_dim == 16 and m.d_conv == 4
    # transformers hard-codes half-rotary RoPE whatever the config says; save_pretrained's
    # infinity
    cfg = ModelArchConfig.from_dict(dict(
        base, mamba_n_heads=8, mamba_d_state=16,
        rope_parameters={"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 1.0},
        time_step_limit=[0.001, {"__float__": "Infinity"}]))
    assert cfg.mamba.rotary_dim == 8 and cfg.rope.rope_theta == 5e5
    assert cfg.mamba.time_step_limit == (0.001, math.inf)
    bad = [
        (dict(mamba_n_heads=6), "must divide"),
        (dict(mamba_n_heads=8, mamba_d_head=8), "must equal the mixer width"),
        (dict(mamba_n_heads=8, mamba_n_groups=3), "multiple of mamba_n_groups"),
        (dict(mamba_n_heads=8, mamba_d_conv=5), "mamba_d_conv"),
        (dict(mamba_n_heads=8, mamba_d_state=512), "mamba_d_state"),
        (dict(mamba_n_heads=8, attn_layer_indices=[2]), "attn_layer_indices"),
        (dict(mamba_n_heads=8, time_step_limit=[1.0, 0.5]), "time_step_limit"),
        (dict(mamba_n_heads=8, time_step_limit=[0.0]), "time_step_limit"),
        (dict(mamba_n_heads=8, mamba_conv_bias="yes"), "mamba_conv_bias"),
    ]
    for extra, match in bad:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict(dict(base, **extra))


def test_cache_layers_and_specs(pair):
    p = pair("default")
    model = p.model
    assert type(model).__name__ == "BambaForCausalLM"
    specs = model.kv_cache_specs(16)
    assert list(specs) == ["model.layers.0.mamba", "model.layers.1.self_attn",
                           "model.layers.2.mamba"]
    state, attn = specs["model.layers.0.mamba"], specs["model.layers.1.self_attn"]
    mc = model.config.mamba
    assert isinstance(state, MambaSpec) and isinstance(attn, FullAttentionSpec)
    assert state.shapes == ((3, mc.conv_dim), (4, 32, 16)) and state.dtypes == ("float32", "float32")
    assert (attn.num_kv_heads, attn.head_size) == (2, 16)
    assert specs["model.layers.2.mamba"] == state
    # bf16: the conv state in the model dtype, the SSM state float32
    bf16 = load_checkpoint(p.path, dtype="bfloat16").model
    assert bf16.kv_cache_specs(16)["model.layers.0.mamba"].dtypes == ("bfloat16", "float32")
    caches = model.allocate_kv_caches(5, 16, fill=0.0)
    assert isinstance(caches[0], tuple) and caches[0][0].shape == (5, 3, mc.conv_dim)
    assert caches[0][1].shape == (5, 4, 32, 16) and caches[1].shape == (2, 5, 16, 2, 16)


def test_parameter_count_and_strict_loading(pair, tmp_path):
    for name in VARIANTS:
        pair(name).check_parameter_count()
    dst = copy_without_tensor(pair("default").path, tmp_path / "no-dt-bias",
                              "model.layers.2.mamba.dt_bias")
    with pytest.raises(CheckpointError, match="model.layers.2.mamba.dt_bias"):
        load_checkpoint(dst)


@pytest.mark.parametrize("lens", [(9, 1, 20, 33), (1, 1, 37, 5)])
def test_mixer_varlen_batch_matches_transformers(pair, lens):
    mh.check_mixer_varlen_batch(pair("default"), layer=0, lens=lens)


SCHEDULES = {
    "mixed": mh.MIXED_SCHEDULE,
    # chunks crossing the kernel's 64-token chunks, a one-token continuation chunk
    "long": [[(0, 70)], [(0, 1)], [(0, 60), (1, 3)], [(0, 1), (1, 1)]],
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_mixer_chunked_prefill_and_decodes_equal_one_pass(pair, name):
    mh.check_mixer_steps(pair("default"), SCHEDULES[name], layer=2)


def test_mixer_time_step_limit_in_prefill(pair):
    # transformers clamps dt only in its chunked (prefill) branch: prefill chunks of any
    # length >= 2 continue the clamped scan exactly
    p = pair("time-step-limit")
    assert p.model.config.mamba.time_step_limit == (0.05, 0.5)
    mh.check_mixer_varlen_batch(p, layer=0, lens=(9, 20, 33))
    mh.check_mixer_steps(p, [[(0, 10), (1, 4)], [(0, 7), (1, 30)]], layer=0)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prompt_logits_match_transformers(pair, name):
    mh.check_prompt_logits(pair(name))


@pytest.mark.parametrize("name", ["default", "biases-1group-w3-tied"])
def test_decode_step_logits_match_transformers(pair, name):
    p = pair(name)
    mh.check_decode_steps(p, p.prompts[2], steps=6)


def test_batched_greedy_with_chunked_prefill_matches_generate(pair):
    mh.check_batched_greedy(pair("default"), 10, chunk_size=7, token_budget=16, pad_tokens=3)


def test_batched_greedy_block_32_matches_generate(pair):
    mh.check_batched_greedy(pair("biases-1group-w3-tied"), 8, block_size=32)
