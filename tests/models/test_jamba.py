"""Jamba (``pagedkv.models.jamba`` + ``mamba_mixer``) against transformers, model level (no
engine): config parsing (Jamba-v0.1's values and parameter count, defaults, errors), the cache
layers it declares, Jamba's MoE block against ``JambaSparseMoeBlock``, the Mamba-1 mixer against
``JambaMambaMixer`` on a varlen batch and across chunked prefill + decode steps with its states
in NaN-poisoned slots and ``MambaMetadata`` built by hand, and tiny checkpoints through the
hybrid paged harness: prompt logits, decode-step logits, batched greedy tokens with chunked
prefill and padding, for variants (MoE on mixer and attention layers, attention first with dense
MLPs, projection biases, no conv bias, conv width 3, tied embeddings, the stacked experts
layout). On CPU the mixer's kernels (causal_conv1d, selective_scan) run through the Triton
interpreter."""

import dataclasses

import mamba2_helpers as mh
import pytest
import torch
from checkpoint_helpers import copy_without_tensor
from jamba_helpers import build_tiny_jamba

from pagedkv.core.spec import FullAttentionSpec, MambaSpec
from pagedkv.errors import CheckpointError, ConfigError
from pagedkv.models.config import ModelArchConfig, MoeConfig
from pagedkv.models.jamba import JambaForCausalLM
from pagedkv.models.loader import load_checkpoint
from pagedkv.models.mamba_mixer import MambaMixer
from pagedkv.models.moe import SparseMoeBlock

transformers = pytest.importorskip("transformers")

