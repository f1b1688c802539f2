"""Multi-head latent attention over the paged latent cache (``pagedkv.attention.mla`` and
``mla_torch_ref``): the reference backend's absorbed (decode) and up-projected (prefill /
extend) forms against a dense float64 attention built from the same weights, on mixed batches
(fresh prefills, chunks over cached context, decodes, CUDA-graph padding) with shuffled blocks
and a NaN-poisoned pool; the latent write (slots, skipped ``-1``, untouched null block); and
the model's ``MLAttention`` layer through the paged cache against transformers'
``DeepseekV3Attention`` with the same weights (q LoRA or plain q_proj, interleaved or halves
RoPE, YaRN with mscale, attention bias), chunk by chunk and token by token."""

import pytest
import torch
from mla_helpers import MIXED, NOPE, D, R, V, Batch, H, L

from pagedkv.attention.backend import AttentionBackend, AttentionPlan
from pagedkv.attention.metadata import build_attention_metadata
from pagedkv.attention.mla import MLAWeights, allocate_mla_kv_caches, mla_backend_for
from pagedkv.attention.mla_torch_ref import TorchRefMLABackend, mla_attention_ref
from pagedkv.attention.torch_ref import TorchRefBackend
from pagedkv.errors import ConfigError, InvariantError


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("absorb", ["decode", "all", "never"])
def test_reference_matches_dense_attention(block_size, absorb):
    b = Batch(MIXED, block_size, pad=3, seed=block_size)
    backend = TorchRefMLABackend(writer="ref", absorb=absorb)
    out = backend.forward(0, b.q_all, b.new_latent, b.cache, AttentionPlan(b.metadata, None),
                          b.scale, b.weights)
    n = b.metadata.num_actual_tokens
    assert out.shape == (n + 3, H, V) and out.dtype == torch.float32
    torch.testing.assert_close(out[:n].double(), b.expected(), atol=2e-5, rtol=1e-5)
    assert torch.equal(out[n:], torch.zeros(3, H, V))  # padding rows
    # the new latents sit at their slots; padding (-1) wrote nothing; the null block and the
    # unused blocks are untouched (still NaN)
    flat = b.cache.view(-1, D)
    torch.testing.assert_close(flat[b.slots[:n]], b.new_latent[:n])
    assert torch.isnan(b.cache[0]).all() and torch.isnan(b.cache[b.unused]).all()
    assert not (flat == 7.0).any()


def test_absorbed_and_up_projected_forms_agree_in_fp32():
    b = Batch(MIXED, 16, seed=3)
    plan = AttentionPlan(b.metadata, None)
    outs = {}
    for absorb in ("all", "never"):
        write = b.new_latent if absorb == "all" else None  # the second call reads the cache
        outs[absorb] = TorchRefMLABackend(absorb=absorb).forward(
            0, b.q_all, write, b.cache, plan, b.scale, b.weights)
    torch.testing.assert_close(outs["all"], outs["never"], atol=1e-5, rtol=1e-5)
    assert not torch.equal(outs["all"], outs["never"])  # really two computations


def test_reference_bf16():
    b = Batch(MIXED, 16, dtype=torch.bfloat16, seed=5)
    out = TorchRefMLABackend().forward(0, b.q_all, b.new_latent, b.cache,
                                       AttentionPlan(b.metadata, None), b.scale, b.weights)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), b.expected(), atol=3e-2, rtol=3e-2)


