"""DeepSeek-V4 (``pagedkv.models.deepseek_v4``) against transformers' ``DeepseekV4ForCausalLM``:
config parsing (a V4-Flash-sized config with its legacy keys, defaults, errors, both RoPEs, the
parameter count), the cache layers and their groups, the pieces (mHC, hash and top-k routing
and the MoE block, the clamped SwiGLU in the fused-MoE kernel), each attention kind, the
compressor's entries and the indexer's selections in place (one prefill step, and chunks that
split compression groups), whole-model prompt logits, decode-step logits and batched greedy
tokens (chunked prefill) for tiny random checkpoints (fp32, NaN-poisoned caches, shuffled
blocks; the index layer's kernels as their twins, one test with the Triton kernels
interpreted), checkpoint layouts, random weights."""

import os

import pytest
import torch
import transformers
from deepseek_v4_helpers import CSA, HCA, SWA, Dsv4Driver, build_tiny_dsv4, use_twins

from pagedkv.attention.dsv4 import Dsv4Backend
from pagedkv.attention.metadata import build_attention_metadata
from pagedkv.core.planning import get_kv_cache_groups
from pagedkv.core.spec import MLAAttentionSpec, SlidingWindowMLASpec
from pagedkv.errors import CheckpointError, ConfigError, InvalidRequestError
from pagedkv.kernels.fused_moe import GatedActivation, fused_moe, fused_moe_ref
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.deepseek_v4 import DeepseekV4ForCausalLM
from pagedkv.models.hyper_connections import HyperConnection, HyperHead, mix_streams
from pagedkv.models.loader import load_checkpoint
from pagedkv.models.rotary import RotaryEmbedding

transformers = pytest.importorskip("transformers")
hfm = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

# DeepSeek-V4-Flash's sizes with the legacy keys its hub config uses
FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
    "num_hidden_layers": 43, "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024,
    "qk_rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "n_routed_experts": 256,
    "num_experts_per_tok": 6, "moe_intermediate_size": 2048, "num_hash_layers": 3,
    "compress_ratios": [0, 0] + [4 if i % 2 else 128 for i in range(41)], "sliding_window": 128,
    "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000,
    "compress_rope_theta": 160000, "max_position_embeddings": 1048576, "hc_mult": 4,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "vocab_size": 129280, "torch_dtype": "bfloat16",
}


def _hf_config(d: dict):
    return transformers.DeepseekV4Config(**{k: v for k, v in d.items()
                                            if k not in ("architectures", "model_type", "torch_dtype")})


def test_flash_config_matches_transformers():
    cfg = ModelArchConfig.from_dict(dict(FLASH))
    hc = _hf_config(FLASH)
    x = cfg.dsv4
    assert cfg.family == "deepseek_v4" and cfg.num_key_value_heads == 1 and cfg.head_dim == 512
    assert list(x.layer_types) == hc.layer_types and list(x.mlp_layer_types) == hc.mlp_layer_types
    assert x.layer_types[:3] == (SWA, SWA, HCA) and x.compress_ratios[:4] == (0, 0, 128, 4)
    assert x.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert x.rope_dim == hc.qk_rope_head_dim == 64
    assert (x.index_n_heads, x.index_head_dim, x.index_topk, x.o_groups) == (64, 128, 512, 8)
    assert cfg.moe.activation == "silu_clamp" and cfg.moe.swiglu_limit == 10.0
    assert cfg.moe.shared_intermediate_size == 2048 and cfg.moe.routed_scaling_factor == 1.5
    # both RoPEs: the main one plain, the compress one YaRN with attention factor 1
    rope = hfm.DeepseekV4RotaryEmbedding(hc)
    for ours, name in ((cfg.rope, "main"), (x.compress_rope, "compress")):
        emb = RotaryEmbedding(x.rope_dim, ours, cfg.max_position_embeddings)
        assert torch.equal(emb.inv_freq, getattr(rope, f"{name}_inv_freq"))
        assert emb.attention_scaling == getattr(rope, f"{name}_attention_scaling") == 1.0
    assert x.compress_rope.rope_type == "yarn" and cfg.rope.rope_type == "default"
    with torch.device("meta"):
        hf = transformers.DeepseekV4ForCausalLM(hc)
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    assert 284e9 < cfg.num_parameters() < 285e9
    # what grows with the context: per token D / C per compressed layer (+ the indexer's)
    per = sum(512 / c + (128 / c if c == 4 else 0) for c in x.compress_ratios if c)
    assert cfg.kv_cache_bytes_per_token(2) == int(per * 2)


