"""ModelArchConfig: parsing, family flags, defaults, RoPE layouts, validation errors, shapes."""

import json

import pytest

from pagedkv.errors import ConfigError, UnsupportedArchitectureError
from pagedkv.models.config import (
    SUPPORTED_ARCHITECTURES,
    ModelArchConfig,
    load_model_config,
    shape_config,
)


def base(arch="LlamaForCausalLM", **kw):
    d = {
        "architectures": [arch],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "vocab_size": 512,
    }
    d.update(kw)
    return d


def test_family_flags():
    llama = ModelArchConfig.from_dict(base())
    assert (llama.family, llama.qkv_bias, llama.o_bias, llama.mlp_bias, llama.qk_norm) == (
        "llama", False, False, False, False)
    assert llama.head_dim == 16 and llama.num_queries_per_kv == 2
    assert llama.bos_token_id == 1 and llama.eos_token_ids == (2,)  # LlamaConfig defaults
    assert llama.max_position_embeddings == 2048
    biased = ModelArchConfig.from_dict(base(attention_bias=True, mlp_bias=True))
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias
    q2 = ModelArchConfig.from_dict(base("Qwen2ForCausalLM"))
    assert q2.qkv_bias and not q2.o_bias and not q2.qk_norm and q2.bos_token_id is None
    q3 = ModelArchConfig.from_dict(base("Qwen3ForCausalLM"))
    assert q3.qk_norm and not q3.qkv_bias and q3.head_dim == 128  # Qwen3Config's default head_dim
    q3b = ModelArchConfig.from_dict(base("Qwen3ForCausalLM", head_dim=32, attention_bias=True))
    assert q3b.head_dim == 32 and q3b.qkv_bias and q3b.o_bias
    m = ModelArchConfig.from_dict(base("MistralForCausalLM", sliding_window=None))
    assert m.family == "mistral" and not m.qkv_bias


def test_misc_fields():
    c = ModelArchConfig.from_dict(base(
        num_key_value_heads=None, torch_dtype="bfloat16", eos_token_id=[2, 7], tie_word_embeddings=True,
        rms_norm_eps=1e-5, max_position_embeddings=99, pad_token_id=0))
    assert c.num_key_value_heads == 4 and c.dtype == "bfloat16" and c.eos_token_ids == (2, 7)
    assert c.eos_token_id == 2 and c.tie_word_embeddings and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 99 and c.pad_token_id == 0
    assert ModelArchConfig.from_dict(base(dtype="float16")).dtype == "float16"
    assert ModelArchConfig.from_dict(base()).dtype == "float32"


