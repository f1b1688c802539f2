#!/usr/bin/env bash
# One GPU call for the engine (device machine: torch 2.11, triton 3.6, transformers 5.17;
# installs nothing): engine GPU tests (graph replay vs eager, Triton parity, profiled sizing),
# then workload W1 on the Qwen3-0.6B shape. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
echo "== engine GPU tests"
timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -x -m "gpu and not slow" tests/engine/test_engine_gpu.py 2>&1 | tee "$OUT/engine_gpu_pytest.log" | tail -25
echo "== W1"
timeout ${W1_TIMEOUT:-270} python3 bench/bench_w1.py --json "$OUT/w1.json" 2>&1 | tee "$OUT/w1.log" | tail -40
