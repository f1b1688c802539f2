#!/usr/bin/env bash
# Runs the tests that launch Triton kernels under the NEWEST triton that pyproject.toml admits
# (`triton>=3.6`; TRITON_VERSION below), through the Triton interpreter on CPU. scripts/test.sh
# covers the oldest (3.6.0, in .venv), so CI checks both ends of the range.
#
# The venv (.venv-triton-$TRITON_VERSION, or $TRITON_VENV) is created if missing and filled
# only with what is missing: a second run just runs the tests. torch is the 2.13.0 CPU build
# (a plain `pip install torch` would pull a multi-GB CUDA build). pagedkv itself is not
# installed there: the tests import it from this checkout (PYTHONPATH).
# When a newer triton is released, raise TRITON_VERSION here (and fix the kernels, or narrow
# the range in pyproject.toml). Extra arguments go to pytest; PYTEST_WORKERS (default 2) sets
# the pytest-xdist worker count (0: one process).
set -euo pipefail
cd "$(dirname "$0")/.."
TRITON_VERSION=3.9.0
TORCH_VERSION=2.13.0
VENV=${TRITON_VENV:-.venv-triton-$TRITON_VERSION}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
VPY=$VENV/bin/python
if ! "$VPY" - "$TRITON_VERSION" "$TORCH_VERSION" 2>/dev/null <<'EOF'
import sys
import numpy, pytest, hypothesis, xdist, transformers, tokenizers, safetensors, xxhash, cbor2  # noqa
import torch, triton
sys.exit(triton.__version__ != sys.argv[1] or torch.__version__.split("+")[0] != sys.argv[2])
EOF
then
  "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  "$VPY" -m pip install -q "torch==$TORCH_VERSION" "triton==$TRITON_VERSION"
  "$VPY" -m pip install -q numpy "pytest>=8" "hypothesis>=6.100" "pytest-xdist>=3.5" \
    "transformers>=4.57" tokenizers safetensors xxhash cbor2
fi
"$VPY" -c 'import torch, triton; print(f"triton {triton.__version__}, torch {torch.__version__}")'
# Every Triton kernel runs in tests/kernels against its reference twin (random inputs), the
# attention kernels in tests/attention, the index kernels through the builders in tests/worker;
# the engine files run the fused kernels with model shapes (the rest of the suite launches only
# the slot-mapping and CSR kernels again). Without CUDA, tests/conftest.py sets
# TRITON_INTERPRET=1, so they run through the interpreter.
FILES=(
  tests/kernels
  tests/attention
  tests/worker
  tests/engine/test_compiled_regions.py
  tests/engine/test_model_runner.py
  tests/engine/test_engine_parity.py
)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$VPY" -m pytest -q -n "${PYTEST_WORKERS:-2}" -p no:cacheprovider "${FILES[@]}" "$@"
