"""Layers against transformers' modules, and the decoder's input checks and helpers."""

import pytest
import torch

from pagedkv.errors import InvalidRequestError
from pagedkv.models.config import ModelArchConfig
from pagedkv.models.decoder import DecoderForCausalLM
from pagedkv.models.layers import GatedMLP, QKVProjection, rms_norm
from pagedkv.attention import build_attention_metadata

transformers = pytest.importorskip("transformers")
from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_matches_transformers(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 64, generator=g) * 3).to(dtype)
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.1 * torch.randn(64, generator=g))
        assert torch.equal(rms_norm(x, ref.weight, 1e-5), ref(x))


def test_gated_mlp_matches_transformers():
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=80)
    ref = LlamaMLP(cfg)
    ours = GatedMLP(32, 80, bias=False)
    with torch.no_grad():
        ours.gate_up_proj.weight.copy_(torch.cat([ref.gate_proj.weight, ref.up_proj.weight]))
        ours.down_proj.weight.copy_(ref.down_proj.weight)
        x = torch.randn(5, 32)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-6, rtol=1e-5)


def test_qkv_projection_split():
    proj = QKVProjection(16, 4, 2, 8, bias=True)
    with torch.no_grad():
        proj.weight.copy_(torch.randn_like(proj.weight))
        proj.bias.copy_(torch.randn_like(proj.bias))
    x = torch.randn(3, 16)
    q, k, v = proj(x)
    assert q.shape == (3, 4, 8) and k.shape == (3, 2, 8) and v.shape == (3, 2, 8)
    full = x @ proj.weight.T + proj.bias
    assert proj.shards == {"q": (0, 32), "k": (32, 16), "v": (48, 16)}
    torch.testing.assert_close(v.reshape(3, 16), full[:, 48:])


def _tiny_model():
    cfg = ModelArchConfig.from_dict({
        "architectures": ["Qwen3ForCausalLM"], "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
        "vocab_size": 300, "attention_bias": True})
    return DecoderForCausalLM(cfg).init_random_weights(seed=3)


def test_init_random_weights_deterministic():
    a, b = _tiny_model(), _tiny_model()
    for (n, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), n
    assert torch.all(a.norm.weight == 1) and torch.all(a.layers[0].self_attn.qkv_proj.bias == 0)
    assert a.layers[0].self_attn.q_norm is not None
    assert not torch.equal(a.layers[0].mlp.down_proj.weight, a.layers[1].mlp.down_proj.weight)


def test_forward_input_checks():
    m = _tiny_model()
    caches = m.allocate_kv_caches(4, 4)
    assert caches[0].shape == (2, 4, 4, 2, 8) == m.kv_cache_shape(4, 4)
    meta = build_attention_metadata([2], [2], torch.tensor([[1, 0]], dtype=torch.int32), torch.tensor([4, 5]))
    ids, pos = torch.tensor([5, 6]), torch.tensor([0, 1])
    hidden = m(ids, pos, caches, meta)
    assert hidden.shape == (2, 32)
    assert m.compute_logits(hidden, torch.tensor([1])).shape == (1, 300)
    with pytest.raises(InvalidRequestError, match="one KV cache per layer"):
        m(ids, pos, caches[:1], meta)
    with pytest.raises(InvalidRequestError, match="flat"):
        m(ids[None], pos[None], caches, meta)


def test_greedy_tokens_fused_and_plain(monkeypatch):
    """``greedy_tokens``: the argmax of ``compute_logits`` (CPU: the plain path); with the fused
    LM head + argmax made to apply, the kernel (interpreted) gives the same tokens for the
    selected rows; a subclass that transforms its logits never takes the fused kernel."""
    import pagedkv.kernels.lm_head_argmax as lha

    m = _tiny_model()
    g = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 32, generator=g)
    idx = torch.tensor([4, 0, 2])
    want = m.compute_logits(hidden, idx).argmax(-1)
    assert m.greedy_tokens(hidden, idx).tolist() == want.tolist()
    assert m.greedy_tokens(hidden).tolist() == m.compute_logits(hidden).argmax(-1).tolist()
    calls = []
    kernel = lha.lm_head_argmax

    def fused(h, w, config=None):
        calls.append(h.shape[0])
        return kernel(h, w, config)

    monkeypatch.setattr(lha, "fused_applies", lambda h, w: True)
    monkeypatch.setattr(lha, "lm_head_argmax", fused)
    assert m.greedy_tokens(hidden, idx).tolist() == want.tolist()
    assert m.greedy_tokens(hidden, [4, 0, 2]).tolist() == want.tolist()
    assert calls == [3, 3]

    class Scaled(DecoderForCausalLM):
        def compute_logits(self, hidden, indices=None, *, widen=True):
            return -super().compute_logits(hidden, indices, widen=widen)

    s = Scaled(m.config).init_random_weights(seed=3)
    assert s.greedy_tokens(hidden, idx).tolist() == s.compute_logits(hidden, idx).argmax(-1).tolist()
    assert calls == [3, 3]
    # a hook set on the instance (tests record the logits so) sees the greedy steps' logits
    seen = []
    inner = m.compute_logits

    def hook(h, indices=None, **kw):
        out = inner(h, indices, **kw)
        seen.append(out)
        return out

    m.compute_logits = hook
    assert m.greedy_tokens(hidden, idx).tolist() == want.tolist()
    assert calls == [3, 3] and len(seen) == 1
