"""TritonAttentionBackend vs TorchRefBackend on mixed batches (decode + chunked prefill + fresh
prefill + CUDA-graph padding), in any row order: same outputs, same KV cache, zero padding
rows. Interpreted on CPU (tiny, fp32/fp16) and native on CUDA (bf16, both fresh-prefill
paths)."""

import pytest
import torch
from test_triton_cases import make_case

from pagedkv.attention import TorchRefBackend
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.errors import ConfigError, InvariantError

TOL = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def both(reqs, *, backend=None, **kw):
    """Run the Triton backend and the reference on twin cases; returns outputs and caches."""
    a = make_case(reqs, **kw)
    b = make_case(reqs, **kw)
    out = (backend or TritonAttentionBackend()).forward_with_metadata(
        0, a["q"], a["k"], a["v"], a["cache"], a["meta"], a["scale"])
    b["cache"] = b["cache"].float()  # the reference attends in fp32 over the same values
    ref = TorchRefBackend(writer="ref").forward_with_metadata(
        0, b["q"].float(), b["k"].float(), b["v"].float(), b["cache"], b["meta"], b["scale"])
    return a, out, b, ref


def check(reqs, **kw):
    a, out, b, ref = both(reqs, **kw)
    dtype = a["q"].dtype
    n = sum(ql for _, ql in reqs)
    assert out.shape == a["q"].shape and out.dtype == dtype
    assert not torch.isnan(out[:n].cpu()).any()
    torch.testing.assert_close(out.float().cpu()[:n], ref.float().cpu()[:n], atol=TOL[dtype],
                               rtol=TOL[dtype])
    assert torch.all(out[n:] == 0), "rows past the batch must be zero"
    # the same slots written, nothing else (the null block and spare slots stay NaN)
    torch.testing.assert_close(a["cache"].float().cpu().nan_to_num(-9.0),
                               b["cache"].float().cpu().nan_to_num(-9.0), atol=0, rtol=0)
    assert torch.isnan(a["cache"][:, 0].float().cpu()).all()
    return out


# decode rows, a chunked prefill (context + chunk), fresh prefills, a prefix hit
MIXED = [(5, 1), (0, 12), (17, 1), (9, 6), (0, 1), (40, 1), (22, 19)]


@pytest.mark.parametrize("block_size,heads", [(1, (4, 4)), (3, (4, 2)), (16, (4, 1)),
                                              (32, (8, 2))])
def test_mixed_batch(kernel_device, block_size, heads):
    check(MIXED, block_size=block_size, num_heads=heads[0], num_kv_heads=heads[1],
          device=kernel_device, pad_tokens=3, padded_reqs=2, seed=block_size)


def test_decode_only_batch_with_graph_padding(kernel_device):
    check([(30, 1), (0, 1), (15, 1), (47, 1)], block_size=16, device=kernel_device,
          pad_tokens=4, padded_reqs=4, seed=1)


def test_fresh_prefill_only_batch(kernel_device):
    check([(0, 18), (0, 1), (0, 33)], block_size=3, device=kernel_device, pad_tokens=2, seed=2)


def test_fp16_decode_rows_not_first(kernel_device):
    check([(0, 9), (12, 1), (6, 7), (33, 1)], block_size=16, dtype=torch.float16,
          device=kernel_device, seed=3)


# the balanced-lengths rule at the interpreter's tiny shapes: any batch is "one wave" (CPU
# runs assume 132 multiprocessors; <= 132 programs)
WIDE = dict(balanced_min_programs_per_sm=0.0, wave_programs_per_sm=1.0)


@pytest.mark.parametrize("reqs,balanced", [([(40, 1), (36, 1), (44, 1)], True),
                                           ([(40, 1), (3, 1), (44, 1)], False)])
def test_decode_balanced_lengths_from_host_or_metadata(kernel_device, reqs, balanced):
    """Decode-only steps: the plan derives ``balanced`` from the host lengths of the actual
    requests (graph padding rows excluded), a metadata ``decode_balanced`` overrides it (a
    CUDA graph's baked value); every choice is exact against the reference."""
    import dataclasses

    from pagedkv.attention.triton_decode import default_decode_config

    from pagedkv.attention.backend import AttentionLayout

    cfg = dataclasses.replace(default_decode_config(torch.device(kernel_device)), **WIDE)
    backend = TritonAttentionBackend(decode_config=cfg)
    check(reqs, backend=backend, block_size=16, device=kernel_device, pad_tokens=2,
          padded_reqs=2, seed=4)
    a = make_case(reqs, block_size=16, device=kernel_device, pad_tokens=2, padded_reqs=2, seed=4)
    plan = backend.plan(a["meta"], AttentionLayout.of(a["q"], a["cache"]))
    assert plan.decode_only and plan.balanced is balanced
    for forced in (True, False):
        a, out, b, ref = both(reqs, backend=backend, block_size=16, device=kernel_device, seed=4)
        a["meta"].decode_balanced = forced
        plan = backend.plan(a["meta"], AttentionLayout.of(a["q"], a["cache"]))
        assert plan.balanced is forced
        out = backend.forward(0, a["q"], a["k"], a["v"], a["cache"], plan, a["scale"])
        torch.testing.assert_close(out.float().cpu()[:3], ref.float().cpu()[:3], atol=1e-4, rtol=1e-4)
    # graph variants: two where the rule applies, one where it cannot
    assert backend.graph_variants(3, 2, torch.device(kernel_device)) == (False, True)
    assert TritonAttentionBackend().graph_variants(3, 2, torch.device(kernel_device)) == (False,)
    lens = [c + q for c, q in reqs]
    assert backend.graph_variant(5, 2, lens, torch.device(kernel_device)) is balanced


