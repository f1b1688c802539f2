"""The split-K GEMM (``pagedkv.kernels.splitk_gemm``) against its torch twin and the float32
product: random inputs, poisoned outputs, ragged shapes (rows, columns and the inner dimension
not multiples of the tiles, empty splits), strided rows; the split choice by hand; on the GPU the
model's decode shapes in bf16, the custom op inside ``torch.compile`` and a CUDA-graph replay."""

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.kernels import splitk_gemm as sk
from pagedkv.kernels.splitk_gemm import (
    SplitKConfig,
    linear_partials,
    split_chunk,
    splitk_linear,
    splitk_linear_op,
    splitk_linear_ref,
    splitk_splits,
)

CFG = SplitKConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)


@pytest.mark.parametrize("M,N,K,S", [(1, 40, 100, 3), (17, 33, 64, 2), (5, 64, 48, 4),
                                     (3, 16, 16, 1), (20, 16, 200, 8), (2, 7, 40, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_twin_and_product(M, N, K, S, dtype):
    g = torch.Generator().manual_seed(M * 1000 + N * 10 + K + S)
    xb = torch.randn(M, K + 5, generator=g).to(dtype)
    x = xb[:, 2:2 + K]  # row stride > width, offset start
    w = torch.randn(N, K, generator=g).to(dtype)
    out = torch.full((S, M, N), float("nan"))
    got = splitk_linear(x, w, S, CFG, out=out)
    assert got is out and not torch.isnan(got).any()
    ref = splitk_linear_ref(x, w, S, CFG)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(got.sum(0), x.float() @ w.float().T, **tol)


def test_partials_are_the_chunks_by_hand():
    """K = 40 over 3 splits of 16-column steps: chunks [0, 16), [16, 32), [32, 40)."""
    assert split_chunk(40, 3, 16) == 16
    assert split_chunk(100, 3, 16) == 48  # 34 rounded up to whole steps: [0, 48), [48, 96), [96, 100)
    assert split_chunk(48, 8, 16) == 16  # splits 3..7 past K are empty (zeros)
    x = torch.ones(1, 40)
    w = torch.arange(40, dtype=torch.float32)[None, :]
    got = splitk_linear(x, w, 3, CFG)
    assert got.shape == (3, 1, 1)
    assert got.flatten().tolist() == [sum(range(16)), sum(range(16, 32)), sum(range(32, 40))]
    empty = splitk_linear(torch.ones(2, 48), torch.ones(3, 48), 8, CFG)
    assert empty[:3].eq(16).all() and empty[3:].eq(0).all()


def test_argument_errors():
    with pytest.raises(ConfigError, match=r"x \[M, K\]"):
        splitk_linear(torch.zeros(2, 3), torch.zeros(4, 5), 2, CFG)
    with pytest.raises(ConfigError, match="share"):
        splitk_linear(torch.zeros(2, 4), torch.zeros(3, 4, dtype=torch.float16), 2, CFG)
    with pytest.raises(ConfigError, match="splits"):
        splitk_linear(torch.zeros(2, 4), torch.zeros(3, 4), 0, CFG)
    with pytest.raises(ConfigError, match="contiguous"):
        splitk_linear(torch.zeros(4, 2).t(), torch.zeros(3, 4), 2, CFG)
    with pytest.raises(ConfigError, match="out must be"):
        splitk_linear(torch.zeros(2, 4), torch.zeros(3, 4), 2, CFG, out=torch.zeros(2, 2, 4))
    with pytest.raises(ConfigError, match="power of two"):
        SplitKConfig(block_n=24)


def test_split_choice_by_hand(monkeypatch):
    """Default tiles of 64 columns, 64 programs wanted: N = 1024 gives 16 tiles -> 4 splits;
    N = 320 (5 tiles) -> 13, capped at 8; K = 512 allows only 2 chunks of 256; N = 4096
    (64 tiles) is not split; a shape in the measured table takes its entry."""
    monkeypatch.setattr(sk, "SPLITK_CONFIGS", {})
    monkeypatch.setattr(sk, "SPLITK_SPLITS", {(1024, 2048): 3})
    assert splitk_splits(1024, 3072) == 4
    assert splitk_splits(320, 4096) == 8
    assert splitk_splits(1024, 512) == 2
    assert splitk_splits(2048, 2048) == 2
    assert splitk_splits(4096, 1024) == 1
    assert splitk_splits(64, 128) == 1  # a chunk would be under 256 columns
    assert splitk_splits(1024, 2048) == 3


def test_wide_split_choice_by_hand(monkeypatch):
    """The gate/up rule (``SPLITK_WIDE_MIN_PROGRAMS`` = 256 programs a row tile, 64-column
    tiles): 6144 x 1024 has 96 tiles -> 3 splits; 4096 x 1024 64 tiles -> 4; K = 512 caps at 2
    chunks of 256; a table entry wins."""
    monkeypatch.setattr(sk, "SPLITK_CONFIGS", {})
    monkeypatch.setattr(sk, "SPLITK_SPLITS", {})
    assert sk.SPLITK_WIDE_MIN_PROGRAMS == 256
    assert splitk_splits(6144, 1024, 256) == 3
    assert splitk_splits(4096, 1024, 256) == 4
    assert splitk_splits(6144, 512, 256) == 2
    assert splitk_splits(16384, 1024, 256) == 1
    monkeypatch.setattr(sk, "SPLITK_SPLITS", {(6144, 1024): 2})
    assert splitk_splits(6144, 1024, 256) == 2


def test_gate_up_split_is_off_by_default_and_cpu_takes_the_product(monkeypatch):
    """``SPLITK_GATE_UP_ENABLED`` is off (not measured end to end); off CUDA, or with a bias,
    ``gate_up_partials`` declines and ``gate_up_silu`` is ``silu_and_mul(F.linear(...))``."""
    from pagedkv.kernels.activation import silu_and_mul
    from pagedkv.models.layers import gate_up_silu

    assert sk.SPLITK_GATE_UP_ENABLED is False
    monkeypatch.setattr(sk, "SPLITK_GATE_UP_ENABLED", True)
    x, w = torch.randn(5, 64), torch.randn(48, 64)
    assert sk.gate_up_partials(x, w) is None
    torch.testing.assert_close(gate_up_silu(x, w),
                               silu_and_mul(torch.nn.functional.linear(x, w)))
    b = torch.randn(48)
    torch.testing.assert_close(gate_up_silu(x, w, b),
                               silu_and_mul(torch.nn.functional.linear(x, w, b)))


def test_gate_up_pieces_compose_interpreted():
    """What ``gate_up_silu`` runs on CUDA, interpreted: the split-K partials of ``x @ w^T``
    through the activation's partials kernel equal the activation of the float32 product."""
    from pagedkv.kernels.activation import silu_and_mul_partials, silu_and_mul_ref

    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(6, 96, generator=g), torch.randn(40, 96, generator=g) * 0.2
    parts = splitk_linear(x, w, 3, CFG)
    got = silu_and_mul_partials(parts, torch.float32)
    torch.testing.assert_close(got, silu_and_mul_ref(x @ w.T), atol=1e-5, rtol=1e-5)


def test_linear_partials_off_cuda_is_linear():
    """Off CUDA (and for prefill-sized batches) the plain product in the input's dtype."""
    x = torch.randn(5, 64, dtype=torch.float16)
    w = torch.randn(32, 64, dtype=torch.float16)
    b = torch.randn(32, dtype=torch.float16)
    got = linear_partials(x, w, b)
    assert got.dtype == torch.float16
    assert torch.equal(got, torch.nn.functional.linear(x, w, b))


def test_custom_op_off_cuda_is_the_twin():
    x, w = torch.randn(3, 64), torch.randn(8, 64)
    torch.testing.assert_close(splitk_linear_op(x, w, 2), splitk_linear_ref(x, w, 2))


# ---- native GPU


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8, 64, 200, 256])
@pytest.mark.parametrize("N,K", [(1024, 2048), (1024, 3072), (4096, 1024)])
def test_gpu_decode_shapes_bf16(M, N, K):
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
    S = splitk_splits(N, K)
    out = torch.full((S, M, N), float("nan"), device="cuda")
    got = splitk_linear(x, w, S, sk.splitk_config_for(N, K), out=out)
    ref = x.double() @ w.double().T
    err = float((got.sum(0).double() - ref).norm() / ref.norm())
    assert err < 1e-5, err  # float32 products of bf16 inputs: the sum is near exact
    assert torch.equal(splitk_linear_op(x, w, S), got)


def test_split_k_is_on_by_default():
    """The engine's default decode path for narrow projections is split-K on CUDA
    (``SPLITK_ENABLED``: see its comment)."""
    assert sk.SPLITK_ENABLED is True


@pytest.mark.gpu
def test_gpu_residual_in_compiled_region_and_graph(monkeypatch):
    """With split-K on: ``hidden + o_proj(x)`` through ``linear_partials`` compiled (dynamic
    rows), against the eager split-K path and the float64 product; then replayed in a CUDA
    graph with new inputs."""
    from pagedkv.models.decoder import residual_add

    monkeypatch.setattr(sk, "SPLITK_ENABLED", True)

    torch.manual_seed(0)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) * 0.02

    def f(h, x):
        return residual_add(h, linear_partials(x, w))

    cf = torch.compile(f)
    for m in (3, 64, 128, 300):  # 300: past SPLITK_MAX_ROWS, cuBLAS
        h = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(h, 0)
        torch._dynamo.mark_dynamic(x, 0)
        got, eager = cf(h, x), f(h, x)
        ref = h.double() + x.double() @ w.double().T
        assert got.dtype == torch.bfloat16
        for y in (got, eager):
            assert float((y.double() - ref).norm() / ref.norm()) < 4e-3
        if m <= sk.SPLITK_MAX_ROWS:
            torch.testing.assert_close(got, eager, atol=2e-2, rtol=1e-2)
    h = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    cf(h, x)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        y = cf(h, x)
    for seed in range(3):
        torch.manual_seed(seed + 1)
        h.copy_(torch.randn_like(h))
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.testing.assert_close(y, cf(h, x), atol=0, rtol=0)


