#!/usr/bin/env bash
# Builds .whl/serve (git-ignored): the HTTP server's packages the device image lacks (fastapi,
# starlette, pydantic + its compiled core for the device's CPython 3.12, uvicorn with its compiled
# loop and HTTP parser (uvloop, httptools), and their
# small pure-Python needs: typing-extensions >= 4.16 for pydantic, opentelemetry-api for fastapi), for `bash scripts/gpu_serve.sh` (carry the folder:
# run(carry=[".whl/serve"])). The device has anyio, h11, httpx, click and prometheus-client.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl/serve && mkdir -p .whl/serve
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl/serve fastapi starlette pydantic pydantic-core annotated-types typing-inspection \
  uvicorn uvloop httptools annotated-doc typing-extensions opentelemetry-api 2>&1 | grep -v "^WARNING: Location" || true
ls .whl/serve