def test_rope_layouts():
    new = ModelArchConfig.from_dict(base(rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert new.rope.rope_type == "default" and new.rope.rope_theta == 5e5
    legacy = ModelArchConfig.from_dict(base(rope_theta=1e6))
    assert legacy.rope.rope_theta == 1e6
    scaled = ModelArchConfig.from_dict(base(rope_theta=5e5, rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert scaled.rope.rope_type == "llama3" and scaled.rope.rope_theta == 5e5
    assert scaled.rope.original_max_position_embeddings == 8192
    yarn = ModelArchConfig.from_dict(base(max_position_embeddings=4096, rope_parameters={
        "rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))
    # original length defaults to max_position_embeddings, as in transformers
    assert yarn.rope.original_max_position_embeddings == 4096
    lin = ModelArchConfig.from_dict(base(rope_scaling={"rope_type": "linear", "factor": 2.0}))
    assert lin.rope.factor == 2.0 and lin.rope.rope_theta == 10000.0


@pytest.mark.parametrize(
    "d, match",
    [
        (base(rope_scaling={"rope_type": "longrope", "factor": 2.0}), "rope type 'longrope' is not supported"),
        (base(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "needs 'low_freq_factor'"),
        (base(rope_scaling={"rope_type": "linear"}), "needs 'factor'"),
        (base(rope_parameters={"rope_type": "default", "rope_theta": -1}), "rope_theta"),
        (base(partial_rotary_factor=0.5), "partial_rotary_factor"),
        (base(hidden_act="gelu"), "hidden_act 'gelu'"),
        (base(num_attention_heads=4, num_key_value_heads=3), "multiple of num_key_value_heads"),
        (base(hidden_size=66, num_attention_heads=4), "head_dim is absent"),
        (base(head_dim=15), "head_dim must be even"),
        (base(hidden_size="64"), "hidden_size must be a positive integer"),
        (base(eos_token_id=-1), "eos_token_id must be a non-negative token id"),
        (base(bos_token_id="1"), "bos_token_id must be a non-negative token id"),
        (base(dtype="int8"), "dtype 'int8' is not supported"),
        ({k: v for k, v in base().items() if k != "vocab_size"}, "required field 'vocab_size' is missing"),
        ({k: v for k, v in base().items() if k != "architectures"}, "'architectures' is missing"),
    ],
)
def test_malformed_configs(d, match):
    with pytest.raises(ConfigError, match=match):
        ModelArchConfig.from_dict(d)


def test_unsupported_architecture_names_it_and_lists_supported():
    with pytest.raises(UnsupportedArchitectureError) as e:
        ModelArchConfig.from_dict(base("GPT2LMHeadModel"))
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in msg
    assert isinstance(e.value, ConfigError)


def test_sliding_window_rules():
    """Per-layer windows as transformers reads them (the engine serves them: SWA groups)."""
    def windows(arch, **kw):
        return ModelArchConfig.from_dict(base(arch, **kw)).layer_windows

    # Mistral: sliding_window on every layer when set
    assert windows("MistralForCausalLM", sliding_window=4096) == (4096, 4096)
    assert windows("MistralForCausalLM", sliding_window=None) == (None, None)
    assert windows("MistralForCausalLM") == (None, None)  # absent
    # Qwen: only with use_sliding_window, on layers >= max_window_layers or per layer_types
    assert windows("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=128) == (None, None)
    assert windows("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=128,
                   max_window_layers=28) == (None, None)  # 2 layers < 28: none slides
    assert windows("Qwen3ForCausalLM", use_sliding_window=True, sliding_window=128,
                   max_window_layers=1) == (None, 128)
    assert windows("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=128,
                   layer_types=["sliding_attention", "full_attention"]) == (128, None)
    assert windows("LlamaForCausalLM", sliding_window=64) == (None, None)  # never slides
    with pytest.raises(ConfigError, match="sliding_window"):
        windows("MistralForCausalLM", sliding_window=-3)
    with pytest.raises(ConfigError, match="layer_types"):
        windows("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=8,
                layer_types=["sliding_attention"])


def test_json_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(ConfigError, match="config.json not found"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_model_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(base()))
    assert load_model_config(tmp_path).hidden_size == 64


def test_named_shapes():
    q = shape_config("qwen3-0.6b")
    assert (q.hidden_size, q.num_hidden_layers, q.num_attention_heads, q.num_key_value_heads, q.head_dim,
            q.intermediate_size, q.vocab_size, q.tie_word_embeddings) == (1024, 28, 16, 8, 128, 3072, 151936, True)
    assert q.qk_norm and q.dtype == "bfloat16"
    assert round(q.num_parameters() / 1e6) == 596
    assert q.kv_cache_bytes_per_token(2) == 2 * 28 * 8 * 128 * 2
    l1 = shape_config("llama-3.2-1b")
    assert l1.rope.rope_type == "llama3" and l1.head_dim == 64 and l1.tie_word_embeddings
    q2 = shape_config("qwen2.5-0.5b", dtype="fp32")
    assert q2.head_dim == 64 and q2.qkv_bias and q2.dtype == "float32"
    with pytest.raises(ConfigError, match="known shapes"):
        shape_config("gpt-5")
