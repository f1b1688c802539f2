"""DeepSeek-V3 (``pagedkv.models.deepseek_v3``): config parsing (V3's defaults and sizes, the
YaRN softmax scale, sparse layers, errors), DeepSeek's routing and MoE block against
transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV3MoE`` (both experts implementations), and
the tiny checkpoints through the paged harness (NaN-poisoned pool, shuffled blocks) against
transformers: prompt logits and batched greedy tokens (block sizes 16 and 32, chunked prefill
mixed with decodes) for the variants (q LoRA / plain q_proj, interleaved / halves RoPE, YaRN,
attention bias, 3 layers, stacked experts layout); the loader skips the multi-token-prediction
layers only; the routing of the tiny checkpoint is not degenerate."""

import json
import math
import os
import shutil

import pytest
import torch

from pagedkv.errors import CheckpointError, ConfigError
from pagedkv.models.config import ModelArchConfig, MoeConfig
from pagedkv.models.harness import PagedHarness
from pagedkv.models.loader import load_checkpoint
from pagedkv.models.moe import SparseMoeBlock, route_grouped_sigmoid

transformers = pytest.importorskip("transformers")

TEXTS = [
    "Hello",
    "The block table maps a request row",
    "Chunked prefill splits a long prompt over several steps so that decode requests keep moving.",
    "Prefix caching hashes full blocks so that a new prompt can reuse the blocks of an old one. "
    "When the pool runs out of free blocks, the scheduler preempts the newest running request!",
]
NEW_TOKENS = 12

# DeepSeek-V3's own config.json (the values that matter here)
V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "vocab_size": 129280,
    "rope_theta": 10000, "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}


def test_v3_config():
    cfg = ModelArchConfig.from_dict(dict(V3))
    m, moe = cfg.mla, cfg.moe
    assert (m.q_lora_rank, m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
            m.v_head_dim, m.rope_interleave) == (1536, 512, 128, 64, 128, True)
    assert m.latent_dim == 576 and m.qk_head_dim == 192
    # the cache: one latent head of 576
    assert (cfg.num_key_value_heads, cfg.head_dim) == (1, 576)
    assert cfg.kv_cache_bytes_per_token(2) == 61 * 576 * 2
    assert moe.sparse_layers == (False,) * 3 + (True,) * 58
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.n_group, moe.topk_group,
            moe.routed_scaling_factor, moe.scoring, moe.shared_intermediate_size) == (
        256, 8, 2048, 8, 4, 2.5, "sigmoid", 2048)
    assert moe.norm_topk_prob and moe.score_correction_bias and moe.weights_dtype == "float32"
    mscale = 0.1 * math.log(40) + 1.0
    assert cfg.attn_scale == pytest.approx(192 ** -0.5 * mscale * mscale, rel=1e-15)
    assert cfg.rope.rope_type == "yarn" and cfg.rope.original_max_position_embeddings == 4096
    assert cfg.max_trained_len == 163840
    # 671B parameters without the MTP layer (the published 671B + 14B MTP)
    assert 670e9 < cfg.num_parameters() < 672e9


def test_defaults_and_errors():
    d = {k: V3[k] for k in ("architectures", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "vocab_size")}
    cfg = ModelArchConfig.from_dict(d)  # DeepseekV3Config's defaults
    assert cfg.mla.latent_dim == 576 and cfg.moe.num_experts == 256 and cfg.moe.top_k == 8
    assert cfg.attn_scale == 192 ** -0.5 and cfg.max_position_embeddings == 4096
    assert cfg.moe.sparse_layers[:4] == (False, False, False, True)
    plain = ModelArchConfig.from_dict({**d, "q_lora_rank": None, "rope_interleave": False})
    assert plain.mla.q_lora_rank is None and not plain.mla.rope_interleave
    for bad, match in [({"n_group": 3}, "multiple of n_group"),
                       ({"n_routed_experts": 8, "n_group": 8}, "at least 2 experts per group"),
                       ({"topk_group": 9}, "must not exceed n_group"),
                       ({"num_experts_per_tok": 129}, "topk_group"),
                       ({"qk_rope_head_dim": 7}, "even"),
                       ({"routed_scaling_factor": 0}, "routed_scaling_factor"),
                       ({"rope_interleave": "yes"}, "rope_interleave")]:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict({**d, **bad})


# ---- routing and the MoE block


