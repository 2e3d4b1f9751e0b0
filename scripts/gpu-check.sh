#!/usr/bin/env bash
# gpu-check: one worker moved through the product's parts on one machine, as one JSON object on
# stdout (relocator/bench/gpucheck.py): the reference engine in a cell (on CUDA: GPU 0, a captured
# CUDA graph, a KV pool), the router in front, 8 greedy streams through it, and three moves
# compared token by token with an unmoved run: freeze and copy (cuda-checkpoint + CRIU, the
# source checked stopped until RELEASE), the same with the free KV pool left out of the image,
# then a warm capture of that copy with the engine's pool released around cuda-checkpoint
# (relocator/warm/sleep.py) and a copy restored from it, and a handoff to that warm copy (two
# cells on the one device: the controller's warm-up, SWITCH at a token, the source never
# stopped). GPU_CHECK_WARM=0: no warm capture, the handoff's target starts cold. --device cpu runs
# the same steps without a GPU.
#
# Nothing is fetched at run time. On a bare GPU machine pass the bundle that
# scripts/gpu-bundle.sh built: DIR/bin goes first on PATH (criu, ip, iptables, cuda-checkpoint),
# DIR/wheels/cpXY is unpacked once into DIR/site-cpXY and put on PYTHONPATH.
#
# Usage: scripts/gpu-check.sh [--bundle DIR] [--device auto|cuda|cpu] [--tokens N]
#                             [--kv-pool-mb N] [--json] [--out FILE]
# --json: stdout is the JSON alone (always so; accepted for scripts that ask for it). Exit 0 when every move was
# exact and the source stayed stopped, 1 otherwise (the JSON says where it stopped), 2 on bad use.
set -euo pipefail
cd "$(dirname "$0")/.."
DEVICE=auto TOKENS=64 POOL=256 OUTFILE="" BUNDLE=${GPU_CHECK_TOOLS:-} JSON=0
need() { [ "$2" -ge 2 ] || { echo "gpu-check: $1 needs a value" >&2; exit 2; }; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) need "$1" $#; DEVICE=$2; shift 2 ;;
    --tokens) need "$1" $#; TOKENS=$2; shift 2 ;;
    --kv-pool-mb) need "$1" $#; POOL=$2; shift 2 ;;
    --bundle) need "$1" $#; BUNDLE=$2; shift 2 ;;
    --out) need "$1" $#; OUTFILE=$2; shift 2 ;;
    --json) JSON=1; shift ;;
    *) echo "gpu-check: unknown argument $1" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in auto|cuda|cpu) ;; *) echo "gpu-check: --device must be auto, cuda or cpu" >&2; exit 2 ;; esac
[[ "$TOKENS" =~ ^[0-9]+$ && "$TOKENS" -ge 8 ]] || { echo "gpu-check: --tokens must be a number >= 8" >&2; exit 2; }
[[ "$POOL" =~ ^[0-9]+$ ]] || { echo "gpu-check: --kv-pool-mb must be a number" >&2; exit 2; }
# the interpreter: PYTHON, else .venv's unless it is a CPU build asked to run on CUDA, else python3
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  PY=python3
  if [ -x .venv/bin/python ]; then
    if [ "$DEVICE" = cpu ] || .venv/bin/python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
      PY=.venv/bin/python
    fi
  fi
fi
if [ -n "$BUNDLE" ]; then
  [ -f "$BUNDLE/bundle.json" ] || { echo "gpu-check: $BUNDLE is not a bundle (no bundle.json; scripts/gpu-bundle.sh DIR builds one)" >&2; exit 2; }
  BUNDLE=$(cd "$BUNDLE" && pwd)
  export PATH="$BUNDLE/bin:$PATH"
  [ -x "$BUNDLE/bin/cuda-checkpoint" ] && export RELOCATOR_CUDA_CHECKPOINT="$BUNDLE/bin/cuda-checkpoint"
  TAG=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  [ -d "$BUNDLE/wheels/$TAG" ] || { echo "gpu-check: the bundle has no wheels for $TAG (scripts/gpu-bundle.sh --python)" >&2; exit 2; }
  if [ ! -f "$BUNDLE/site-$TAG/.unpacked" ]; then  # a wheel is a zip: unpacked without pip
    "$PY" - "$BUNDLE/wheels/$TAG" "$BUNDLE/site-$TAG" <<'PYEOF'
import pathlib, sys, zipfile
src, dst = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
for whl in sorted(src.glob("*.whl")):
    zipfile.ZipFile(whl).extractall(dst)
(dst / ".unpacked").write_text("\n".join(p.name for p in sorted(src.glob("*.whl"))))
PYEOF
  fi
  export PYTHONPATH="$BUNDLE/site-$TAG${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
set +e
OUTPUT=$("$PY" -m relocator.bench.gpucheck --device "$DEVICE" --tokens "$TOKENS" --kv-pool-mb "$POOL")
RC=$?
set -e
[ -z "$OUTFILE" ] || printf '%s\n' "$OUTPUT" > "$OUTFILE"
printf '%s\n' "$OUTPUT"
exit "$RC"
