#!/usr/bin/env bash
# One GPU call: A/B of the serving front. Offline W1 (pagedkv bench), then for each variant -
# BASE_ROOT (default .whl/base: a copy of the pagedkv package from before the front changes,
# made here with `mkdir -p .whl/base && git archive 38bc849 pagedkv | tar -x -C .whl/base` and
# carried: run with carry [".whl"]) and this tree - `pagedkv serve --shape qwen3-0.6b` and
# ROUNDS x `pagedkv bench serve --request-rate inf` (W1 all at once; the same client code for
# both), with the front process's CPU seconds per round (/proc/PID/stat) and the client's.
# Needs fastapi/uvicorn as wheels in .whl/serve when the machine lacks them (serve_wheels.sh).
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/wait_server.sh
. scripts/wait_server.sh
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=""
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${SERVE_WHEELS:-.whl/serve}"/*.whl || exit 1
  SITE=/tmp/site:
fi
PORT=${PORT:-8011}
ROUNDS=${ROUNDS:-3}
BASE_ROOT=${BASE_ROOT:-$PWD/.whl/base}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/env.txt"
if [ -z "${SKIP_OFFLINE:-}" ]; then
  echo "== offline W1"
  PYTHONPATH=$SITE$PWD timeout 300 python3 -m pagedkv bench --quiet --json "$OUT/w1_offline.json" 2>&1 | tail -4
fi
cpu_s() { awk '{print ($14 + $15) / 100}' "/proc/$1/stat"; }
for variant in ${VARIANTS:-base new}; do
  root=$PWD; [ "$variant" = base ] && root=$BASE_ROOT
  echo "== server $variant ($root)"
  PYTHONPATH=$SITE$root python3 -m pagedkv serve --shape qwen3-0.6b --max-model-len 4096 \
    --port "$PORT" --log-level warning > "$OUT/server_$variant.log" 2>&1 &
  SERVER=$!
  wait_server "$PORT" "$SERVER" "$OUT/server_$variant.log"
  for r in $(seq 1 "$ROUNDS"); do
    c0=$(cpu_s $SERVER)
    PYTHONPATH=$SITE$PWD python3 - "$PORT" "$OUT/serve_${variant}_$r.json" <<'PY'
import resource, subprocess, sys
port, out = sys.argv[1], sys.argv[2]
p = subprocess.run([sys.executable, "-m", "pagedkv", "bench", "serve", "--base-url",
                    f"http://127.0.0.1:{port}", "--request-rate", "inf", "--json", out],
                   capture_output=True, text=True, timeout=240)
print("\n".join(p.stdout.strip().splitlines()[-6:]))
ru = resource.getrusage(resource.RUSAGE_CHILDREN)
print(f"client CPU {ru.ru_utime + ru.ru_stime:.2f} s")
PY
    c1=$(cpu_s $SERVER)
    echo "front CPU $(echo "$c1 - $c0" | bc 2>/dev/null || python3 -c "print($c1 - $c0)") s"
  done
  kill -TERM $SERVER; wait $SERVER; echo "server $variant exit status $?"
done
