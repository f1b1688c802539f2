#!/usr/bin/env bash
# Builds .whl/tf524 (git-ignored): transformers 5.24 and the wheels it needs beyond the device's
# own packages, for `TRANSFORMERS_WHEELS=.whl/tf524 bash scripts/gpu_suite.sh` (carry the
# folder: run(carry=[".whl/tf524"])). huggingface_hub stays on 1.x: 2.x imports httpx2, which
# the device does not have (eleventh session: the carried 2.4 did not import there).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh >/dev/null
rm -rf .whl/tf524 && mkdir -p .whl/tf524
.venv/bin/python -m pip download -q --no-deps -d .whl/tf524 transformers==5.24.0 \
  "tokenizers>=0.23.1,<0.24" "safetensors>=0.8" "huggingface_hub>=1.31,<2" 2>&1 | grep -v "^WARNING: Location" || true
ls .whl/tf524
