"""The greedy argmax kernels (``pagedkv.kernels.argmax``) against torch's argmax: by hand
(ties, NaN, signed zeros, infinities), on random poisoned rows (interpreted on CPU, native on
the GPU), by a property test over values drawn from a tiny set (ties everywhere), and the
argument checks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedkv.errors import ConfigError
from pagedkv.kernels.argmax import _BLOCK, greedy_argmax, greedy_argmax_ref, num_chunks

NAN, INF = float("nan"), float("inf")


def test_by_hand_first_maximum_nan_signed_zero_and_infinities():
    rows = [
        [1.0, 3.0, 3.0, 2.0],          # tie: the first 3 -> 1
        [-5.0, -1.0, -2.0, -1.0],      # all negative, tie -> 1
        [0.0, -0.0, -1.0, -0.0],       # +0 and -0 are equal -> 0
        [-0.0, 0.0, -1.0, -2.0],       # -> 0 (the first zero, whatever its sign)
        [1.0, NAN, INF, NAN],          # NaN above everything, the first NaN -> 1
        [-INF, -INF, -INF, -INF],      # all -inf -> 0
        [-INF, INF, 5.0, INF],         # -> 1
        [2.0, 1.0, 0.0, -1.0],         # -> 0
    ]
    want = [1, 1, 0, 0, 1, 0, 1, 0]
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        x = torch.tensor(rows, dtype=dtype)
        assert greedy_argmax(x).tolist() == want, dtype
        assert greedy_argmax_ref(x).tolist() == want, dtype


def test_num_chunks():
    # sixteen programs a multiprocessor, at most one chunk per tile, at most 256
    assert num_chunks(256, 151936, 132) == 9  # cdiv(16 x 132, 256)
    assert num_chunks(64, 151936, 132) == 33
    assert num_chunks(1, 151936, 132) == 149  # cdiv(151936, 1024) = 149 tiles
    assert num_chunks(1, 100, 132) == 1
    assert num_chunks(4, 3000, 4) == 3


def _poisoned(rows, cols, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * 4
    # planted ties at the row maximum, specials in some rows
    for r in range(rows):
        m = float(x[r].max()) + 1.0
        at = torch.randint(0, cols, (3,), generator=g).tolist()
        for i in at:
            x[r, i] = m
        if r % 4 == 1:
            x[r, torch.randint(0, cols, (1,), generator=g).item()] = NAN
        if r % 4 == 2:
            x[r, torch.randint(0, cols, (2,), generator=g).tolist()] = INF
        if r % 4 == 3:
            x[r] = -INF
            x[r, cols - 1] = -0.0
            x[r, cols // 2] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("rows,cols", [(1, 1), (3, 1023), (2, 2 * _BLOCK), (2, 3000),
                                       (5, 2 * _BLOCK + 7)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_poisoned_rows_match_torch(rows, cols, dtype):
    x = _poisoned(rows, cols, dtype, seed=rows * 1000 + cols)
    got = greedy_argmax(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert got.tolist() == greedy_argmax_ref(x).tolist()


def test_strided_rows_and_no_rows():
    base = _poisoned(4, 2500, torch.float32, seed=7)
    view = base[:, :2100]  # row stride 2500
    assert greedy_argmax(view).tolist() == view.argmax(-1).tolist()
    assert greedy_argmax(base[:0]).shape == (0,)


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_property_ties_everywhere(data):
    rows = data.draw(st.integers(1, 3))
    cols = data.draw(st.integers(1, 2300))
    pool = [-INF, -1.5, -0.0, 0.0, 0.5, 2.0, INF, NAN]
    weights = data.draw(st.lists(st.integers(0, 3), min_size=len(pool), max_size=len(pool)))
    if not any(weights):
        weights[3] = 1
    choices = [v for v, w in zip(pool, weights) for _ in range(w)]
    seed = data.draw(st.integers(0, 2 ** 16))
    g = torch.Generator().manual_seed(seed)
    pick = torch.randint(0, len(choices), (rows, cols), generator=g)
    x = torch.tensor(choices)[pick]
    want = x.argmax(-1).tolist()
    for r in range(rows):  # torch's own rule, spelled out
        vals = x[r].tolist()
        if any(math.isnan(v) for v in vals):
            assert want[r] == next(i for i, v in enumerate(vals) if math.isnan(v))
        else:
            assert want[r] == vals.index(max(vals))
    assert greedy_argmax(x).tolist() == want


def test_bad_arguments():
    with pytest.raises(ConfigError):
        greedy_argmax(torch.zeros(4))
    with pytest.raises(ConfigError):
        greedy_argmax(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ConfigError):
        greedy_argmax(torch.zeros(2, 0))
    with pytest.raises(ConfigError):
        greedy_argmax(torch.zeros(4, 3).t())  # columns not contiguous


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 7, 64, 256])
def test_model_shape_on_gpu(rows):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = _poisoned(rows, 151936, torch.float32, seed=rows).to("cuda", torch.bfloat16)
    assert greedy_argmax(x).tolist() == x.argmax(-1).tolist()
    y = torch.randn(rows, 151936, device="cuda", dtype=torch.bfloat16)
    assert greedy_argmax(y).tolist() == y.argmax(-1).tolist()


def test_argmax_rows_takes_torch_on_the_cpu(monkeypatch):
    """An engine on the CPU (the runner's greedy path, the sampler's greedy rows) takes
    torch's argmax, never the kernels through the interpreter."""
    import pagedkv.kernels.argmax as mod

    def boom(_):
        raise AssertionError("the kernels ran for a CPU tensor")

    monkeypatch.setattr(mod, "greedy_argmax", boom)
    x = _poisoned(3, 500, torch.float32, seed=3)
    assert mod.argmax_rows(x).tolist() == x.argmax(-1).tolist()
    assert mod.argmax_rows(x.t()).tolist() == x.t().argmax(-1).tolist()  # any layout


@pytest.mark.gpu
def test_argmax_rows_on_gpu_any_layout():
    """On CUDA the kernels for the layouts they take, torch for the rest (never an error)."""
    import pagedkv.kernels.argmax as mod

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    x = _poisoned(6, 5000, torch.float32, seed=5).cuda()
    for t in (x, x.half(), x.t(), x[:, ::2], x[:0]):
        assert mod.argmax_rows(t).tolist() == t.argmax(-1).tolist()


@pytest.mark.skipif(not __import__("triton").__version__.startswith("3.6."),
                    reason="compiled with the Triton version the H200 runs (3.6)")
def test_kernels_compile_for_sm90_on_the_cpu():
    """Both kernels compile for the H200 (sm_90, Triton's bundled ptxas, no device; a fresh
    process without TRITON_INTERPRET): the interpreter runs what compiled Triton rejects (a
    non-constexpr global broke every greedy GPU engine test once), and neither spills."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    res = subprocess.run([sys.executable, "-m", "pagedkv.tools.sm90_report", "argmax", "--json",
                          "--sass"], capture_output=True, text=True, env=env, timeout=600,
                         cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    rep = json.loads(res.stdout.strip().splitlines()[-1])
    assert rep["loops"] == 1 and rep["local"] == 0 and rep["reduce"]["local"] == 0, rep
    # the loop over whole tiles loads 16-byte vectors (one a thread a tile of 1,024 bf16);
    # the masked tail's 2-byte loads run once (a mask on the row length in the loop made
    # every load a 2-byte one: ~40% of copy bandwidth on the H200)
    loads = rep["sass_loads"]
    assert loads.get("LDG.E.128", 0) == 1 and set(loads) <= {"LDG.E.128", "LDG.E.U16"}, loads