def test_grouped_routing_by_hand():
    """8 experts in 2 groups, the best group chosen on the biased scores, weights from the
    plain scores, renormalized, scaled."""
    logits = torch.tensor([[0.0, 2.0, -1.0, 0.5, 1.0, 1.5, 1.8, -2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.0])
    s = torch.sigmoid(logits[0])
    # group scores (top-2 sums of s + bias): group 0 s1 + s3, group 1 (s6 + .3) + s5
    assert float(s[6] + 0.3 + s[5]) > float(s[1] + s[3])
    w, ids = route_grouped_sigmoid(logits, bias, 2, 2, 1, True, 2.5)
    assert sorted(ids[0].tolist()) == [5, 6]  # expert 1 (the best score) is in the other group
    want = {5: s[5], 6: s[6]}
    total = s[5] + s[6]
    for j, e in enumerate(ids[0].tolist()):
        assert float(w[0, j]) == pytest.approx(float(want[e] / (total + 1e-20) * 2.5), rel=1e-6)
    w2, ids2 = route_grouped_sigmoid(logits, None, 2, 2, 2, False, 1.0)  # both groups, no norm
    assert sorted(ids2[0].tolist()) == [1, 6] and w2.dtype == torch.float32
    torch.testing.assert_close(w2[0].sort().values, torch.stack([s[6], s[1]]).sort().values)


H, E, I, K = 40, 8, 24, 2


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("norm,groups,topk_groups,shared", [(True, 2, 1, 1), (False, 4, 2, 2),
                                                            (True, 1, 1, 0)])
def test_moe_block_matches_transformers(impl, norm, groups, topk_groups, shared):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    torch.manual_seed(groups * 10 + shared)
    hf_cfg = transformers.DeepseekV3Config(hidden_size=H, n_routed_experts=E, num_experts_per_tok=K,
                                           moe_intermediate_size=I, n_group=groups,
                                           topk_group=topk_groups, norm_topk_prob=norm,
                                           n_shared_experts=shared, routed_scaling_factor=1.7)
    hf_cfg._experts_implementation = impl
    hf = DeepseekV3MoE(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
        hf.gate.e_score_correction_bias.normal_(0, 0.2)
    moe = MoeConfig(num_experts=E, top_k=K, intermediate_size=I, norm_topk_prob=norm,
                    weights_dtype="float32", sparse_layers=(True,), scoring="sigmoid",
                    n_group=groups, topk_group=topk_groups, routed_scaling_factor=1.7,
                    score_correction_bias=True, shared_intermediate_size=shared * I)
    ours = SparseMoeBlock(H, moe, "deepseek_v3")
    assert ours.gate.weight.dtype == torch.float32 and (ours.shared_experts is None) == (shared == 0)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.e_score_correction_bias.copy_(hf.gate.e_score_correction_bias)
        ours.w13.copy_(hf.experts.gate_up_proj)
        ours.w2.copy_(hf.experts.down_proj)
        if shared:
            s = hf.shared_experts
            ours.shared_experts.gate_up_proj.weight.copy_(torch.cat([s.gate_proj.weight, s.up_proj.weight]))
            ours.shared_experts.down_proj.weight.copy_(s.down_proj.weight)
    x = torch.randn(3, 11, H)
    with torch.no_grad():
        want = hf(x)
        _, hf_w, hf_ids = hf.gate(x)
        w, ids = ours.route(x.reshape(-1, H))
        got = ours(x.reshape(-1, H))
    assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w)
    assert len(ids.unique()) >= E - 1  # the test routes to (nearly) every expert
    torch.testing.assert_close(got, want.reshape(-1, H), atol=1e-5, rtol=1e-5)


# ---- tiny checkpoints against transformers

VARIANTS = {
    "default": {},
    "q-proj-halves": dict(q_lora_rank=None, rope_interleave=False),
    "yarn-bias": dict(attention_bias=True, max_position_embeddings=256,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64, "mscale": 1.0,
                                    "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
    "3-layers-no-norm": dict(num_layers=3, norm_topk_prob=False, n_group=4, topk_group=2,
                             n_shared_experts=2, routed_scaling_factor=1.0),
    "stacked-experts": dict(save_original_format=False),
}


class Ref:
    def __init__(self, path):
        self.ck = load_checkpoint(path, dtype="float32")
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.prompts = [self.ck.tokenizer.encode(t) for t in TEXTS]
        self._gen = None

    @property
    def generations(self):
        if self._gen is None:
            with torch.no_grad():
                self._gen = []
                for p in self.prompts:
                    ids = torch.tensor([p])
                    out = self.hf.generate(ids, attention_mask=torch.ones_like(ids),
                                           max_new_tokens=NEW_TOKENS, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
                    self._gen.append(out[0, len(p):].tolist())
        return self._gen

    def harness(self, block_size):
        need = sum(-(-(len(p) + NEW_TOKENS) // block_size) for p in self.prompts)
        return PagedHarness(self.ck.model, block_size=block_size, num_blocks=need + 3)


_REFS: dict = {}


@pytest.fixture(scope="module")
def ref(tiny_dir):
    def get(name):
        if name not in _REFS:
            _REFS[name] = Ref(tiny_dir("deepseek_v3", **VARIANTS[name]))
        return _REFS[name]

    yield get
    _REFS.clear()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prompt_logits_and_greedy_tokens_match_transformers(ref, name):
    r = ref(name)
    cfg = r.ck.config
    assert type(r.ck.model).__name__ == "DeepseekV3ForCausalLM"
    assert [layer.sparse for layer in r.ck.model.layers] == list(cfg.moe.sparse_layers)
    assert cfg.attn_scale == pytest.approx(r.hf.model.layers[0].self_attn.scaling, rel=1e-15)
    h = r.harness(16)
    for p in r.prompts:
        with torch.no_grad():
            want = r.hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(h.prompt_logits(p), want, atol=1e-4, rtol=1e-4)
    assert r.harness(32).greedy_generate(r.prompts, NEW_TOKENS) == r.generations


def test_chunked_prefill_mixed_with_decodes(ref):
    r = ref("default")
    h = r.harness(16)
    assert h.greedy_generate(r.prompts, NEW_TOKENS, chunk_size=7, token_budget=16,
                             pad_tokens=3) == r.generations
    assert any(any(done >= plen for _, done, _, plen in s) and any(0 < done < plen for _, done, _, plen in s)
               for s in h.step_log)


def test_parameter_count_matches_transformers(ref):
    for name in ("default", "q-proj-halves", "3-layers-no-norm"):
        r = ref(name)
        assert r.ck.config.num_parameters() == sum(t.numel() for t in r.hf.state_dict().values())


def test_tiny_routing_is_not_degenerate(ref):
    r = ref("default")
    model = r.ck.model
    seen = []
    sparse = [layer.mlp for layer in model.layers if layer.sparse]
    assert sparse and all(float(m.e_score_correction_bias.abs().max()) > 0 for m in sparse)
    hooks = [m.register_forward_hook(lambda mod, args, out: seen.append(mod.route(args[0])[1]))
             for m in sparse]
    r.harness(16).prompt_logits(r.prompts[3])
    for hk in hooks:
        hk.remove()
    e = model.config.moe.num_experts
    for ids in seen:
        counts = torch.bincount(ids.reshape(-1), minlength=e)
        assert (counts > 0).sum() >= e - 1, counts.tolist()
        assert counts.max() <= 0.5 * ids.numel(), counts.tolist()
        assert len(ids[:, 0].unique()) >= e // 2


def test_loader_skips_only_the_mtp_layers(tiny_dir, tmp_path):
    from safetensors.torch import save_file

    src = tiny_dir("deepseek_v3")
    dst = tmp_path / "with-mtp"
    shutil.copytree(src, dst)
    # no model.safetensors: every *.safetensors file of the directory is read
    os.rename(dst / "model.safetensors", dst / "model-part1.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    layers, mtp = cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"]
    assert mtp == 1
    save_file({f"model.layers.{layers}.eh_proj.weight": torch.zeros(4, 4),
               f"model.layers.{layers}.self_attn.kv_b_proj.weight": torch.zeros(4, 4)},
              str(dst / "mtp.safetensors"))
    base = load_checkpoint(src, dtype="float32").model
    got = load_checkpoint(dst, dtype="float32").model
    for (n, a), (_, b) in zip(base.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), n
    save_file({f"model.layers.{layers + mtp}.eh_proj.weight": torch.zeros(4, 4)},
              str(dst / "beyond.safetensors"))
    with pytest.raises(CheckpointError, match=f"unexpected tensors: model.layers.{layers + mtp}"):
        load_checkpoint(dst, dtype="float32")
    os.remove(dst / "beyond.safetensors")
    os.remove(dst / "model-part1.safetensors")
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_checkpoint(dst, dtype="float32")
