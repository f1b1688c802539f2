#!/usr/bin/env bash
# One GPU call for issue 10's H200 record (device machine: torch 2.11, triton 3.6,
# transformers 5.17; installs nothing): SWA and MLA decode bandwidth against the bytes read
# (bench/bench_swa_mla_decode_gpu.py), W1 on the Qwen3-0.6B shape with LLM defaults, and
# W1-style throughput for the Gemma-3-1B and DeepSeek-V2-Lite shapes with transformers'
# generate_batch in the same run. Logs and JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null; } | tee "$OUT/env.txt"
echo "== SWA / MLA decode bandwidth"
timeout ${BW_TIMEOUT:-150} python3 bench/bench_swa_mla_decode_gpu.py --out "$OUT/swa_mla_decode.json" 2>&1 \
  | grep -v -i warn | tee "$OUT/swa_mla_decode.log" | tail -30
echo "== W1 qwen3-0.6b (defaults)"
timeout ${W1_TIMEOUT:-150} python3 bench/bench_w1.py --json "$OUT/w1_qwen3.json" 2>&1 | grep -v -i warn \
  | tee "$OUT/w1_qwen3.log" | tail -8
for shape in ${SHAPES:-gemma-3-1b deepseek-v2-lite}; do
  echo "== W1-style $shape (+ transformers)"
  timeout ${SHAPE_TIMEOUT:-200} python3 bench/bench_w1.py --shape $shape ${SHAPE_ARGS:---with-hf} \
    --json "$OUT/w1_$shape.json" 2>&1 | grep -v -i warn | tee "$OUT/w1_$shape.log" | tail -12
done
