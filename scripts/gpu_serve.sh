#!/usr/bin/env bash
# One GPU call for the serving benchmark (issue 11): offline W1 with LLM defaults on the
# Qwen3-0.6B shape, then `pagedkv serve --shape qwen3-0.6b` (same defaults, random weights,
# synthetic word-level tokenizer) and `pagedkv bench serve` replaying W1's prompts as streamed
# completions at 4, 16, 64 req/s (Poisson) and all at once; SIGTERM ends the server (exit 0
# expected); SERVE_ARGS adds server flags, SKIP_OFFLINE=1 skips the offline run. Needs fastapi/uvicorn/pydantic: carried as wheels in .whl/ when the machine lacks
# them (the device image has no fastapi): `bash scripts/serve_wheels.sh` builds .whl/serve. Results under $OUT; summary.json has the ratios.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/wait_server.sh
. scripts/wait_server.sh
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import fastapi, uvicorn" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${SERVE_WHEELS:-.whl/serve}"/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
# the carried cuDNN frontend (the engine's default prefill where it imports): scripts/cudnn_path.sh
# shellcheck source=scripts/cudnn_path.sh
. scripts/cudnn_path.sh; cudnn_path > "$OUT/cudnn.txt" 2>&1; cat "$OUT/cudnn.txt"
PORT=${PORT:-8011}
RATES=${RATES:-"4 16 64 inf"}
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader
  python3 -c "import torch, triton, fastapi, uvicorn; print('torch', torch.__version__, 'triton', triton.__version__, 'fastapi', fastapi.__version__, 'uvicorn', uvicorn.__version__)"
  git rev-parse HEAD 2>/dev/null; } | tee "$OUT/env.txt"
if [ -z "${SKIP_OFFLINE:-}" ]; then
  echo "== offline W1 (pagedkv bench, defaults)"
  timeout 300 python3 -m pagedkv bench --quiet --json "$OUT/w1_offline.json" 2>&1 | tail -15
fi
echo "== server"
# SERVE_ARGS: extra server flags (an A/B run, e.g. --no-mixed-cuda-graphs)
# shellcheck disable=SC2086
python3 -m pagedkv serve --shape qwen3-0.6b --max-model-len 4096 --port "$PORT" \
  --log-level warning ${SERVE_ARGS:-} > "$OUT/server.log" 2>&1 &
SERVER=$!
wait_server "$PORT" "$SERVER" "$OUT/server.log"
for rate in $RATES; do
  echo "== bench serve --request-rate $rate"
  timeout 240 python3 -m pagedkv bench serve --base-url "http://127.0.0.1:$PORT" \
    --request-rate "$rate" --json "$OUT/serve_$rate.json" 2>&1 | tail -14
done
curl -s "http://127.0.0.1:$PORT/metrics" | grep -E "^pagedkv:(num_preemptions|prompt_tokens|generation_tokens|request_success)" | head -12
kill -TERM $SERVER; wait $SERVER; echo "server exit status $?" | tee -a "$OUT/env.txt"
python3 - "$OUT" <<'PY'
import json, os, sys
out = sys.argv[1]
path = os.path.join(out, "w1_offline.json")
off = json.load(open(path))["result"] if os.path.exists(path) else {}
rows = {"offline_output_tok_s": off.get("output_tokens_per_s") or off.get("output_throughput")}
for name in sorted(os.listdir(out)):
    if name.startswith("serve_") and name.endswith(".json"):
        r = json.load(open(os.path.join(out, name)))["result"]
        rows[name[6:-5]] = {k: r[k] for k in ("completed", "failed", "wall_s", "request_throughput",
                                              "output_throughput", "ttft_ms", "itl_ms", "e2e_ms")}
        if rows["offline_output_tok_s"]:
            rows[name[6:-5]]["ratio_to_offline"] = r["output_throughput"] / rows["offline_output_tok_s"]
json.dump(rows, open(os.path.join(out, "summary.json"), "w"), indent=1)
print(json.dumps(rows, indent=1))
PY
