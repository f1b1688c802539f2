"""Attention sinks (GPT-OSS): a learned logit per query head that joins the softmax
denominator. The torch reference against a hand-computed case, a dense computation written
here and transformers' GPT-OSS eager attention; the Triton decode and prefill kernels (with
sliding windows, forced splits) and the backend against the reference on random cases whose
unowned slots, null blocks and outputs are NaN. Interpreted on CPU (fp32 / fp16), native on
CUDA (bf16)."""

import math

import pytest
import torch
from test_sliding_window import REQS
from test_triton_cases import make_case, poisoned_out, rows_of

from pagedkv.attention import TorchRefBackend, build_attention_metadata
from pagedkv.attention.torch_ref import paged_attention_ref
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.attention.triton_decode import paged_decode_attention, paged_decode_attention_ref
from pagedkv.attention.triton_prefill import paged_prefill_attention, paged_prefill_attention_ref
from pagedkv.errors import ConfigError


def sinks_for(num_heads, seed=0, device="cpu", spread=2.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(num_heads, generator=gen) * spread).to(device)


def dense(case, window, sinks):
    """Per query and head: exp(s) / (sum exp(s) + exp(sink)) over the unpaged keys."""
    q, cache, scale = case["q"].float().cpu(), case["cache"].float().cpu(), case["scale"]
    table, B, hkv = case["full_table"], cache.shape[2], cache.shape[3]
    out = torch.zeros_like(q)
    row = 0
    for r, (c, ql) in enumerate(case["reqs"]):
        pos = torch.arange(c + ql)
        slots = table[r, pos // B].long() * B + pos % B
        k = cache[0].reshape(-1, hkv, cache.shape[4])[slots].double()
        v = cache[1].reshape(-1, hkv, cache.shape[4])[slots].double()
        for i in range(ql):
            p = c + i
            lo = max(0, p - window + 1) if window else 0
            for h in range(q.shape[1]):
                kh = h // (q.shape[1] // hkv)
                e = torch.exp((k[lo:p + 1, kh] @ q[row + i, h].double()) * scale)
                w = e / (e.sum() + math.exp(float(sinks[h])))
                out[row + i, h] = (w @ v[lo:p + 1, kh]).float()
        row += ql
    return out


def test_reference_hand_computed():
    """One query, two keys with scores 0 and ln 3, sink 0: weights 1/5 and 3/5 (the sink
    takes 1/5); a second head with sink -inf is the plain softmax (1/4, 3/4)."""
    d = 2
    q = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])  # [T=1, H=2, D]
    cache = torch.zeros(2, 2, 2, 1, d)  # one block of 2 positions, block 1
    cache[0, 1, 0, 0] = torch.tensor([0.0, 5.0])
    cache[0, 1, 1, 0] = torch.tensor([math.log(3.0), -7.0])
    cache[1, 1, 0, 0] = torch.tensor([10.0, 0.0])
    cache[1, 1, 1, 0] = torch.tensor([0.0, 20.0])
    meta = build_attention_metadata([1], [2], torch.tensor([[1]]), torch.tensor([-1]))
    out = paged_attention_ref(q, cache, meta, 1.0, sinks=torch.tensor([0.0, float("-inf")]))
    torch.testing.assert_close(out[0, 0], torch.tensor([2.0, 12.0]))
    torch.testing.assert_close(out[0, 1], torch.tensor([2.5, 15.0]))


