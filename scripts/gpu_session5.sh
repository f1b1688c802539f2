#!/usr/bin/env bash
# One GPU call for issue 13 (installs nothing): W1 and W3 step profiles (timeline + profiler
# windows by kernel class), the attention kernel table, FP8 KV-cache W1/W2. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cat COMMIT 2>/dev/null | tee "$OUT/env.txt"
run() { local name=$1 t=$2; shift 2; echo "== $name"; timeout $t "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.log" | tail -${TAIL:-40}; }
[ -z "${SKIP_PW1:-}" ] && run profile_w1 180 python3 bench/profile_w1_gpu.py --out "$OUT/prof_w1" --windows ${W1_WINDOWS:-4:7,60:63,400:403,800:803}
[ -z "${SKIP_PW3:-}" ] && run profile_w3 180 python3 bench/profile_w1_gpu.py --workload w3 --out "$OUT/prof_w3" --windows ${W3_WINDOWS:-4:7,40:43,150:153}
[ -z "${SKIP_ATTN:-}" ] && TAIL=30 run attention 120 python3 bench/bench_attention_gpu.py --out "$OUT/attention.json"
[ -z "${SKIP_FP8:-}" ] && TAIL=12 run w1_fp8 120 python3 bench/bench_w1.py --kv-cache-dtype fp8 --json "$OUT/w1_fp8.json"
[ -z "${SKIP_FP8:-}" ] && TAIL=12 run w2_fp8 150 python3 bench/bench_w1.py --workload w2 --kv-cache-dtype fp8 --json "$OUT/w2_fp8.json"