@pytest.mark.gpu
def test_gpu_gate_up_silu_in_compiled_region_and_graph(monkeypatch):
    """With the gate/up split on: ``gate_up_silu`` (split-K partials of 6144 x 1024, summed by
    the activation kernel) compiled with dynamic rows against the float64 expression, cuBLAS
    past ``SPLITK_MAX_ROWS``; then one CUDA-graph replay with new inputs."""
    from pagedkv.models.layers import gate_up_silu

    monkeypatch.setattr(sk, "SPLITK_GATE_UP_ENABLED", True)
    torch.manual_seed(0)
    w = torch.randn(6144, 1024, device="cuda", dtype=torch.bfloat16) * 0.03

    def expect(x):
        g, u = (x.double() @ w.double().T).chunk(2, dim=-1)
        return g * torch.sigmoid(g) * u

    cf = torch.compile(gate_up_silu)
    for m in (3, 64, 128, 300):
        x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16)
        torch._dynamo.mark_dynamic(x, 0)
        if m <= sk.SPLITK_MAX_ROWS:
            assert sk.gate_up_partials(x, w) is not None
        for y in (cf(x, w), gate_up_silu(x, w)):
            assert y.dtype == torch.bfloat16 and y.shape == (m, 3072)
            ref = expect(x)
            assert float((y.double() - ref).norm() / ref.norm()) < 1e-2
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    out = cf(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cf(x, w)
    x.copy_(torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    ref = expect(x)
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.skipif(not __import__("triton").__version__.startswith("3.6."),
                    reason="compiled with the Triton version the H200 runs (3.6)")
def test_splitk_launch_compiles_for_sm90_pipelined_without_spills():
    """The default split-K launch compiles for the H200 (sm_90 on the CPU, a fresh process
    without TRITON_INTERPRET) as one software-pipelined loop (copies in flight while the
    product runs: an async wait with num > 0), no spills, at least two programs a
    multiprocessor."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "pagedkv.tools.sm90_report", "splitk",
                          "--json"], capture_output=True, text=True, env=env, timeout=600,
                         cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["loops"] == 1 and rep["local"] == 0 and rep["waits"][0] > 0, rep
    assert rep["programs_per_sm"] >= 2, rep