@pytest.mark.parametrize("window", [None, 1, 7, 25])
def test_reference_equals_dense(window):
    case = make_case(REQS, write_new=True, sliding_window=window, block_size=4, seed=3)
    sinks = sinks_for(4, seed=window or 0)
    ref = paged_attention_ref(case["q"], case["cache"], case["meta"], case["scale"],
                              sliding_window=window, sinks=sinks)
    n = sum(ql for _, ql in REQS)
    assert not torch.isnan(ref[:n]).any()
    torch.testing.assert_close(ref[:n], dense(case, window, sinks)[:n], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_reference_equals_transformers_gpt_oss_attention(window):
    """transformers' GPT-OSS eager attention (its sink concatenation) on one sequence."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    L, H, HKV, D = 19, 4, 2, 8
    case = make_case([(0, L)], write_new=True, block_size=4, num_heads=H, num_kv_heads=HKV,
                     head_dim=D, seed=11, sliding_window=window)
    sinks = sinks_for(H, seed=5)
    ours = paged_attention_ref(case["q"], case["cache"], case["meta"], case["scale"],
                               sliding_window=window, sinks=sinks)
    table = case["full_table"][0]
    pos = torch.arange(L)
    slots = table[pos // 4].long() * 4 + pos % 4
    k = case["cache"][0].reshape(-1, HKV, D)[slots]
    v = case["cache"][1].reshape(-1, HKV, D)[slots]
    i, j = pos[:, None], pos[None, :]
    visible = (j <= i) & ((j > i - window) if window else True)
    mask = torch.zeros(L, L).masked_fill(~visible, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups, module.training = sinks, H // HKV, False
    theirs, _ = eager_attention_forward(module, case["q"].transpose(0, 1)[None],
                                        k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask,
                                        case["scale"])
    torch.testing.assert_close(ours, theirs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [1, 3, 8])
@pytest.mark.parametrize("window", [None, 1, 9, 30])
def test_decode_kernel_with_sinks(kernel_device, splits, window):
    """Forced split counts (the reduce kernel adds the sink), sliding windows (the null
    block is NaN), untouched rows of longer requests stay NaN."""
    reqs = [(70, 1), (8, 1), (33, 4), (129, 1), (0, 1)]
    case = make_case(reqs, write_new=True, sliding_window=window, block_size=4,
                     device=kernel_device, seed=splits)
    sinks = sinks_for(4, seed=splits, device=kernel_device)
    m = case["meta"]
    out = poisoned_out(case)
    paged_decode_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, num_splits=splits,
                           sliding_window=window, sinks=sinks)
    want = paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                      m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                      poisoned_out(case), sliding_window=window, sinks=sinks)
    dec = rows_of(case, lambda ql: ql == 1)
    assert not torch.isnan(out.cpu()[dec]).any()
    torch.testing.assert_close(out.cpu()[dec], want.cpu()[dec], atol=1e-5, rtol=1e-5)
    assert torch.isnan(out.cpu()[rows_of(case, lambda ql: ql > 1)]).all()
    # the sinks matter: without them the rows differ
    plain = paged_decode_attention_ref(case["q"], case["cache"], m.block_table_tensor,
                                       m.query_start_loc, m.seq_lens, m.num_reqs, case["scale"],
                                       poisoned_out(case), sliding_window=window)
    assert (plain.cpu()[dec] - out.cpu()[dec]).abs().max() > 1e-2


@pytest.mark.parametrize("window", [None, 5, 12])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_kernel_with_sinks(kernel_device, window, dtype):
    """Chunks crossing the window edge, fresh prefills longer than the window, decodes
    skipped (left NaN)."""
    reqs = [(50, 20), (0, 40), (3, 17), (9, 1)]
    case = make_case(reqs, write_new=True, sliding_window=window, block_size=8,
                     device=kernel_device, seed=5, dtype=dtype)
    sinks = sinks_for(4, seed=1, device=kernel_device).to(dtype)
    m = case["meta"]
    out = poisoned_out(case)
    paged_prefill_attention(case["q"], case["cache"], m.block_table_tensor, m.query_start_loc,
                            m.seq_lens, m.num_reqs, case["scale"], out, skip_decode=True,
                            sliding_window=window, sinks=sinks)
    want = paged_prefill_attention_ref(case["q"].float(), case["cache"].float(),
                                       m.block_table_tensor, m.query_start_loc, m.seq_lens,
                                       m.num_reqs, case["scale"], poisoned_out(case).float(),
                                       skip_decode=True, sliding_window=window, sinks=sinks)
    rows = rows_of(case, lambda ql: ql > 1)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    got = out.float().cpu()
    assert not torch.isnan(got[rows]).any()
    torch.testing.assert_close(got[rows], want.cpu()[rows], atol=tol, rtol=tol)
    torch.testing.assert_close(got[rows], dense(case, window, sinks.float().cpu())[rows],
                               atol=tol, rtol=tol)
    assert torch.isnan(got[rows_of(case, lambda ql: ql == 1)]).all()


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window", [None, 3, 16])
def test_backend_mixed_batch_with_sinks(kernel_device, block_size, window):
    """The whole backend (KV write, decode + prefill rows, graph padding rows zero) against
    the torch backend, both given the layer's sinks."""
    kw = dict(block_size=block_size, device=kernel_device, seed=block_size, pad_tokens=3,
              padded_reqs=2, sliding_window=window)
    a, b = make_case(REQS, **kw), make_case(REQS, **kw)
    sinks = sinks_for(4, seed=block_size, device=kernel_device)
    out = TritonAttentionBackend().forward_with_metadata(
        0, a["q"], a["k"], a["v"], a["cache"], a["meta"], a["scale"], sinks=sinks,
        sliding_window=window)
    ref = TorchRefBackend(writer="ref").forward_with_metadata(
        0, b["q"], b["k"], b["v"], b["cache"], b["meta"], b["scale"], sinks=sinks,
        sliding_window=window)
    n = sum(ql for _, ql in REQS)
    assert not torch.isnan(out[:n].cpu()).any()
    torch.testing.assert_close(out.cpu()[:n], ref.cpu()[:n], atol=1e-5, rtol=1e-5)
    assert torch.all(out[n:] == 0)
    torch.testing.assert_close(ref.cpu()[:n], dense(b, window, sinks.cpu())[:n], atol=1e-5,
                               rtol=1e-5)


def test_extreme_sinks(kernel_device):
    """A sink far above every score takes all the weight (output 0, no NaN); a sink far
    below leaves the plain softmax."""
    reqs = [(20, 1), (3, 1), (0, 6)]
    case = make_case(reqs, write_new=True, block_size=4, device=kernel_device, seed=2)
    m = case["meta"]
    args = (case["q"], case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens,
            m.num_reqs, case["scale"])
    dec, pre = rows_of(case, lambda ql: ql == 1), rows_of(case, lambda ql: ql > 1)
    for splits in (1, 4):
        hi = paged_decode_attention(*args, poisoned_out(case), num_splits=splits,
                                    sinks=torch.full((4,), 500.0, device=kernel_device))
        assert torch.all(hi.cpu()[dec] == 0)
        lo = paged_decode_attention(*args, poisoned_out(case), num_splits=splits,
                                    sinks=torch.full((4,), -1e4, device=kernel_device))
        plain = paged_decode_attention(*args, poisoned_out(case), num_splits=splits)
        torch.testing.assert_close(lo.cpu()[dec], plain.cpu()[dec])
    hi = paged_prefill_attention(*args, poisoned_out(case), skip_decode=True,
                                 sinks=torch.full((4,), 500.0, device=kernel_device))
    assert torch.all(hi.cpu()[pre] == 0)


def test_bad_sinks_are_typed_errors(kernel_device):
    case = make_case([(5, 1)], write_new=True, block_size=4, device=kernel_device)
    m = case["meta"]
    args = (case["q"], case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens,
            m.num_reqs, case["scale"], torch.zeros_like(case["q"]))
    for bad in (torch.zeros(3, device=kernel_device), torch.zeros(4, 1, device=kernel_device),
                torch.zeros(4, dtype=torch.int32, device=kernel_device), [0.0] * 4):
        for fn in (paged_decode_attention, paged_prefill_attention):
            with pytest.raises(ConfigError, match="sinks"):
                fn(*args, sinks=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 128])
