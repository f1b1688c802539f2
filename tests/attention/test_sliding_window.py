"""Sliding-window attention and logit soft-capping: the torch reference against a dense
computation written here, and the Triton decode / prefill kernels (through the backend and
directly) against the reference. Tables hold the null block for blocks wholly outside every
query's window (as the sliding-window manager leaves them), and the null block is NaN: a
kernel that reads a block it must not read turns the output into NaN. Interpreted on CPU
(small shapes, fp32 / fp16), native on CUDA (bf16)."""

import pytest
import torch
from test_triton_cases import make_case

from pagedkv.attention import TorchRefBackend
from pagedkv.attention.torch_ref import paged_attention_ref
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.attention.triton_decode import paged_decode_attention
from pagedkv.attention.triton_prefill import paged_prefill_attention
from pagedkv.errors import ConfigError

# decodes past the window, a chunk crossing the window edge, a fresh prefill longer than the
# window, a short fresh prefill, a decode inside the window
REQS = [(40, 1), (23, 9), (0, 30), (0, 3), (5, 1), (61, 1), (17, 13)]


def dense(case, window, cap):
    """Per request, plain softmax attention over the unpaged keys (the full table)."""
    q, cache, scale = case["q"].float().cpu(), case["cache"].float().cpu(), case["scale"]
    table = case["full_table"]
    B, hkv = cache.shape[2], cache.shape[3]
    out = torch.zeros_like(q)
    row = 0
    for r, (c, ql) in enumerate(case["reqs"]):
        L = c + ql
        pos = torch.arange(L)
        slots = table[r, pos // B].long() * B + pos % B
        k = cache[0].reshape(-1, hkv, cache.shape[4])[slots]
        v = cache[1].reshape(-1, hkv, cache.shape[4])[slots]
        for i in range(ql):
            p = c + i
            lo = max(0, p - window + 1) if window else 0
            for h in range(q.shape[1]):
                kh = h // (q.shape[1] // hkv)
                s = (k[lo : p + 1, kh] @ q[row + i, h]) * scale
                if cap:
                    s = cap * torch.tanh(s / cap)
                out[row + i, h] = torch.softmax(s, 0) @ v[lo : p + 1, kh]
        row += ql
    return out


def _written_case(reqs, window, **kw):
    """A case whose cache holds every position already (the kernels only read)."""
    return make_case(reqs, write_new=True, sliding_window=window, **kw)


@pytest.mark.parametrize("window,cap", [(1, None), (7, None), (16, None), (25, 5.0), (None, 3.0),
                                        (100, None)])
def test_reference_equals_dense_attention(window, cap):
    case = _written_case(REQS, window, block_size=4, seed=window or 0)
    ref = paged_attention_ref(case["q"], case["cache"], case["meta"], case["scale"],
                              sliding_window=window, logits_soft_cap=cap)
    n = sum(ql for _, ql in REQS)
    assert not torch.isnan(ref[:n]).any()
    torch.testing.assert_close(ref[:n], dense(case, window, cap)[:n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("window,cap", [(3, None), (16, None), (33, 20.0), (None, 2.5)])
def test_backend_mixed_batch_matches_reference(kernel_device, block_size, window, cap):
    """The whole backend: KV write, decode rows, chunked prefill across the window edge,
    fresh prefills; CUDA-graph padding rows stay zero."""
    kw = dict(block_size=block_size, device=kernel_device, seed=block_size, pad_tokens=3,
              padded_reqs=2, sliding_window=window)
    a, b = make_case(REQS, **kw), make_case(REQS, **kw)
    out = TritonAttentionBackend().forward_with_metadata(
        0, a["q"], a["k"], a["v"], a["cache"], a["meta"], a["scale"], sliding_window=window,
        logits_soft_cap=cap)
    ref = TorchRefBackend(writer="ref").forward_with_metadata(
        0, b["q"], b["k"], b["v"], b["cache"], b["meta"], b["scale"], sliding_window=window,
        logits_soft_cap=cap)
    n = sum(ql for _, ql in REQS)
    assert not torch.isnan(out[:n].cpu()).any()
    torch.testing.assert_close(out.cpu()[:n], ref.cpu()[:n], atol=1e-4, rtol=1e-4)
    assert torch.all(out[n:] == 0)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("window", [1, 9, 30])
def test_decode_kernel_splits_only_the_window(kernel_device, splits, window):
    """Forced split counts over a window: every range lies inside the window (ranges before
    it would read the null block: NaN)."""
    reqs = [(70, 1), (8, 1), (33, 1), (129, 1)]
    case = _written_case(reqs, window, block_size=4, device=kernel_device, seed=splits)
    out = torch.full_like(case["q"], float("nan"))
    m = case["meta"]
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, num_splits=splits,
                           sliding_window=window)
    want = paged_attention_ref(case["q"], case["cache"], m, case["scale"], sliding_window=window)
    assert not torch.isnan(out.cpu()).any()
    torch.testing.assert_close(out.cpu(), want.cpu(), atol=1e-4, rtol=1e-4)


def test_prefill_kernel_fp16_window_and_cap(kernel_device):
    reqs = [(50, 20), (0, 40), (3, 17)]
    case = _written_case(reqs, 12, block_size=8, device=kernel_device, seed=5, dtype=torch.float16)
    m = case["meta"]
    out = torch.zeros_like(case["q"])
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out, sliding_window=12,
                            logits_soft_cap=4.0)
    want = dense(case, 12, 4.0)
    assert not torch.isnan(out.float().cpu()).any()
    torch.testing.assert_close(out.float().cpu(), want, atol=1e-2, rtol=1e-2)


def test_bad_window_and_cap_are_typed_errors(kernel_device):
    case = _written_case([(5, 1)], None, block_size=4, device=kernel_device)
    m = case["meta"]
    for kw in (dict(sliding_window=0), dict(sliding_window=2.5), dict(logits_soft_cap=-1.0)):
        with pytest.raises(ConfigError):
            paged_decode_attention(case["q"], case["cache"], m.block_table_tensor,
                                   m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                   torch.zeros_like(case["q"]), **kw)


@pytest.mark.gpu
@pytest.mark.parametrize("window,cap", [(128, None), (1024, 50.0), (4096, None)])
def test_backend_gpu_bf16(window, cap):
    torch.manual_seed(0)
    reqs = [(int(c), 1) for c in torch.randint(0, 6000, (40,))] + [(3000, 300), (0, 2048)]
    kw = dict(block_size=16, num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
              device="cuda", seed=1, sliding_window=window)
    a, b = make_case(reqs, **kw), make_case(reqs, **kw)
    out = TritonAttentionBackend().forward_with_metadata(
        0, a["q"], a["k"], a["v"], a["cache"], a["meta"], a["scale"], sliding_window=window,
        logits_soft_cap=cap)
    b["cache"] = b["cache"].float()
    ref = TorchRefBackend(writer="ref").forward_with_metadata(
        0, b["q"].float(), b["k"].float(), b["v"].float(), b["cache"], b["meta"], b["scale"],
        sliding_window=window, logits_soft_cap=cap)
    assert not torch.isnan(out.float()).any()
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=2e-2, rtol=2e-2)
