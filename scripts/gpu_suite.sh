#!/usr/bin/env bash
# The whole GPU-marked suite on the device in one call (installs nothing), in two groups run
# with 4 workers each; the non-fast-path W1 variant test alone; tests that failed, again alone. Logs under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/pagedkv-gpu-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# TRANSFORMERS_WHEELS=DIR (scripts/transformers_wheels.sh builds .whl/tf524): a newer transformers (and its wheels) carried
# to the device, installed into a side directory (nothing downloaded) and put first on the path
# when it imports; otherwise the device's own transformers is used.
if [ -n "${TRANSFORMERS_WHEELS:-}" ]; then
  side=${TMPDIR:-/tmp}/pagedkv-transformers
  rm -rf "$side"; python3 -m pip install -q --no-index --no-deps --target "$side" "$TRANSFORMERS_WHEELS"/*.whl \
    && PYTHONPATH=$side:$PYTHONPATH python3 -c "import transformers; transformers.AutoConfig" \
    && export PYTHONPATH=$side:$PYTHONPATH || echo "carried transformers did not import: using the device's"
fi
# The carried cuDNN frontend (cuDNN's paged attention tests need it): scripts/cudnn_path.sh
# shellcheck source=scripts/cudnn_path.sh
. scripts/cudnn_path.sh; cudnn_path
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  cat COMMIT 2>/dev/null; } | tee "$OUT/env.txt"
# -v names every result as it lands and SIGINT at the limit lets pytest print its summary, so a
# cut run still says which test failed.
# SUITE_GROUPS: which groups run ("kernels engine" by default; "engine" alone for a quick check)
groups=${SUITE_GROUPS:-kernels engine}
[[ " $groups " == *" kernels "* ]] && timeout -s INT -k 20 ${T1:-280} python3 -m pytest -v -p no:cacheprovider -m gpu -n 4 tests/kernels tests/attention \
  tests/sampling tests/worker tests/models tests/core tests/property -rfE > "$OUT/suite_kernels_models.log" 2>&1 \
  ; [[ " $groups " == *" kernels "* ]] && tail -12 "$OUT/suite_kernels_models.log"
[[ " $groups " == *" engine "* ]] && timeout -s INT -k 20 ${T2:-280} python3 -m pytest -v -p no:cacheprovider -m gpu -n 4 tests/engine tests/entrypoints \
  tests/conformance tests/distributed tests/test_sanitizer.py -k "not test_qwen3_0_6b_shape_w1_variant" -rfE \
  > "$OUT/suite_engine.log" 2>&1; [[ " $groups " == *" engine "* ]] && tail -12 "$OUT/suite_engine.log"
# A test that failed under the 4 workers is run again alone, one process, one test at a time
# (T3 seconds in all, default 150; RERUN=0 skips): the log then tells a failure that needs the
# load (seen in the twenty-first and twenty-second sessions) from one that does not.
# (from the summary's "FAILED id" lines and from -v's "[gwN] [ p%] FAILED id" lines: a group
# whose pytest hangs at exit, as one did in inductor's compile-worker shutdown in the
# twenty-fourth session, prints no summary)
failed=$(cat "$OUT"/suite_*.log 2>/dev/null | grep -oE '(^|\] )(FAILED|ERROR) tests/[^ ]*' \
  | sed -E 's/.*(FAILED|ERROR) //' | sort -u)
if [ -n "$failed" ] && [ "${RERUN:-1}" != 0 ]; then
  echo "== the failed tests again, alone" | tee "$OUT/suite_reruns.log"
  end=$(( $(date +%s) + ${T3:-150} ))
  for t in $failed; do
    left=$(( end - $(date +%s) ))
    [ "$left" -le 5 ] && { echo "no time left for $t" | tee -a "$OUT/suite_reruns.log"; continue; }
    timeout -s INT -k 10 "$left" python3 -m pytest -q -p no:cacheprovider -m gpu "$t" -rfE \
      > "$OUT/rerun.log" 2>&1
    echo "$t alone: $(tail -1 "$OUT/rerun.log")" | tee -a "$OUT/suite_reruns.log"
    grep -E "^E  |first flip" "$OUT/rerun.log" | head -8 >> "$OUT/suite_reruns.log"
  done
  rm -f "$OUT/rerun.log"
fi
