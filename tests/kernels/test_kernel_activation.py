"""The SiLU-gated activation kernel (``pagedkv.kernels.activation``) against its torch twin, on
random inputs with poisoned outputs and strided rows; the custom op inside ``torch.compile``."""

import pytest
import torch

from pagedkv.errors import ConfigError
from pagedkv.kernels.activation import (
    silu_and_mul,
    silu_and_mul_op,
    silu_and_mul_partials,
    silu_and_mul_partials_op,
    silu_and_mul_partials_ref,
    silu_and_mul_ref,
)


def _expected(x):
    g, u = x.float().chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("rows,inter", [(1, 8), (5, 100), (3, 1030), (0, 16)])
def test_kernel_matches_reference_with_poisoned_output(dtype, rows, inter):
    g = torch.Generator().manual_seed(rows * 1000 + inter)
    base = torch.randn(rows, 2 * inter + 6, generator=g).to(dtype) * 3
    x = base[:, 3:3 + 2 * inter]  # row stride > width, offset start
    out = torch.full((rows, inter), float("nan"), dtype=dtype)
    got = silu_and_mul(x, out)
    assert got is out
    ref = silu_and_mul_ref(x)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(got.float(), _expected(x), **tol)
    assert not torch.isnan(got).any()


def test_hand_computed_values():
    x = torch.tensor([[0.0, 1.0, -2.0, 5.0, 7.0, 3.0]])  # gate [0, 1, -2], up [5, 7, 3]
    s = lambda v: v / (1 + torch.exp(torch.tensor(-v)))  # noqa: E731
    want = torch.tensor([[0.0, float(s(1.0)) * 7, float(s(-2.0)) * 3]])
    torch.testing.assert_close(silu_and_mul(x), want)
    torch.testing.assert_close(silu_and_mul_ref(x), want)


def test_argument_errors():
    with pytest.raises(ConfigError, match="2 \\* I"):
        silu_and_mul(torch.zeros(2, 3))
    with pytest.raises(ConfigError, match="bf16"):
        silu_and_mul(torch.zeros(2, 4, dtype=torch.int32))
    with pytest.raises(ConfigError, match="contiguous"):
        silu_and_mul(torch.zeros(4, 2).t())
    with pytest.raises(ConfigError, match="out must be"):
        silu_and_mul(torch.zeros(2, 4), torch.zeros(2, 3))


def test_custom_op_traces_under_torch_compile():
    def f(x):
        return silu_and_mul_op(x * 2) + 1

    x = torch.randn(7, 32)
    torch._dynamo.mark_dynamic(x, 0)
    got = torch.compile(f, backend="inductor")(x)
    torch.testing.assert_close(got, silu_and_mul_ref(x * 2) + 1)


def _expected_partials(parts):
    g, u = parts.double().sum(0).chunk(2, dim=-1)
    return g * torch.sigmoid(g) * u


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("splits,rows,inter", [(1, 3, 8), (2, 5, 100), (3, 2, 1030), (4, 1, 16),
                                               (3, 0, 16)])
def test_partials_kernel_matches_twin(dtype, splits, rows, inter):
    """Split-K partials ``[S, T, 2I]`` (strided rows and splits: a view into a wider buffer)
    summed in float32, then the activation, one rounding to ``dtype``: the kernel
    (interpreted) against the torch twin and the float64 expression. Every output row is
    written (the kernel allocates its output: no stale rows can pass)."""
    g = torch.Generator().manual_seed(splits * 100 + rows * 10 + inter)
    base = torch.randn(splits + 1, rows, 2 * inter + 6, generator=g) * 2
    parts = base[1:, :, 3:3 + 2 * inter]
    got = silu_and_mul_partials(parts, dtype)
    assert got.dtype == dtype and got.shape == (rows, inter)
    ref = silu_and_mul_partials_ref(parts, dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got, ref, **tol)
    torch.testing.assert_close(got.double(), _expected_partials(parts), **tol)
    assert not torch.isnan(got).any()


def test_partials_hand_computed():
    """Two partials of one row: gate [1, -2] = [0.5, -1.5] + [0.5, -0.5], up [4, 3]."""
    parts = torch.tensor([[[0.5, -1.5, 1.0, 1.0]], [[0.5, -0.5, 3.0, 2.0]]])
    s = lambda v: v / (1 + torch.exp(torch.tensor(-v)))  # noqa: E731
    want = torch.tensor([[float(s(1.0)) * 4, float(s(-2.0)) * 3]])
    torch.testing.assert_close(silu_and_mul_partials(parts, torch.float32), want)
    torch.testing.assert_close(silu_and_mul_partials_ref(parts, torch.float32), want)
    # one partial is the plain activation of it
    torch.testing.assert_close(silu_and_mul_partials(parts[:1], torch.float32),
                               silu_and_mul(parts[0]))


def test_partials_argument_errors():
    with pytest.raises(ConfigError, match="S >= 1"):
        silu_and_mul_partials(torch.zeros(2, 4), torch.float32)
    with pytest.raises(ConfigError, match="S >= 1"):
        silu_and_mul_partials(torch.zeros(2, 3, 5), torch.float32)
    with pytest.raises(ConfigError, match="float32"):
        silu_and_mul_partials(torch.zeros(2, 3, 4, dtype=torch.float16), torch.float16)
    with pytest.raises(ConfigError, match="contiguous"):
        silu_and_mul_partials(torch.zeros(2, 4, 3).transpose(1, 2), torch.float32)
    with pytest.raises(ConfigError, match="output dtype"):
        silu_and_mul_partials(torch.zeros(2, 3, 4), torch.int32)


def test_partials_custom_op_off_cuda_and_under_compile():
    parts = torch.randn(3, 7, 32)
    torch.testing.assert_close(silu_and_mul_partials_op(parts, torch.float16),
                               silu_and_mul_partials_ref(parts, torch.float16))

    def f(p):
        return silu_and_mul_partials_op(p * 2, torch.float32) + 1

    torch._dynamo.mark_dynamic(parts, 1)
    got = torch.compile(f, backend="inductor")(parts)
    torch.testing.assert_close(got, silu_and_mul_partials_ref(parts * 2, torch.float32) + 1)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 256, 8192])
def test_gpu_kernel_bf16(rows):
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 6144, generator=g, device="cuda", dtype=torch.bfloat16) * 3
    out = torch.full((rows, 3072), float("nan"), device="cuda", dtype=torch.bfloat16)
    silu_and_mul(x, out)
    torch.testing.assert_close(out.float(), _expected(x), atol=2e-2, rtol=1e-2)
    op = silu_and_mul_op(x)
    assert torch.equal(op, out)


@pytest.mark.gpu
def test_gpu_custom_op_in_compiled_region():
    def f(x):
        return silu_and_mul_op(x) * 2

    x = torch.randn(33, 256, device="cuda", dtype=torch.bfloat16)
    torch._dynamo.mark_dynamic(x, 0)
    got = torch.compile(f)(x)
    torch.testing.assert_close(got.float(), _expected(x) * 2, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,rows", [(1, 1), (3, 7), (3, 128), (4, 256)])
def test_gpu_partials_kernel(splits, rows):
    """Native: float32 partials of the gate/up width (6144) into bf16, against the float64
    expression; the custom op equals the function."""
    g = torch.Generator(device="cuda").manual_seed(splits * 1000 + rows)
    parts = torch.randn(splits, rows, 6144, generator=g, device="cuda") * 2
    got = silu_and_mul_partials(parts, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _expected_partials(parts), atol=2e-2, rtol=1e-2)
    assert torch.equal(silu_and_mul_partials_op(parts, torch.bfloat16), got)
