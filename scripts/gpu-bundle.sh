#!/usr/bin/env bash
# Build, on this (Debian 12, x86_64) machine, what a bare GPU machine without a package registry
# needs to run `scripts/gpu-check.sh --bundle DIR` (it has python3 with torch and CUDA):
#   DIR/bin/    criu, ip, iptables(-restore), cuda-checkpoint: wrappers that set LD_LIBRARY_PATH
#               to DIR/lib for that binary alone (the machine's python keeps its own libraries)
#   DIR/real/   the binaries: CRIU 4.2.1 (scripts/install-criu.sh), iproute2's ip, iptables-nft
#               (CRIU's network lock runs iptables-restore), NVIDIA's cuda-checkpoint
#   DIR/lib/    every shared library ldd lists for them, glibc's own excepted (the target's is
#               newer: Debian 12's 2.36 against Ubuntu 24.04's 2.39)
#   DIR/wheels/cpXY/  the relocator's runtime wheels for CPython X.Y (not torch nor numpy),
#               at requirements.lock's versions; gpu-check.sh unpacks them into DIR/site-cpXY
#   DIR/bundle.json   what is in it, with sizes
# cuda-checkpoint is NVIDIA's (public GitHub repository NVIDIA/cuda-checkpoint, file
# bin/x86_64_Linux/cuda-checkpoint); nothing here downloads it: pass --cuda-checkpoint PATH (or
# have it on PATH). Without it the bundle is built and says so (a GPU run then fails preflight).
#
# Usage: scripts/gpu-bundle.sh DIR [--cuda-checkpoint PATH] [--python "3.12 3.11"]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
log() { printf '[gpu-bundle] %s\n' "$*" >&2; }
die() { printf 'gpu-bundle: %s\n' "$*" >&2; exit 2; }
[ $# -ge 1 ] && [ "${1#-}" = "$1" ] || die "usage: scripts/gpu-bundle.sh DIR [--cuda-checkpoint PATH] [--python \"3.12 3.11\"]"
OUT=$1; shift
CC=${CUDA_CHECKPOINT:-$(command -v cuda-checkpoint || true)}
PYVERS="3.12 3.11"
while [ $# -gt 0 ]; do
  case "$1" in
    --cuda-checkpoint) [ $# -ge 2 ] || die "--cuda-checkpoint needs a path"; CC=$2; shift 2 ;;
    --python) [ $# -ge 2 ] || die "--python needs versions"; PYVERS=$2; shift 2 ;;
    *) die "unknown argument $1" ;;
  esac
done
[ -z "$CC" ] || [ -x "$CC" ] || die "--cuda-checkpoint $CC is not an executable file"
CRIU=${CRIU_BINARY:-/usr/local/sbin/criu}
[ -x "$CRIU" ] || die "no CRIU at $CRIU (bash scripts/install-criu.sh builds it)"
IP=$(command -v ip) || die "no ip (apt-get install iproute2)"
XT=$(readlink -f "$(command -v iptables-restore)" 2>/dev/null || true)
mkdir -p "$OUT"/{bin,real,lib,wheels}
OUT=$(cd "$OUT" && pwd)

GLIBC='^(linux-vdso|ld-linux|libc|libm|libdl|libpthread|librt|libresolv|libutil)\.so'
carry() {  # carry NAME BINARY [TOOL...]: the binary, its libraries, a wrapper per tool name
  local name=$1 bin=$2; shift 2
  install -m 0755 "$bin" "$OUT/real/$name"
  ldd "$bin" | awk '$3 ~ /^\// {print $3}' | while read -r lib; do
    base=$(basename "$lib"); [[ $base =~ $GLIBC ]] && continue
    [ -e "$OUT/lib/$base" ] || cp -L "$lib" "$OUT/lib/$base"
  done
  for tool in "$name" "$@"; do
    # xtables-nft-multi picks its personality from argv[0]: exec -a
    printf '#!/bin/bash\nD=$(cd "$(dirname "$0")/.." && pwd)\nLD_LIBRARY_PATH="$D/lib" XTABLES_LIBDIR="$D/lib/xtables" exec -a %s "$D/real/%s" "$@"\n' \
      "$tool" "$name" > "$OUT/bin/$tool"
    chmod 0755 "$OUT/bin/$tool"
  done
}
log "CRIU $("$CRIU" --version | sed -n 's/^Version: *//p'), ip, iptables-nft and their libraries"
carry criu "$CRIU"
carry ip "$IP"
if [ -n "$XT" ]; then
  carry xtables-nft-multi "$XT" iptables iptables-restore iptables-save ip6tables ip6tables-restore
  XTDIR=$(dirname "$(ldd "$XT" | awk '/libxtables/ {print $3}')")/xtables
  mkdir -p "$OUT/lib/xtables"
  for ext in libxt_standard libxt_mark libxt_MARK libipt_REJECT libxt_comment libxt_tcp libxt_udp; do
    [ -f "$XTDIR/$ext.so" ] && cp -L "$XTDIR/$ext.so" "$OUT/lib/xtables/"
  done
  rm -f "$OUT/bin/xtables-nft-multi"
else
  log "no iptables here: CRIU's default network lock will need the target's"
fi
if [ -n "$CC" ]; then
  install -m 0755 "$CC" "$OUT/real/cuda-checkpoint"
  printf '#!/bin/sh\nexec "$(cd "$(dirname "$0")/.." && pwd)/real/cuda-checkpoint" "$@"\n' > "$OUT/bin/cuda-checkpoint"
  chmod 0755 "$OUT/bin/cuda-checkpoint"
else
  log "no cuda-checkpoint given: get bin/x86_64_Linux/cuda-checkpoint from NVIDIA's cuda-checkpoint repository and pass --cuda-checkpoint PATH"
fi

# The runtime wheels (what `import relocator.router.server, relocator.snapshot, relocator.worker,
# adapters.reference.server` loads beyond torch's own dependencies), at the CPU lock's versions.
WHEELS="aiohappyeyeballs aiohttp aiosignal annotated-types attrs frozenlist idna multidict
nvidia-ml-py prometheus-client propcache psutil pydantic pydantic-core pydantic-settings
python-dotenv PyYAML tenacity tokenizers typing-inspection typing-extensions yarl"
PINS=()
for w in $WHEELS; do
  pin=$(grep -i -E "^${w//-/[-_]}==" "$ROOT/requirements.lock" | head -1)
  [ -n "$pin" ] || die "$w is not in requirements.lock"
  PINS+=("$pin")
done
for v in $PYVERS; do
  tag=cp${v/./}
  log "wheels for CPython $v"
  mkdir -p "$OUT/wheels/$tag"
  python3 -m pip download -q --no-deps --only-binary=:all: --dest "$OUT/wheels/$tag" \
    --python-version "$v" --implementation cp --abi "$tag" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "${PINS[@]}" 2> >(grep -v "is ignored: it is neither" >&2)
done

BYTES=$(du -sb "$OUT" | cut -f1)
python3 - "$OUT" "$BYTES" "$("$CRIU" --version | sed -n 's/^Version: *//p')" <<'PYEOF'
import json, os, sys
out, size, criu = sys.argv[1], int(sys.argv[2]), sys.argv[3]
ls = lambda d: sorted(os.listdir(os.path.join(out, d))) if os.path.isdir(os.path.join(out, d)) else []
info = {"bytes": size, "criu": criu, "tools": ls("bin"), "libs": ls("lib"),
        "cuda_checkpoint": "cuda-checkpoint" in ls("bin"),
        "wheels": {t: ls(os.path.join("wheels", t)) for t in ls("wheels")}}
json.dump(info, open(os.path.join(out, "bundle.json"), "w"), indent=1)
PYEOF
LIMIT=$((60 << 20))
log "bundle at $OUT: $((BYTES >> 20)) MiB ($BYTES bytes; limit 60 MiB)"
[ "$BYTES" -le "$LIMIT" ] || die "the bundle is over 60 MiB"