def test_empty_batch(kernel_device):
    a = make_case([], block_size=4, device=kernel_device, pad_tokens=3)
    out = TritonAttentionBackend().forward_with_metadata(0, a["q"], a["k"], a["v"], a["cache"], a["meta"],
                                           a["scale"])
    assert torch.all(out == 0) and out.shape == (3, 4, 16)


def test_backend_errors(kernel_device):
    with pytest.raises(ConfigError, match="fresh_prefill"):
        TritonAttentionBackend(fresh_prefill="flash")
    a = make_case([(2, 3), (0, 2)], block_size=4, device=kernel_device)
    a["meta"].seq_lens_cpu[0] = 2  # shorter than its query: an invariant breach
    with pytest.raises(InvariantError, match="query_len <= seq_len"):
        TritonAttentionBackend().forward_with_metadata(0, a["q"], a["k"], a["v"], a["cache"], a["meta"],
                                         a["scale"])


# ---- native GPU


def test_fresh_prefill_cudnn_is_gone():
    """The per-request cuDNN path over gathered K/V was replaced by cuDNN over the paged cache
    (``paged_prefill``): asking for it is a ConfigError that names the replacement."""
    with pytest.raises(ConfigError, match="paged_prefill='cudnn'"):
        TritonAttentionBackend(fresh_prefill="cudnn")


@pytest.mark.gpu
@pytest.mark.parametrize("fresh_prefill", ["triton", "varlen"])
@pytest.mark.parametrize("block_size", [16, 3])
def test_mixed_batch_gpu_bf16(fresh_prefill, block_size):
    reqs = [(300, 1), (0, 513), (1200, 1), (700, 260), (0, 1), (5000, 1), (64, 64)]
    check(reqs, backend=TritonAttentionBackend(fresh_prefill=fresh_prefill),
          block_size=block_size, num_heads=16, num_kv_heads=8, head_dim=128,
          dtype=torch.bfloat16, device="cuda", pad_tokens=7, padded_reqs=3, seed=block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("fresh_prefill", ["triton", "varlen"])
def test_fresh_prefill_gpu_bf16(fresh_prefill):
    check([(0, 1000), (0, 1), (0, 257), (0, 2048), (0, 4500)],
          backend=TritonAttentionBackend(fresh_prefill=fresh_prefill), block_size=16,
          num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
          pad_tokens=3, seed=4)


@pytest.mark.gpu
def test_decode_batch_gpu_bf16():
    torch.manual_seed(0)
    reqs = [(int(c), 1) for c in torch.randint(0, 4000, (100,))]
    check(reqs, block_size=16, num_heads=16, num_kv_heads=8, head_dim=128,
          dtype=torch.bfloat16, device="cuda", pad_tokens=28, padded_reqs=28, seed=5)


@pytest.mark.parametrize("reqs", [MIXED, [(30, 1), (0, 1), (15, 1)]])
def test_one_plan_serves_every_layer_of_a_step(kernel_device, reqs):
    """The runner makes one plan per step and KV-cache group (validation, host ints, split
    workspace) and hands it to every layer of the group: each layer still gets its own exact
    result; the first layer checks the tensors against the plan's layout, so a layer of
    another layout is refused."""
    from pagedkv.attention.backend import AttentionLayout

    base = make_case(reqs, block_size=4, device=kernel_device, seed=1)
    meta = base["meta"]
    g = torch.Generator().manual_seed(7)

    def layer_inputs(i):  # layer i: same metadata, its own q/k/v and cache contents
        if i == 0:
            return base["q"], base["k"], base["v"], base["cache"]
        noise = lambda t: (t.cpu() + torch.randn(t.shape, generator=g, dtype=t.dtype)).to(t.device)  # noqa: E731
        return noise(base["q"]), noise(base["k"]), noise(base["v"]), noise(base["cache"])

    inputs = [layer_inputs(i) for i in range(3)]
    backend = TritonAttentionBackend()
    plan = backend.plan(meta, AttentionLayout.of(base["q"], base["cache"]))
    assert not plan.checked
    outs = [backend.forward(i, q, k, v, cache.clone(), plan, base["scale"])
            for i, (q, k, v, cache) in enumerate(inputs)]
    assert plan.checked
    for (q, k, v, cache), out in zip(inputs, outs):  # as a fresh plan computes it
        ref = TritonAttentionBackend().forward_with_metadata(0, q, k, v, cache.clone(), meta,
                                                             base["scale"])
        torch.testing.assert_close(out, ref, atol=0, rtol=0, equal_nan=True)
    q, k, v, cache = inputs[0]
    other = backend.plan(meta, AttentionLayout.of(q[:, :2], cache))  # fewer query heads
    with pytest.raises(InvariantError, match="layout"):
        backend.forward(0, q, k, v, cache.clone(), other, base["scale"])
