"""The mixture-of-experts block (``pagedkv.models.moe``) and its experts reference
(``pagedkv.kernels.fused_moe.fused_moe_ref``): routing and outputs equal transformers' Qwen3-MoE
and Mixtral modules with the same weights (each of its experts implementations), the
sorted-by-expert reference equals a naive per-token loop and never touches an expert without
tokens; config parsing (sparse layers, defaults, errors), both checkpoint layouts, and the tiny
checkpoints' routing is not degenerate."""

import pytest
import torch
import torch.nn.functional as F

from pagedkv.errors import CheckpointError, ConfigError
from pagedkv.kernels.fused_moe import fused_moe_ref, sort_by_expert
from pagedkv.models.config import ModelArchConfig, MoeConfig
from pagedkv.models.moe import SparseMoeBlock, route_topk

transformers = pytest.importorskip("transformers")
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402

H, E, I, K = 48, 6, 40, 2


def naive_moe(x, w13, w2, weights, ids):
    """One token and one choice at a time, in float64: the definition."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[-1]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e].double() @ x[t].double()
            h = F.silu(gu[:inter]) * gu[inter:]
            out[t] += float(weights[t, j]) * (w2[e].double() @ h)
    return out


def random_experts(gen, t, e=E, k=K, dtype=torch.float32, h=H, inter=I):
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.2).to(dtype)
    w2 = (torch.randn(e, h, inter, generator=gen) * 0.2).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    weights, ids = route_topk(logits, k, True, torch.float32)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("t,e,k", [(1, 6, 2), (7, 6, 2), (33, 8, 3), (20, 4, 1), (5, 16, 4)])
def test_sorted_reference_equals_a_naive_loop(t, e, k):
    gen = torch.Generator().manual_seed(t * 100 + e * 10 + k)
    x, w13, w2, weights, ids = random_experts(gen, t, e, k)
    got = fused_moe_ref(x, w13, w2, weights, ids)
    assert got.dtype == torch.float32 and got.shape == (t, H)
    torch.testing.assert_close(got.double(), naive_moe(x, w13, w2, weights, ids), atol=1e-5, rtol=1e-5)


def test_reference_low_precision_and_duplicate_choices():
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, weights, ids = random_experts(gen, 9, dtype=torch.bfloat16)
    got = fused_moe_ref(x, w13, w2, weights.to(torch.bfloat16), ids)
    assert got.dtype == torch.bfloat16
    want = naive_moe(x, w13, w2, weights.to(torch.bfloat16), ids)
    torch.testing.assert_close(got.double(), want, atol=5e-2, rtol=3e-2)
    # a token routed twice to one expert (not what top-k produces, but the sum is defined)
    ids = torch.tensor([[1, 1], [0, 1], [3, 3]])
    w = torch.tensor([[0.25, 0.75], [0.5, 0.5], [1.0, 2.0]])
    x3, w13f, w2f = x[:3].float(), w13.float(), w2.float()
    torch.testing.assert_close(fused_moe_ref(x3, w13f, w2f, w, ids).double(),
                               naive_moe(x3, w13f, w2f, w, ids), atol=1e-5, rtol=1e-5)


def test_reference_runs_only_the_experts_with_tokens():
    """Experts nobody is routed to hold NaN weights: a dense all-experts computation would
    spread them into every row."""
    gen = torch.Generator().manual_seed(5)
    x, w13, w2, _, _ = random_experts(gen, 10, e=8)
    ids = torch.randint(0, 3, (10, 1), generator=gen)
    ids = torch.cat([ids, ids + 4], dim=1)  # experts 3 and 7 never chosen
    weights = torch.rand(10, 2, generator=gen)
    w13[3], w2[3], w13[7], w2[7] = float("nan"), float("nan"), float("nan"), float("nan")
    got = fused_moe_ref(x, w13, w2, weights, ids)
    assert torch.isfinite(got).all()
    order, counts = sort_by_expert(ids, 8)
    assert counts[3] == 0 and counts[7] == 0 and counts.sum() == 20
    flat = ids.reshape(-1)[order]
    assert torch.all(flat[1:] >= flat[:-1])  # sorted by expert
    for e in range(8):  # stable: pair order within one expert
        pairs = order[flat == e]
        assert torch.all(pairs[1:] > pairs[:-1])


def test_reference_edge_cases_and_errors():
    gen = torch.Generator().manual_seed(1)
    x, w13, w2, weights, ids = random_experts(gen, 4)
    assert fused_moe_ref(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, H)
    with pytest.raises(ConfigError, match=r"topk_ids must lie in \[0, 6\)"):
        fused_moe_ref(x, w13, w2, weights, ids + E)
    with pytest.raises(ConfigError, match="w13 must be"):
        fused_moe_ref(x, w13[:, :-1], w2, weights, ids)
    with pytest.raises(ConfigError, match="share one dtype"):
        fused_moe_ref(x.half(), w13, w2, weights, ids)
    with pytest.raises(ConfigError, match="both be"):
        fused_moe_ref(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ConfigError, match="int32/int64"):
        fused_moe_ref(x, w13, w2, weights, ids.float())


# ---- the block against transformers' modules


def _hf_block(family, norm_topk_prob, impl):
    if family == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(hidden_size=H, num_experts=E, num_experts_per_tok=K,
                                          moe_intermediate_size=I, norm_topk_prob=norm_topk_prob)
        cls = Qwen3MoeSparseMoeBlock
    else:
        cfg = transformers.MixtralConfig(hidden_size=H, num_local_experts=E, num_experts_per_tok=K,
                                         intermediate_size=I)
        cls = MixtralSparseMoeBlock
    cfg._experts_implementation = impl
    return cls(cfg).eval()


def _ours(family, norm_topk_prob, hf, dtype):
    moe = MoeConfig(num_experts=E, top_k=K, intermediate_size=I,
                    norm_topk_prob=norm_topk_prob or family == "mixtral",
                    weights_dtype="model" if family == "qwen3_moe" else "float32",
                    sparse_layers=(True,))
    block = SparseMoeBlock(H, moe, family, dtype=dtype)
    with torch.no_grad():
        block.gate.weight.copy_(hf.gate.weight)
        block.w13.copy_(hf.experts.gate_up_proj)
        block.w2.copy_(hf.experts.down_proj)
    return block


@pytest.mark.parametrize("impl", ["eager", "grouped_mm"])
@pytest.mark.parametrize("family,norm", [("qwen3_moe", False), ("qwen3_moe", True), ("mixtral", True)])
def test_block_matches_transformers(family, norm, impl):
    torch.manual_seed(0)
    hf = _hf_block(family, norm, impl)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    ours = _ours(family, norm, hf, torch.float32)
    x = torch.randn(2, 13, H)
    with torch.no_grad():
        want = hf(x)
        got = ours(x.reshape(-1, H))
        _, hf_w, hf_ids = hf.gate(x.reshape(-1, H))
        w, ids = ours.route(x.reshape(-1, H))
    assert torch.equal(ids, hf_ids) and torch.equal(w, hf_w) and w.dtype == hf_w.dtype
    assert len(ids.unique()) == E  # every expert got tokens
    torch.testing.assert_close(got, want.reshape(-1, H), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_block_bf16_follows_transformers_rounding(family):
    """bf16: Qwen3-MoE rounds its routing weights to bf16, Mixtral keeps them float32; the
    weighted sum rounds once (transformers' default grouped_mm experts)."""
    torch.manual_seed(1)
    hf = _hf_block(family, True, "grouped_mm")
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf = hf.to(torch.bfloat16)
    ours = _ours(family, True, hf, torch.bfloat16)
    x = torch.randn(1, 17, H).to(torch.bfloat16)
    with torch.no_grad():
        want = hf(x).reshape(-1, H)
        w, _ = ours.route(x.reshape(-1, H))
        got = ours(x.reshape(-1, H))
    assert w.dtype == (torch.bfloat16 if family == "qwen3_moe" else torch.float32)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_route_topk_hand_computed():
    logits = torch.tensor([[0.0, 1.0, 2.0, -1.0]])
    p = torch.softmax(logits, -1)[0]
    w, ids = route_topk(logits, 2, False, torch.float32)
    assert ids.tolist() == [[2, 1]]
    torch.testing.assert_close(w[0], p[[2, 1]])
    w, _ = route_topk(logits, 2, True, torch.float32)
    torch.testing.assert_close(w[0], p[[2, 1]] / p[[2, 1]].sum())
    assert route_topk(logits.half(), 2, True, torch.float16)[0].dtype == torch.float16


# ---- config


def _cfg(arch, **kw):
    d = {"architectures": [arch], "hidden_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
         "vocab_size": 512}
    d.update(kw)
    return ModelArchConfig.from_dict(d)


def test_config_sparse_layers_and_defaults():
    q = _cfg("Qwen3MoeForCausalLM")
    assert q.family == "qwen3_moe" and q.qk_norm and q.head_dim == 16  # hidden / heads
    assert q.moe == MoeConfig(num_experts=128, top_k=8, intermediate_size=768, norm_topk_prob=False,
                              weights_dtype="model", sparse_layers=(True,) * 4)
    assert _cfg("Qwen3MoeForCausalLM", decoder_sparse_step=2).moe.sparse_layers == (False, True, False, True)
    assert _cfg("Qwen3MoeForCausalLM", mlp_only_layers=[0, 3], num_local_experts=4,
                num_experts_per_tok=2).moe.sparse_layers == (False, True, True, False)
    assert _cfg("Qwen3MoeForCausalLM", num_experts=0).moe.sparse_layers == (False,) * 4
    assert _cfg("Qwen3MoeForCausalLM", num_experts=16, num_local_experts=4).moe.num_experts == 16
    m = _cfg("MixtralForCausalLM")
    assert m.family == "mixtral" and not m.qk_norm and m.bos_token_id == 1 and m.eos_token_ids == (2,)
    assert m.moe == MoeConfig(num_experts=8, top_k=2, intermediate_size=128, norm_topk_prob=True,
                              weights_dtype="float32", sparse_layers=(True,) * 4)
    # windows: Mixtral as Mistral; Qwen3-MoE on every layer, only with use_sliding_window
    assert _cfg("MixtralForCausalLM", sliding_window=64).layer_windows == (64,) * 4
    assert _cfg("Qwen3MoeForCausalLM", sliding_window=64).layer_windows == (None,) * 4
    assert _cfg("Qwen3MoeForCausalLM", use_sliding_window=True, sliding_window=64,
                max_window_layers=2).layer_windows == (64,) * 4
    assert _cfg("Qwen3MoeForCausalLM", use_sliding_window=True).layer_windows == (4096,) * 4


@pytest.mark.parametrize("kw,match", [
    (dict(num_experts_per_tok=9, num_experts=8), "must not exceed"),
    (dict(mlp_only_layers=[4]), "mlp_only_layers"),
    (dict(mlp_only_layers="0"), "mlp_only_layers"),
    (dict(decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(norm_topk_prob="yes"), "norm_topk_prob"),
    (dict(num_experts=-1), "num_experts"),
    (dict(moe_intermediate_size=1.5), "moe_intermediate_size"),
])
def test_config_errors(kw, match):
    with pytest.raises(ConfigError, match=match):
        _cfg("Qwen3MoeForCausalLM", **kw)


@pytest.mark.parametrize("family,opts", [
    ("qwen3_moe", dict(num_layers=3, mlp_only_layers=(0,), decoder_sparse_step=1)),
    ("mixtral", dict()),
])
def test_parameter_count_matches_transformers(tiny_dir, family, opts):
    from pagedkv.models.config import load_model_config

    path = tiny_dir(family, **opts)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert load_model_config(path).num_parameters() == sum(p.numel() for p in hf.parameters())


# ---- checkpoints


def test_both_checkpoint_layouts_load_the_same_weights(tiny_dir):
    from safetensors import safe_open

    from pagedkv.models.loader import checkpoint_files, load_model

    for family in ("qwen3_moe", "mixtral"):
        per_expert, fused = tiny_dir(family), tiny_dir(family, save_original_format=False)
        names = set(checkpoint_files(per_expert))
        assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names or \
            "model.layers.0.block_sparse_moe.experts.0.w1.weight" in names
        assert "model.layers.0.mlp.experts.gate_up_proj" in set(checkpoint_files(fused))
        a, b = load_model(per_expert), load_model(fused)
        for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
            assert na == nb and torch.equal(pa, pb), na
        # the fused tensors are transformers' module parameters as they are
        hf = transformers.AutoModelForCausalLM.from_pretrained(per_expert, dtype=torch.float32)
        state = hf.state_dict()
        for name, (t, rows) in a.hf_weight_map("fused").items():
            got = t if rows is None else t[rows[0]: rows[0] + rows[1]]
            assert torch.equal(got, state[name]), name
        # per expert: gate rows, then up rows, of w13
        files = checkpoint_files(per_expert)
        key = next(n for n in files if n.endswith("experts.5.up_proj.weight")
                   or n.endswith("experts.5.w3.weight"))
        with safe_open(files[key], "pt") as f:
            up = f.get_tensor(key)
        inter = a.config.moe.intermediate_size
        assert torch.equal(a.layers[int(key.split(".")[2])].mlp.w13[5, inter:], up)


def test_missing_expert_tensor_names_the_layout(tiny_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from pagedkv.models.loader import load_model

    src = tiny_dir("qwen3_moe")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    state = load_file(dst / "model.safetensors")
    del state["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layouts per_expert, fused: per_expert\).*"
                                              r"missing tensors: model.layers.1.mlp.experts.3.down_proj"):
        load_model(dst)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tiny_routing_is_not_degenerate(tiny_dir, family):
    """On a real prompt, every sparse layer of the tiny checkpoint sends tokens to most experts
    and different tokens to different first choices."""
    from pagedkv.models.harness import PagedHarness
    from pagedkv.models.loader import load_checkpoint

    ck = load_checkpoint(tiny_dir(family))
    seen = []
    hooks = [layer.mlp.register_forward_hook(
        lambda mod, args, out: seen.append(mod.route(args[0])[1])) for layer in ck.model.layers]
    prompt = ck.tokenizer.encode("Prefix caching hashes full blocks so that a new prompt can reuse "
                                 "the blocks of an old one.")
    PagedHarness(ck.model, block_size=16, num_blocks=8).prompt_logits(prompt)
    for h in hooks:
        h.remove()
    assert len(seen) == ck.config.num_hidden_layers
    e = ck.config.moe.num_experts
    for ids in seen:
        counts = torch.bincount(ids.reshape(-1), minlength=e)
        assert (counts > 0).sum() >= e - 1, counts.tolist()
        assert counts.max() <= 0.5 * ids.numel(), counts.tolist()
        assert len(ids[:, 0].unique()) >= e // 2
