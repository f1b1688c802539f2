"""Qwen3-Next (``pagedkv.models.qwen3_next`` / ``gated_deltanet``) against transformers 5.24 on
CPU, fp32, kernels through the Triton interpreter.

The Gated-DeltaNet mixer with states allocated here (``[num_slots, *shape]``, NaN-poisoned)
and ``MambaMetadata`` built by hand: a varlen batch of fresh prompts (with a padded row) equals
transformers' ``Qwen3NextGatedDeltaNet`` on each prompt; prompts cut into chunks, mixed with
decode rows (decodes first, as the runner orders them), carry the state to the same outputs as
one whole pass; untouched slots stay NaN. Config parsing (Qwen3-Next's defaults, layer types,
partial RoPE, the shared expert gate, errors, parameter count), the partial rotary and the
shared-expert gate against transformers' pieces, and the whole model (a tiny checkpoint saved
by transformers, loaded by pagedkv's loader) against ``Qwen3NextForCausalLM``: prompt logits
and several decode steps of a batch, chunked prefill.
"""

import pytest
import torch
import torch.nn.functional as F

from pagedkv.attention.backend import StepAttention
from pagedkv.attention.metadata import build_attention_metadata
from pagedkv.errors import ConfigError, InvalidRequestError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.gated_deltanet import GatedDeltaNet
from pagedkv.worker.attn_builders import MambaMetadata

from test_parity import NEW_TOKENS, Ref  # noqa: E402  (tests/models is on sys.path)

transformers = pytest.importorskip("transformers")
from transformers import Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_next import modeling_qwen3_next as hf_q3n  # noqa: E402

PAD = -1

# the mixer's sizes: 2 key heads of 16, 4 value heads of 16 (two per key head), conv width 4
MIXER = dict(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4)


def hf_config(**kw) -> Qwen3NextConfig:
    d = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
             num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24,
             layer_types=["linear_attention", "full_attention"],
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5})
    d.update(MIXER)
    d.update(kw)
    return Qwen3NextConfig(**d)


def arch_config(hf_cfg: Qwen3NextConfig) -> ModelArchConfig:
    import json

    d = json.loads(hf_cfg.to_json_string())
    d["architectures"] = ["Qwen3NextForCausalLM"]
    return ModelArchConfig.from_dict(d)


