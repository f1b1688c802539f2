"""Multi-head latent attention over the paged latent cache (``pagedkv.attention.mla`` and
``mla_torch_ref``): the reference backend's absorbed (decode) and up-projected (prefill /
extend) forms against a dense float64 attention built from the same weights, on mixed batches
(fresh prefills, chunks over cached context, decodes, CUDA-graph padding) with shuffled blocks
and a NaN-poisoned pool; the latent write (slots, skipped ``-1``, untouched null block); and
the model's ``MLAttention`` layer through the paged cache against transformers'
``DeepseekV3Attention`` with the same weights (q LoRA or plain q_proj, interleaved or halves
RoPE, YaRN with mscale, attention bias), chunk by chunk and token by token."""

import random

import pytest
import torch

from pagedkv.attention.backend import AttentionBackend, AttentionPlan
from pagedkv.attention.metadata import build_attention_metadata
from pagedkv.attention.mla import (
    MLAWeights,
    allocate_mla_kv_caches,
    mla_backend_for,
    write_latent,
)
from pagedkv.attention.mla_torch_ref import TorchRefMLABackend, mla_attention_ref
from pagedkv.attention.torch_ref import TorchRefBackend
from pagedkv.errors import ConfigError, InvariantError

H, L, R, NOPE, V = 4, 32, 8, 16, 12
D = L + R


def dense_mla(q, c, k_pe, kv_b, scale):
    """float64 causal attention of one request: ``q [q_len, H, NOPE + R]`` (the last q_len
    positions), ``c [S, L]``, ``k_pe [S, R]``; keys ``[W_UK c | k_pe]``, values ``W_UV c``."""
    q, c, k_pe, kv_b = (t.double() for t in (q, c, k_pe, kv_b))
    s, q_len = c.shape[0], q.shape[0]
    kv = (c @ kv_b.T).view(s, H, NOPE + V)
    k = torch.cat([kv[..., :NOPE], k_pe[:, None].expand(s, H, R)], dim=-1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    q_pos = torch.arange(s - q_len, s)
    scores = scores.masked_fill(torch.arange(s)[None, :] > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khv->qhv", torch.softmax(scores, dim=-1), kv[..., NOPE:])


class Batch:
    """Requests ``(cached context, new tokens)``: context latents written beforehand, new
    latents passed to the backend; each request owns shuffled blocks (never block 0)."""

    def __init__(self, reqs, block_size, dtype=torch.float32, pad=0, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.reqs, self.block_size, self.dtype = reqs, block_size, dtype
        lens = [c + n for c, n in reqs]
        width = max(-(-s // block_size) for s in lens) + 1
        num_blocks = sum(-(-s // block_size) for s in lens) + 3
        free = list(range(1, num_blocks))
        random.Random(seed).shuffle(free)
        self.table = torch.zeros(len(reqs), width, dtype=torch.int32)
        for r, s in enumerate(lens):
            for j in range(-(-s // block_size)):
                self.table[r, j] = free.pop()
        self.unused = free
        (self.cache,) = allocate_mla_kv_caches(1, num_blocks, block_size, D, dtype=dtype,
                                               fill=float("nan"))
        self.kv_b = torch.randn(H * (NOPE + V), L, generator=gen) * 0.3
        self.weights = MLAWeights(self.kv_b.to(dtype), H, NOPE, R, V)
        self.c = [torch.randn(s, L, generator=gen) for s in lens]
        self.k_pe = [torch.randn(s, R, generator=gen) for s in lens]
        self.q = [torch.randn(n, H, NOPE + R, generator=gen) for _, n in reqs]
        self.scale = (NOPE + R) ** -0.5
        ctx_slots, ctx_lat, new_slots, new_lat = [], [], [], []
        for r, ((ctx, n), s) in enumerate(zip(reqs, lens)):
            lat = torch.cat([self.c[r], self.k_pe[r]], dim=-1)
            for p in range(s):
                slot = int(self.table[r, p // block_size]) * block_size + p % block_size
                (ctx_slots if p < ctx else new_slots).append(slot)
                (ctx_lat if p < ctx else new_lat).append(lat[p])
        if ctx_slots:
            write_latent(torch.stack(ctx_lat).to(dtype), self.cache, torch.tensor(ctx_slots),
                         writer="ref")
        self.new_latent = torch.stack(new_lat + [torch.full((D,), 7.0)] * pad).to(dtype)
        self.slots = torch.tensor(new_slots + [-1] * pad, dtype=torch.int64)
        self.q_all = torch.cat(self.q + [torch.full((pad, H, NOPE + R), 3.0)]).to(dtype)
        self.metadata = build_attention_metadata([n for _, n in reqs], lens, self.table, self.slots)
        self.lens = lens

    def expected(self) -> torch.Tensor:
        return torch.cat([dense_mla(self.q[r].to(self.dtype), self.c[r].to(self.dtype),
                                    self.k_pe[r].to(self.dtype), self.kv_b.to(self.dtype),
                                    self.scale) for r in range(len(self.reqs))])


MIXED = [(0, 5), (20, 1), (0, 1), (37, 9), (15, 17), (3, 1), (33, 1)]


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