# ai21labs/Jamba-v0.1's config.json (the values that matter here)
JAMBA_V01 = {
    "architectures": ["JambaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "attn_layer_period": 8, "attn_layer_offset": 4, "expert_layer_period": 2,
    "expert_layer_offset": 1, "num_experts": 16, "num_experts_per_tok": 2,
    "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_dt_rank": 256,
    "mamba_conv_bias": True, "mamba_proj_bias": False, "vocab_size": 65536,
    "rms_norm_eps": 1e-6, "max_position_embeddings": 262144, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16", "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
}

VARIANTS = {
    # layer 0 mixer + MLP, 1 mixer + MoE, 2 attention + MLP, 3 mixer + MoE
    "default": {},
    # attention first, then mixers; dense MLPs only; projection biases, no conv bias, width 3,
    # tied embeddings
    "attn-first-dense-biases": dict(num_hidden_layers=3, attn_layer_period=3,
                                    attn_layer_offset=0, num_experts=1, mamba_proj_bias=True,
                                    mamba_conv_bias=False, mamba_d_conv=3,
                                    tie_word_embeddings=True),
    # MoE on the attention layer too (every layer sparse), top-1, the stacked experts layout
    "stacked-experts": dict(num_hidden_layers=2, attn_layer_period=2, attn_layer_offset=1,
                            expert_layer_period=1, expert_layer_offset=0, num_experts_per_tok=1,
                            save_original_format=False),
}

@pytest.fixture(scope="module")
def pair(tiny_cache):
    return mh.Pairs(lambda name: build_tiny_jamba(tiny_cache, **VARIANTS[name]))


def _hf_parameter_count(d: dict) -> int:
    """transformers' parameter count of ``config.json`` ``d``, built on the meta device."""
    keys = set(transformers.JambaConfig().to_dict())
    cfg = transformers.JambaConfig(**{k: v for k, v in d.items() if k in keys})
    with torch.device("meta"):
        model = transformers.JambaForCausalLM(cfg)
    return sum(p.numel() for p in model.parameters())


def test_jamba_v01_config():
    cfg = ModelArchConfig.from_dict(dict(JAMBA_V01))
    m, moe = cfg.mamba, cfg.moe
    assert cfg.family == "jamba" and m.variant == "jamba" and m.mamba1
    assert [i for i, t in enumerate(m.layer_types) if t == "attention"] == [4, 12, 20, 28]
    assert moe.sparse_layers == tuple(i % 2 == 1 for i in range(32))
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (16, 2, 14336)
    assert not moe.norm_topk_prob and moe.weights_dtype == "model" and moe.scoring == "softmax"
    assert (m.intermediate_size, m.d_state, m.d_conv, m.dt_rank) == (8192, 16, 4, 256)
    assert m.conv_dim == 8192 and m.in_proj_size == 16384
    assert m.conv_state_shape == (3, 8192) and m.ssm_state_shape == (8192, 16)
    assert (m.conv_bias, m.in_proj_bias, m.out_proj_bias, m.gated_norm) == (True, False, False,
                                                                            False)
    assert cfg.head_dim == 128 and m.rotary_dim == 0 and cfg.rms_norm_eps == 1e-6
    # 51.6 B parameters (the published "52B"), as transformers counts them
    n = cfg.num_parameters()
    assert n == _hf_parameter_count(JAMBA_V01)
    assert 51.5e9 < n < 51.7e9


def test_jamba_defaults_and_errors():
    base = {"architectures": ["JambaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 10, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 300}
    cfg = ModelArchConfig.from_dict(dict(base))
    m, moe = cfg.mamba, cfg.moe
    # JambaConfig's defaults: attention at i % 8 == 4, experts at odd layers (16, top-2),
    # dt rank ceil(64 / 16), state 16, conv 4, eps 1e-6
    assert [t == "attention" for t in m.layer_types] == [i == 4 for i in range(10)]
    assert moe.sparse_layers == tuple(i % 2 == 1 for i in range(10))
    assert (moe.num_experts, moe.top_k, m.dt_rank, m.d_state, m.d_conv) == (16, 2, 4, 16, 4)
    assert cfg.rms_norm_eps == 1e-6 and cfg.max_position_embeddings == 262144
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)
    # one expert: every layer dense
    assert not any(ModelArchConfig.from_dict(dict(base, num_experts=1)).moe.sparse_layers)
    for extra in (dict(num_experts=1), dict(mamba_proj_bias=True, mamba_conv_bias=False),
                  dict(attn_layer_period=3, attn_layer_offset=0, mamba_d_conv=2)):
        d = dict(base, **extra)
        assert ModelArchConfig.from_dict(d).num_parameters() == _hf_parameter_count(d)
    bad = [
        (dict(attn_layer_offset=8), "attn_layer_offset"),
        (dict(attn_layer_period=0), "attn_layer_period"),
        (dict(expert_layer_offset=2), "expert_layer_offset"),
        (dict(mamba_d_conv=5), "mamba_d_conv"),
        (dict(mamba_d_state=512), "mamba_d_state"),
        (dict(mamba_dt_rank=0), "mamba_dt_rank"),
        (dict(mamba_conv_bias="yes"), "mamba_conv_bias"),
        (dict(num_experts=4, num_experts_per_tok=5), "num_experts_per_tok"),
    ]
    for extra, match in bad:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict(dict(base, **extra))


def test_cache_layers_and_specs(pair):
    p = pair("default")
    model = p.model
    assert type(model) is JambaForCausalLM
    assert [type(layer.mamba).__name__ if layer.mamba else type(layer.self_attn).__name__
            for layer in model.layers] == ["MambaMixer", "MambaMixer", "JambaAttention",
                                           "MambaMixer"]
    assert [layer.sparse for layer in model.layers] == [False, True, False, True]
    specs = model.kv_cache_specs(16)
    assert list(specs) == ["model.layers.0.mamba", "model.layers.1.mamba",
                           "model.layers.2.self_attn", "model.layers.3.mamba"]
    state, attn = specs["model.layers.0.mamba"], specs["model.layers.2.self_attn"]
    assert isinstance(state, MambaSpec) and isinstance(attn, FullAttentionSpec)
    assert state.shapes == ((3, 64), (64, 8)) and state.dtypes == ("float32", "float32")
    assert (attn.num_kv_heads, attn.head_size) == (2, 8)
    bf16 = load_checkpoint(p.path, dtype="bfloat16").model
    assert bf16.kv_cache_specs(16)["model.layers.1.mamba"].dtypes == ("bfloat16", "float32")
    caches = model.allocate_kv_caches(5, 16, fill=0.0)
    assert isinstance(caches[0], tuple) and caches[0][0].shape == (5, 3, 64)
    assert caches[0][1].shape == (5, 64, 8) and caches[2].shape == (2, 5, 16, 2, 8)


def test_parameter_count_and_strict_loading(pair, tmp_path):
    for name in VARIANTS:
        pair(name).check_parameter_count()
    dst = copy_without_tensor(pair("default").path, tmp_path / "no-b-norm",
                              "model.layers.3.mamba.b_layernorm.weight")
    with pytest.raises(CheckpointError, match=r"model\.layers\.3\.mamba\.b_layernorm\.weight"):
        load_checkpoint(dst)
    with pytest.raises(ConfigError, match="Mamba-1"):
        MambaMixer(32, ModelArchConfig.from_dict({
            "architectures": ["BambaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 1, "num_attention_heads": 4, "vocab_size": 300,
            "mamba_n_heads": 4, "mamba_d_state": 8}).mamba, 1e-6)


def test_moe_block_matches_transformers():
    """Jamba's sparse block (softmax top-k, probabilities not renormalized, model dtype) ==
    transformers' ``JambaSparseMoeBlock`` with the same weights."""
    from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock

    torch.manual_seed(0)
    h, e, i, k = 24, 6, 20, 2
    hf = JambaSparseMoeBlock(transformers.JambaConfig(hidden_size=h, intermediate_size=i,
                                                      num_experts=e, num_experts_per_tok=k)).eval()
    with torch.no_grad():
        for prm in hf.parameters():
            prm.normal_(0, 0.5)
    ours = SparseMoeBlock(h, MoeConfig(num_experts=e, top_k=k, intermediate_size=i,
                                       norm_topk_prob=False, weights_dtype="model",
                                       sparse_layers=(True,)), "jamba")
    sd = hf.state_dict()
    for name, (param, rows) in ours.hf_entries("", "fused").items():
        param.data.copy_(sd[name.removeprefix("feed_forward.")])
    x = torch.randn(37, h)
    with torch.no_grad():
        want = hf(x[None])[0]
        got = ours(x)
        w, ids = ours.route(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(w.sum(-1), torch.ones(37))  # not renormalized
    assert len(set(ids.flatten().tolist())) == e  # every expert used


@pytest.mark.parametrize("layer", [0, 1, 3])
def test_mixer_varlen_batch_matches_transformers(pair, layer):
    mh.check_mixer_varlen_batch(pair("default"), layer=layer, lens=(9, 1, 20, 33))


SCHEDULES = {
    "mixed": mh.MIXED_SCHEDULE,
    # chunks across the kernel's 16-token chunks, a one-token continuation chunk
    "long": [[(0, 40)], [(0, 1)], [(0, 17), (1, 3)], [(0, 1), (1, 1)]],
}


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_mixer_chunked_prefill_and_decodes_equal_one_pass(pair, name):
    mh.check_mixer_steps(pair("default"), SCHEDULES[name], layer=1)


def test_the_step_check_sees_a_dropped_state(pair, monkeypatch):
    """The check above fails when the mixer drops its states between steps (every row told it
    has none: decodes and later chunks start from zeros): the recurrence carries the prompt."""
    real = MambaMixer.forward

    def forgetful(self, hidden, states, meta):
        n = meta.num_actual_reqs
        meta = dataclasses.replace(
            meta, has_initial_state=torch.zeros_like(meta.has_initial_state), num_decodes=0,
            num_decode_tokens=0, num_prefills=n, num_prefill_tokens=meta.num_actual_tokens)
        return real(self, hidden, states, meta)

    monkeypatch.setattr(MambaMixer, "forward", forgetful)
    with pytest.raises(AssertionError):
        mh.check_mixer_steps(pair("default"), SCHEDULES["mixed"], layer=1)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prompt_logits_match_transformers(pair, name):
    mh.check_prompt_logits(pair(name))


@pytest.mark.parametrize("name", ["default", "attn-first-dense-biases"])
def test_decode_step_logits_match_transformers(pair, name):
    p = pair(name)
    mh.check_decode_steps(p, p.prompts[2], steps=6)


def test_batched_greedy_with_chunked_prefill_matches_generate(pair):
    p = pair("default")
    assert [len(x) for x in p.prompts] == sorted({len(x) for x in p.prompts})  # 4 lengths
    mh.check_batched_greedy(p, 10, chunk_size=7, token_budget=16, pad_tokens=3)


def test_batched_greedy_block_32_matches_generate(pair):
    mh.check_batched_greedy(pair("stacked-experts"), 8, block_size=32)
