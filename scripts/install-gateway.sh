#!/usr/bin/env bash
# Install the LiteLLM proxy with the relocator plugin (relocator.gateways.litellm) into its own
# virtual environment, .venv-gateway. Idempotent: a second run only checks.
# Usage: scripts/install-gateway.sh
#
# Why a venv of its own, apart from vLLM's .venv: litellm[proxy] pins rich<14 and
# websockets<16, while .venv has rich 15 and websockets 17 (vLLM/Ray's set, requirements.lock);
# putting LiteLLM there would change versions vLLM and Ray were locked with. The LiteLLM proxy
# is a process of its own anyway: it runs from .venv-gateway and imports the plugin (and the
# router core it reuses) from this checkout, put on its path by a .pth file.
#
# What gets installed is the exact set in requirements-gateway.lock (`scripts/lock.sh gateway`
# rewrites it): litellm[proxy]==1.108.5 and relocator's own runtime dependencies.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
log() { printf '[install-gateway] %s\n' "$*" >&2; }
VENV="$ROOT/.venv-gateway"
LOCK="$ROOT/requirements-gateway.lock"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x "$VENV/bin/python" ]; then
  log "creating .venv-gateway with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# pip warns once per package that a local index on this machine has no folder for it: noise.
pipq() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
STAMP="$VENV/.relocator-deps"
HASH=$(sha256sum "$LOCK" scripts/install-gateway.sh | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$HASH" ]; then
  start=$(date +%s)
  log "installing litellm and its dependencies from requirements-gateway.lock - a minute or two on a fresh machine"
  pipq install -q "$(grep -E '^pip==' "$LOCK")"
  pipq install -q --no-deps -r "$LOCK"
  # this checkout on the path (relocator, adapters): what an editable install would give,
  # without building the package (no wheel/setuptools needed in this venv)
  SITE=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  echo "$ROOT" > "$SITE/relocator-checkout.pth"
  echo "$HASH" > "$STAMP"
  log "installed in $(( $(date +%s) - start )) s"
else
  log "gateway dependencies up to date"
fi
# LiteLLM must not phone home: the plugin's tests and docs run it with
# LITELLM_LOCAL_MODEL_COST_MAP=True and telemetry off. Import check of the plugin:
LITELLM_LOCAL_MODEL_COST_MAP=True "$VPY" -W ignore -c '
import litellm, relocator.gateways.litellm  # noqa: F401
from importlib.metadata import version
print("[install-gateway] litellm", version("litellm"))
' >&2
