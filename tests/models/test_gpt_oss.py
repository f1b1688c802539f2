"""GPT-OSS (``pagedkv.models.gpt_oss``): config parsing (GPT-OSS-20B's config.json, the
defaults of ``GptOssConfig``, errors), the parameter count against transformers' model, the
routing by hand, the MoE block against transformers' ``GptOssMLP`` (both experts
implementations; biases, interleaved gate/up, the clamp acting), and the tiny checkpoint
through the paged harness (NaN-poisoned pool, shuffled blocks) against transformers: every
layer's output, prompt logits, batched greedy tokens (block sizes 16 and 32, chunked prefill
mixed with decodes, prompts longer than the window), the sinks and the window shown to matter,
the loader's strictness, the tiny routing not degenerate."""

import json
import os
import shutil

import pytest
import torch

from pagedkv.errors import CheckpointError, ConfigError
from pagedkv.models.config import ModelArchConfig, MoeConfig
from pagedkv.models.loader import load_checkpoint
from pagedkv.models.moe import SparseMoeBlock, route_topk_softmax

transformers = pytest.importorskip("transformers")
from test_deepseek_v3 import Ref  # noqa: E402 - the tiny-checkpoint reference
# the harness-vs-transformers tests (every layer, prompt logits, greedy tokens) on ``ref``
from tiny_parity_helpers import (  # noqa: E402, F401
    test_every_layer_matches_transformers,
    test_greedy_tokens_match_transformers,
    test_prompt_logits_match_transformers,
)

W = 16  # the tiny checkpoint's window

# GPT-OSS-20B's config.json (without its MXFP4 quantization_config)
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
    "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
    "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                     "original_max_position_embeddings": 4096, "rope_type": "yarn",
                     "truncate": False},
    "rope_theta": 150000, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "vocab_size": 201088, "eos_token_id": 200002,
    "pad_token_id": 199999, "torch_dtype": "bfloat16",
}


def test_gpt_oss_20b_config_and_parameter_count():
    cfg = ModelArchConfig.from_dict(dict(GPT_OSS_20B))
    assert cfg.family == "gpt_oss" and cfg.attn_sinks and cfg.qkv_bias and cfg.o_bias
    assert cfg.layer_windows == (128, None) * 12
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (64, 8, 64)
    m = cfg.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.scoring, m.activation) == (
        32, 4, 2880, "topk_softmax", "swiglu_clamp")
    assert (m.swiglu_alpha, m.swiglu_limit, m.router_bias, m.expert_bias) == (1.702, 7.0, True, True)
    assert m.sparse_layers == (True,) * 24 and not m.norm_topk_prob and m.weights_dtype == "model"
    r = cfg.rope
    assert (r.rope_type, r.factor, r.original_max_position_embeddings, r.truncate,
            r.rope_theta) == ("yarn", 32.0, 4096, False, 150000)
    assert cfg.max_trained_len == 131072
    # transformers' own model of this config, on the meta device
    hf_cfg = transformers.GptOssConfig(**{k: v for k, v in GPT_OSS_20B.items()
                                          if k not in ("architectures", "rope_scaling",
                                                       "rope_theta", "torch_dtype")},
                                       rope_parameters={**GPT_OSS_20B["rope_scaling"],
                                                        "rope_theta": 150000.0})
    with torch.device("meta"):
        hf = transformers.GptOssForCausalLM(hf_cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert 20.8e9 < cfg.num_parameters() < 21.0e9


def test_defaults_and_errors():
    d = {k: GPT_OSS_20B[k] for k in ("architectures", "hidden_size", "intermediate_size",
                                     "num_hidden_layers", "num_attention_heads", "vocab_size")}
    cfg = ModelArchConfig.from_dict(d)  # GptOssConfig's defaults
    assert cfg.head_dim == 64 and cfg.moe.num_experts == 128 and cfg.moe.top_k == 4
    assert cfg.layer_windows == (128, None) * 12  # sliding on even layers, window 128
    assert (cfg.moe.swiglu_alpha, cfg.moe.swiglu_limit) == (1.702, 7.0)
    assert cfg.max_position_embeddings == 131072
    for bad, match in [({"swiglu_limit": 0}, "swiglu_limit"),
                       ({"swiglu_alpha": "x"}, "swiglu_alpha"),
                       ({"num_experts_per_tok": 200}, "num_experts_per_tok"),
                       ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
                       ({"sliding_window": 0}, "sliding_window")]:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict({**d, **bad})


def test_topk_softmax_routing_by_hand():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    w, ids = route_topk_softmax(logits, 2)
    assert ids[0].tolist() == [1, 3]
    e = torch.tensor([2.0, 1.0]).exp()
    torch.testing.assert_close(w[0], e / e.sum())
    w16, _ = route_topk_softmax(logits.half(), 2)
    assert w16.dtype == torch.float16


H, E, I, K = 40, 8, 24, 2


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("limit", [7.0, 0.7])
def test_moe_block_matches_transformers(impl, limit):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    torch.manual_seed(int(limit * 10))
    hf_cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                                       num_experts_per_tok=K, swiglu_limit=limit)
    hf_cfg._experts_implementation = impl
    hf = GptOssMLP(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    moe = MoeConfig(num_experts=E, top_k=K, intermediate_size=I, norm_topk_prob=False,
                    weights_dtype="model", sparse_layers=(True,), scoring="topk_softmax",
                    router_bias=True, expert_bias=True, activation="swiglu_clamp",
                    swiglu_limit=limit)
    ours = SparseMoeBlock(H, moe, "gpt_oss")
    assert ours.gate_up_interleaved
    # the checkpoint's names and shapes map onto the block's parameters (filled in place)
    entries = ours.hf_entries("model.layers.0.", "per_expert")
    assert sorted(entries) == sorted(f"model.layers.0.mlp.{n}" for n in (
        "router.weight", "router.bias", "experts.gate_up_proj", "experts.gate_up_proj_bias",
        "experts.down_proj", "experts.down_proj_bias"))
    state = {"router.weight": hf.router.weight, "router.bias": hf.router.bias,
             "experts.gate_up_proj": hf.experts.gate_up_proj,
             "experts.gate_up_proj_bias": hf.experts.gate_up_proj_bias,
             "experts.down_proj": hf.experts.down_proj,
             "experts.down_proj_bias": hf.experts.down_proj_bias}
    with torch.no_grad():
        for name, (dst, rows) in entries.items():
            src = state[name.removeprefix("model.layers.0.mlp.")]
            assert rows is None and dst.shape == src.shape
            dst.copy_(src)
    x = torch.randn(3, 11, H)
    with torch.no_grad():
        want, _ = hf(x)
        _, hf_w, hf_ids = hf.router(x.reshape(-1, H))
        w, ids = ours.route(x.reshape(-1, H))
        got = ours(x.reshape(-1, H))
        gate_up = torch.einsum("th,ehi->tei", x.reshape(-1, H), hf.experts.gate_up_proj)
    assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)
    assert len(ids.unique()) >= E - 1
    if limit < 1:
        assert (gate_up.abs() > limit).float().mean() > 0.2  # the clamp acts
    torch.testing.assert_close(got, want.reshape(-1, H), atol=1e-5, rtol=1e-5)


