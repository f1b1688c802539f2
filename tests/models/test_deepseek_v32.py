"""DeepSeek-V3.2 (``pagedkv.models.deepseek_v32``, DeepSeek sparse attention): config parsing
(the hub config's sizes, defaults, the indexer's parameters, ``mlp_layer_types``, errors), the
cache layers (latent + indexer keys per layer, one UniformTypeKVCacheSpecs group), and tiny
random checkpoints through the paged harness (NaN-poisoned pool, shuffled blocks) against
transformers' ``DeepseekV32ForCausalLM``: the indexer's top-k (the selected positions of every
token and layer) on prefill and on each decode step, prompt logits, batched greedy tokens with
chunked prefill mixed with decodes, for the torch twins and the Triton kernels (interpreter),
variants (YaRN + attention bias, top-k covering the whole context, 3 layers) and the parameter
count."""

import pytest
import torch

from test_deepseek_v3 import NEW_TOKENS, TEXTS
from test_deepseek_v3 import Ref as V3Ref

from pagedkv.attention.mla_sparse import DSABackend
from pagedkv.core.planning import get_kv_cache_groups
from pagedkv.core.spec import MLAAttentionSpec, UniformTypeKVCacheSpecs
from pagedkv.errors import ConfigError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.harness import PagedHarness
from pagedkv.models.loader import load_checkpoint

transformers = pytest.importorskip("transformers")

# DeepSeek-V3.2-Exp's config.json (the values that matter here)
V32 = {
    "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128,
    "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6, "vocab_size": 129280, "rope_theta": 10000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
}


def test_v32_config():
    cfg = ModelArchConfig.from_dict(dict(V32))
    x, m = cfg.indexer, cfg.mla
    assert cfg.family == "deepseek_v32"
    assert (x.n_heads, x.head_dim, x.topk, x.rope_dim) == (64, 128, 2048, 64)
    assert m.latent_dim == 576 and m.rope_interleave and m.q_lora_rank == 1536
    # latent (576) + indexer key (128) per layer and token
    assert cfg.kv_cache_bytes_per_token(2) == 61 * (576 + 128) * 2
    assert cfg.moe.sparse_layers == (False,) * 3 + (True,) * 58
    v3 = ModelArchConfig.from_dict({**V32, "architectures": ["DeepseekV3ForCausalLM"]})
    assert v3.indexer is None and cfg.attn_scale == v3.attn_scale
    # the indexer per layer: wq_b 1536 x (64 * 128), wk 7168 x 128, k_norm 2 x 128,
    # weights_proj 7168 x 64
    per_layer = 1536 * 64 * 128 + 7168 * 128 + 2 * 128 + 7168 * 64
    assert cfg.num_parameters() == v3.num_parameters() + 61 * per_layer
    assert 671e9 < cfg.num_parameters() < 673e9


def test_defaults_layer_kinds_and_errors():
    d = {k: V32[k] for k in ("architectures", "hidden_size", "intermediate_size",
                             "num_hidden_layers", "num_attention_heads", "vocab_size")}
    cfg = ModelArchConfig.from_dict(d)  # DeepseekV32Config's defaults
    assert (cfg.indexer.n_heads, cfg.indexer.head_dim, cfg.indexer.topk) == (64, 128, 2048)
    assert cfg.max_position_embeddings == 163840 and cfg.moe.sparse_layers[:4] == (False,) * 3 + (True,)
    # transformers always interleaves the MLA rope pairs of DeepSeek-V3.2
    assert ModelArchConfig.from_dict({**d, "rope_interleave": False}).mla.rope_interleave
    kinds = ["dense", "sparse", "dense"] + ["sparse"] * 58
    assert ModelArchConfig.from_dict({**d, "mlp_layer_types": kinds}).moe.sparse_layers[:4] == (
        False, True, False, True)
    for bad, match in [({"q_lora_rank": None}, "q_lora_rank"),
                       ({"index_head_dim": 32}, "at least qk_rope_head_dim"),
                       ({"index_topk": 0}, "index_topk"),
                       ({"index_n_heads": "64"}, "index_n_heads"),
                       ({"mlp_layer_types": ["dense"] * 60}, "mlp_layer_types"),
                       ({"mlp_layer_types": ["moe"] * 61}, "mlp_layer_types")]:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict({**d, **bad})


# ---- tiny checkpoints against transformers

