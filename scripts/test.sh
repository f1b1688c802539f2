#!/usr/bin/env bash
# Installs what the tests need (scripts/setup.sh), then runs the whole suite.
# GPU-only tests (marked `gpu`) are skipped without CUDA; Triton kernels run through the
# Triton interpreter on CPU-only machines. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# one thread per worker: 2 workers on a 2-core machine (tests/conftest.py sets torch's too)
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
exec .venv/bin/python -m pytest -q -n 2 -p no:cacheprovider "$@"
