#!/usr/bin/env bash
# One GPU call (device machine: torch 2.11, triton 3.6, nothing installable): native kernel
# tests, worker tests on CUDA, then the index-building benchmark. Writes logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/gpu.txt"
echo "== native GPU tests"
python3 -m pytest -q -p no:cacheprovider tests/kernels tests/worker -m "not slow" 2>&1 | tee "$OUT/pytest_gpu.log" | tail -25
echo "== index-building benchmark"
python3 bench/bench_index_gpu.py --out "$OUT/bench_index_gpu.json" 2>&1 | tee "$OUT/bench_index_gpu.log" | tail -40
