"""The Triton MLA decode kernel (``pagedkv.attention.mla_triton_decode``) against its torch twin
(through the Triton interpreter on CPU, natively on a GPU): absorbed queries over the latent
cache for many query heads packed per program, one latent head, split-KV (forced and chosen),
block sizes that are and are not powers of two, fp32 / fp16 (bf16 on the GPU); rows of other
requests untouched (NaN-poisoned), CUDA-graph padding rows zeroed. The Triton MLA backend
(``mla_triton_backend``) against the dense float64 MLA on mixed and decode-only batches with
padding. On a GPU (``@pytest.mark.gpu``): DeepSeek-V3's shape (128 heads x (512 + 64), bf16,
long contexts) and the backend's decode step captured in a CUDA graph."""

import importlib.util
import json
import os
import sys

import pytest
import torch
from mla_helpers import MIXED, Batch

from pagedkv.attention.backend import AttentionLayout
from pagedkv.attention.mla import mla_backend_for
from pagedkv.attention.mla_triton_backend import TritonMLABackend, TritonMLAPlan
from pagedkv.attention.mla_triton_decode import (
    INTERPRET_MLA_DECODE_CONFIG,
    MLA_DECODE_VARIANTS,
    SPLIT_PACKED,
    SPLIT_TRIPLE,
    SPLIT_WIDE,
    MLADecodeConfig,
    default_mla_decode_config,
    mla_decode_attention,
    mla_decode_attention_ref,
    mla_launch,
)
from pagedkv.attention.triton_backend import TritonAttentionBackend
from pagedkv.attention.triton_decode import choose_split
from pagedkv.errors import ConfigError

