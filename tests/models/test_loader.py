"""Checkpoint loading: sharded and single-file safetensors, dtypes, tied embeddings, tokenizer,
idempotent tiny builds, and clear errors for unsupported or malformed checkpoints."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedkv.errors import CheckpointError, ConfigError, UnsupportedArchitectureError
from pagedkv.models.harness import PagedHarness
from pagedkv.models.loader import checkpoint_files, load_checkpoint, load_model, resolve_dtype
from pagedkv.models.registry import get_model_class, supported_architectures
from pagedkv.models.tiny import build_tiny_checkpoint

transformers = pytest.importorskip("transformers")

PROMPT = "Attention reads the context of each request through its block table, one page at a time."


def _copy(src, tmp_path, name="ckpt"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _hf_state(path, dtype=torch.float32):
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return hf, {k: v.detach() for k, v in hf.state_dict().items()}


def _assert_weights_equal(model, hf_state):
    for name, (param, rows) in model.hf_weight_map().items():
        got = param.data if rows is None else param.data[rows[0]: rows[0] + rows[1]]
        assert torch.equal(got, hf_state[name].to(got.dtype)), name


def test_sharded_checkpoint_loads_like_single_file(tiny_dir):
    single = tiny_dir("qwen2")
    sharded = tiny_dir("qwen2", max_shard_size="20KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    shards = {os.path.basename(f) for f in checkpoint_files(sharded).values()}
    assert len(shards) > 3
    a, b = load_model(single), load_model(sharded)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb), na
    hf, state = _hf_state(sharded)
    _assert_weights_equal(b, state)
    ck = load_checkpoint(sharded)
    p = ck.tokenizer.encode(PROMPT)
    ours = PagedHarness(ck.model, block_size=16, num_blocks=12).greedy_generate([p], 8)[0]
    ids = torch.tensor([p])
    ref = hf.eval().generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
    assert ours == ref


def test_bfloat16_checkpoint_and_dtype_conversion(tiny_dir):
    path = tiny_dir("qwen3", dtype="bfloat16")
    ck = load_checkpoint(path)  # dtype "auto" -> the checkpoint's
    assert ck.config.dtype == "bfloat16" and ck.model.embed_tokens.dtype == torch.bfloat16
    hf, state = _hf_state(path, torch.bfloat16)
    _assert_weights_equal(ck.model, state)
    fp32 = load_model(path, dtype="fp32")
    assert fp32.embed_tokens.dtype == torch.float32
    _assert_weights_equal(fp32, state)  # bf16 -> fp32 is exact
    assert load_model(path, dtype=torch.float16).embed_tokens.dtype == torch.float16
    # bf16 forward: close to transformers' bf16 forward
    p = ck.tokenizer.encode(PROMPT)
    ours = PagedHarness(ck.model, block_size=16, num_blocks=8).prompt_logits(p)
    with torch.no_grad():
        ref = hf.eval()(torch.tensor([p])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=0.1, rtol=0.05)
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_resolve_dtype():
    from pagedkv.models.config import shape_config

    cfg = shape_config("qwen3-0.6b")
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    assert resolve_dtype(None, cfg) == torch.bfloat16
    assert resolve_dtype("half", cfg) == torch.float16
    with pytest.raises(ConfigError, match="not supported"):
        resolve_dtype(torch.int8, cfg)
    with pytest.raises(ConfigError, match="not supported"):
        resolve_dtype("float64", cfg)


def test_tied_embeddings(tiny_dir, tmp_path):
    tied = load_checkpoint(tiny_dir("qwen3"))
    assert tied.config.tie_word_embeddings and tied.model.lm_head is None
    assert tied.model.lm_head_weight is tied.model.embed_tokens
    untied = load_checkpoint(tiny_dir("llama"))
    assert not untied.config.tie_word_embeddings and untied.model.lm_head is not None
    # a tied checkpoint that also stores lm_head.weight loads (the copy is ignored, as in transformers)
    d = _copy(tiny_dir("qwen3"), tmp_path)
    tensors = load_file(d / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    m = load_model(d)
    assert torch.equal(m.lm_head_weight, tied.model.embed_tokens)


def test_tokenizer(tiny_dir):
    for family, has_bos in (("llama", True), ("qwen2", False)):
        path = tiny_dir(family)
        tok = load_checkpoint(path).tokenizer
        hf_tok = transformers.AutoTokenizer.from_pretrained(path)
        ids = tok.encode(PROMPT)
        assert ids == hf_tok(PROMPT)["input_ids"]
        assert (ids[0] == tok.bos_token_id) == has_bos
        assert tok.decode(ids) == PROMPT
        assert tok.eos_token_id == 2 and tok.bos_token_id == 1 and tok.pad_token_id == 0
        assert tok.vocab_size <= load_checkpoint(path).config.vocab_size
        assert tok.decode(tok.encode("ünïcödé ✓ 42")) == "ünïcödé ✓ 42"


def test_tiny_build_is_idempotent(tiny_cache):
    a = build_tiny_checkpoint("mistral", tiny_cache)
    stamp = os.path.getmtime(os.path.join(a, "model.safetensors"))
    assert build_tiny_checkpoint("mistral", tiny_cache) == a
    assert os.path.getmtime(os.path.join(a, "model.safetensors")) == stamp
    b = build_tiny_checkpoint("mistral", tiny_cache, num_layers=3)
    assert b != a and load_checkpoint(b, tokenizer=False).config.num_hidden_layers == 3
    assert not [f for f in os.listdir(tiny_cache) if "building" in f]
    with pytest.raises(ConfigError, match="unknown tiny family"):
        build_tiny_checkpoint("gpt2", tiny_cache)
    with pytest.raises(ConfigError, match="bad tiny checkpoint option"):
        build_tiny_checkpoint("llama", tiny_cache, hidden=3)


def test_registry():
    from pagedkv.models.decoder import DecoderForCausalLM
    from pagedkv.models.gemma import GemmaForCausalLM

    from pagedkv.models.deepseek_v3 import DeepseekV3ForCausalLM
    from pagedkv.models.moe_decoder import MoeForCausalLM

    assert set(supported_architectures()) == {
        "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM",
        "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
        "DeepseekV3ForCausalLM", "Qwen3NextForCausalLM", "BambaForCausalLM",
        "FalconH1ForCausalLM", "JambaForCausalLM", "GptOssForCausalLM", "Cohere2ForCausalLM", "DeepseekV32ForCausalLM",
        "DeepseekV4ForCausalLM"}
    assert get_model_class("DeepseekV3ForCausalLM") is DeepseekV3ForCausalLM
    assert get_model_class("BambaForCausalLM").__name__ == "BambaForCausalLM"
    assert get_model_class("FalconH1ForCausalLM").__name__ == "FalconH1ForCausalLM"
    assert get_model_class("JambaForCausalLM").__name__ == "JambaForCausalLM"
    assert get_model_class("GptOssForCausalLM").__name__ == "GptOssForCausalLM"
    assert get_model_class("Cohere2ForCausalLM").__name__ == "Cohere2ForCausalLM"
    assert get_model_class("DeepseekV32ForCausalLM").__name__ == "DeepseekV32ForCausalLM"
    assert get_model_class("DeepseekV4ForCausalLM").__name__ == "DeepseekV4ForCausalLM"
    assert get_model_class("Gemma3ForCausalLM") is GemmaForCausalLM
    assert get_model_class("MistralForCausalLM") is DecoderForCausalLM
    assert get_model_class("Qwen3MoeForCausalLM") is MoeForCausalLM
    assert get_model_class("MixtralForCausalLM") is MoeForCausalLM
    with pytest.raises(UnsupportedArchitectureError, match="FalconForCausalLM.*LlamaForCausalLM"):
        get_model_class("FalconForCausalLM")


# ---- errors


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def test_unsupported_architecture(tiny_dir, tmp_path):
    d = _copy(tiny_dir("llama"), tmp_path)
    _edit_config(d, architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_checkpoint(d)
    assert "GPTNeoXForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)


def test_missing_and_unexpected_tensors(tiny_dir, tmp_path):
    d = _copy(tiny_dir("llama"), tmp_path)
    original = load_file(d / "model.safetensors")
    tensors = dict(original)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert "missing tensors: model.layers.1.mlp.up_proj.weight" in msg
    assert "unexpected tensors: model.layers.0.self_attn.extra.weight" in msg
    # untied model without lm_head
    tensors = dict(original)
    del tensors["lm_head.weight"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="missing tensors: lm_head.weight"):
        load_model(d)


def test_config_and_weights_disagree(tiny_dir, tmp_path):
    d = _copy(tiny_dir("qwen3"), tmp_path)
    _edit_config(d, num_hidden_layers=3)
    with pytest.raises(CheckpointError, match="missing tensors: model.layers.2"):
        load_model(d)
    _edit_config(d, num_hidden_layers=2, intermediate_size=96)
    with pytest.raises(CheckpointError, match=r"mlp.gate_proj.weight has shape \(128, 64\), expected \(96, 64\)"):
        load_model(d)


def test_malformed_files(tiny_dir, tmp_path):
    d = _copy(tiny_dir("qwen2"), tmp_path)
    (d / "config.json").write_text('{"architectures": ["Qwen2ForCausalLM"], ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_checkpoint(d)
    d = _copy(tiny_dir("qwen2"), tmp_path, "trunc")
    blob = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: cannot read"):
        load_model(d)
    (d / "model.safetensors").write_bytes(b"\x00" * 7)
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_model(d)
    os.remove(d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"no \*.safetensors"):
        load_model(d)


def test_sharded_index_errors(tiny_dir, tmp_path):
    d = _copy(tiny_dir("qwen2", max_shard_size="20KB"), tmp_path)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    moved = d / "moved.bin"
    os.rename(d / victim, moved)
    with pytest.raises(CheckpointError, match=f"shard files that do not exist: {victim}"):
        load_model(d)
    os.rename(moved, d / victim)
    # the index maps a tensor to a shard that does not hold it
    name = next(n for n, f in index["weight_map"].items() if f != victim)
    index["weight_map"][name] = victim
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"lacks them: {name}"):
        load_model(d)
    (d / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(CheckpointError, match="weight_map"):
        load_model(d)


def test_tokenizer_missing(tiny_dir, tmp_path):
    d = _copy(tiny_dir("qwen3"), tmp_path)
    os.remove(d / "tokenizer.json")
    with pytest.raises(CheckpointError, match="tokenizer.json is missing"):
        load_checkpoint(d)
    assert load_checkpoint(d, tokenizer="auto").tokenizer is None
    assert load_checkpoint(d, tokenizer=False).model is not None


def test_shape_spec_options_reproduce_named_shapes():
    from pagedkv.models.config import ModelArchConfig, shape_config
    from pagedkv.models.tiny import FAMILY_ARCHITECTURES, TinySpec, hf_config_dict, shape_spec_options

    for name in ("qwen3-0.6b", "llama-3.2-1b", "qwen2.5-0.5b"):
        family, opts = shape_spec_options(name)
        spec = TinySpec(family=family, **opts)
        spec.validate()
        hf_cfg = getattr(transformers, FAMILY_ARCHITECTURES[family].replace("ForCausalLM", "Config"))(
            **hf_config_dict(spec))
        d = {**hf_cfg.to_dict(), "architectures": [FAMILY_ARCHITECTURES[family]]}
        got, want = ModelArchConfig.from_dict(d), shape_config(name)
        for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                  "intermediate_size", "vocab_size", "tie_word_embeddings", "rms_norm_eps", "rope", "qkv_bias",
                  "qk_norm", "max_position_embeddings"):
            assert getattr(got, f) == getattr(want, f), (name, f)
        assert opts["dtype"] == want.dtype  # applied when the model is saved
