#!/usr/bin/env bash
# One GPU call for issue 12 / 13 numbers (installs nothing): the MLA decode variant sweep,
# cascade attention on W3's decode shape, W3 and W2 with LLM defaults, Bamba-9B and
# DeepSeek-V3.2 decode throughput with transformers in the same run. Logs/JSON under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
cat COMMIT 2>/dev/null | tee "$OUT/env.txt"
run() { local name=$1 t=$2; shift 2; echo "== $name"; timeout $t "$@" 2>&1 | grep -v -i warn | tee "$OUT/$name.log" | tail -${TAIL:-14}; }
[ -z "${SKIP_MLA:-}" ] && run mla_sweep 120 python3 bench/bench_swa_mla_decode_gpu.py --skip-swa --sweep --out "$OUT/mla_sweep.json"
[ -z "${SKIP_CASCADE:-}" ] && [ -f bench/bench_cascade_gpu.py ] && run cascade 90 python3 bench/bench_cascade_gpu.py --out "$OUT/cascade.json"
[ -z "${SKIP_W1:-}" ] && run w1 120 python3 bench/bench_w1.py --json "$OUT/w1.json"
[ -z "${SKIP_W3:-}" ] && run w3 120 python3 bench/bench_w1.py --workload w3 --json "$OUT/w3.json"
[ -z "${SKIP_W3:-}" ] && run w3_plain 120 python3 bench/bench_w1.py --workload w3 --no-cascade --json "$OUT/w3_plain.json"
[ -z "${SKIP_W2:-}" ] && run w2 150 python3 bench/bench_w1.py --workload w2 --json "$OUT/w2.json"
[ -z "${SKIP_MAMBA:-}" ] && run mamba2 150 python3 bench/bench_mamba2_decode.py --json "$OUT/mamba2_decode.json"
[ -z "${SKIP_DSV32:-}" ] && run dsv32 150 python3 bench/bench_dsv32_decode.py --batch 4 --json "$OUT/dsv32_decode.json"