def test_config_defaults_and_errors():
    d = {"architectures": ["DeepseekV4ForCausalLM"], "hidden_size": 64, "num_hidden_layers": 5,
         "num_attention_heads": 2, "head_dim": 32, "vocab_size": 300}
    cfg = ModelArchConfig.from_dict(d)
    hc = _hf_config(d)
    assert list(cfg.dsv4.layer_types) == hc.layer_types == [HCA, HCA, HCA, CSA, HCA]
    assert cfg.dsv4.compress_ratios == (128, 128, 128, 4, 128)
    assert list(cfg.dsv4.mlp_layer_types) == hc.mlp_layer_types
    assert cfg.dsv4.rope_dim == 4 and cfg.dsv4.compress_rope.rope_theta == 160000.0
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.dsv4.scoring_func) == (0, (1,), "sqrtsoftplus")
    nested = ModelArchConfig.from_dict({**d, "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.5},
        "compress": {"rope_type": "default", "rope_theta": 7.0, "partial_rotary_factor": 0.5}},
        "partial_rotary_factor": 0.5, "compress_rates": {CSA: 8, HCA: 32}})
    assert (nested.rope.rope_theta, nested.dsv4.compress_rope.rope_theta) == (5000.0, 7.0)
    assert nested.dsv4.rope_dim == 16 and nested.dsv4.compress_ratios == (32, 32, 32, 8, 32)
    for bad, match in [({"num_key_value_heads": 2}, "num_key_value_heads"),
                       ({"scoring_func": "softmax"}, "scoring_func"),
                       ({"o_groups": 3}, "o_groups"),
                       ({"index_head_dim": 2}, "index_head_dim"),
                       ({"layer_types": [SWA] * 4}, "layer_types"),
                       ({"mlp_layer_types": ["dense"] * 5}, "mlp_layer_types"),
                       ({"compress_rates": {CSA: 1, HCA: 128}}, "compress rate"),
                       ({"compress_ratios": [0, 3, 4, 4, 4]}, "compress_ratios"),
                       ({"partial_rotary_factor": 0.03}, "rotary part"),
                       ({"hidden_act": "gelu"}, "hidden_act"),
                       ({"num_experts_per_tok": 9, "n_routed_experts": 8}, "num_experts_per_tok")]:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict({**d, **bad})


# ---- tiny checkpoints

VARIANTS = {
    # sliding, CSA (4), HCA (16), CSA; window 8, top-4 of 16 indexer heads, 4 streams
    "default": {},
    # sigmoid routing scores, YaRN on the compress RoPE, an HCA layer first
    "yarn-sigmoid": dict(
        scoring_func="sigmoid", num_hidden_layers=3, layer_types=[HCA, CSA, SWA],
        mlp_layer_types=["moe", "hash_moe", "moe"], hc_mult=2, routed_scaling_factor=2.0,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1}),
    # the real heavy compression ratio (128) with prompts of up to 300 tokens
    "hca-128": dict(num_hidden_layers=3, layer_types=[HCA, SWA, CSA],
                    compress_rates={CSA: 4, HCA: 128}, mlp_layer_types=["moe", "hash_moe", "moe"],
                    sliding_window=16, index_topk=8, hc_mult=2),
    # transformers' module names (stacked experts)
    "fused-names": dict(save_original_format=False),
}
LENGTHS = {"default": (5, 23, 70, 41), "yarn-sigmoid": (5, 23, 70, 41),
           "hca-128": (300, 140, 9), "fused-names": (70, 12)}
NEW = 10


class Ref:
    """Our model and transformers' on one tiny checkpoint, prompts and their generations."""

    def __init__(self, cache: str, name: str):
        opts = dict(VARIANTS[name])
        fmt = opts.pop("save_original_format", True)
        self.path = build_tiny_dsv4(cache, save_original_format=fmt, **opts)
        self.ck = load_checkpoint(self.path, dtype="float32")
        self.model = self.ck.model
        self.hf = transformers.AutoModelForCausalLM.from_pretrained(self.path, dtype=torch.float32).eval()
        g = torch.Generator().manual_seed(7)
        self.prompts = [torch.randint(3, 320, (n,), generator=g).tolist() for n in LENGTHS[name]]
        self._gen: dict = {}

    @torch.no_grad()
    def generate(self, prompt, n=NEW) -> list[int]:
        key = (tuple(prompt), n)
        if key not in self._gen:
            ids = torch.tensor([prompt])
            out = self.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
            self._gen[key] = out[0, len(prompt):].tolist()
        return self._gen[key]