def test_shapes_errors_and_backend_mapping():
    b = Batch([(4, 2)], 16)
    plan = AttentionPlan(b.metadata, None)
    backend = TorchRefMLABackend()
    with pytest.raises(InvariantError, match="q must be"):
        backend.forward(0, b.q_all[..., :-1], None, b.cache, plan, b.scale, b.weights)
    with pytest.raises(InvariantError, match="latent must be"):
        backend.forward(0, b.q_all, b.new_latent[:, :-1], b.cache, plan, b.scale, b.weights)
    with pytest.raises(InvariantError, match="MLA KV cache"):
        backend.forward(0, b.q_all, None, b.cache.unsqueeze(2), plan, b.scale, b.weights)
    with pytest.raises(ConfigError, match="kv_b_proj weight"):
        MLAWeights(b.kv_b[:-1], H, NOPE, R, V)
    with pytest.raises(ConfigError, match="absorb"):
        TorchRefMLABackend(absorb="sometimes")
    with pytest.raises(ConfigError, match="absorb"):
        mla_attention_ref(b.q_all, b.cache, b.metadata, b.scale, b.weights, absorb="x")
    assert mla_backend_for(backend) is backend
    mapped = mla_backend_for(TorchRefBackend(writer="ref"))
    assert isinstance(mapped, TorchRefMLABackend) and mapped.writer == "ref"

    class Other(AttentionBackend):
        def forward(self, *args):
            return None

    with pytest.raises(ConfigError, match="no multi-head latent"):
        mla_backend_for(Other())
    w = b.weights
    assert w.w_uk.shape == (H, NOPE, L) and w.w_uv.shape == (H, V, L)
    assert w.w_uk.data_ptr() == w.kv_b.data_ptr()  # views, no copies


# ---- the model's layer against transformers' DeepseekV3Attention

transformers = pytest.importorskip("transformers")

CASES = {
    "q-lora-interleaved": dict(q_lora_rank=24, rope_interleave=True),
    "q-proj-halves": dict(q_lora_rank=None, rope_interleave=False),
    "yarn-mscale-bias": dict(q_lora_rank=24, rope_interleave=True, attention_bias=True,
                             max_position_embeddings=256,
                             rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                              "factor": 4.0, "original_max_position_embeddings": 64,
                                              "mscale": 1.0, "mscale_all_dim": 0.8,
                                              "beta_fast": 32, "beta_slow": 1}),
}


def _hf_config(**kw):
    d = dict(vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=1, num_attention_heads=H, num_key_value_heads=H,
             kv_lora_rank=L, qk_rope_head_dim=R, qk_nope_head_dim=NOPE, v_head_dim=V,
             n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
             first_k_dense_replace=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    d.update(kw)
    cfg = transformers.DeepseekV3Config(**d)
    cfg._attn_implementation = "eager"
    return cfg


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_transformers_chunk_by_chunk(case):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3Attention,
        DeepseekV3RotaryEmbedding,
    )

    from pagedkv.models.config import ModelArchConfig
    from pagedkv.models.mla_attention import MLAttention
    from pagedkv.models.rotary import RotaryEmbedding

    torch.manual_seed(0)
    hf_cfg = _hf_config(**CASES[case])
    hf = DeepseekV3Attention(hf_cfg, 0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.1 * torch.randn(p.shape) if "layernorm" in name else 0.2 * torch.randn(p.shape))
    cfg = ModelArchConfig.from_dict({**hf_cfg.to_dict(), "architectures": ["DeepseekV3ForCausalLM"]})
    assert cfg.attn_scale == pytest.approx(hf.scaling, rel=1e-15)
    ours = MLAttention(cfg, 0)
    with torch.no_grad():
        own = dict(ours.named_parameters())
        for name, p in hf.named_parameters():
            own[name].copy_(p)
    rotary = RotaryEmbedding(R, cfg.rope, cfg.max_position_embeddings)
    S = 40
    x = torch.randn(1, S, cfg.hidden_size)
    pos = torch.arange(S)
    mask = torch.full((S, S), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        cos_sin = DeepseekV3RotaryEmbedding(hf_cfg)(x, pos[None])
        want = hf(x, cos_sin, mask)[0][0]
    # our layer over the paged cache: a prefill chunk, a chunk over cached context, decodes
    block_size = 16
    (cache,) = allocate_mla_kv_caches(1, 8, block_size, L + R, dtype=torch.float32, fill=float("nan"))
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    backend = TorchRefMLABackend()
    done, got = 0, []
    for n in [13, 11] + [1] * (S - 24):
        p = pos[done:done + n]
        slots = (table[0, p // block_size].long() * block_size + p % block_size)
        md = build_attention_metadata([n], [done + n], table, slots)
        cos, sin = rotary(p)
        with torch.no_grad():
            got.append(ours(x[0, done:done + n], cos, sin, cache, AttentionPlan(md, None), backend))
        done += n
    got = torch.cat(got)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
