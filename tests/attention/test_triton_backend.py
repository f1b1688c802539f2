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


def test_cudnn_padded_len_by_hand():
    """cuDNN's requests run padded to multiples of 512 tokens (one plan per multiple)."""
    from pagedkv.attention.cudnn_prefill import padded_len

    assert [padded_len(n) for n in (1, 511, 512, 513, 4096, 7000, 16384)] == \
        [512, 512, 512, 1024, 4096, 7168, 16384]


def test_cudnn_choice_without_cudnn_serves_everything_with_triton(kernel_device):
    """``fresh_prefill="cudnn"`` where cuDNN cannot run (CPU): no runs, the paged kernels
    serve every row, exact against the reference."""
    from pagedkv.attention.backend import AttentionLayout

    backend = TritonAttentionBackend(fresh_prefill="cudnn", cudnn_min_query_len=4)
    reqs = [(0, 12), (5, 1), (0, 6), (9, 6)]
    check(reqs, backend=backend, block_size=4, device=kernel_device, pad_tokens=2, seed=7)
    a = make_case(reqs, block_size=4, device=kernel_device, seed=7)
    plan = backend.plan(a["meta"], AttentionLayout.of(a["q"], a["cache"]))
    assert plan.cudnn_reqs == () and plan.triton_prefill_rest
    for bad in (1, True, 3.0):
        with pytest.raises(ConfigError, match="cudnn_min_query_len"):
            TritonAttentionBackend(cudnn_min_query_len=bad)


@pytest.mark.gpu
@pytest.mark.parametrize("fresh_prefill", ["triton", "varlen", "cudnn"])
@pytest.mark.parametrize("block_size", [16, 3])
def test_mixed_batch_gpu_bf16(fresh_prefill, block_size):
    reqs = [(300, 1), (0, 513), (1200, 1), (700, 260), (0, 1), (5000, 1), (64, 64)]
    check(reqs, backend=TritonAttentionBackend(fresh_prefill=fresh_prefill),
          block_size=block_size, num_heads=16, num_kv_heads=8, head_dim=128,
          dtype=torch.bfloat16, device="cuda", pad_tokens=7, padded_reqs=3, seed=block_size)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True])
def test_cudnn_fresh_requests_in_a_mixed_batch_gpu_bf16(fused):
    """cuDNN serves requests 0, 1, 3 and 6 (fresh, >= 256 tokens here) among decode rows, a
    chunk with context and a fresh request below the threshold (Triton's); padded to 512,
    1,024, 1,024 and 2,048 rows (request 6's padding past the step's rows: a copy), with the
    step's K/V given or already in the cache (``fused``: k = v = None): the reference's
    output; the H200 has cuDNN's attention (the path must not fall back silently)."""
    from pagedkv.attention.backend import AttentionLayout
    from pagedkv.attention.cudnn_prefill import cudnn_prefill_available_for
    from pagedkv.kernels.reshape_and_cache import reshape_and_cache

    assert cudnn_prefill_available_for(torch.bfloat16, torch.device("cuda"), 128)
    reqs = [(0, 300), (0, 600), (50, 1), (0, 700), (100, 40), (0, 255), (0, 2000)]
    kw = dict(block_size=16, num_heads=16, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
              device="cuda", pad_tokens=5, padded_reqs=2, seed=8)
    backend = TritonAttentionBackend(fresh_prefill="cudnn", cudnn_min_query_len=256)
    a = make_case(reqs, **kw)
    plan = backend.plan(a["meta"], AttentionLayout.of(a["q"], a["cache"]))
    assert plan.cudnn_reqs == ((0, 300), (300, 600), (901, 700), (1896, 2000))
    assert plan.triton_prefill_rest
    if not fused:
        check(reqs, backend=backend, **kw)
        return
    a, _, b, ref = both(reqs, backend=backend, **kw)  # ref and the written cache
    c = make_case(reqs, **kw)
    reshape_and_cache(c["k"], c["v"], c["cache"][0], c["cache"][1],
                      c["meta"].slot_mapping[:c["meta"].num_actual_tokens])
    plan = backend.plan(c["meta"], AttentionLayout.of(c["q"], c["cache"]))
    out = backend.forward(0, c["q"], None, None, c["cache"], plan, c["scale"])
    n = sum(ql for _, ql in reqs)
    torch.testing.assert_close(out.float().cpu()[:n], ref.float().cpu()[:n], atol=2e-2, rtol=2e-2)
    assert torch.all(out[n:] == 0)


@pytest.mark.gpu
@pytest.mark.parametrize("fresh_prefill", ["triton", "varlen", "cudnn"])
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
