#!/usr/bin/env bash
# The nvidia-cudnn-frontend wheel for the device's Python (3.12), into .whl/cudnn_fe, to carry
# (gpu_suite.sh and the benches install it into a side directory; nothing is downloaded there).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl/cudnn_fe
python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
  "nvidia-cudnn-frontend==${CUDNN_FE_VERSION:-1.32.0}" -d .whl/cudnn_fe
ls -la .whl/cudnn_fe