VARIANTS = {
    "default": {},  # top-k 8 of up to ~45 positions
    "yarn-bias": dict(attention_bias=True, index_topk=5, index_n_heads=12, index_head_dim=24,
                      max_position_embeddings=256,
                      rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                    "original_max_position_embeddings": 64, "mscale": 1.0,
                                    "mscale_all_dim": 0.8, "beta_fast": 32, "beta_slow": 1}),
    "dense-topk": dict(index_topk=64),  # every token selects its whole context: MLA
    "3-layers": dict(num_layers=3, index_topk=12, n_group=4, topk_group=2),
}


class Ref(V3Ref):
    """DeepSeek-V3's reference pair (our model + transformers' on one checkpoint), with the
    DSA backend's kernels or twins."""

    def harness(self, block_size, kernels="ref"):
        writer = "ref" if kernels == "ref" else "kernel"
        self.ck.model.set_attention_backend(DSABackend(kernels, writer=writer))
        return super().harness(block_size)


_REFS: dict = {}


@pytest.fixture(scope="module")
def ref(tiny_dir):
    def get(name):
        if name not in _REFS:
            _REFS[name] = Ref(tiny_dir("deepseek_v32", **VARIANTS[name]))
        return _REFS[name]

    yield get
    _REFS.clear()


def test_cache_layers_form_one_group(ref):
    model = ref("default").ck.model
    specs = model.kv_cache_specs(16)
    assert list(specs) == ["model.layers.0.self_attn", "model.layers.0.self_attn.indexer",
                           "model.layers.1.self_attn", "model.layers.1.self_attn.indexer"]
    assert specs["model.layers.0.self_attn"] == MLAAttentionSpec(16, num_kv_heads=1, head_size=40,
                                                                 dtype="float32")
    assert specs["model.layers.1.self_attn.indexer"] == MLAAttentionSpec(
        16, num_kv_heads=1, head_size=16, dtype="float32")
    (group,) = get_kv_cache_groups(specs)
    assert group.layer_names == tuple(specs)
    assert isinstance(group.kv_cache_spec, UniformTypeKVCacheSpecs)
    caches = model.allocate_kv_caches(5, 16, fill=None)
    assert [tuple(c.shape) for c in caches] == [(5, 16, 40), (5, 16, 16)] * 2


def _hf_topk_hooks(hf, store):
    """Record every indexer call of transformers' model: per layer, a list of [S, k] top-k."""
    hooks = []
    for i, layer in enumerate(hf.model.layers):
        def hook(mod, args, out, i=i):
            store.setdefault(i, []).append(out[0].clone())
        hooks.append(layer.self_attn.indexer.register_forward_hook(hook))
    return hooks


def _sets(rows, first_pos):
    """Selected positions per token (rows of a [S, k] top-k), causal entries only."""
    out = []
    for j, row in enumerate(rows.tolist()):
        p = first_pos + j
        out.append(sorted(v for v in row if 0 <= v <= p))
    return out


