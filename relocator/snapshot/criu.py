"""The one wrapper around the CRIU binary: version, check, dump and restore of a cell's tree."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Sequence

MIN_VERSION = (4, 2)
NETNS_KEY = "cellnet"  # label of the cell's network namespace, external to the image


class CriuError(RuntimeError):
    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message + (f"\n--- criu log (last lines) ---\n{log_tail}" if log_tail else ""))
        self.log_tail = log_tail


def criu_binary() -> str:
    for cand in (os.environ.get("RELOCATOR_CRIU"), "/usr/local/sbin/criu", shutil.which("criu")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return cand
    raise CriuError("CRIU not found: run scripts/install-criu.sh (CRIU >= 4.2 is required)")


@lru_cache(maxsize=4)
def criu_version(binary: str | None = None) -> str:
    binary = binary or criu_binary()
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    m = re.search(r"Version:\s*(\S+)", out)
    if not m:
        raise CriuError(f"cannot read the version of {binary}: {out.strip()!r}")
    return m.group(1)


def version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:3])


def _log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    errors = [line for line in text if "Error" in line or "error" in line]
    return "\n".join((errors or text)[-lines:])


@dataclass
class DumpResult:
    seconds: float


def dump(pid: int, image_dir: Path, netns_inode: int, leave_stopped: bool = True,
         extra_args: Sequence[str] = ()) -> DumpResult:
    """Checkpoint the tree rooted at host `pid` into `image_dir`.

    The cell's network namespace is marked external (it is recreated on the target, with its own
    address), so only the sockets go into the image. The tree is left stopped, not killed.
    """
    image_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        criu_binary(), "dump", "-t", str(pid), "-D", str(image_dir), "-o", "dump.log", "-v2",
        "--tcp-established", "--link-remap", "--manage-cgroups=ignore",
        # A connection still waiting in a listen queue (a health probe or scrape sent straight
        # to the worker at that instant) would otherwise fail the whole dump; it is dropped.
        "--skip-in-flight",
        "--external", f"net[{netns_inode}]:{NETNS_KEY}",
    ]
    if leave_stopped:
        cmd.append("--leave-stopped")
    cmd += list(extra_args)  # e.g. a GPU cell's driver mounts, external (devices.criu_external_args)
    start = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    took = time.monotonic() - start
    if proc.returncode != 0:
        raise CriuError(f"criu dump of pid {pid} failed (exit {proc.returncode})", _log_tail(image_dir / "dump.log"))
    return DumpResult(seconds=took)


def restore(image_dir: Path, netns_path: str, pidfile: Path, log_dir: Path,
            extra_args: Sequence[str] = ()) -> int:
    """Restore the tree from `image_dir` into the network namespace at `netns_path`.

    Runs CRIU inside a throw-away private mount namespace with `/` bound as its root (CRIU
    4.2.1 needs --root for a tree with its own mount namespace). Established TCP connections
    are restored closed: they belonged to clients of the old place, and the engine then aborts
    the requests they carried instead of decoding for nobody. Returns the host PID of the
    restored tree's init; the tree is detached (not our child).
    """
    pidfile.unlink(missing_ok=True)  # an existing pidfile makes CRIU kill what it restored
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / "restore.log"
    root_bind = Path(tempfile.mkdtemp(prefix="relocator-restore-root-", dir="/run"))
    criu = [
        criu_binary(), "restore", "-D", str(image_dir), "-W", str(log_dir), "-o", str(log), "-v2",
        "--root", str(root_bind), "-d", "--tcp-close", "--manage-cgroups=ignore",
        "--pidfile", str(pidfile), "--inherit-fd", f"fd[7]:{NETNS_KEY}", *extra_args,
    ]
    script = 'mount --bind / "$0" && exec 7<"$1" && shift && exec "$@"'
    try:
        proc = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(root_bind), netns_path, *criu],
            capture_output=True, text=True, stdin=subprocess.DEVNULL,
        )
    finally:
        try:
            root_bind.rmdir()
        except OSError:
            pass
    if proc.returncode != 0 or not pidfile.exists():
        raise CriuError(f"criu restore from {image_dir} failed (exit {proc.returncode}) {proc.stderr.strip()}",
                        _log_tail(log))
    return int(pidfile.read_text().strip())


def unlock_network(netns: str) -> None:
    """Drop the packet filter CRIU leaves in a namespace whose tree was dumped and left stopped."""
    script = (
        "iptables -D INPUT -j CRIU; iptables -D OUTPUT -j CRIU; iptables -F CRIU; iptables -X CRIU; "
        "nft delete table inet CRIU"
    )
    subprocess.run(["ip", "netns", "exec", netns, "sh", "-c", script], capture_output=True)
