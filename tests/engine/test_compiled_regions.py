"""``DecoderForCausalLM.compile_regions`` (``compile_model=True``): the per-layer regions around
attention traced by dynamo without graph breaks and compiled by inductor (here its CPU backend;
on the GPU the same graphs become Triton kernels), one compiled function for every layer and every
token count, eager results when it is off, and the engine's greedy tokens unchanged (fp32)."""

import os

import pytest
import torch
from engine_helpers import TEXTS, make_llm

from pagedkv import SamplingParams
from pagedkv.models import decoder as dec


def test_eager_split_layer_is_the_plain_layer(tiny_dir):
    """forward_split + the residual add moved into the next layer's region is bit-identical to
    the layer's plain forward (same ops in the same order)."""
    from pagedkv.models.loader import load_checkpoint

    model = load_checkpoint(tiny_dir("qwen3"), dtype="float32").model
    layer = model.layers[0]
    attn = layer.self_attn
    t = 5
    h = torch.randn(t, model.config.hidden_size)
    cos, sin = model.rotary(torch.arange(t), None)
    a = torch.randn(t, attn.num_heads, attn.head_dim)

    class Fixed:
        def forward(self, layer_idx, q, k, v, kv_cache, metadata, scale):
            return a

    ref = h + attn.o_proj(a.reshape(t, -1))
    ref = ref + layer.mlp(layer.post_attention_layernorm(ref))
    assert torch.equal(layer(h, cos, sin, None, None, Fixed()), ref)
    assert not model.compiled and model.compile_regions() is False  # CPU: stays eager


def test_compiled_regions_in_the_engine_on_cpu(tiny_dir, hf_ref):
    path = tiny_dir("qwen3")
    llm = make_llm(path, async_scheduling=True)
    model = llm.engine.model
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests' graphs
    assert model.compile_regions(allow_cpu=True, fullgraph=True)  # also checks against eager
    assert model.compiled and model._regions[0] is not dec.pre_attention
    _assert_mostly_greedy(llm, hf_ref(path), TEXTS, 8)
    # one graph per (layer-0 variant without a residual delta, T == 1 or not) and region
    # (pre_attention 4, post_attention 2, pre_attention_qkv 4, post_pre_qkv 2; the last two
    # compiled by the check): every layer and every token count reuse them
    stats = torch._dynamo.utils.counters["stats"]
    assert stats["unique_graphs"] <= 12


def _assert_mostly_greedy(llm, ref, texts, n: int) -> None:
    """Greedy tokens of ``n`` new tokens a text: at least 90% equal transformers' (compiled
    regions keep float32 intermediates, so an occasional near-tie may flip)."""
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    got = [t for o in outs for t in o.outputs[0].token_ids]
    want = [t for o in outs for t in ref.greedy(o.prompt_token_ids, n)]
    assert sum(x == y for x, y in zip(got, want)) >= 0.9 * len(want)


def _counted(calls: list, name: str, fn):
    """``fn`` that appends ``name`` to ``calls`` on every call."""
    def call(*a):
        calls.append(name)
        return fn(*a)
    return call


@pytest.mark.parametrize("where", ["compile", "check"])
def test_compile_failure_falls_back_to_eager(tiny_dir, caplog, monkeypatch, where):
    path = tiny_dir("llama")
    llm = make_llm(path)
    model = llm.engine.model

    def bad(*a, **k):
        raise RuntimeError("no compiler here")

    if where == "compile":
        monkeypatch.setattr(torch, "compile", bad)
    else:  # the compiled regions disagree with eager
        monkeypatch.setattr(torch, "compile", lambda fn, **kw: (lambda *a: tuple(
            x + 1 if isinstance(x, torch.Tensor) else x for x in fn(*a))))
    assert model.compile_regions(allow_cpu=True) is False
    assert not model.compiled and "falling back to eager" in caplog.text
    out = llm.generate([TEXTS[1]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
def test_compiled_fused_path_in_the_engine_on_cpu(tiny_dir, hf_ref):
    """Compiled regions on the fused-KV-write path (Triton backend, interpreted): layer 0's
    pre_attention_qkv, then one post_pre_qkv region between two attention calls, the last
    layer's post_attention; greedy tokens follow transformers."""
    path = tiny_dir("qwen3")
    llm = make_llm(path, attention_backend="triton", max_num_batched_tokens=32, max_num_seqs=4)
    model = llm.engine.model
    torch._dynamo.reset()
    assert model.compile_regions(allow_cpu=True)
    assert model.fused_kv_write_usable(llm.engine.runner.kv_caches[0])
    calls = []
    pre, post, pre_qkv, mid = model._regions
    model.__dict__["_compiled_regions"] = (pre, _counted(calls, "post", post),
                                           _counted(calls, "pre_qkv", pre_qkv),
                                           _counted(calls, "mid", mid))
    _assert_mostly_greedy(llm, hf_ref(path), TEXTS[:3], 6)
    layers = len(model.layers)
    steps = calls.count("pre_qkv")
    assert steps > 0 and calls.count("mid") == steps * (layers - 1) and calls.count("post") == steps


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton backend on CPU tensors needs the Triton interpreter")
def test_compiled_fused_projection_in_the_engine_on_cpu(tiny_dir, hf_ref, monkeypatch):
    """Compiled regions on the fused-projection path (``fuse_qkv_projection``; the kernel
    interpreted) with the fused gate/up custom op inside them: the check compiles and compares
    the two norm regions too, then layer 0's pre_attention_norm and one post_pre_norm region
    between two attention calls serve every step; greedy tokens follow transformers."""
    from pagedkv.kernels import gate_up_silu as gu

    monkeypatch.setattr(gu, "FUSED_GATE_UP_ENABLED", True)
    gu_rows = []
    real = gu.fused_gate_up_silu
    monkeypatch.setattr(gu, "fused_gate_up_silu",
                        lambda x, *a, **k: gu_rows.append(x.shape[0]) or real(x, *a, **k))
    path = tiny_dir("qwen3", head_dim=32)
    llm = make_llm(path, attention_backend="triton", max_num_batched_tokens=32, max_num_seqs=4)
    model = llm.engine.model
    model.fuse_qkv_projection = True
    torch._dynamo.reset()
    assert model.compile_regions(allow_cpu=True)
    pre_norm, mid_norm = model._norm_regions
    assert pre_norm is not dec.pre_attention_norm and mid_norm is not dec.post_pre_norm
    calls = []
    model.__dict__["_compiled_norm_regions"] = (_counted(calls, "pre", pre_norm),
                                                _counted(calls, "mid", mid_norm))
    _assert_mostly_greedy(llm, hf_ref(path), TEXTS[:3], 6)
    steps = calls.count("pre")
    assert steps > 0 and calls.count("mid") == steps * (len(model.layers) - 1)
    assert gu_rows  # the compiled regions called the fused gate/up op


def test_region_check_tolerance_follows_the_model_dtype():
    """``compile_regions``' eager-vs-compiled check takes its tolerance from the model's dtype,
    not the output's: a float32 output of a bf16 model (the split-K partial sums) carries bf16
    roundings (before: checked at float32's 1e-3, the H200 engine silently stayed eager)."""
    from pagedkv.models.decoder import _close

    g = torch.Generator().manual_seed(0)
    ref = torch.randn(7, 64, generator=g)
    got = ref * 1.005  # relative error 5e-3
    _close(ref, got, torch.bfloat16)
    with pytest.raises(ValueError, match="relative error"):
        _close(ref, got, torch.float32)
