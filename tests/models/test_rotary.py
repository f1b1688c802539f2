"""RoPE: cos/sin and the rotation match transformers bit for bit, for every scaling type."""

import pytest
import torch

from pagedkv.models.config import ModelArchConfig
from pagedkv.models.rotary import RotaryEmbedding, apply_rotary, compute_inv_freq
from pagedkv.models.tiny import TinySpec, hf_config_dict

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

ROPES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                    "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
                    "truncate": False},
    "yarn-attn": {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 40,
                  "attention_factor": 1.25},
}


def _pair(rope, head_dim=16, max_pos=64, theta=10000.0):
    spec = TinySpec(family="llama", head_dim=head_dim, max_position_embeddings=max_pos,
                    rope_theta=theta, rope_scaling=rope)
    hf_cfg = transformers.LlamaConfig(**hf_config_dict(spec))
    d = hf_cfg.to_dict()
    d["architectures"] = ["LlamaForCausalLM"]
    ours = ModelArchConfig.from_dict(d)
    return LlamaRotaryEmbedding(hf_cfg), RotaryEmbedding(head_dim, ours.rope, ours.max_position_embeddings)


def _hf_cos_sin(hf_rot, positions, dtype=torch.float32):
    x = torch.zeros(1, len(positions), 4, dtype=dtype)
    cos, sin = hf_rot(x, torch.tensor([positions]))
    return cos[0], sin[0]


@pytest.mark.parametrize("name", [n for n in ROPES if n != "dynamic"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_cos_sin_match_transformers(name, head_dim):
    hf_rot, ours = _pair(ROPES[name], head_dim=head_dim)
    positions = list(range(0, 300, 3))
    hc, hs = _hf_cos_sin(hf_rot, positions)
    c, s = ours(torch.tensor(positions))
    assert torch.equal(torch.cat([c, c], -1), hc)
    assert torch.equal(torch.cat([s, s], -1), hs)
    assert ours.attention_scaling == hf_rot.attention_scaling
    assert torch.equal(ours.inv_freq, hf_rot.inv_freq)


def test_dynamic_ntk_follows_sequence_length_like_transformers():
    hf_rot, ours = _pair(ROPES["dynamic"], max_pos=16)
    # a long prefill (20 > 16 positions), a decode step, then a short sequence (reset)
    for positions in (list(range(20)), [20], list(range(5)), list(range(17))):
        hc, hs = _hf_cos_sin(hf_rot, positions)
        seq_len = max(positions) + 1
        c, s = ours(torch.tensor(positions), torch.full((len(positions),), seq_len))
        assert torch.equal(torch.cat([c, c], -1), hc), positions
        assert torch.equal(torch.cat([s, s], -1), hs), positions


def test_dynamic_ntk_per_request_lengths_in_one_batch():
    _, ours = _pair(ROPES["dynamic"], max_pos=16)
    pos = torch.tensor([3, 4, 25, 30])
    c, _ = ours(pos, torch.tensor([5, 5, 31, 31]))
    c_short, _ = ours(pos[:2], torch.tensor([5, 5]))
    c_long, _ = ours(pos[2:], torch.tensor([31, 31]))
    assert torch.equal(c[:2], c_short) and torch.equal(c[2:], c_long)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rotary_matches_transformers(dtype):
    hf_rot, ours = _pair(ROPES["llama3"], head_dim=32)
    g = torch.Generator().manual_seed(0)
    positions = [0, 1, 7, 33, 100]
    q = torch.randn(len(positions), 4, 32, generator=g).to(dtype)
    k = torch.randn(len(positions), 2, 32, generator=g).to(dtype)
    hc, hs = _hf_cos_sin(hf_rot, positions, dtype)
    # transformers' layout: [batch, heads, seq, dim]
    hq, hk = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hc[None], hs[None])
    c, s = ours(torch.tensor(positions))
    assert torch.equal(apply_rotary(q, c, s), hq[0].transpose(0, 1))
    assert torch.equal(apply_rotary(k, c, s), hk[0].transpose(0, 1))


def test_inv_freq_shapes():
    from pagedkv.models.config import RopeConfig

    inv, scale = compute_inv_freq(RopeConfig(), 128, 4096)
    assert inv.shape == (64,) and inv.dtype == torch.float32 and scale == 1.0
    assert inv[0] == 1.0