# ---- the tiny checkpoint against transformers


@pytest.fixture(scope="module")
def ref(tiny_dir):
    return Ref(tiny_dir("gpt_oss", num_layers=3))


def test_tiny_config(ref):
    cfg = ref.ck.config
    assert type(ref.ck.model).__name__ == "GptOssForCausalLM"
    assert cfg.layer_windows == (W, None, W) and cfg.rope.rope_type == "yarn"
    assert max(len(p) for p in ref.prompts) > 3 * W
    assert cfg.num_parameters() == sum(t.numel() for t in ref.hf.state_dict().values())


def test_sinks_and_window_matter(ref):
    """Without a layer's sinks, or with the window ignored, the logits differ."""
    model = ref.ck.model
    prompt = ref.prompts[3]
    base = ref.harness(16).prompt_logits(prompt)
    attn = model.layers[0].self_attn
    saved = attn.sinks.detach().clone()
    try:
        with torch.no_grad():
            attn.sinks.fill_(-1e4)
        assert (ref.harness(16).prompt_logits(prompt) - base).abs().max() > 1e-2
    finally:
        with torch.no_grad():
            attn.sinks.copy_(saved)
    windowless = model.attention_layout  # every layer full: the sliding layers see everything
    model.attention_layout = lambda spec=None: windowless(None)
    try:
        assert (ref.harness(16).prompt_logits(prompt) - base).abs().max() > 1e-2
    finally:
        del model.attention_layout
    torch.testing.assert_close(ref.harness(16).prompt_logits(prompt), base)


def test_tiny_routing_is_not_degenerate_and_the_clamp_acts(ref):
    """On the longest prompt every layer routes to all experts but one at most, and some
    gate/up values pass the SwiGLU limit."""
    model = ref.ck.model
    seen = []

    def record(mod, args, out):
        x = args[0]
        pre = torch.einsum("th,eih->tei", x, mod.w13) + mod.w13_bias
        seen.append((mod.route(x)[1], float(pre.abs().max())))

    hooks = [layer.mlp.register_forward_hook(record) for layer in model.layers]
    ref.harness(16).prompt_logits(ref.prompts[3])
    for hk in hooks:
        hk.remove()
    m = model.config.moe
    assert len(seen) == len(model.layers)
    for ids, largest in seen:
        assert len(ids.unique()) >= m.num_experts - 1, ids.unique().tolist()
        assert largest > m.swiglu_limit


def test_loader_is_strict(ref, tmp_path):
    """A checkpoint without a layer's sinks, or without an expert bias, is refused."""
    from safetensors.torch import load_file, save_file

    for drop in ("model.layers.1.self_attn.sinks", "model.layers.0.mlp.experts.down_proj_bias"):
        d = tmp_path / drop.replace(".", "_")
        shutil.copytree(ref.ck.model_dir, d)
        f = os.path.join(d, "model.safetensors")
        tensors = load_file(f)
        del tensors[drop]
        save_file(tensors, f, metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=drop.replace(".", r"\.")):
            load_checkpoint(str(d), dtype="float32")
    with open(os.path.join(ref.ck.model_dir, "config.json")) as f:
        assert json.load(f)["swiglu_limit"] == 1.0  # the tiny model's limit (the clamp acts)
