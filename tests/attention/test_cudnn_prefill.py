"""The cuDNN fresh-prefill wrapper (``pagedkv.attention.cudnn_prefill``) around its one cuDNN
call: padding, the heads-first gathers (slots, slot -1), the output rows. On the CPU cuDNN's
call is replaced by its plain twin (causal attention of ``[heads, S', D]`` tensors in fp32)
so that everything around it is checked against the paged reference; on the GPU the real
call (``tests/attention/test_triton_backend.py`` runs it in the backend and the engine)."""

import pytest
import torch
from test_triton_cases import make_case, reference

import pagedkv.attention.cudnn_prefill as cp
from pagedkv.errors import ConfigError


def _plain_attend(q, k, v, scale):
    """Causal attention of one padded sequence, heads first, K/V heads grouped."""
    group = q.shape[0] // k.shape[0]
    k = k.float().repeat_interleave(group, 0)
    v = v.float().repeat_interleave(group, 0)
    s = q.float() @ k.transpose(1, 2) * scale
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return (torch.softmax(s, -1) @ v).to(q.dtype)


@pytest.fixture
def plain_cudnn(monkeypatch):
    monkeypatch.setattr(cp, "_mode", lambda q: "gqa")
    monkeypatch.setattr(cp, "_attend", _plain_attend)
    monkeypatch.setattr(cp, "PAD_GRANULE", 16)


def test_padded_requests_match_the_paged_reference(kernel_device, plain_cudnn):
    """Fresh requests of 20, 16 and 33 tokens (padded to 32, 16, 48) among a decode row and a
    chunk with context, the K/V read back from the cache by the slots: each request's rows
    equal the reference's, every other row keeps its poison."""
    reqs = [(0, 20), (7, 1), (0, 16), (9, 5), (0, 33)]
    case = make_case(reqs, block_size=4, num_heads=4, num_kv_heads=2, device=kernel_device,
                     write_new=True, pad_tokens=3, seed=9)
    want = reference(case)
    out = torch.full_like(case["q"], float("nan"))
    slots = case["meta"].slot_mapping
    rows = []
    for row, n in ((0, 20), (21, 16), (42, 33)):
        cp.cudnn_prefill_attention(case["q"], row, n, case["cache"], slots[row:row + n],
                                   case["scale"], out)
        rows += list(range(row, row + n))
    got = out.float().cpu()
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    others = [r for r in range(out.shape[0]) if r not in rows]
    assert torch.isnan(got[others]).all()


def test_slot_minus_one_reads_slot_zero_and_errors(kernel_device, plain_cudnn):
    """The memory profile's forward (every slot -1) runs without reading out of bounds; bad
    shapes are refused."""
    case = make_case([(0, 10)], block_size=4, device=kernel_device, write_new=True, seed=1)
    out = torch.zeros_like(case["q"])
    minus = torch.full((10,), -1, dtype=torch.int64, device=kernel_device)
    cp.cudnn_prefill_attention(case["q"], 0, 10, case["cache"].nan_to_num(0.0), minus,
                               case["scale"], out)
    assert torch.isfinite(out).all()
    with pytest.raises(ConfigError, match="do not fit"):
        cp.cudnn_prefill_attention(case["q"], 5, 10, case["cache"], minus, case["scale"], out)
    with pytest.raises(ConfigError, match="do not fit"):
        cp.cudnn_prefill_attention(case["q"], 0, 10, case["cache"], minus[:4], case["scale"],
                                   out)


def test_not_available_without_cuda():
    """Off the GPU the path is unavailable and says so."""
    assert not cp.cudnn_prefill_available_for(torch.bfloat16, torch.device("cpu"), 128)
    q = torch.zeros(4, 2, 16)
    with pytest.raises(ConfigError, match="not available"):
        cp.cudnn_prefill_attention(q, 0, 4, torch.zeros(2, 2, 4, 1, 16),
                                   torch.arange(4), 0.25, torch.zeros_like(q))