_REFS: dict = {}


@pytest.fixture(scope="module")
def ref(tiny_cache):
    def get(name):
        if name not in _REFS:
            _REFS[name] = Ref(tiny_cache, name)
        return _REFS[name]

    yield get
    _REFS.clear()


@pytest.fixture
def twins(monkeypatch):
    use_twins(monkeypatch)


def test_cache_layers_and_groups(ref):
    model = ref("default").model
    specs = model.kv_cache_specs(16)
    a = "model.layers.{}.self_attn"
    assert list(specs) == [a.format(0), a.format(1), a.format(1) + ".compressor",
                           a.format(1) + ".compressor.state", a.format(1) + ".compressor.indexer",
                           a.format(1) + ".compressor.indexer.state", a.format(2),
                           a.format(2) + ".compressor", a.format(2) + ".compressor.state",
                           a.format(3), a.format(3) + ".compressor",
                           a.format(3) + ".compressor.state", a.format(3) + ".compressor.indexer",
                           a.format(3) + ".compressor.indexer.state"]
    swa = SlidingWindowMLASpec(16, num_kv_heads=1, head_size=32, dtype="float32", sliding_window=8)
    assert specs[a.format(0)] == specs[a.format(2)] == swa
    assert specs[a.format(1) + ".compressor"] == MLAAttentionSpec(
        16, num_kv_heads=1, head_size=32, dtype="float32", compress_ratio=4)
    assert specs[a.format(2) + ".compressor"] == MLAAttentionSpec(
        16, num_kv_heads=1, head_size=32, dtype="float32", compress_ratio=16)
    assert model.kv_cache_specs(24)[a.format(2) + ".compressor"].block_size == 48  # lcm
    # the states: [kv | score] of two series (CSA) or one (HCA), float32, windows 2C / C
    assert specs[a.format(1) + ".compressor.state"] == SlidingWindowMLASpec(
        16, num_kv_heads=1, head_size=4 * 32, dtype="float32", sliding_window=8)
    assert specs[a.format(2) + ".compressor.state"] == SlidingWindowMLASpec(
        16, num_kv_heads=1, head_size=2 * 32, dtype="float32", sliding_window=16)
    assert specs[a.format(3) + ".compressor.indexer"] == MLAAttentionSpec(
        16, num_kv_heads=1, head_size=16, dtype="float32", compress_ratio=4)
    groups = get_kv_cache_groups(specs)
    assert sorted(n for g in groups for n in g.layer_names) == sorted(specs)
    # one page per block id: the planner grows the smaller pages' block sizes
    assert len({g.kv_cache_spec.page_size_bytes for g in groups}) == 1
    caches = model.allocate_kv_caches(3, 16, fill=None)
    assert [tuple(c.shape) for c in caches[:6]] == [(3, 16, 32), (3, 16, 32), (3, 4, 32),
                                                    (3, 16, 128), (3, 4, 16), (3, 16, 64)]
    assert tuple(caches[7].shape) == (3, 1, 32)  # HCA: one entry per 16-token block


def _hf_tiny_config(**kw):
    from deepseek_v4_helpers import DSV4_TINY

    return transformers.DeepseekV4Config(**{**DSV4_TINY, **kw})