@pytest.mark.parametrize("name", ["default", "yarn-bias"])
def test_indexer_topk_matches_transformers_prefill_and_decode(ref, name):
    """The positions the indexer selects, token by token and layer by layer, on a prompt
    prefill and on every decode step of greedy generation."""
    r = ref(name)
    model, topk = r.ck.model, r.ck.config.indexer.topk
    prompt = r.prompts[3]
    assert len(prompt) > 4 * topk
    hf_sel: dict = {}
    hooks = _hf_topk_hooks(r.hf, hf_sel)
    try:
        with torch.no_grad():
            ids = torch.tensor([prompt])
            out = r.hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                do_sample=False, eos_token_id=None, pad_token_id=0)
    finally:
        for h in hooks:
            h.remove()
    ours: dict = {}
    model.topk_hook = lambda layer, idx: ours.setdefault(layer, []).append(idx.clone())
    try:
        h = r.harness(16)
        assert h.greedy_generate([prompt], 4) == [out[0, len(prompt):].tolist()]
    finally:
        model.topk_hook = None
    nontrivial = 0
    for layer in range(len(model.layers)):
        steps_hf, steps_ours = hf_sel[layer], ours[layer]
        assert len(steps_hf) == len(steps_ours) == 4  # prefill + 3 decodes
        pos = 0
        for a, b in zip(steps_hf, steps_ours):
            want, got = _sets(a, pos), _sets(b, pos)
            assert got == want
            # -1 exactly past the min(topk, p + 1) valid entries, valid entries first
            for j, row in enumerate(b.tolist()):
                k = min(topk, pos + j + 1)
                assert all(v >= 0 for v in row[:k]) and all(v == -1 for v in row[k:])
            nontrivial += sum(s != list(range(pos + j + 1 - len(s), pos + j + 1))
                              for j, s in enumerate(got) if len(s) == topk)
            pos += a.shape[0]
    assert nontrivial > 10  # the selections are not just the most recent positions


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prompt_logits_and_greedy_tokens_match_transformers(ref, name):
    r = ref(name)
    assert type(r.ck.model).__name__ == "DeepseekV32ForCausalLM"
    assert r.ck.config.attn_scale == pytest.approx(r.hf.model.layers[0].self_attn.scaling, rel=1e-15)
    h = r.harness(16)
    with torch.no_grad():
        for p in r.prompts:
            torch.testing.assert_close(h.prompt_logits(p), r.hf(torch.tensor([p])).logits[0],
                                       atol=1e-4, rtol=1e-4)
    # batched, block size 32; then chunks of 7 within 16 tokens a step mixed with decodes,
    # padding tokens
    assert r.harness(32).greedy_generate(r.prompts, NEW_TOKENS) == r.generations
    if name == "default":
        h = r.harness(16)
        assert h.greedy_generate(r.prompts, NEW_TOKENS, chunk_size=7, token_budget=16,
                                 pad_tokens=3) == r.generations
        assert any(any(d >= n for _, d, _, n in s) and any(0 < d < n for _, d, _, n in s)
                   for s in h.step_log)


def test_triton_kernels_match_transformers(ref):
    """The Triton indexer-score and sparse-attention kernels (interpreter on CPU)."""
    r = ref("default")
    h = r.harness(16, kernels="kernel")
    p = r.prompts[2]
    with torch.no_grad():
        want = r.hf(torch.tensor([p])).logits[0]
    torch.testing.assert_close(h.prompt_logits(p), want, atol=1e-4, rtol=1e-4)
    h = r.harness(16, kernels="kernel")
    assert h.greedy_generate(r.prompts[1:3], NEW_TOKENS, chunk_size=9) == r.generations[1:3]


def test_parameter_count_and_fp32_weights_proj(ref):
    """The loader takes every tensor of the checkpoint (it rejects missing and unexpected
    names); the counts agree; ``weights_proj`` stays float32 in a bf16 model as in
    transformers (``_keep_in_fp32_modules``)."""
    for name in ("default", "3-layers"):
        r = ref(name)
        assert r.ck.config.num_parameters() == sum(t.numel() for t in r.hf.state_dict().values())
    from pagedkv.models.deepseek_v32 import DeepseekV32ForCausalLM

    bf16 = DeepseekV32ForCausalLM(ref("default").ck.config, dtype=torch.bfloat16)
    idx = bf16.layers[0].self_attn.indexer
    assert idx.weights_proj.weight.dtype == torch.float32 and idx.wk.weight.dtype == torch.bfloat16


# ---- GPU


@pytest.mark.gpu
def test_fp32_kernels_on_gpu_match_transformers(ref, tiny_dir):
    """fp32 on the GPU: the Triton DSA kernels ("auto": CUDA tensors) and the fused-MoE
    kernel; prompt logits and greedy tokens (chunked prefill) equal transformers' on the CPU."""
    r = ref("default")
    model = load_checkpoint(tiny_dir("deepseek_v32"), dtype="float32", device="cuda").model
    model.set_attention_backend(DSABackend())
    assert model.attn_backend.plan(_cuda_metadata(), None).kernels
    h = PagedHarness(model, block_size=16, num_blocks=64)
    with torch.no_grad():
        for p in r.prompts:
            torch.testing.assert_close(h.prompt_logits(p).cpu(), r.hf(torch.tensor([p])).logits[0],
                                       atol=1e-3, rtol=1e-3)
    assert PagedHarness(model, block_size=16, num_blocks=64).greedy_generate(
        r.prompts, NEW_TOKENS, chunk_size=8) == r.generations


def _cuda_metadata():
    from pagedkv.attention.metadata import build_attention_metadata

    return build_attention_metadata([1], [1], torch.ones(1, 1, dtype=torch.int32),
                                    torch.zeros(1, dtype=torch.int64), device="cuda")


