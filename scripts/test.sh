#!/usr/bin/env bash
# The test command of README.md: set up (idempotent), then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec .venv/bin/python -m pytest -ra --durations=15 "$@"