def mixer_pair(seed=0, **kw):
    """transformers' mixer with random weights (a slow decay so that the state matters over
    tens of tokens) and ours with the same weights."""
    torch.manual_seed(seed)
    cfg = hf_config(**kw)
    hf = hf_q3n.Qwen3NextGatedDeltaNet(cfg, layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        hf.A_log.copy_(torch.empty_like(hf.A_log).uniform_(0.02, 0.3).log())
        hf.dt_bias.copy_(torch.randn_like(hf.dt_bias) * 0.3)
        hf.norm.weight.copy_(1.0 + torch.randn_like(hf.norm.weight) * 0.1)
    ours = GatedDeltaNet(arch_config(cfg), 0)
    with torch.no_grad():
        for name, (param, rows) in ours.hf_entries("").items():
            assert rows is None
            param.copy_(dict(hf.named_parameters())[name])
    return hf, ours


def hf_mixer_out(hf, x):
    """transformers' mixer on one whole sequence ``x [L, H]`` (no cache: its chunked path)."""
    with torch.no_grad():
        return hf(x[None])[0]


def mamba_metadata(rows, slots, num_pad_rows=0) -> MambaMetadata:
    """``rows`` = [(tokens computed before, new tokens)] (decodes first), ``slots`` their state
    slots; ``num_pad_rows`` padded rows (state index -1, no tokens) after them."""
    q = [n for _, n in rows] + [0] * num_pad_rows
    seq = [c + n for c, n in rows] + [0] * num_pad_rows
    qsl = torch.tensor([0] + torch.tensor(q).cumsum(0).tolist(), dtype=torch.int32)
    n_dec = 0
    while n_dec < len(rows) and rows[n_dec][1] == 1 and rows[n_dec][0] > 0:
        n_dec += 1
    assert all(not (n == 1 and c > 0) for c, n in rows[n_dec:]), "decodes must come first"
    n_tok = sum(q)
    return MambaMetadata(
        num_reqs=len(q), num_actual_tokens=n_tok, query_start_loc=qsl,
        seq_lens=torch.tensor(seq, dtype=torch.int32),
        state_indices=torch.tensor(list(slots) + [PAD] * num_pad_rows, dtype=torch.int32)[:, None],
        has_initial_state=torch.tensor([c > 0 for c, _ in rows] + [False] * num_pad_rows),
        block_table=torch.zeros(len(q), 1, dtype=torch.int32), num_actual_reqs=len(rows),
        num_decodes=n_dec, num_decode_tokens=n_dec, num_prefills=len(rows) - n_dec,
        num_prefill_tokens=n_tok - n_dec)


def poisoned_states(mixer, num_slots):
    conv, rec = mixer.state_shapes()
    return (torch.full((num_slots, *conv), float("nan")),
            torch.full((num_slots, *rec), float("nan")))


def test_state_shapes_and_spec():
    _, ours = mixer_pair()
    assert ours.state_shapes() == ((3, 2 * 2 * 16 + 4 * 16), (4, 16, 16))


def test_mixer_varlen_batch_matches_transformers():
    """Three fresh prompts of different lengths (one longer than the 64-token kernel chunk) and
    a padded row in one step: each prompt's outputs equal transformers' mixer on it alone; the
    slots of the prompts hold finite states, the others stay NaN."""
    hf, ours = mixer_pair()
    lens = [70, 1, 13]
    xs = [torch.randn(n, 32) for n in lens]
    states = poisoned_states(ours, 6)
    slots = [4, 1, 2]
    meta = mamba_metadata([(0, n) for n in lens], slots, num_pad_rows=1)
    with torch.no_grad():
        got = ours(torch.cat(xs), states, meta)
    start = 0
    for x in xs:
        torch.testing.assert_close(got[start:start + len(x)], hf_mixer_out(hf, x),
                                   atol=2e-5, rtol=2e-5)
        start += len(x)
    for s in states:
        assert torch.isfinite(s[slots]).all()
        assert torch.isnan(s[[0, 3, 5]]).all()


@pytest.mark.parametrize("cuts", [(5, 9, 10, 11), (1, 2, 30, 31, 32)])
def test_chunked_prefill_and_decodes_carry_the_state(cuts):
    """Two requests run step by step: prompt chunks (``has_initial_state`` from the second
    on), then decode tokens, the decode rows first in each step; the concatenated outputs equal
    transformers' mixer over each whole sequence."""
    hf, ours = mixer_pair(seed=1)
    total = [cuts[-1] + 6, 40]
    xs = [torch.randn(n, 32) for n in total]
    # request 0 is cut at `cuts` (one-token steps after its prompt count as decodes), request
    # 1 runs 17 + 11 + 12 one-token steps
    bounds = [[0, *cuts, *range(cuts[-1] + 1, total[0] + 1)], [0, 17, 28, *range(29, 41)]]
    states = poisoned_states(ours, 5)
    slots = [3, 0]
    outs = [[], []]
    step = 0
    while any(step + 1 < len(b) for b in bounds):
        rows = [(r, b[step], b[step + 1]) for r, b in enumerate(bounds) if step + 1 < len(b)]
        # decodes (one token, state present) first
        rows.sort(key=lambda r: not (r[2] - r[1] == 1 and r[1] > 0))
        meta = mamba_metadata([(lo, hi - lo) for _, lo, hi in rows], [slots[r] for r, _, _ in rows])
        x = torch.cat([xs[r][lo:hi] for r, lo, hi in rows])
        with torch.no_grad():
            y = ours(x, states, meta)
        start = 0
        for r, lo, hi in rows:
            outs[r].append(y[start:start + hi - lo])
            start += hi - lo
        step += 1
    for r in range(2):
        torch.testing.assert_close(torch.cat(outs[r]), hf_mixer_out(hf, xs[r]), atol=5e-5,
                                   rtol=5e-5)
    assert torch.isnan(states[1][[1, 2, 4]]).all()


def test_mixer_decode_matches_transformers_cache():
    """transformers' own decode path (its cache: conv-state update and the recurrent rule) after
    a prefill equals ours token by token."""
    hf, ours = mixer_pair(seed=2)
    cfg = hf_config()
    cache = transformers.DynamicCache(config=cfg)
    x = torch.randn(12, 32)
    states = poisoned_states(ours, 2)
    with torch.no_grad():
        want = [hf(x[None, :8], cache=cache)[0]]
        got = [ours(x[:8], states, mamba_metadata([(0, 8)], [1]))]
        for t in range(8, 12):
            want.append(hf(x[None, t:t + 1], cache=cache)[0])
            got.append(ours(x[t:t + 1], states, mamba_metadata([(t, 1)], [1])))
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=2e-5, rtol=2e-5)
    conv, rec = cache.get_conv_state(0, state_idx=0), cache.get_recurrent_state(0, state_idx=0)
    torch.testing.assert_close(states[1][1], rec[0].float(), atol=2e-5, rtol=2e-5)
    # transformers keeps the last W inputs (this token's included), ours the last W - 1
    torch.testing.assert_close(states[0][1], conv[0, :, 1:].T, atol=1e-6, rtol=1e-6)


