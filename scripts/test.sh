#!/usr/bin/env bash
# Installs what the tests need (scripts/setup.sh), then runs the whole suite.
# GPU-only tests (marked `gpu`) are skipped without CUDA; Triton kernels run through the
# Triton interpreter on CPU-only machines. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 -p no:cacheprovider "$@"