def test_hyper_connections_match_transformers():
    hc = _hf_tiny_config()
    g = torch.Generator().manual_seed(1)
    theirs = hfm.DeepseekV4HyperConnection(hc)
    head = hfm.DeepseekV4HyperHead(hc)
    with torch.no_grad():
        for p in list(theirs.parameters()) + list(head.parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.dim() > 1 else 1.0))
    ours = HyperConnection(4, 32, hc.hc_sinkhorn_iters, hc.hc_eps, hc.rms_norm_eps)
    ours.load_state_dict(theirs.state_dict())
    our_head = HyperHead(4, 32, hc.hc_eps, hc.rms_norm_eps)
    our_head.load_state_dict(head.state_dict())
    streams = torch.randn(1, 6, 4, 32, generator=g)
    out = torch.randn(1, 6, 32, generator=g)
    with torch.no_grad():
        post, comb, coll = theirs(streams)
        p2, c2, x2 = ours(streams[0])
        torch.testing.assert_close(p2, post[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(c2, comb[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(x2, coll[0], rtol=0, atol=1e-6)
        # Sinkhorn: rows and columns sum to ~1; the matrix is not symmetric (order matters)
        assert torch.allclose(c2.sum(-1), torch.ones(6, 4), atol=1e-3)
        assert not torch.allclose(c2, c2.transpose(-1, -2), atol=1e-3)
        want = post.unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(comb.transpose(-1, -2), streams)
        torch.testing.assert_close(mix_streams(streams[0], out[0], p2, c2), want[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(our_head(streams[0]), head(streams)[0], rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_rope_and_unweighted_norm_match_transformers(dtype):
    """V4's RoPE on the trailing dims in interleaved pairs (and back with -sin), and the
    unweighted RMSNorm, bit for bit as transformers computes them."""
    from pagedkv.models.layers import unweighted_rms_norm
    from pagedkv.models.rotary import apply_rotary_interleaved_tail

    g = torch.Generator().manual_seed(4)
    x = torch.randn(5, 3, 24, generator=g).to(dtype)
    ang = torch.randn(5, 4, generator=g)
    cos, sin = ang.cos(), ang.sin()
    want = hfm.apply_rotary_pos_emb(x.transpose(0, 1).unsqueeze(0), cos.to(dtype)[None],
                                    sin.to(dtype)[None])[0].transpose(0, 1)
    got = apply_rotary_interleaved_tail(x, cos, sin)
    assert torch.equal(got, want) and torch.equal(got[..., :16], x[..., :16])
    back = apply_rotary_interleaved_tail(got, cos, -sin)
    torch.testing.assert_close(back.float(), x.float(), rtol=0, atol=0.05 if dtype != torch.float32 else 1e-6)
    norm = hfm.DeepseekV4UnweightedRMSNorm(eps=1e-6)
    assert torch.equal(unweighted_rms_norm(x, 1e-6), norm(x))


def test_moe_routing_and_block_match_transformers(ref):
    """Hash layers take the token's tid2eid row, top-k layers the best score + bias; the
    weights, the experts and the whole block (routed + clamped shared expert) as
    transformers'."""
    r = ref("default")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 32, generator=g)
    ids = torch.randint(0, 320, (9,), generator=g)
    for i in (0, 2):  # a hash layer, a top-k layer
        ours, theirs = r.model.layers[i].mlp, r.hf.model.layers[i].mlp
        assert ours.is_hash == (i == 0) == theirs.is_hash
        with torch.no_grad():
            w, e = ours.route(x, ids)
            args = (x[None], ids[None]) if theirs.is_hash else (x[None],)
            _, tw, te = theirs.gate(*args)
            order, t_order = e.argsort(-1), te.argsort(-1)
            assert torch.equal(e.gather(1, order), te.gather(1, t_order))
            torch.testing.assert_close(w.gather(1, order), tw.gather(1, t_order), rtol=0, atol=1e-6)
            if i == 0:
                assert torch.equal(e, ours.tid2eid[ids])
            torch.testing.assert_close(ours(x, ids), theirs(x[None], input_ids=ids[None])[0],
                                       rtol=1e-5, atol=1e-6)
    # the correction bias changes the choice of a top-k layer
    mlp = r.model.layers[2].mlp
    with torch.no_grad():
        e1 = mlp.route(x, ids)[1]
        saved = mlp.e_score_correction_bias.clone()
        mlp.e_score_correction_bias.copy_(torch.arange(8.0) * 10)
        assert mlp.route(x, ids)[1].sort(-1).values.tolist() == [[6, 7]] * 9
        mlp.e_score_correction_bias.copy_(saved)
        assert torch.equal(mlp.route(x, ids)[1], e1)


def test_silu_clamp_activation_and_kernel(kernel_device):
    """DeepSeek-V4's ``silu(min(gate, limit)) * clamp(up, -limit, limit)``: by hand, and the
    fused-MoE kernel (the interpreter on CPU) equal to its twin with the clamp biting."""
    act = GatedActivation("silu_clamp", limit=0.5)
    gate, up = torch.tensor([-2.0, 0.2, 3.0]), torch.tensor([1.0, -0.3, -4.0])
    sig = torch.sigmoid(torch.tensor([-2.0, 0.2, 0.5]))
    # up 1 -> 0.5, gate 3 -> 0.5, up -4 -> -0.5
    want = torch.stack([-2.0 * sig[0] * 0.5, 0.2 * sig[1] * -0.3, 0.5 * sig[2] * -0.5])
    torch.testing.assert_close(act(gate, up), want)
    g = torch.Generator().manual_seed(3)
    t, h, e, i, k = 13, 32, 4, 16, 2
    x = torch.randn(t, h, generator=g).to(kernel_device)
    w13 = (torch.randn(e, 2 * i, h, generator=g) * 0.3).to(kernel_device)
    w2 = (torch.randn(e, h, i, generator=g) * 0.3).to(kernel_device)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(kernel_device)
    weights = torch.rand(t, k, generator=g).to(kernel_device)
    ref_out = fused_moe_ref(x, w13, w2, weights, ids, activation=act)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, activation=act), ref_out,
                               rtol=1e-4, atol=1e-5)
    plain = fused_moe_ref(x, w13, w2, weights, ids)
    assert (plain - ref_out).abs().max() > 0.1  # the clamp acts on these activations


def _hf_hooks(hf, store):
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        a = layer.self_attn
        hooks.append(a.register_forward_hook(
            lambda m, args, out, i=i: store.setdefault(("attn", i), []).append(out[0][0].clone())))
        if a.compressor is not None:
            hooks.append(a.compressor.register_forward_hook(
                lambda m, args, out, i=i: store.setdefault(("entries", i), []).append(out[0][0, 0].clone())))
        if getattr(a.compressor, "indexer", None) is not None:
            hooks.append(a.compressor.indexer.register_forward_hook(
                lambda m, args, out, i=i: store.setdefault(("topk", i), []).append(out[0].clone())))
    return hooks


def _valid_sets(rows):
    return [sorted(v for v in row if v >= 0) for row in rows.tolist()]


@pytest.mark.parametrize("chunk", [None, 9])
def test_attention_kinds_compressor_and_indexer_match_transformers(ref, twins, chunk):
    """One 70-token prompt (one step, or chunks of 9 that split compression groups): each
    layer's attention output (sliding, CSA, HCA), the entries in the compressed caches and
    every CSA query's selection equal transformers'."""
    r = ref("default")
    prompt = r.prompts[2]
    store: dict = {}
    hooks = _hf_hooks(r.hf, store)
    try:
        with torch.no_grad():
            r.hf(torch.tensor([prompt]))
    finally:
        for h in hooks:
            h.remove()
    model = r.model
    mine: dict = {}
    hooks = [layer.self_attn.register_forward_hook(
        lambda m, args, out, i=i: mine.setdefault(i, []).append(out.clone()))
        for i, layer in enumerate(model.layers)]
    sel: dict = {}
    model.topk_hook = lambda i, idx: sel.setdefault(i, []).append(idx.clone())
    d = Dsv4Driver(model)
    try:
        rid = d.add(prompt)
        for s in range(0, len(prompt), chunk or len(prompt)):
            d.step([(rid, min(chunk or len(prompt), len(prompt) - s))])
    finally:
        model.topk_hook = None
        for h in hooks:
            h.remove()
    for i in range(4):
        torch.testing.assert_close(torch.cat(mine[i]), store[("attn", i)][0], rtol=1e-4, atol=1e-5)
    names = list(model.kv_cache_specs(16))
    for i, c in ((1, 4), (2, 16), (3, 4)):
        want = store[("entries", i)][0]
        assert want.shape[0] == len(prompt) // c
        k = names.index(f"model.layers.{i}.self_attn.compressor")
        cache, blocks = d.caches[k], d.reqs[rid]["blocks"][d.group_of[k]]
        s = cache.shape[1]
        got = torch.stack([cache[blocks[w // s], w % s] for w in range(want.shape[0])])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    nontrivial = 0
    for i in (1, 3):
        got = [row for step in sel[i] for row in _valid_sets(step)]
        want = _valid_sets(store[("topk", i)][0])
        assert got == want
        for p, s in enumerate(got):
            n = (p + 1) // 4
            assert len(s) == min(4, n) and all(v < n for v in s)
            nontrivial += len(s) == 4 and s != list(range(n - 4, n))
    assert nontrivial > 10  # not just the most recent entries


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prompt_and_decode_logits_match_transformers(ref, twins, name):
    """Prompt logits (one step; chunks of 7) and the logits of 6 greedy decode steps against
    transformers' own cache path, prompts longer than the window and than several groups."""
    r = ref(name)
    p = max(r.prompts, key=len)
    assert len(p) > 4 * r.model.config.dsv4.sliding_window
    with torch.no_grad():
        want = r.hf(torch.tensor([p])).logits[0]
    d = Dsv4Driver(r.model)
    torch.testing.assert_close(d.prompt_logits(p), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(d.prompt_logits(p, chunk=7), want, rtol=1e-4, atol=1e-4)
    rid = d.add(p)
    logits = r.model.compute_logits(d.step([(rid, len(p))]))[-1]
    cache = transformers.DynamicCache(config=r.hf.config)
    with torch.no_grad():
        hf_logits = r.hf(torch.tensor([p]), cache=cache, use_cache=True).logits[0, -1]
        for _ in range(6):
            torch.testing.assert_close(logits, hf_logits, rtol=1e-4, atol=1e-4)
            tok = int(hf_logits.argmax())
            d.reqs[rid]["tokens"].append(tok)
            logits = r.model.compute_logits(d.step([(rid, 1)]))[0]
            hf_logits = r.hf(torch.tensor([[tok]]), cache=cache, use_cache=True).logits[0, -1]
    d.finish(rid)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_batched_greedy_matches_generate(ref, twins, name):
    """Batches of prompts of different lengths, chunked prefill (chunks of 9) beside decodes,
    blocks of 16 and 32: tokens equal transformers' ``generate`` of each prompt."""
    r = ref(name)
    want = [r.generate(p) for p in r.prompts]
    assert Dsv4Driver(r.model).greedy(r.prompts, NEW, chunk=9) == want
    if name == "default":
        assert Dsv4Driver(r.model, block_size=32, seed=3).greedy(r.prompts, NEW) == want


def test_triton_kernels_in_the_model(ref):
    """The index layer's kernels, the KV writer and the indexer scores through the Triton
    interpreter (no twins): prompt logits and two decode steps as transformers'."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the kernels on CPU tensors need the Triton interpreter")
    r = ref("default")
    model = r.model
    model.set_attention_backend(Dsv4Backend("kernel", writer="kernel"))
    try:
        p = r.prompts[1]
        with torch.no_grad():
            want = r.hf(torch.tensor([p])).logits[0]
        torch.testing.assert_close(Dsv4Driver(model).prompt_logits(p, chunk=10), want,
                                   rtol=1e-4, atol=1e-4)
        assert Dsv4Driver(model).greedy([p], 2) == [r.generate(p, 2)]
    finally:
        model.set_attention_backend(Dsv4Backend("ref"))


def test_parameter_count_and_checkpoint_layouts(ref, tmp_path):
    """Every tensor of save_pretrained's names is one of ours (and the buffers: hash tables,
    router biases); transformers' module names load too; so do the hub's (renamed here)."""
    from safetensors.torch import load_file, save_file

    r = ref("default")
    cfg = r.ck.config
    assert cfg.num_parameters() == sum(p.numel() for p in r.hf.parameters())
    saved = load_file(os.path.join(r.path, "model.safetensors"))
    assert set(r.model.hf_weight_map("original")) == set(saved)
    assert set(r.model.hf_weight_map("fused")) == set(r.hf.state_dict()) - {
        k for k in r.hf.state_dict() if "rotary_emb" in k}
    hub = {k: v for k, v in zip(r.model.hf_weight_map("hub"), r.model.hf_weight_map("original"))}
    assert hub["embed.weight"] == "model.embed_tokens.weight" and "hc_head_fn" in hub
    assert "layers.1.attn.indexer.compressor.ape" in hub
    d = tmp_path / "hub"
    d.mkdir()
    save_file({h: saved[o] for h, o in hub.items()}, str(d / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (d / f).write_bytes(open(os.path.join(r.path, f), "rb").read())
    model = load_checkpoint(str(d), dtype="float32").model
    for (k, (a, _)), (_, (b, _)) in zip(model.hf_weight_map().items(), r.model.hf_weight_map().items()):
        assert torch.equal(a, b), k
    # a hash table must be integers
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({**saved, "model.layers.0.ffn.gate.tid2eid": saved["model.layers.0.ffn.gate.tid2eid"].float()},
              str(bad / "model.safetensors"))
    (bad / "config.json").write_bytes(open(os.path.join(r.path, "config.json"), "rb").read())
    with pytest.raises(CheckpointError, match="integer"):
        load_checkpoint(str(bad), dtype="float32", tokenizer=False)


def test_bare_metadata_serves_only_a_profile_step(ref):
    model = ref("default").model
    caches = model.allocate_kv_caches(2, 16)
    table = torch.zeros(1, 4, dtype=torch.int32)
    md = build_attention_metadata([6], [6], table, torch.full((6,), -1, dtype=torch.int64))
    out = model(torch.arange(6), torch.arange(6), caches, md)
    assert out.shape == (6, 32) and torch.isfinite(out).all()
    assert all(torch.count_nonzero(c) == 0 for c in caches)  # nothing written
    md = build_attention_metadata([6], [6], table, torch.arange(6))
    with pytest.raises(InvalidRequestError, match="StepAttention"):
        model(torch.arange(6), torch.arange(6), caches, md)


def test_random_weights_generate(ref, twins):
    cfg = ref("default").ck.config
    model = DeepseekV4ForCausalLM(cfg).init_random_weights(seed=1)
    t = model.layers[0].mlp.tid2eid
    assert all(len(set(row)) == 2 for row in t.tolist()) and t.max() < 8
    assert len({tuple(row) for row in t.tolist()}) > 20
    out = Dsv4Driver(model).greedy([list(range(3, 40))], 4)
    assert len(out[0]) == 4


def _bf16_check(r, device: str) -> None:
    """Our bf16 prompt logits against transformers' float32 ones, beside transformers' own
    bf16 model: over all prompts, a relative (Frobenius) error at most 1.5 times transformers'
    and as many top-1 tokens agreeing (within 5%). Random tiny weights make bf16 logits differ
    by ~1-7% in both, prompt by prompt either way."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(r.path, dtype=torch.bfloat16)
    hf = hf.to(device).eval()
    model = load_checkpoint(r.path, dtype="bfloat16", device=device).model
    model.set_attention_backend(Dsv4Backend())
    err = {"ours": 0.0, "theirs": 0.0}
    agree = {"ours": 0, "theirs": 0}
    for p in r.prompts:
        with torch.no_grad():
            ref32 = r.hf(torch.tensor([p])).logits[0].float()
            theirs = hf(torch.tensor([p], device=device)).logits[0].float().cpu()
        ours = Dsv4Driver(model).prompt_logits(p, chunk=37).float().cpu()
        for k, x in (("ours", ours), ("theirs", theirs)):
            err[k] += float((x - ref32).norm() / ref32.norm())
            agree[k] += int((x.argmax(-1) == ref32.argmax(-1)).sum())
    assert err["ours"] <= 1.5 * err["theirs"], err
    assert agree["ours"] >= 0.95 * agree["theirs"], agree


@pytest.mark.parametrize("name", ["default", "hca-128"])
def test_bf16_is_as_close_as_transformers_bf16(ref, twins, name):
    """bf16 (weights, latents and entries; states, norms, mHC and sinks float32) on the CPU."""
    _bf16_check(ref(name), "cpu")


# ---- GPU


@pytest.mark.gpu
@pytest.mark.skipif(
    tuple(int(x) for x in transformers.__version__.split(".")[:2]) < (5, 24),
    reason="transformers < 5.24: its DeepSeek-V4 fails in bf16 inside its own forward (H200, 5.17)")
@pytest.mark.parametrize("name", ["default", "hca-128"])
def test_gpu_fp32_and_bf16_match_transformers(ref, name):
    """On the GPU: fp32 logits equal transformers' on the CPU (the Triton index kernels, the
    KV writer, the indexer scores and the fused-MoE kernel with the clamp); bf16 logits no
    further from transformers' float32 ones than transformers' bf16 model on the GPU."""
    r = ref(name)
    p = max(r.prompts, key=len)
    model = load_checkpoint(r.path, dtype="float32", device="cuda").model
    model.set_attention_backend(Dsv4Backend())
    with torch.no_grad():
        want = r.hf(torch.tensor([p])).logits[0]
    got = Dsv4Driver(model).prompt_logits(p, chunk=37).cpu()
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
    _bf16_check(r, "cuda")
