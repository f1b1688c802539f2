#!/usr/bin/env bash
# A/B rounds of bench_w1.py in alternating processes, for the device (installs nothing).
#   AB_SPECS="w1|;w1|--decode-config few_waves=none;w3|--repeat 2 --mixed-cuda-graphs"
# runs each ';'-separated "workload|flags" spec in turn, ROUNDS rounds (default 2), each run
# under AB_T seconds (default 150). One line a run goes to $OUT/ab.txt: workload, flags,
# output tok/s (every timed run), start-up seconds, device memory after start-up; the JSON records go into one
# $OUT/ab_runs.tgz (the device returns at most 8 files a call).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
work=$(mktemp -d)
cat COMMIT 2>/dev/null | tee -a "$OUT/ab.txt"
IFS=';' read -r -a specs <<< "${AB_SPECS:?AB_SPECS=\"workload|flags;...\"}"
for i in $(seq 1 "${ROUNDS:-2}"); do
  for j in "${!specs[@]}"; do
    w=${specs[$j]%%|*}; f=${specs[$j]#*|}
    name=${w}_${j}_$i
    # shellcheck disable=SC2086
    timeout "${AB_T:-150}" python3 bench/bench_w1.py --workload "$w" $f --json "$work/$name.json" \
      > "$work/$name.log" 2>&1
    summary=$(python3 - "$work/$name.json" <<'EOF' 2>/dev/null || echo "failed: $(tail -c 300 "$work/$name.log" | tr '\n' ' ')"
import json, sys
r = json.load(open(sys.argv[1]))
rates = r.get("pagedkv_repeats_tok_s") or [r["pagedkv"]["output_tokens_per_s"]]
mem = r.get("device_memory_after_startup")
print(" / ".join(f"{x:,.0f}" for x in rates), "tok/s; start-up", round(r.get("startup_s", -1), 1), "s",
      f"; after start-up GiB allocated {mem['allocated'] / 2**30:.2f} reserved {mem['reserved'] / 2**30:.2f} "
      f"device used {mem['used_by_process_and_others'] / 2**30:.2f}" if mem else "")
EOF
)
    echo "round $i $w [$f]: $summary" | tee -a "$OUT/ab.txt"
  done
done
(cd "$work" && tar czf "$OUT/ab_runs.tgz" ./*.json ./*.log)
rm -rf "$work"