# ---- config


NEXT_80B = {  # Qwen3-Next-80B-A3B's config.json (the values that matter here)
    "architectures": ["Qwen3NextForCausalLM"], "hidden_size": 2048, "intermediate_size": 5120,
    "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "vocab_size": 151936, "max_position_embeddings": 262144,
    "rope_theta": 10000000, "partial_rotary_factor": 0.25, "full_attention_interval": 4,
    "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "norm_topk_prob": True, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


def test_config_of_the_80b_model():
    cfg = ModelArchConfig.from_dict(dict(NEXT_80B))
    la, moe = cfg.linear_attn, cfg.moe
    assert cfg.family == "qwen3_next" and cfg.qk_norm and cfg.head_dim == 256
    assert la.layer_types == ("linear_attention",) * 3 + ("full_attention",) + la.layer_types[4:]
    assert sum(map(la.is_linear, range(48))) == 36
    assert (la.num_key_heads, la.num_value_heads, la.key_head_dim, la.value_head_dim,
            la.conv_kernel_dim, la.rotary_dim) == (16, 32, 128, 128, 4, 64)
    assert la.conv_dim == 2 * 16 * 128 + 32 * 128 == 8192
    assert cfg.rope.rope_theta == 1e7 and cfg.rope.rope_type == "default"
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob,
            moe.shared_intermediate_size, moe.shared_expert_gate, moe.weights_dtype) == (
        512, 10, 512, True, 512, True, "model")
    assert all(moe.sparse_layers)
    # 80B parameters (the published count; no MTP module)
    assert 79e9 < cfg.num_parameters() < 81e9


