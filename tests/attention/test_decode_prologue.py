"""The decode kernels' fused prologue (``QKPrologue``): q/k RMS norms, RoPE and the new
token's K/V write done by the decode launch itself, against ``qk_norm_rope_cache``'s twin
followed by the reference attention. Interpreted on the CPU (small shapes, fp32), natively on
CUDA (bf16, model-sized).

The cases' caches hold every context position but the step's new one, whose slot is NaN
(``make_case`` without ``write_new``): a launch that reads the new position before its
program wrote it gives NaN."""

import dataclasses

import pytest
import torch
from test_decode_flat_split import flat_cfg
from test_triton_cases import assert_rows_close, make_case, poisoned_out, rows_of

from pagedkv.attention.torch_ref import paged_attention_ref
from pagedkv.attention.triton_decode import (
    DecodeConfig,
    QKPrologue,
    default_decode_config,
    paged_decode_attention,
)
from pagedkv.errors import ConfigError
from pagedkv.kernels.qk_norm_rope_cache import qk_norm_rope_cache, qk_norm_rope_cache_ref

TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
# decode requests (context, 1): block boundaries, one tile and several, a first position
REQS = [(0, 1), (4, 1), (15, 1), (16, 1), (47, 1), (70, 1), (33, 1)]


def prologue_case(reqs, *, device, block_size=4, num_heads=4, num_kv_heads=2, head_dim=16,
                  norm=True, dtype=torch.float32, seed=0, pad_rows=0):
    """A decode case plus a random raw QKV projection, RoPE tables and norm weights for its
    rows; ``pad_rows`` extra QKV rows past the requests' (CUDA-graph padding: slot -1)."""
    case = make_case(reqs, block_size=block_size, num_heads=num_heads,
                     num_kv_heads=num_kv_heads, head_dim=head_dim, seed=seed, dtype=dtype,
                     device=device, pad_tokens=pad_rows)
    g = torch.Generator().manual_seed(seed + 1)
    t = case["q"].shape[0]
    width = (num_heads + 2 * num_kv_heads) * head_dim + 8  # a row stride past the width
    qkv = torch.randn(t, width, generator=g).to(dtype).to(device)
    ang = torch.rand(t, head_dim // 2, generator=g) * 6.0
    w = (lambda: (1.0 + 0.3 * torch.randn(head_dim, generator=g)).to(dtype).to(device))
    pro = QKPrologue(qkv[:, : width - 8], num_heads, num_kv_heads, head_dim,
                     w() if norm else None, w() if norm else None, 1e-6,
                     ang.cos().to(device), ang.sin().to(device),
                     case["meta"].slot_mapping)
    return case, pro


def expected(case, pro):
    """The unfused statement: ``qk_norm_rope_cache_ref`` (q, and the new K/V written into a
    copy of the cache), then the reference attention over that cache; returns ``(out,
    cache)`` on the CPU."""
    cache = case["cache"].clone()
    q = qk_norm_rope_cache_ref(pro.qkv, pro.num_heads, pro.num_kv_heads, pro.head_dim,
                               pro.q_norm_weight, pro.k_norm_weight, pro.eps, pro.cos, pro.sin,
                               pro.slot_mapping, cache[0], cache[1])
    out = paged_attention_ref(q.float(), cache.float(), case["meta"], case["scale"])
    return out.cpu(), cache.cpu()


def run(case, pro, **kw):
    m = case["meta"]
    out = poisoned_out(case)
    paged_decode_attention(pro.query(), case["cache"], m.block_table_tensor, m.query_start_loc,
                           m.seq_lens, m.num_reqs, case["scale"], out, prologue=pro, **kw)
    return out


def assert_matches(case, pro, out, want_out, want_cache):
    rows = rows_of(case, lambda ql: ql == 1)
    assert_rows_close(out, want_out, rows, TOL[case["q"].dtype])
    # the new positions written as the twin writes them, every other slot (NaN or not) as it was
    torch.testing.assert_close(case["cache"].cpu(), want_cache, atol=1e-6, rtol=1e-6,
                               equal_nan=True)


@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("splits", [1, 3, None])
def test_prologue_per_request_launch(kernel_device, norm, splits):
    """The per-request split kernel: one range a request (the program writes, then reads the
    new position), three (only the last range writes) and the default policy."""
    case, pro = prologue_case(REQS, device=kernel_device, norm=norm, seed=3 + norm)
    want_out, want_cache = expected(case, pro)
    cfg = dataclasses.replace(default_decode_config(torch.device(kernel_device)),
                              flat_split=False, min_split_tokens=16)
    out = run(case, pro, num_splits=splits, config=cfg)
    assert_matches(case, pro, out, want_out, want_cache)


@pytest.mark.parametrize("programs,norm", [(3, True), (5, False), (2, True)])
def test_prologue_flat_launch(kernel_device, programs, norm):
    """The flat split: pieces cross requests and start mid-request; the program holding a
    request's last tile writes its new K/V (before the piece's loop), and its reduce merges
    pieces of prologue queries."""
    case, pro = prologue_case(REQS, device=kernel_device, norm=norm, seed=programs)
    want_out, want_cache = expected(case, pro)
    out = run(case, pro, config=flat_cfg(programs, 2))
    assert_matches(case, pro, out, want_out, want_cache)


def test_prologue_equals_the_unfused_launches(kernel_device):
    """Against ``qk_norm_rope_cache`` then the plain decode launch on the same cache: the
    same rows (fp32 rounding apart) and the same cache."""
    case, pro = prologue_case(REQS, device=kernel_device, seed=11)
    plain_cache = case["cache"].clone()
    q = qk_norm_rope_cache(pro.qkv, pro.num_heads, pro.num_kv_heads, pro.head_dim,
                           pro.q_norm_weight, pro.k_norm_weight, pro.eps, pro.cos, pro.sin,
                           pro.slot_mapping, plain_cache[0], plain_cache[1])
    m = case["meta"]
    cfg = flat_cfg(3, 2)
    plain = poisoned_out(case)
    paged_decode_attention(q, plain_cache, m.block_table_tensor, m.query_start_loc, m.seq_lens,
                           m.num_reqs, case["scale"], plain, config=cfg)
    out = run(case, pro, config=cfg)
    rows = rows_of(case, lambda ql: ql == 1)
    torch.testing.assert_close(out[rows], plain[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(case["cache"], plain_cache, atol=1e-6, rtol=1e-6, equal_nan=True)


def test_prologue_padding_rows_write_nothing(kernel_device):
    """CUDA-graph padding: QKV rows past the requests' (slot -1) write nothing, and a slot
    list shorter than the rows guards the loads."""
    case, pro = prologue_case(REQS[:3], device=kernel_device, seed=5, pad_rows=2)
    want_out, want_cache = expected(case, pro)
    out = run(case, pro, config=flat_cfg(2, 2))
    assert_matches(case, pro, out, want_out, want_cache)


def test_prologue_falls_back_where_the_kernels_cannot(kernel_device):
    """A head size that is not a power of two (24) runs ``qk_norm_rope_cache`` ahead of the
    plain launch: the same semantics."""
    case, pro = prologue_case(REQS[:4], device=kernel_device, head_dim=24, seed=7)
    assert not pro.fused(case["cache"])
    want_out, want_cache = expected(case, pro)
    out = run(case, pro, config=flat_cfg(2, 2))
    assert_matches(case, pro, out, want_out, want_cache)


def test_prologue_argument_errors():
    case, pro = prologue_case(REQS[:2], device="cpu", seed=9)
    m = case["meta"]
    args = (case["cache"], m.block_table_tensor, m.query_start_loc, m.seq_lens, m.num_reqs,
            case["scale"], poisoned_out(case))
    with pytest.raises(ConfigError, match="query view"):
        paged_decode_attention(case["q"], *args, prologue=pro)
    bad = dataclasses.replace(pro, cos=pro.cos[:, :3])
    with pytest.raises(ConfigError):
        paged_decode_attention(bad.query(), *args, prologue=bad)
    bad = dataclasses.replace(pro, q_norm_weight=None)  # one norm weight without the other
    with pytest.raises(ConfigError):
        paged_decode_attention(bad.query(), *args, prologue=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_prologue_gpu_bf16(block_size):
    """bf16, 16 / 8 heads of 128 (Qwen3's attention), 64 mixed lengths (the flat split) and
    B1 / B3 (the per-request split merging in the kernel), the default launches: close to the
    twin's statement, the cache's new positions as the twin writes them (bf16 rounding),
    nothing else touched."""
    torch.manual_seed(block_size)
    for ctx in ([8191], [3000, 17, 4000], [int(x) for x in torch.randint(1, 3000, (64,))]):
        case, pro = prologue_case([(c, 1) for c in ctx], device="cuda", block_size=block_size,
                                  num_heads=16, num_kv_heads=8, head_dim=128,
                                  dtype=torch.bfloat16, seed=len(ctx))
        want_out, want_cache = expected(case, pro)
        out = run(case, pro, config=DecodeConfig())
        rows = rows_of(case, lambda ql: ql == 1)
        assert_rows_close(out, want_out, rows, TOL[torch.bfloat16])
        torch.testing.assert_close(case["cache"].float().cpu(), want_cache.float(), atol=2e-2,
                                   rtol=2e-2, equal_nan=True)
