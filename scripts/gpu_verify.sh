#!/usr/bin/env bash
# One GPU call for the issue's proof items (device machine: torch 2.11, triton 3.6,
# transformers 5.17; installs nothing): the decode/prefill attention anchors with config and
# split variants, the bf16 engine parity test, W1 in both harnesses on the same machine lease
# (so the harness difference is separated from lease variance), then the GPU tests named in
# TESTS. Options (environment): SKIP_ATTN_BENCH, SKIP_W1, SKIP_PARITY, MIXED='<args of
# bench_decode_mixed.py>', SPLIT_COST=1, W1_ARGS (e.g. '--with-hf --repeat 3'), PROF_ARGS, TESTS,
# TEST_MARK, ATTN_ARGS (default --sweep), WAVES='<args of bench_decode_waves.py>', *_TIMEOUT.
# Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader | tee "$OUT/env.txt"
lscpu | grep -m1 "Model name" | tee -a "$OUT/env.txt"
git rev-parse HEAD 2>/dev/null | tee -a "$OUT/env.txt"
if [ -z "${SKIP_ATTN_BENCH:-}" ]; then
  echo "== attention anchors (sweep)"
  timeout ${ATTN_TIMEOUT:-150} python3 bench/bench_attention_gpu.py ${ATTN_ARGS:---sweep} --out "$OUT/attention_gpu.json" \
    2>&1 | tee "$OUT/attention_gpu.log" | tail -32
fi
if [ -n "${MIXED:-}" ]; then
  echo "== decode attention on mixed lengths"
  timeout ${MIXED_TIMEOUT:-150} python3 bench/bench_decode_mixed.py $MIXED --out "$OUT/decode_mixed.json" \
    2>&1 | tee "$OUT/decode_mixed.log" | tail -24
fi
if [ -n "${WAVES:-}" ]; then
  echo "== decode launch shapes vs one wave"
  timeout ${WAVES_TIMEOUT:-150} python3 bench/bench_decode_waves.py $WAVES --out "$OUT/decode_waves.json" \
    2>&1 | grep -v -i warn | tee "$OUT/decode_waves.log" | tail -40
fi
if [ -n "${SPLIT_COST:-}" ]; then
  echo "== decode split cost (split kernel and reduce apart)"
  timeout ${SPLIT_COST_TIMEOUT:-120} python3 bench/bench_decode_split_cost.py --out "$OUT/decode_split_cost.json" \
    2>&1 | tee "$OUT/decode_split_cost.log" | tail -24
fi
if [ -z "${SKIP_W1:-}" ]; then
  echo "== W1 official harness"
  timeout ${W1_TIMEOUT:-150} python3 bench/bench_w1.py ${W1_ARGS:-} --json "$OUT/w1.json" 2>&1 | grep -v -i warn \
    | tee "$OUT/w1.log" | tail -16
  echo "== W1 engine-loop timeline (same lease)"
  timeout ${W1_TIMEOUT:-150} python3 bench/profile_w1_gpu.py --out "$OUT/prof" ${PROF_ARGS:---skip-profile} \
    2>&1 | grep -v -i "warn" | tee "$OUT/profile_w1.log" | tail -${PROF_TAIL:-12}
fi
if [ -z "${SKIP_PARITY:-}" ]; then
  echo "== bf16 engine parity vs transformers"
  timeout ${PARITY_TIMEOUT:-150} python3 -m pytest -q -s -p no:cacheprovider -m gpu \
    "tests/engine/test_engine_gpu.py::test_qwen3_0_6b_shape_bf16_engine_matches_transformers" \
    2>&1 | grep -v -i warn | tee "$OUT/engine_bf16_parity.log" | tail -8
fi
if [ -n "${TESTS:-}" ]; then
  echo "== GPU tests: $TESTS"
  timeout ${TEST_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -m "${TEST_MARK:-gpu}" --durations=8 $TESTS \
    2>&1 | tee "$OUT/gpu_pytest.log" | tail -20
fi