MID_SHAPE = dict(
    init_std=0.02, hidden_size=512, num_layers=4, num_heads=8, intermediate_size=1024,
    vocab_size=1024, max_position_embeddings=4096, q_lora_rank=256, kv_lora_rank=128,
    qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, num_experts=16,
    num_experts_per_tok=4, moe_intermediate_size=128, n_group=4, topk_group=2,
    index_n_heads=32, index_head_dim=64, index_topk=64)


def _greedy_no_cache(model, prompt, n):
    """transformers' greedy tokens by full forwards (no KV cache: nothing of its cache code)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids], device=model.device)).logits[0, -1].argmax()))
    return ids[len(prompt):]


def bf16_within_noise_floor(path, device, backend, lengths=(17, 300, 900), n_new=24):
    """bf16 rounding moves near-ties of the indexer's scores, so a token's top-k set (and then
    its logits) can differ between any two bf16 implementations; the truth is fp32. The
    criterion: against transformers in fp32 (the bf16 checkpoint's weights, upcast), our bf16
    engine is about as far as transformers' own bf16 is: the mean and the 99th percentile of
    ``1 - cos`` of the prompt logits at most 4 times transformers' (+1e-3; our decode absorbs
    the key up-projection into the query, in bf16: CPU twins, 17 dense positions: mean 0.0025
    against transformers' 0.0008), top-1 agreement at most 0.15 below, and for the greedy continuation, teacher-forced on fp32, at least as many
    argmax tokens as transformers' bf16 greedy tokens get minus 25% and a largest margin at
    most twice theirs (+0.05). Returns the per-prompt numbers (printed)."""
    from pagedkv.models.harness import teacher_forced_check

    ck = load_checkpoint(path, device=device)
    assert ck.model.embed_tokens.dtype == torch.bfloat16
    ck.model.set_attention_backend(backend)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    ref = ref.to(device).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    hf = hf.to(device).eval()
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1024, (n,), generator=g).tolist() for n in lengths]
    h = PagedHarness(ck.model, block_size=16, num_blocks=160)
    ours = h.greedy_generate(prompts, n_new)
    rows = []
    with torch.no_grad():
        for p, o in zip(prompts, ours):
            want = ref(torch.tensor([p], device=device)).logits[0].float()
            err = {}
            for name, x in (("ours", h.prompt_logits(p)),
                            ("hf", hf(torch.tensor([p], device=device)).logits[0].float())):
                e = 1 - torch.nn.functional.cosine_similarity(x.to(want.device), want, dim=-1)
                top1 = (x.to(want.device).argmax(-1) == want.argmax(-1)).float().mean().item()
                err[name] = (e.mean().item(), torch.quantile(e, 0.99).item(), top1)
            tf_ours = teacher_forced_check(ref, p, o)
            tf_hf = teacher_forced_check(ref, p, _greedy_no_cache(hf, p, n_new))
            row = dict(prompt=len(p), ours=err["ours"], hf=err["hf"],
                       tf_ours=(tf_ours.exact, tf_ours.max_margin),
                       tf_hf=(tf_hf.exact, tf_hf.max_margin))
            print(row)
            rows.append(row)
            (m_o, q_o, t_o), (m_h, q_h, t_h) = err["ours"], err["hf"]
            assert m_o <= 4 * m_h + 1e-3 and q_o <= 4 * q_h + 1e-3, row
            assert t_o >= t_h - 0.15, row
            assert tf_ours.exact >= tf_hf.exact - 0.25 * n_new, row
            assert tf_ours.max_margin <= 2 * tf_hf.max_margin + 0.05, row
    return rows


@pytest.mark.gpu
def test_bf16_mid_shape_on_gpu_close_to_transformers(tiny_cache):
    """bf16 on a mid-sized V3.2 checkpoint (random weights, std 0.02; indexer 32 heads x 64,
    top-k 64) on the GPU with the Triton DSA kernels, contexts far past the top-k: within
    transformers' own bf16 distance from fp32 (``bf16_within_noise_floor``). H200, transformers
    5.17, at ae1f2e1 against transformers bf16 directly: min cos 0.982 / 0.885, top-1 0.94 /
    0.78 at the 17- / 300-token prompts (the 17-token prompt is within the top-k: dense)."""
    from pagedkv.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint("deepseek_v32", tiny_cache, dtype="bfloat16", **MID_SHAPE)
    bf16_within_noise_floor(path, "cuda", DSABackend())
