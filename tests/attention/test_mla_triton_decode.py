"""The Triton MLA decode kernel (``pagedkv.attention.mla_triton_decode``) against its torch twin
(through the Triton interpreter on CPU, natively on a GPU): absorbed queries over the latent
cache for many query heads packed per program, one latent head, split-KV (forced and chosen),
block sizes that are and are not powers of two, fp32 / fp16 (bf16 on the GPU); rows of other
requests untouched (NaN-poisoned), CUDA-graph padding rows zeroed. The Triton MLA backend
(``mla_triton_backend``) against the dense float64 MLA on mixed and decode-only batches with
padding. On a GPU (``@pytest.mark.gpu``): DeepSeek-V3's shape (128 heads x (512 + 64), bf16,
long contexts) and the backend's decode step captured in a CUDA graph."""

import pytest
import torch
from mla_helpers import MIXED, Batch

from pagedkv.attention.backend import AttentionLayout
from pagedkv.attention.mla import mla_backend_for
from pagedkv.attention.mla_triton_backend import TritonMLABackend, TritonMLAPlan
from pagedkv.attention.mla_triton_decode import (
    MLADecodeConfig,
    mla_decode_attention,
    mla_decode_attention_ref,
)
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.errors import ConfigError


def _decode_inputs(device, heads, rank, rope, block_size, dtype, seed=0,
                   lens=(1, 17, 40, 64, 3, 0, 0), qlens=(1, 1, 3, 1, 1, 0, 0)):
    """A batch of decode requests, one prefill request (3 tokens) and two padded requests
    (no tokens, length 0), as a CUDA-graph step pads; 2 rows past the last request."""
    gen = torch.Generator().manual_seed(seed)
    nb = sum(-(-s // block_size) for s in lens) + 2
    cache = torch.randn(nb, block_size, rank + rope, generator=gen).to(dtype)
    cache[0] = float("nan")  # the null block: never read
    perm = (torch.randperm(nb - 1, generator=gen) + 1).tolist()
    width = max(-(-s // block_size) for s in lens) + 1
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for r, s in enumerate(lens):
        for j in range(-(-s // block_size)):
            table[r, j] = perm.pop()
    qsl = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(qlens), 0)
    t = int(qsl[-1]) + 2
    q = torch.randn(t, heads, rank + rope, generator=gen).to(dtype)
    seq = torch.tensor(lens, dtype=torch.int32)
    to = dict(device=device)
    return (q.to(**to), cache.to(**to), table.to(**to), qsl.to(**to), seq.to(**to), len(lens),
            [int(qsl[r]) for r in range(len(lens)) if qlens[r] == 1])


SHAPES = [(4, 32, 8), (20, 32, 16), (16, 64, 16)]


BATCHES = {
    # decodes, a 3-token prefill (rows 2-4, left untouched), two requests without tokens
    # (rows 7, 8 past num_reqs: untouched)
    "mixed": {},
    # a CUDA-graph decode step: 2 decodes padded to 4 requests; rows 2, 3 belong to no
    # request and the padded requests 2, 3 zero them
    "graph": dict(lens=(5, 70, 0, 0), qlens=(1, 1, 0, 0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32, 5])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_kernel_matches_twin(kernel_device, batch, shape, block_size, dtype):
    heads, rank, rope = shape
    q, cache, table, qsl, seq, n, dec = _decode_inputs(kernel_device, heads, rank, rope,
                                                       block_size, dtype, seed=block_size,
                                                       **BATCHES[batch])
    want = torch.full((q.shape[0], heads, rank), float("nan"), dtype=dtype, device=kernel_device)
    mla_decode_attention_ref(q, cache, table, qsl, seq, n, 0.3, want, kv_lora_rank=rank,
                             zero_padded_rows=True)
    if batch == "graph":
        assert torch.equal(want[2:4].cpu(), torch.zeros(2, heads, rank, dtype=dtype))
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    for splits in (None, 1, 3):
        got = torch.full_like(want, float("nan"))
        mla_decode_attention(q, cache, table, qsl, seq, n, 0.3, got, kv_lora_rank=rank,
                             num_splits=splits, zero_padded_rows=True, workspace={})
        torch.testing.assert_close(got[dec], want[dec], **tol)
        assert torch.isfinite(got[dec]).all()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), splits
        others = [i for i in range(q.shape[0]) if i not in dec]
        torch.testing.assert_close(got[others], want[others], equal_nan=True)


def test_twin_definition_and_padding_rows():
    """The twin by hand for one request; padded requests zero only the rows no request owns."""
    q, cache, table, qsl, seq, n, dec = _decode_inputs("cpu", 2, 16, 16, 16, torch.float32,
                                                       lens=(5, 0), qlens=(1, 0))
    out = torch.full((q.shape[0], 2, 16), 9.0)
    mla_decode_attention_ref(q, cache, table, qsl, seq, n, 0.5, out, kv_lora_rank=16,
                             zero_padded_rows=True)
    lat = cache[table[0, 0].long(), :5].double()
    p = torch.softmax(q[0].double() @ lat.T * 0.5, dim=-1)
    torch.testing.assert_close(out[0].double(), p @ lat[:, :16], atol=1e-5, rtol=1e-5)
    assert torch.equal(out[1], torch.zeros(2, 16))  # request 1: no rows, row 1 of nobody
    assert torch.equal(out[2], torch.full((2, 16), 9.0))  # past num_reqs: never touched


def test_errors():
    q, cache, table, qsl, seq, n, _ = _decode_inputs("cpu", 4, 32, 8, 16, torch.float32)
    out = torch.empty(q.shape[0], 4, 32)
    with pytest.raises(ConfigError, match="kv_lora_rank"):
        mla_decode_attention(q, cache, table, qsl, seq, n, 0.3, out, kv_lora_rank=40)
    with pytest.raises(ConfigError, match="out"):
        mla_decode_attention(q, cache, table, qsl, seq, n, 0.3, out[..., :-1], kv_lora_rank=32)
    with pytest.raises(ConfigError, match="latent width"):
        mla_decode_attention(q[..., :-1], cache, table, qsl, seq, n, 0.3, out, kv_lora_rank=32)
    with pytest.raises(ConfigError, match="num_splits"):
        mla_decode_attention(q, cache, table, qsl, seq, n, 0.3, out, kv_lora_rank=32, num_splits=0)
    with pytest.raises(ConfigError, match="power of two"):
        MLADecodeConfig(block_h=24)


# ---- the backend


def _run_backend(b, backend, pad_rows=0):
    layout = AttentionLayout(b.dims[0], 1, b.dims[1] + b.dims[2], b.dtype, b.cache.device)
    plan = backend.plan(b.metadata, layout)
    return plan, backend.forward(0, b.q_all, b.new_latent, b.cache, plan, b.scale, b.weights)


@pytest.mark.parametrize("block_size", [16, 32])
def test_backend_mixed_batch_matches_dense(kernel_device, block_size):
    b = Batch(MIXED, block_size, pad=3, seed=block_size + 1, device=kernel_device)
    plan, out = _run_backend(b, TritonMLABackend())
    assert isinstance(plan, TritonMLAPlan) and not plan.decode_only and plan.triton
    n = b.metadata.num_actual_tokens
    torch.testing.assert_close(out[:n].double().cpu(), b.expected(), atol=2e-5, rtol=1e-5)
    assert torch.equal(out[n:].cpu(), torch.zeros(3, *out.shape[1:]))
    flat = b.cache.view(-1, b.cache.shape[2])
    torch.testing.assert_close(flat[b.slots[:n]], b.new_latent[:n])
    assert torch.isnan(b.cache[0]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_backend_decode_only_with_graph_padding(kernel_device, dtype):
    """As a CUDA-graph decode step: 4 decode requests padded to 6 (two requests with no
    tokens and length 0) and 6 query rows; the padded rows come out zero."""
    reqs = [(20, 1), (3, 1), (40, 1), (63, 1), (0, 0), (0, 0)]
    b = Batch(reqs, 16, dtype=dtype, pad=2, seed=7, device=kernel_device)
    plan, out = _run_backend(b, TritonMLABackend())
    assert plan.decode_only and out.shape == (6, *out.shape[1:])
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[:4].double().cpu(), b.expected(), **tol)
    assert torch.equal(out[4:].cpu(), torch.zeros(2, *out.shape[1:], dtype=dtype))


def test_engine_backend_maps_to_triton_mla():
    assert isinstance(mla_backend_for(TritonAttentionBackend()), TritonMLABackend)
    assert TritonMLABackend.supports_cuda_graphs


# ---- on a CUDA GPU, natively


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_deepseek_v3_shape_bf16(heads):
    """DeepSeek-V3's latent (512 + 64), bf16, block 64, contexts up to 4096, 16 or 128 query
    heads (one GPU of TP 8, or all): kernel vs twin."""
    lens = (1, 777, 4096, 2048, 100, 0)
    qlens = (1, 1, 1, 1, 1, 0)
    q, cache, table, qsl, seq, n, dec = _decode_inputs("cuda", heads, 512, 64, 64, torch.bfloat16,
                                                       lens=lens, qlens=qlens)
    want = torch.full((q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_decode_attention_ref(q, cache, table, qsl, seq, n, 192 ** -0.5, want, kv_lora_rank=512,
                             zero_padded_rows=True)
    for splits in (None, 1, 8):
        got = torch.full_like(want, float("nan"))
        mla_decode_attention(q, cache, table, qsl, seq, n, 192 ** -0.5, got, kv_lora_rank=512,
                             num_splits=splits, zero_padded_rows=True, max_seq_len=4096)
        torch.testing.assert_close(got[dec].float(), want[dec].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(torch.isnan(got), torch.isnan(want))


@pytest.mark.gpu
def test_gpu_backend_decode_step_in_a_cuda_graph():
    """The backend's decode step (latent write, absorbed GEMM, kernel, W_UV) captured once and
    replayed with other lengths and tokens equals an eager step."""
    reqs = [(30, 1), (200, 1), (5, 1), (1000, 1)]
    b = Batch(reqs, 64, dtype=torch.bfloat16, seed=3, device="cuda",
              dims=(16, 512, 64, 128, 128))
    backend = TritonMLABackend()
    layout = AttentionLayout(16, 1, 576, torch.bfloat16, torch.device("cuda"))
    eager = backend.forward(0, b.q_all, b.new_latent, b.cache.clone(),
                            backend.plan(b.metadata, layout), b.scale, b.weights)
    cache = b.cache.clone()
    q, latent = b.q_all.clone(), b.new_latent.clone()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        backend.forward(0, q, latent, cache, backend.plan(b.metadata, layout), b.scale, b.weights)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            out = backend.forward(0, q, latent, cache, backend.plan(b.metadata, layout), b.scale,
                                  b.weights)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.float(), eager.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out[:4].double().cpu(), b.expected(), atol=3e-2, rtol=3e-2)
