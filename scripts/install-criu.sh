#!/usr/bin/env bash
# Install CRIU >= 4.2 (Debian 12's 3.17 fails on recent kernels): build it from Debian
# unstable's source package. The mirror is read from this machine's own apt configuration.
# Result is cached in /usr/local/sbin/criu; a second run returns at once.
set -euo pipefail
WANT_MAJOR=4; WANT_MINOR=2
PREFIX=${CRIU_PREFIX:-/usr/local/sbin}
log() { printf '[install-criu] %s\n' "$*" >&2; }

have_good_criu() {
  local bin=$1 v
  [ -x "$bin" ] || return 1
  v=$("$bin" --version 2>/dev/null | sed -n 's/^Version: *//p' | head -1)
  [ -n "$v" ] || return 1
  local major=${v%%.*} rest=${v#*.}; local minor=${rest%%.*}
  [ "$major" -gt "$WANT_MAJOR" ] || { [ "$major" -eq "$WANT_MAJOR" ] && [ "$minor" -ge "$WANT_MINOR" ]; }
}

if have_good_criu "$PREFIX/criu"; then log "CRIU already installed: $("$PREFIX/criu" --version | head -1)"; exit 0; fi
[ "$(id -u)" -eq 0 ] || { log "root is needed to install CRIU"; exit 1; }

export DEBIAN_FRONTEND=noninteractive
BUILD_DEPS="build-essential pkg-config libprotobuf-dev libprotobuf-c-dev protobuf-c-compiler protobuf-compiler python3-protobuf libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev libnftables-dev uuid-dev libaio-dev libdrm-dev xz-utils dpkg-dev"
RUNTIME_DEPS="iptables iproute2 util-linux libprotobuf-c1 libnl-3-200 libnet1 libnftables1"
log "installing build dependencies"
apt-get update -qq
apt-get install -y -qq --no-install-recommends $BUILD_DEPS $RUNTIME_DEPS >/dev/null

# Mirror URI from the machine's own deb822 sources (first URIs: line of the main Debian suite).
URI=""
for f in /etc/apt/sources.list.d/*.sources; do
  [ -f "$f" ] || continue
  URI=$(awk '/^URIs:/ {print $2; exit}' "$f"); [ -n "$URI" ] && break
done
if [ -z "$URI" ] && [ -f /etc/apt/sources.list ]; then
  URI=$(awk '$1=="deb" {for(i=2;i<=NF;i++) if ($i ~ /^[a-z]+:\/\//) {print $i; exit}}' /etc/apt/sources.list)
fi
[ -n "$URI" ] || { log "no Debian mirror URI found in /etc/apt"; exit 1; }
URI=${URI%-security}   # a security mirror has no sid

WORK=$(mktemp -d /tmp/criu-build.XXXXXX); trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/lists/partial" "$WORK/src"
echo "deb-src $URI sid main" > "$WORK/sid.list"
APT_OPTS=(-o Dir::Etc::SourceList="$WORK/sid.list" -o Dir::Etc::SourceParts=/dev/null -o Dir::State::Lists="$WORK/lists" -o APT::Get::AllowUnauthenticated=true -o Acquire::AllowInsecureRepositories=true)
log "fetching the criu source package from Debian unstable"
apt-get "${APT_OPTS[@]}" update -qq 2>/dev/null || true
( cd "$WORK/src" && apt-get "${APT_OPTS[@]}" source --download-only criu >/dev/null 2>&1 ) || true
DSC=$(ls "$WORK"/src/criu_*.dsc 2>/dev/null | head -1)
TARBALL=$(ls "$WORK"/src/criu_*.orig.tar.* 2>/dev/null | head -1)
[ -n "$DSC" ] && [ -n "$TARBALL" ] || { log "could not download the criu source package (dsc or orig tarball missing)"; exit 1; }
# Verify the tarball against the sha256 in the .dsc.
WANT_SHA=$(awk '/^Checksums-Sha256:/ {f=1; next} f && /^ / {print $1, $3} /^[^ ]/ && f && !/^Checksums/ {f=0}' "$DSC" | awk -v t="$(basename "$TARBALL")" '$2==t {print $1}')
GOT_SHA=$(sha256sum "$TARBALL" | cut -d' ' -f1)
[ "$WANT_SHA" = "$GOT_SHA" ] || { log "checksum mismatch for $(basename "$TARBALL"): dsc says $WANT_SHA, file is $GOT_SHA"; exit 1; }
log "building $(basename "$TARBALL")"
tar -C "$WORK" -xf "$TARBALL"
SRC=$(find "$WORK" -mindepth 1 -maxdepth 1 -type d -name 'criu-[0-9]*' | head -1)
make -C "$SRC" -j"$(nproc)" criu >"$WORK/build.log" 2>&1 || { tail -40 "$WORK/build.log" >&2; log "criu build failed"; exit 1; }
install -D -m 0755 "$SRC/criu/criu" "$PREFIX/criu"
have_good_criu "$PREFIX/criu" || { log "built criu reports an unexpected version"; exit 1; }
log "installed $("$PREFIX/criu" --version | head -1) at $PREFIX/criu"