def test_backend_gpu_bf16_gpt_oss_shape(window):
    """GPT-OSS-20B's attention shape (64 query / 8 KV heads, head_dim 64, window 128) in bf16
    against the float32 torch backend: long decodes (split), a chunk, a fresh prefill."""
    torch.manual_seed(0)
    reqs = [(int(c), 1) for c in torch.randint(0, 6000, (40,))] + [(3000, 300), (0, 1024)]
    kw = dict(block_size=16, num_heads=64, num_kv_heads=8, head_dim=64, dtype=torch.bfloat16,
              device="cuda", seed=1, sliding_window=window)
    a, b = make_case(reqs, **kw), make_case(reqs, **kw)
    sinks = sinks_for(64, seed=3, device="cuda", spread=3.0).to(torch.bfloat16)
    out = TritonAttentionBackend().forward_with_metadata(
        0, a["q"], a["k"], a["v"], a["cache"], a["meta"], a["scale"], sinks=sinks,
        sliding_window=window)
    ref = TorchRefBackend(writer="ref").forward_with_metadata(
        0, b["q"].float(), b["k"].float(), b["v"].float(), b["cache"].float(), b["meta"],
        b["scale"], sinks=sinks.float(), sliding_window=window)
    assert not torch.isnan(out.float()).any()
    torch.testing.assert_close(out.float().cpu(), ref.float().cpu(), atol=2e-2, rtol=2e-2)
