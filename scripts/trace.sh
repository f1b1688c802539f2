#!/usr/bin/env bash
# The main job: installs what it needs (scripts/setup.sh), then runs `pagedkv trace`.
# Arguments go to `pagedkv trace` (see `bash scripts/trace.sh --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/pagedkv trace "$@"
