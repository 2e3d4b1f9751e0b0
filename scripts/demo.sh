#!/usr/bin/env bash
# The main job of README.md: set up (idempotent), then run the live-relocation demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
exec .venv/bin/relocator demo "$@"