BENCH = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "bench_swa_mla_decode_gpu.py")


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
    for r, s in enumerate(lens):  # slots past the length in the last block: never read
        if s % block_size:
            cache[int(table[r, s // block_size]), s % block_size:] = float("nan")
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
    with pytest.raises(ConfigError, match="v_chunks"):
        MLADecodeConfig(v_chunks=4)
    with pytest.raises(ConfigError, match="maxnreg"):
        MLADecodeConfig(maxnreg=300)
    with pytest.raises(ConfigError, match="DecodeConfig"):
        MLADecodeConfig(split=None)
    with pytest.raises(ConfigError, match="65535 requests"):
        big = 65536
        mla_decode_attention(q[:1].expand(big, -1, -1), cache, table[:1].expand(big, -1),
                             torch.arange(big + 1, dtype=torch.int32),
                             torch.ones(big, dtype=torch.int32), big, 0.3,
                             out[:1].expand(big, -1, -1), kv_lora_rank=32)


# ---- launch variants: every one against the twin


def _variant_case(i, cfg):
    """Interpreter inputs for variant ``i``: 80 heads where a program holds 64 or 128 (two
    head tiles of 64, or one of 128 with 48 rows masked), 20 elsewhere (a partial tile);
    fp32 / block 16 and fp16 / block 5 in turn."""
    heads = 80 if cfg.block_h >= 64 else 20
    return (heads,) + ((torch.float32, 16) if i % 2 == 0 else (torch.float16, 5))


@pytest.mark.parametrize("i", range(len(MLA_DECODE_VARIANTS)),
                         ids=[c.name for c in MLA_DECODE_VARIANTS])
def test_every_variant_matches_twin(kernel_device, i):
    """Each launch variant the GPU sweep times (its heads per program, value chunks, tile and
    split policy; warps, stages and register caps do not change the interpreted result), on
    the mixed batch over a cache whose null block and slots past each length are NaN: the
    decode rows equal the twin, every other row stays as it was (NaN), for the policy's split
    count and a forced 3-range split (partials + the reduce kernel)."""
    cfg = MLA_DECODE_VARIANTS[i]
    heads, dtype, block_size = _variant_case(i, cfg)
    q, cache, table, qsl, seq, n, dec = _decode_inputs(kernel_device, heads, 32, 16, block_size,
                                                       dtype, seed=i)
    want = torch.full((q.shape[0], heads, 32), float("nan"), dtype=dtype, device=kernel_device)
    mla_decode_attention_ref(q, cache, table, qsl, seq, n, 0.3, want, kv_lora_rank=32,
                             zero_padded_rows=True)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    for splits in (None, 3):
        got = torch.full_like(want, float("nan"))
        mla_decode_attention(q, cache, table, qsl, seq, n, 0.3, got, kv_lora_rank=32,
                             num_splits=splits, zero_padded_rows=True, config=cfg,
                             max_seq_len=int(seq.max()), workspace={})
        torch.testing.assert_close(got[dec], want[dec], **tol)
        assert torch.equal(torch.isnan(got), torch.isnan(want)), splits


@pytest.mark.parametrize("rank,rope", [(40, 8), (48, 16)])
def test_value_chunks_with_padded_columns(kernel_device, rank, rope):
    """Two value chunks where the columns are padded (rank 40 -> 64: the second half holds
    columns 32-39 of 32; rope 8 -> 16) or not padded at all (48 = 32 + 16 is not: rank 48 ->
    64 as well, rope 16 exact), 64 and 16 heads a program."""
    heads = 20
    q, cache, table, qsl, seq, n, dec = _decode_inputs(kernel_device, heads, rank, rope, 16,
                                                       torch.float32, seed=rank)
    want = torch.full((q.shape[0], heads, rank), float("nan"), device=kernel_device)
    mla_decode_attention_ref(q, cache, table, qsl, seq, n, 0.3, want, kv_lora_rank=rank)
    for cfg in (MLADecodeConfig(64, 16, v_chunks=2, split=INTERPRET_MLA_DECODE_CONFIG.split),
                MLADecodeConfig(16, 32, v_chunks=2, split=INTERPRET_MLA_DECODE_CONFIG.split)):
        assert mla_launch(cfg, heads, rank, rope).v_chunks == 2
        for splits in (1, 2):
            got = torch.full_like(want, float("nan"))
            mla_decode_attention(q, cache, table, qsl, seq, n, 0.3, got, kv_lora_rank=rank,
                                 num_splits=splits, config=cfg)
            torch.testing.assert_close(got[dec], want[dec], atol=1e-5, rtol=1e-5)
            assert torch.equal(torch.isnan(got), torch.isnan(want)), (cfg.name, splits)


def test_exact_columns_unmasked_variant(kernel_device):
    """Rank and rope already powers of two (32 + 16: no column predicates) with two value
    chunks of 16 columns: the masked-out rows (null block, slots past the length) stay
    unread."""
    q, cache, table, qsl, seq, n, dec = _decode_inputs(kernel_device, 16, 32, 16, 16,
                                                       torch.float32, seed=5)
    want = torch.full((q.shape[0], 16, 32), float("nan"), device=kernel_device)
    mla_decode_attention_ref(q, cache, table, qsl, seq, n, 0.3, want, kv_lora_rank=32)
    cfg = MLADecodeConfig(16, 16, v_chunks=2, split=INTERPRET_MLA_DECODE_CONFIG.split)
    got = torch.full_like(want, float("nan"))
    mla_decode_attention(q, cache, table, qsl, seq, n, 0.3, got, kv_lora_rank=32, config=cfg,
                         num_splits=2)
    torch.testing.assert_close(got[dec], want[dec], atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.isnan(got), torch.isnan(want))


def test_launch_shapes():
    """Heads per program capped by the head count; value chunks halve the padded rank."""
    cfg = MLADecodeConfig(64, 16, v_chunks=2)
    ln = mla_launch(cfg, 128, 512, 64)  # DeepSeek-V3: 2 head tiles x 2 halves of 256
    assert (ln.block_h, ln.head_tiles, ln.l_pad, ln.r_pad, ln.block_v, ln.v_chunks,
            ln.programs_per_req) == (64, 2, 512, 64, 256, 2, 4)
    ln = mla_launch(cfg, 16, 512, 64)  # 16 heads: one tile of 16 rows
    assert (ln.block_h, ln.head_tiles, ln.programs_per_req) == (16, 1, 2)
    ln = mla_launch(MLADecodeConfig(128), 20, 40, 8)  # 20 -> 32 rows; 40 -> 64, 8 -> 16
    assert (ln.block_h, ln.head_tiles, ln.l_pad, ln.r_pad, ln.v_chunks) == (32, 1, 64, 16, 1)
    ln = mla_launch(cfg, 20, 16, 16)  # 16 columns cannot split into two of >= 16
    assert (ln.l_pad, ln.block_v, ln.v_chunks) == (16, 16, 1)
    assert cfg.name == "h64-v2-t16-w4-s2"
    assert MLADecodeConfig(16, 16, 4, 5, maxnreg=168).name == "h16-v1-t16-w4-s5-r168"


def test_default_policy_by_head_count():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert default_mla_decode_config(cpu, 128) is INTERPRET_MLA_DECODE_CONFIG
    for heads in (1, 16, 32):
        assert default_mla_decode_config(cuda, heads).name == "h16-v1-t32-w4-s5"
    for heads in (33, 64):
        assert default_mla_decode_config(cuda, heads).name == "h64-v2-t16-w4-s3"
    for heads in (65, 128):
        assert default_mla_decode_config(cuda, heads).name == "h128-v2-t32-w8-s2"
    assert default_mla_decode_config(cuda).name == "h16-v1-t32-w4-s5"  # heads unknown
    names = [c.name for c in MLA_DECODE_VARIANTS]
    assert len(set(zip(names, (c.split for c in MLA_DECODE_VARIANTS)))) == len(names)
    for heads in (16, 128):  # the defaults are variants the sweep times
        assert default_mla_decode_config(cuda, heads) in MLA_DECODE_VARIANTS


def test_split_policies_fill_about_one_wave():
    """choose_split with MLA's policies on 132 multiprocessors (hand-computed): about one wave
    of programs for equal lengths, no split from 2 x 132 programs on, at most 64 ranges."""
    def splits(policy, reqs, programs_per_req, max_len=8192):
        return choose_split(reqs, programs_per_req, max_len, 132, policy)

    # one resident program an SM: int(0.97 * 132) = 128 programs wanted
    assert splits(SPLIT_WIDE, 64, 2) == (1, 64)  # 128 programs
    assert splits(SPLIT_WIDE, 16, 2) == (4, 64)  # 32 x 4 = 128
    assert splits(SPLIT_WIDE, 1, 2) == (64, 64)  # capped at 64 ranges
    assert splits(SPLIT_WIDE, 1, 2, max_len=1000)[0] == 16  # ranges of >= 64 positions
    assert splits(SPLIT_WIDE, 200, 2)[0] == 1  # 400 programs >= 2 x 132: no split
    # two resident programs an SM: int(1.94 * 132) = 256
    assert splits(SPLIT_PACKED, 64, 1) == (4, 32)
    assert splits(SPLIT_PACKED, 16, 4) == (4, 32)  # 64 heads x 2 chunks at 128 heads
    assert splits(SPLIT_PACKED, 64, 4)[0] == 1
    assert splits(SPLIT_PACKED, 1, 1, max_len=2048)[0] == 64
    # three: int(2.91 * 132) = 384
    assert splits(SPLIT_TRIPLE, 64, 1)[0] == 6
    assert splits(SPLIT_TRIPLE, 128, 1)[0] == 3


# ---- the GPU sweep's path (bench/bench_swa_mla_decode_gpu.py --sweep), tiny, interpreted


def test_bench_sweep_tiny_path(tmp_path, capsys):
    """``--tiny --sweep`` on two variants at 20 heads (hand-counted): B2/L40, lengths 40 and
    33; the first version (16 heads a program: 2 head tiles, GQA split policy: 2 ranges of
    32 positions) and 64 heads x 2 value chunks (20 heads -> one tile of 32 rows, 2 chunks;
    packed policy: 2 ranges); forced: 1 range each (2 would be ranges of < 64 positions)."""
    spec = importlib.util.spec_from_file_location("bench_swa_mla_decode_gpu", BENCH)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    out = tmp_path / "sweep.json"
    res = bench.main(["--tiny", "--sweep", "--sweep-heads", "20", "--out", str(out),
                      "--sweep-variants", "h16-v1-t32-w4-s2/gqa,h64-v2-t16-w4-s3"])
    assert json.loads(out.read_text())["correctness_failures"] == []
    (case,) = res["sweep"]
    assert (case["heads"], case["batch"], case["ctx"], case["bytes"]) == (20, 2, 40, 73 * 192)
    got = {(r["variant"], r["splits"], r["auto"], r["programs"]) for r in case["runs"]}
    assert got == {("h16-v1-t32-w4-s2/gqa", 2, True, 8), ("h16-v1-t32-w4-s2/gqa", 1, False, 4),
                   ("h64-v2-t16-w4-s3/packed", 2, True, 8),
                   ("h64-v2-t16-w4-s3/packed", 1, False, 4)}
    assert all(r["rel_err"] < 1e-5 and r["us"] > 0 for r in case["runs"])
    assert case["best"]["variant"] in {r["variant"] for r in case["runs"]}
    printed = capsys.readouterr().out
    assert "h64-v2-t16-w4-s3/packed" in printed and "first version" in printed
    with pytest.raises(SystemExit, match="matches none"):
        bench.main(["--tiny", "--sweep", "--sweep-variants", "nope", "--out", str(out)])


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


GPU_CONFIGS = (None,) + MLA_DECODE_VARIANTS  # None: the default policy's choice


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=["default"] + [c.name for c in MLA_DECODE_VARIANTS])
def test_gpu_deepseek_v3_shape_bf16(heads, cfg):
    """DeepSeek-V3's latent (512 + 64), bf16, contexts up to 4096 (NaN null block and tails),
    16 or 128 query heads (one GPU of TP 8, or all): the default launch (block 64) and every
    variant the sweep times (block 16), compiled natively, vs the twin at the policy's split
    count and forced ones."""
    lens = (1, 777, 4096, 2048, 100, 0)
    qlens = (1, 1, 1, 1, 1, 0)
    q, cache, table, qsl, seq, n, dec = _decode_inputs("cuda", heads, 512, 64,
                                                       64 if cfg is None else 16,
                                                       torch.bfloat16, lens=lens, qlens=qlens)
    want = torch.full((q.shape[0], heads, 512), float("nan"), dtype=torch.bfloat16, device="cuda")
    mla_decode_attention_ref(q, cache, table, qsl, seq, n, 192 ** -0.5, want, kv_lora_rank=512,
                             zero_padded_rows=True)
    for splits in (None, 1, 8):
        got = torch.full_like(want, float("nan"))
        mla_decode_attention(q, cache, table, qsl, seq, n, 192 ** -0.5, got, kv_lora_rank=512,
                             num_splits=splits, zero_padded_rows=True, max_seq_len=4096,
                             config=cfg)
        torch.testing.assert_close(got[dec].float(), want[dec].float(), atol=2e-2, rtol=2e-2)
        assert torch.equal(torch.isnan(got), torch.isnan(want))


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_backend_decode_step_in_a_cuda_graph(heads):
    """The backend's decode step (latent write, absorbed GEMM, kernel, W_UV; the default
    launch for 16 or 128 heads) captured in a CUDA graph and replayed equals an eager step and
    the dense reference."""
    reqs = [(30, 1), (200, 1), (5, 1), (1000, 1)]
    b = Batch(reqs, 64, dtype=torch.bfloat16, seed=3, device="cuda",
              dims=(heads, 512, 64, 128, 128))
    backend = TritonMLABackend()  # the default launch for the head count
    layout = AttentionLayout(heads, 1, 576, torch.bfloat16, torch.device("cuda"))
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
