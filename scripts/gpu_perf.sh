#!/usr/bin/env bash
# One GPU call for engine speed work (device machine: torch 2.11, triton 3.6; installs nothing):
# native tests of the fused kernels and attention, a W1 timeline with host phases, the compile
# log and profiler windows (bench/profile_w1_gpu.py), then the engine GPU tests. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
echo "== kernel + attention GPU tests"
timeout ${KTEST_TIMEOUT:-300} python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/kernels/test_kernel_activation.py tests/kernels/test_kernel_qk_norm_rope_cache.py \
  tests/attention 2>&1 | tee "$OUT/kernel_gpu_pytest.log" | tail -6
echo "== W1 timeline, phases, profiler windows"
timeout ${W1_TIMEOUT:-300} python3 bench/profile_w1_gpu.py --out "$OUT/prof" --phases --log-compiles \
  --windows ${WINDOWS:-60:63,800:803} 2>&1 | grep -v -i "warn" | tee "$OUT/profile_w1.log" | tail -70
echo "== engine GPU tests"
timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -q -p no:cacheprovider -m "gpu and not slow" tests/engine \
  2>&1 | tee "$OUT/engine_gpu_pytest.log" | tail -6
