"""Every Triton kernel of the package reads module globals only where compiled Triton allows
it: a plain int / float / bool / str global inside a ``@triton.jit`` function runs under the
interpreter (the CPU suite) but fails to compile on the GPU ("Cannot access global variable
... from within @jit'ed function"); such constants must be ``tl.constexpr(...)``. The
greedy argmax once shipped one and every greedy GPU engine test failed
(``bench/records/h200_session13_engine_group_9ef4fb8_constexpr_bug.log``)."""

import importlib
import pkgutil

import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

import pagedkv


def _kernels():
    for info in pkgutil.walk_packages(pagedkv.__path__, "pagedkv."):
        try:
            mod = importlib.import_module(info.name)
        except ModuleNotFoundError as e:
            # an optional third-party package a serving module needs (prometheus_client,
            # fastapi: absent from scripts/test_triton_versions.sh's venv); never a kernel's
            if (e.name or "").startswith("pagedkv") or info.name.startswith(
                    ("pagedkv.kernels", "pagedkv.attention", "pagedkv.models")):
                raise
            continue
        for name, obj in vars(mod).items():
            if isinstance(obj, (InterpretedFunction, JITFunction)) \
                    and obj.fn.__module__ == mod.__name__:
                yield f"{mod.__name__}.{name}", obj.fn


def _plain_globals(fn):
    return [(n, fn.__globals__[n]) for n in fn.__code__.co_names
            if n in fn.__globals__ and isinstance(fn.__globals__[n], (int, float, bool, str))
            and not isinstance(fn.__globals__[n], tl.constexpr)]


def test_kernels_read_no_plain_globals():
    kernels = dict(_kernels())
    assert len(kernels) >= 50 and "pagedkv.kernels.argmax._argmax_chunks_kernel" in kernels
    bad = {name: found for name, fn in kernels.items() if (found := _plain_globals(fn))}
    assert not bad, bad


def test_the_check_finds_a_plain_global():
    scope = {"LIMIT": 7, "BOUND": tl.constexpr(3)}
    exec("def k(x):\n    return x + LIMIT + BOUND\n", scope)
    assert _plain_globals(scope["k"]) == [("LIMIT", 7)]