def test_config_defaults_and_errors():
    d = {k: NEXT_80B[k] for k in ("architectures", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads", "vocab_size")}
    cfg = ModelArchConfig.from_dict(d)  # Qwen3NextConfig's defaults
    assert cfg.head_dim == 256 and cfg.num_key_value_heads == 16
    assert cfg.linear_attn.rotary_dim == 64  # partial_rotary_factor 0.25
    assert cfg.linear_attn.layer_types[:4] == ("linear_attention",) * 3 + ("full_attention",)
    assert (cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.norm_topk_prob) == (512, 10, True)
    inner = ModelArchConfig.from_dict({**d, "rope_parameters": {
        "rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.5}})
    assert inner.linear_attn.rotary_dim == 128 and inner.rope.rope_theta == 5e6
    two = ModelArchConfig.from_dict({**d, "num_hidden_layers": 4, "full_attention_interval": 2,
                                     "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert two.linear_attn.layer_types == ("linear_attention", "full_attention") * 2
    assert two.moe.sparse_layers == (False, True, False, False)
    for bad, match in [({"linear_num_value_heads": 24}, "multiple of linear_num_key_heads"),
                       ({"linear_conv_kernel_dim": 5}, "2, 3 or 4"),
                       ({"linear_key_head_dim": 512}, "256"),
                       ({"partial_rotary_factor": 0.0}, "partial_rotary_factor"),
                       ({"partial_rotary_factor": 0.005}, "even"),
                       ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
                       ({"layer_types": ["linear_attention", "mamba"] * 24}, "layer_types"),
                       ({"shared_expert_intermediate_size": 0}, "shared_expert_intermediate")]:
        with pytest.raises(ConfigError, match=match):
            ModelArchConfig.from_dict({**d, **bad})


def test_parameter_count_matches_transformers():
    cfg = hf_config(num_hidden_layers=3, mlp_only_layers=[2], attention_bias=True,
                    layer_types=["linear_attention", "full_attention", "linear_attention"])
    hf = hf_q3n.Qwen3NextForCausalLM(cfg)
    assert arch_config(cfg).num_parameters() == sum(t.numel() for t in hf.state_dict().values())


# ---- pieces against transformers'


def test_partial_rotary_matches_transformers():
    from pagedkv.models.rotary import RotaryEmbedding, apply_rotary

    cfg = hf_config()
    ours_cfg = arch_config(cfg)
    rope = RotaryEmbedding(ours_cfg.linear_attn.rotary_dim, ours_cfg.rope, 256)
    hf_rope = hf_q3n.Qwen3NextRotaryEmbedding(cfg)
    pos = torch.tensor([0, 3, 17, 100])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    cos, sin = hf_rope(q, pos[None])
    want_q, want_k = hf_q3n.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                 cos, sin)
    c, s = rope(pos)
    assert c.shape == (4, 4)  # rotary_dim 8 of head_dim 16
    torch.testing.assert_close(apply_rotary(q, c, s), want_q[0].transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, c, s), want_k[0].transpose(0, 1))
    assert torch.equal(apply_rotary(q, c, s)[..., 8:], q[..., 8:])


def test_sparse_block_with_the_gated_shared_expert_matches_transformers():
    from pagedkv.models.moe import SparseMoeBlock

    torch.manual_seed(3)
    cfg = hf_config()
    hf = hf_q3n.Qwen3NextSparseMoeBlock(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    ours = SparseMoeBlock(32, arch_config(cfg).moe, "qwen3_next")
    with torch.no_grad():
        for layout in ("per_expert", "fused"):
            entries = ours.hf_entries("", layout)
            assert {n.removeprefix("mlp.") for n in entries if "experts." not in n} == {
                "gate.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                "shared_expert.down_proj.weight", "shared_expert_gate.weight"}
        sd = hf.state_dict()
        for name, (param, rows) in ours.hf_entries("", "fused").items():
            src = sd[name.removeprefix("mlp.")]
            (param.data if rows is None else param.data[rows[0]:rows[0] + rows[1]]).copy_(src)
        x = torch.randn(2, 9, 32)
        want = hf(x).reshape(-1, 32)
        got = ours(x.reshape(-1, 32))
        # the shared expert's gate matters: without it the output differs
        ours.shared_expert_gate = None
        ungated = ours(x.reshape(-1, 32))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (ungated - want).abs().max() > 1e-2


# ---- the whole model (tiny checkpoints saved by transformers) against transformers

VARIANTS = {
    "default": {},  # layers: linear, full; both sparse
    # linear, full, linear: layer 2 dense; q/k/v/o biases
    "3-layers-dense-bias": dict(num_layers=3, mlp_only_layers=(2,),
                                linear_options={"attention_bias": True}),
    # linear, full, linear, full: sparse every 2nd layer; stacked experts; conv width 3
    "4-layers-stacked": dict(num_layers=4, decoder_sparse_step=2, save_original_format=False,
                             linear_options={"linear_conv_kernel_dim": 3}),
}


class Driver:
    """Runs a Qwen3-Next model step by step over its own caches (no engine): each request
    gets shuffled attention blocks and a state slot; every step's rows come decodes first, the
    attention layers get the backend's plan and the state layers a ``MambaMetadata``. Unused
    blocks and slots are NaN."""

    def __init__(self, model, *, block_size=16, num_blocks=64, num_slots=9, seed=0):
        import random

        self.model, self.block_size = model, block_size
        specs = model.kv_cache_specs(block_size)
        self.linear = ["linear_attn" in name for name in specs]
        self.caches = model.allocate_kv_caches(num_blocks, block_size, fill=float("nan"))
        free = list(range(1, num_blocks))
        random.Random(seed).shuffle(free)
        self.free, self.width = free, num_blocks - 1
        self.free_slots = list(range(num_slots - 1, 0, -1))
        self.reqs: dict = {}

    def add(self, rid, tokens):
        self.reqs[rid] = dict(tokens=list(tokens), done=0, blocks=[],
                              slot=self.free_slots.pop())

    @torch.no_grad()
    def step(self, schedule, *, all_logits=False):
        """``schedule`` = [(request id, new tokens)]; returns {rid: logits of its last (or
        all) scheduled tokens}."""
        rows = sorted(schedule, key=lambda r: not (r[1] == 1 and self.reqs[r[0]]["done"] > 0))
        ids, pos, table, qlens, seqs = [], [], [], [], []
        for rid, n in rows:
            r = self.reqs[rid]
            while len(r["blocks"]) * self.block_size < r["done"] + n:
                r["blocks"].append(self.free.pop())
            ids += r["tokens"][r["done"]:r["done"] + n]
            pos += list(range(r["done"], r["done"] + n))
            table.append(r["blocks"] + [0] * (self.width - len(r["blocks"])))
            qlens.append(n)
            seqs.append(r["done"] + n)
        table = torch.tensor(table, dtype=torch.int32)
        positions = torch.tensor(pos)
        row = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(qlens))
        slots = table[row, positions // self.block_size].long() * self.block_size \
            + positions % self.block_size
        meta = build_attention_metadata(qlens, seqs, table, slots)
        plan = self.model.attn_backend.plan(meta, self.model.attention_layout())
        state = mamba_metadata([(self.reqs[rid]["done"], n) for rid, n in rows],
                               [self.reqs[rid]["slot"] for rid, _ in rows])
        step = StepAttention(meta, [state if lin else plan for lin in self.linear])
        hidden = self.model(torch.tensor(ids), positions, self.caches, step)
        out, start = {}, 0
        for rid, n in rows:
            r = self.reqs[rid]
            r["done"] += n
            idx = list(range(start, start + n)) if all_logits else [start + n - 1]
            out[rid] = self.model.compute_logits(hidden, idx)
            start += n
        return out

    def generate(self, prompts, new_tokens, *, chunk=None, budget=1 << 30):
        """Batched greedy decoding (prompt chunks of at most ``chunk`` tokens within ``budget``
        tokens a step); returns the generated tokens per prompt and the steps' schedules."""
        for i, p in enumerate(prompts):
            self.add(i, p)
        gen = {i: [] for i in range(len(prompts))}
        log = []
        while any(len(g) < new_tokens for g in gen.values()):
            left, schedule = budget, []
            for i in gen:
                r = self.reqs[i]
                n = min(len(r["tokens"]) - r["done"], chunk or 1 << 30, left)
                if len(gen[i]) < new_tokens and n > 0:
                    schedule.append((i, n))
                    left -= n
            log.append([(i, self.reqs[i]["done"], n) for i, n in schedule])
            for i, lg in self.step(schedule).items():
                r = self.reqs[i]
                if r["done"] == len(r["tokens"]):
                    tok = int(lg[0].argmax())
                    gen[i].append(tok)
                    r["tokens"].append(tok)
        return [gen[i] for i in range(len(prompts))], log


_REFS: dict = {}


def use_twins(monkeypatch):
    """The mixer's kernels as their torch twins (the kernels equal the twins: their own tests,
    and the mixer tests above run the kernels through the interpreter), so that the whole-model
    tests run in seconds."""
    import pagedkv.models.gated_deltanet as gd
    from pagedkv.kernels import causal_conv1d as cc
    from pagedkv.kernels import gated_delta_rule as gdr

    monkeypatch.setattr(gd, "causal_conv1d", cc.causal_conv1d_ref)
    monkeypatch.setattr(gd, "chunk_gated_delta_rule", gdr.chunk_gated_delta_rule_ref)
    monkeypatch.setattr(gd, "recurrent_gated_delta_rule", gdr.recurrent_gated_delta_rule_ref)


@pytest.fixture
def twins(monkeypatch):
    use_twins(monkeypatch)


@pytest.fixture(scope="module")
def ref(tiny_dir):
    def get(name):
        if name not in _REFS:
            _REFS[name] = Ref(tiny_dir("qwen3_next", **VARIANTS[name]))
        return _REFS[name]

    yield get
    _REFS.clear()


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_prompt_logits_and_greedy_tokens_match_transformers(ref, twins, name):
    """All prompts as one varlen prefill step: every token's logits equal transformers'; then
    batched greedy decoding gives transformers' tokens, each decode step's logits equal
    transformers' on the whole sequence."""
    r = ref(name)
    model = r.ck.model
    la = r.ck.config.linear_attn
    assert type(model).__name__ == "Qwen3NextForCausalLM"
    assert [layer.linear for layer in model.layers] == list(map(la.is_linear, range(len(la.layer_types))))
    assert [layer.sparse for layer in model.layers] == list(r.ck.config.moe.sparse_layers)
    assert r.ck.config.num_parameters() == sum(t.numel() for t in r.hf.state_dict().values())
    d = Driver(model)
    for i, p in enumerate(r.prompts):
        d.add(i, p)
    got = d.step([(i, len(p)) for i, p in enumerate(r.prompts)], all_logits=True)
    for i, p in enumerate(r.prompts):
        torch.testing.assert_close(got[i], r.hf_logits(p), atol=1e-4, rtol=1e-4)
    toks, _ = Driver(model, seed=1).generate(r.prompts, NEW_TOKENS)
    assert toks == r.hf_generations
    # a decode step's logits (the last generated token, not computed yet) against
    # transformers' on the whole sequence
    d2 = Driver(model, seed=2)
    toks2, _ = d2.generate(r.prompts[:2], 4)
    out = d2.step([(0, 1), (1, 1)])
    for i in range(2):
        want = r.hf_logits(r.prompts[i] + toks2[i])[-1]
        torch.testing.assert_close(out[i][0], want, atol=1e-4, rtol=1e-4)


def test_chunked_prefill_mixed_with_decodes(ref, twins):
    """Prompt chunks of 5 tokens within 12 a step, decode rows beside them: transformers'
    tokens; some step mixed decodes with a later chunk (state carried into a chunk)."""
    r = ref("default")
    toks, log = Driver(r.ck.model).generate(r.prompts, NEW_TOKENS, chunk=5, budget=12)
    assert toks == r.hf_generations
    lens = {i: len(p) for i, p in enumerate(r.prompts)}
    assert any(any(done >= lens[i] for i, done, _ in s) and any(0 < done < lens[i] for i, done, _ in s)
               for s in log)


def test_bare_metadata_is_refused(ref):
    r = ref("default")
    meta = build_attention_metadata([3], [3], torch.ones(1, 4, dtype=torch.int32),
                                    torch.arange(16, 19))
    with pytest.raises(InvalidRequestError, match="MambaMetadata"):
        r.ck.model(torch.tensor([5, 6, 7]), torch.arange(3), r.ck.model.allocate_kv_caches(4, 16),
                   meta)


def test_specs_and_caches(ref):
    from pagedkv.core.spec import FullAttentionSpec, MambaSpec

    model = ref("default").ck.model
    specs = model.kv_cache_specs(32)
    assert list(specs) == ["model.layers.0.linear_attn", "model.layers.1.self_attn"]
    state, full = specs.values()
    assert isinstance(full, FullAttentionSpec) and (full.num_kv_heads, full.head_size) == (2, 16)
    assert isinstance(state, MambaSpec) and state.shapes == ((3, 2 * 32 + 64), (4, 16, 16))
    assert state.dtypes == ("float32", "float32") and not state.prefix_cacheable
    caches = model.allocate_kv_caches(5, 32)
    assert [tuple(t.shape) for t in caches[0]] == [(5, 3, 128), (5, 4, 16, 16)]
    assert tuple(caches[1].shape) == (2, 5, 32, 2, 16)
    with pytest.raises(ConfigError, match="model dtype"):
        model.allocate_kv_caches(5, 32, dtype=torch.float16)


def test_loader_skips_the_mtp_module(tiny_dir, tmp_path):
    import os
    import shutil

    from safetensors.torch import save_file

    from pagedkv.errors import CheckpointError
    from pagedkv.models.loader import load_checkpoint

    src = tiny_dir("qwen3_next")
    dst = tmp_path / "with-mtp"
    shutil.copytree(src, dst)
    # no model.safetensors: every *.safetensors file of the directory is read
    os.rename(dst / "model.safetensors", dst / "model-part1.safetensors")
    save_file({"mtp.fc.weight": torch.zeros(4, 4), "mtp.layers.0.input_layernorm.weight":
               torch.zeros(4)}, str(dst / "mtp.safetensors"))
    base = load_checkpoint(src, dtype="float32").model
    got = load_checkpoint(dst, dtype="float32").model
    for (n, a), (_, b) in zip(base.named_parameters(), got.named_parameters()):
        assert torch.equal(a, b), n
    save_file({"model.layers.9.linear_attn.A_log": torch.zeros(4)}, str(dst / "extra.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensors: model.layers.9"):
        load_checkpoint(dst, dtype="float32")
    os.remove(dst / "extra.safetensors")
    os.remove(dst / "model-part1.safetensors")
    with pytest.raises(CheckpointError, match="missing tensors"):
        load_checkpoint(dst, dtype="float32")


def test_random_weights_generate(twins):
    """``init_random_weights`` (benchmarks by shape): finite logits, (1 + w) factors 1."""
    from pagedkv.models.gemma import GemmaRMSNorm
    from pagedkv.models.qwen3_next import Qwen3NextForCausalLM

    cfg = arch_config(hf_config())
    model = Qwen3NextForCausalLM(cfg).init_random_weights(seed=3)
    assert all(torch.equal(m.factor, torch.ones_like(m.factor)) for m in model.modules()
               if isinstance(m, GemmaRMSNorm))
    toks, _ = Driver(model).generate([[5, 6, 7, 8], [9]], 3)
    assert all(len(t) == 3 for t in toks)


# ---- on a CUDA GPU


@pytest.mark.gpu
def test_gpu_mixer_bf16_at_the_80b_head_shape():
    """The mixer at Qwen3-Next-80B's head shape (16 key / 32 value heads of 128, conv width 4;
    hidden 256 to stay small) in bf16 on the GPU, the kernels native: three prompts (300, 1 and
    77 tokens, one step) then 3 decode steps each; against transformers' mixer in float32 on
    each whole sequence, our error is within twice transformers' own bf16 error (plus 1e-2)."""
    dims = dict(hidden_size=256, linear_num_key_heads=16, linear_num_value_heads=32,
                linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
    hf, ours = mixer_pair(seed=4, **dims)
    with torch.no_grad():  # weights of a trained scale: keep the projections' outputs O(1)
        for p in list(hf.parameters()) + list(ours.parameters()):
            if p.dim() == 2:
                p.mul_(256 ** -0.5 / 0.3)
    hf, ours = hf.cuda(), ours.cuda().to(torch.bfloat16)
    lens = [300, 1, 77]
    xs = [torch.randn(n + 3, 256, device="cuda") for n in lens]
    states = tuple(s.cuda() for s in poisoned_states(ours, 5))
    states = (states[0].to(torch.bfloat16), states[1])
    slots = [3, 0, 4]

    def meta(rows):
        m = mamba_metadata(rows, slots)
        for f in ("query_start_loc", "seq_lens", "state_indices", "has_initial_state"):
            setattr(m, f, getattr(m, f).cuda())
        return m

    with torch.no_grad():
        y = ours(torch.cat([x[:n] for x, n in zip(xs, lens)]).bfloat16(), states,
                 meta([(0, n) for n in lens]))
        got = [[y[a:b]] for a, b in zip([0, 300, 301], [300, 301, 378])]
        for t in range(3):
            y = ours(torch.stack([x[n + t] for x, n in zip(xs, lens)]).bfloat16(), states,
                     meta([(n + t, 1) for n in lens]))
            for i in range(3):
                got[i].append(y[i:i + 1])
        hf16 = hf_q3n.Qwen3NextGatedDeltaNet(hf_config(**dims), 0).cuda().to(torch.bfloat16)
        hf16.load_state_dict(hf.state_dict())
        for i, x in enumerate(xs):
            want = hf(x[None])[0]
            err = lambda a: float((a.float() - want).abs().max() / want.abs().max())  # noqa: E731
            ours_err, hf_err = err(torch.cat(got[i])), err(hf16(x[None].bfloat16())[0])
            print(f"sequence {i} ({len(x)} tokens): ours {ours_err:.4f}, transformers bf16 "
                  f"{hf_err:.4f}")
            assert ours_err <= 2 * hf_err + 1e-2
