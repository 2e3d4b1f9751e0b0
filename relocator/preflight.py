"""Check, before anything fails later, that this machine can run relocator's cells and snapshots."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

from pydantic import BaseModel

from relocator import procs


class Check(BaseModel):
    name: str
    ok: bool
    detail: str
    fix: str = ""
    #: a failed warning is reported but does not fail the preflight
    warning: bool = False


#: the exact dependency set scripts/install.sh installs (absent when installed as a package)
LOCK_FILE = Path(__file__).resolve().parents[1] / "requirements.lock"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock: Path = LOCK_FILE) -> dict[str, str]:
    """{canonical name: version} from a `name==version` lock file."""
    out = {}
    for line in lock.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[_canonical(name)] = version.strip()
    return out


def lock_drift(lock: Path = LOCK_FILE) -> list[str]:
    """Installed packages whose version differs from the lock, or that are missing."""
    installed = {_canonical(d.metadata["Name"] or ""): d.version
                 for d in importlib.metadata.distributions()}
    drift = []
    for name, want in sorted(locked_versions(lock).items()):
        have = installed.get(name)
        if have != want:
            drift.append(f"{name} {have or 'missing'} (lock: {want})")
    return drift


def _lock() -> list[Check]:
    if not LOCK_FILE.exists():
        return []
    drift = lock_drift()
    shown = "; ".join(drift[:5]) + (f"; and {len(drift) - 5} more" if len(drift) > 5 else "")
    return [Check(name="python packages match requirements.lock", ok=not drift, warning=True,
                  detail=f"{len(locked_versions())} pinned, all as locked" if not drift else shown,
                  fix="rm .venv/.relocator-deps && bash scripts/install.sh (reinstall from the "
                      "lock), or bash scripts/lock.sh to re-lock on purpose")]


def _criu() -> list[Check]:
    from relocator.snapshot import criu

    try:
        binary = criu.criu_binary()
    except criu.CriuError as exc:
        return [Check(name="criu", ok=False, detail=str(exc), fix="scripts/install-criu.sh")]
    version = criu.criu_version(binary)
    ok = criu.version_tuple(version)[:2] >= criu.MIN_VERSION
    checks = [Check(name="criu version", ok=ok, detail=f"{binary}: {version}",
                    fix="" if ok else f"CRIU >= {'.'.join(map(str, criu.MIN_VERSION))} is needed (older "
                    "versions fail on this kernel): scripts/install-criu.sh")]
    if ok and os.geteuid() == 0:
        proc = subprocess.run([binary, "check"], capture_output=True, text=True)
        out = (proc.stdout + proc.stderr).strip()
        checks.append(Check(name="criu check", ok=proc.returncode == 0 and "Looks good" in out,
                            detail=out.splitlines()[-1] if out else f"exit {proc.returncode}",
                            fix="see `criu check --all` for the missing kernel feature"))
    return checks


def _kernel() -> list[Check]:
    checks = []
    for ns in ("pid", "mnt", "ipc", "uts", "net"):
        present = procs.namespace(ns) is not None
        checks.append(Check(name=f"kernel {ns} namespaces", ok=present, detail="present" if present else "missing",
                            fix="a kernel with CONFIG_NAMESPACES and CONFIG_*_NS"))
    mf = Path("/proc/self/map_files").exists()
    checks.append(Check(name="kernel checkpoint/restore", ok=mf, detail="/proc/self/map_files " + ("present" if mf else "missing"),
                        fix="a kernel with CONFIG_CHECKPOINT_RESTORE"))
    return checks


def _tools() -> list[Check]:
    out = []
    for tool, pkg in (("unshare", "util-linux"), ("setsid", "util-linux"), ("ip", "iproute2"),
                      ("iptables", "iptables"), ("iptables-restore", "iptables")):
        path = shutil.which(tool)
        out.append(Check(name=f"tool {tool}", ok=path is not None, detail=path or "not found",
                         fix=f"apt-get install {pkg}"))
    return out


def _python() -> list[Check]:
    out = []
    for mod, what in (("ray", "ray"), ("aiohttp", "aiohttp")):
        found = importlib.util.find_spec(mod) is not None
        out.append(Check(name=f"python {mod}", ok=found, detail="importable" if found else "missing",
                         fix=f"scripts/install.sh (installs {what} into .venv)"))
    from adapters.base import engine_names, get_adapter

    for name in engine_names():
        why = get_adapter(name).missing()
        out.append(Check(name=f"engine {name}", ok=why is None, detail=why or "installed",
                         fix="scripts/install.sh"))
    tv = importlib.util.find_spec("torchvision") is not None
    out.append(Check(name="python torchvision absent", ok=not tv,
                     detail="installed (breaks transformers imports beside the CPU torch)" if tv else "absent",
                     fix="pip uninstall torchvision torchaudio"))
    return out


def _fs_type(path: Path) -> str:
    """The filesystem type of the mount holding `path` (longest matching mount point)."""
    return procs.fs_type(path) or "?"


#: filesystems that other hosts can mount too (an image store on one is "shared" across hosts)
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "ceph", "glusterfs", "fuse.sshfs", "lustre", "beegfs", "gpfs",
              "fuse.juicefs", "9p", "virtiofs")


def transfer_checks(image_store: Path | None = None) -> list[Check]:
    """Which transfer modes this node can do, and why (docs/snapshots.md "Transfer modes");
    warnings only: shared is the default and works within one machine."""
    from relocator.snapshot import criu

    try:
        criu.criu_binary()
    except criu.CriuError as exc:
        return [Check(name="transfer modes", ok=False, detail=str(exc), fix="scripts/install-criu.sh", warning=True)]
    store = image_store or Path(os.environ.get("RELOCATOR_IMAGE_STORE", "/var/lib/relocator"))
    probe = store if store.exists() else store.parent
    fs = _fs_type(probe)
    shared = fs in NETWORK_FS
    uffd_ok, uffd_words = criu.feature("uffd-noncoop")
    pipes_ok, pipes_words = criu.lazy_dump_pipes()
    dirty_ok, dirty_words = criu.feature("mem_dirty_track")
    postcopy = uffd_ok and pipes_ok
    pick = "shared (when both nodes see the image store), else " + ("postcopy" if postcopy else "stream")
    return [
        Check(name="transfer shared", ok=True, warning=True,
              detail=f"{store} is on {fs}: " + ("other hosts can mount it" if shared else
                                                 "shared only by nodes on this machine"),
              fix="" if shared else "across hosts: an image store on NFS/Ceph/... mounted at the same path "
                                    "on every node, or transfer stream/postcopy"),
        Check(name="transfer stream (page server)", ok=True, warning=True,
              detail="criu page-server straight into the target's image directory; no shared storage needed"),
        Check(name="transfer postcopy (lazy pages)", ok=postcopy, warning=True,
              detail=f"{uffd_words}; {pipes_words}",
              fix="" if postcopy else ("a kernel with CONFIG_USERFAULTFD and unprivileged-or-root uffd" if not uffd_ok
                                       else "sysctl -w fs.pipe-max-size=4194304 (scripts/install.sh makes it "
                                            "permanent in /etc/sysctl.d)")),
        Check(name="transfer pre-copy (dirty-page tracking)", ok=dirty_ok, warning=True,
              detail=dirty_words if not dirty_ok else "supported (not used: relocator has no pre-copy mode yet)",
              fix="" if dirty_ok else "a kernel with CONFIG_MEM_SOFT_DIRTY; without it the worker is frozen for "
                                      "the whole dump (stream) or only for the non-memory state (postcopy)"),
        Check(name="transfer auto picks", ok=True, warning=True, detail=pick),
    ]


def run_checks() -> list[Check]:
    checks = [Check(name="root", ok=os.geteuid() == 0, detail=f"euid {os.geteuid()}",
                    fix="cells and CRIU need root (namespaces, ptrace, mknod)")]
    return checks + _kernel() + _tools() + _criu() + _python() + _lock() + transfer_checks()
