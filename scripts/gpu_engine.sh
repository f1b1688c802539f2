#!/usr/bin/env bash
# One GPU call for the engine (device machine: torch 2.11, triton 3.6, transformers 5.17;
# installs nothing): workload W1 on the Qwen3-0.6B shape (async scheduling + compiled regions,
# falling back to the plain serial engine if that run fails; W1_ARGS=--with-hf adds transformers'
# generate_batch on the same prompts), then the engine GPU tests
# (graph replay vs eager, async vs sync, compiled vs eager, Triton parity, profiled sizing).
# Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/env.txt"
echo "== W1"
timeout ${W1_TIMEOUT:-240} python3 bench/bench_w1.py ${W1_ARGS:-} --json "$OUT/w1.json" 2>&1 | tee "$OUT/w1.log" | tail -30
if [ "${PIPESTATUS[0]}" != 0 ]; then
  echo "== W1 fallback: serial, eager regions"
  timeout ${W1_TIMEOUT:-240} python3 bench/bench_w1.py --no-async-scheduling --no-compile-model \
    --json "$OUT/w1_serial.json" 2>&1 | tee "$OUT/w1_serial.log" | tail -30
fi
echo "== engine GPU tests"
timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/engine 2>&1 | tee "$OUT/engine_gpu_pytest.log" | tail -25
