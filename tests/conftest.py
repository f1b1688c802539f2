"""Test configuration.

Without a CUDA GPU, Triton kernels run through the Triton interpreter: TRITON_INTERPRET=1
must be set before any kernel module is imported, so it is set here, at collection start.
With a GPU, kernels run natively (set PAGEDKV_FORCE_INTERPRET=1 to interpret anyway).
"""

import os
import subprocess
import sys

# One torch thread per test process: the suite runs on 2-core machines with 2 pytest workers,
# and two workers with all cores each oversubscribe the machine (measured: 1.4 s of work took
# 88-98 s with two processes, 3.2 s with one thread each). Subprocesses inherit the env.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA or os.environ.get("PAGEDKV_FORCE_INTERPRET") == "1":
    os.environ["TRITON_INTERPRET"] = "1"
    assert "pagedkv.kernels" not in sys.modules or not any(
        m.startswith("pagedkv.kernels.") for m in sys.modules
    ), "a kernel module was imported before TRITON_INTERPRET was set"

import pytest  # noqa: E402

# Conformance vectors (traces + vLLM 0.33.0's recorded answers), copied from shared/vectors.
VECTORS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def kernel_device() -> str:
    """Where kernel tests run: the GPU natively, else the CPU through the interpreter."""
    return "cuda" if HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


@pytest.fixture(scope="session")
def vectors_dir() -> str:
    return VECTORS


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory) -> str:
    """Where tiny checkpoints are built: $PAGEDKV_TEST_CACHE when set (reused across runs),
    else a session temporary directory."""
    return os.environ.get("PAGEDKV_TEST_CACHE") or str(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="session")
def tiny_dir(tiny_cache):
    """``tiny_dir(family, **TinySpec options) -> checkpoint path`` (built once)."""
    from pagedkv.models.tiny import build_tiny_checkpoint

    def make(family: str, **options) -> str:
        return build_tiny_checkpoint(family, tiny_cache, **options)

    return make


@pytest.fixture(scope="session")
def compiled_run():
    """``compiled_run(*args, timeout=600) -> str``: ``python *args`` (``"-c", code`` or ``"-m",
    module, ...``) in a subprocess without TRITON_INTERPRET (compiling a kernel for sm_90 needs
    no GPU), this checkout first on the path; asserts it succeeded and returns the last line
    of its output (the sm_90 reports print their JSON there)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

    def run(*args: str, timeout: int = 600) -> str:
        env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("TRITON_INTERPRET", None)
        res = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env,
                             timeout=timeout, cwd=root)
        assert res.returncode == 0, res.stderr[-3000:]
        return res.stdout.strip().splitlines()[-1]

    return run
