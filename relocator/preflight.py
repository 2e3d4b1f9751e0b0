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
    from relocator.snapshot.fingerprint import gpu_info

    gpus = gpu_info().count > 0  # cuda restore reads every page inside RESTORE: post-copy gains nothing
    pick = "handoff where the target starts warm, else shared (when both nodes see the image store), else " + (
        "stream (never postcopy on a node with NVIDIA GPUs)" if gpus else "postcopy" if postcopy else "stream")
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
        Check(name="transfer handoff (make-before-break)", ok=True, warning=True,
              detail="on request (transfer: handoff; needs room for a second copy on the target); "
                     + _handoff_why()),
    ]


def _handoff_why() -> str:
    from relocator.controller.transfers.handoff import AUTO_RULE

    return AUTO_RULE


# -- GPU section: only where an NVIDIA driver answers (docs/gpu.md, "Preflight") -------------
#: where libcuda.so.1 is looked for after LD_LIBRARY_PATH (distributions, NVIDIA's containers, WSL)
LIBCUDA_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64",
                "/usr/local/nvidia/lib", "/usr/lib/wsl/lib")
MIN_CUDA_DRIVER = 550  # cuda-checkpoint's --action (lock/checkpoint/restore/unlock)
DEVICE_MAP_DRIVER = 580  # --device-map: restore onto other GPUs than the ones a worker left


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _major(version: str | None) -> int:
    m = re.match(r"(\d+)", version or "")
    return int(m.group(1)) if m else 0


class GpuFacts(BaseModel):
    """What NVML says of this host's driver and GPUs."""

    driver: str
    names: list[str]
    persistence: list[bool]


def nvml_facts() -> GpuFacts | str | None:
    """The driver's facts; None when no NVIDIA driver answers (no library, no kernel module);
    a string when NVML fails otherwise (the reason)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        if exc.value in (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, pynvml.NVML_ERROR_DRIVER_NOT_LOADED):
            return None
        return f"NVML: {exc}"
    try:
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        return GpuFacts(driver=_text(pynvml.nvmlSystemGetDriverVersion()),
                        names=[_text(pynvml.nvmlDeviceGetName(h)) for h in handles],
                        persistence=[pynvml.nvmlDeviceGetPersistenceMode(h) == pynvml.NVML_FEATURE_ENABLED
                                     for h in handles])
    except pynvml.NVMLError as exc:
        return f"NVML: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _cuda_checkpoint(driver: str) -> list[Check]:
    from relocator.snapshot import cuda

    tool = cuda.binary()
    where = "NVIDIA's cuda-checkpoint (public repository NVIDIA/cuda-checkpoint, bin/x86_64_Linux/) on PATH or in "
    if tool is None:
        return [Check(name="gpu cuda-checkpoint", ok=False, detail="not found", fix=where + "RELOCATOR_CUDA_CHECKPOINT")]
    try:
        proc = subprocess.run([tool, "--help"], capture_output=True, text=True, timeout=60)
        text = proc.stdout + proc.stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        return [Check(name="gpu cuda-checkpoint", ok=False, detail=f"{tool}: {exc}", fix=where + "RELOCATOR_CUDA_CHECKPOINT")]
    m = re.search(r"Version\s+(\d+(?:\.\d+)+)", text)
    version = m.group(1) if m else None
    actions = "--action" in text
    checks = [Check(name="gpu cuda-checkpoint", ok=actions, detail=f"{tool}: version {version or '?'}"
                    + ("" if actions else "; no --action (lock/checkpoint/restore/unlock)"),
                    fix=f"a driver >= {MIN_CUDA_DRIVER} and its cuda-checkpoint")]
    same = version == driver
    checks.append(Check(
        name="gpu cuda-checkpoint matches the driver", ok=same or _major(version) == _major(driver), warning=not same
        and _major(version) == _major(driver), detail=f"cuda-checkpoint {version or '?'}, driver {driver}",
        fix="the tool drives the driver through the libcuda this host loads: both must be the driver's release "
            "(a libcuda of another release than the kernel module, e.g. a container's, breaks checkpoints)"))
    return checks


def _libcuda() -> Path | None:
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(LIBCUDA_DIRS)
    for d in dirs:
        lib = Path(d) / "libcuda.so.1"
        if lib.exists():
            return lib.resolve()
    return None


def driver_libs_check(lib: Path | None, mount_points: list[str], cell_mounts: list[str]) -> Check:
    """Whether a cell sees the driver's user-space library `lib`: a cell binds / (without its
    submounts) and, recursively, the mounts in `cell_mounts` (relocator.cell.devices.driver_mounts)."""
    name = "gpu driver libraries visible in cells"
    if lib is None:
        return Check(name=name, ok=False, detail=f"libcuda.so.1 not found (LD_LIBRARY_PATH, {', '.join(LIBCUDA_DIRS)})",
                     fix="install the NVIDIA driver's user-space libraries, or put their directory in LD_LIBRARY_PATH")
    holder = max((m for m in mount_points if str(lib) == m or str(lib).startswith(m.rstrip("/") + "/")),
                 key=len, default="/")
    seen = holder == "/" or holder in cell_mounts
    return Check(name=name, ok=seen, detail=f"{lib} on mount {holder}" + (
        "" if seen else f" (cells bind / and {', '.join(cell_mounts) or 'no driver mount'})"),
        fix="cells bind / without its submounts, plus every mount whose path names nvidia: put the driver's "
            "libraries on the root filesystem or under such a mount (e.g. /usr/local/nvidia)")


def _gpu_models(names: list[str]) -> Check:
    groups: dict[str, list[int]] = {}
    for i, n in enumerate(names):
        groups.setdefault(n, []).append(i)
    return Check(name="gpu models identical (device map)", ok=len(groups) <= 1, warning=True,
                 detail="; ".join(f"GPU {','.join(map(str, ids))}: {n}" for n, ids in groups.items()) or "no GPU",
                 fix="cuda-checkpoint's --device-map and the fingerprint need one GPU model: a worker moves only "
                     "between GPUs of its own model (others are refused at PLAN)")


def _gpu_criu() -> Check:
    from relocator.snapshot import criu

    try:
        version = criu.criu_version(criu.criu_binary())
    except criu.CriuError as exc:
        return Check(name="gpu criu >= 4.2", ok=False, detail=str(exc), fix="scripts/install-criu.sh")
    ok = criu.version_tuple(version)[:2] >= criu.MIN_VERSION
    return Check(name="gpu criu >= 4.2", ok=ok, detail=f"criu {version}",
                 fix="CRIU 4.2 or newer (older ones fail on this kernel and lack the CUDA fixes): scripts/install-criu.sh")


def gpu_checks() -> list[Check]:
    """The GPU section: one line when there is no NVIDIA driver, else driver and cuda-checkpoint
    (and that they match), persistence mode, CRIU, the driver's libraries in cells, GPU models."""
    facts = nvml_facts()
    if facts is None:
        return [Check(name="gpu", ok=True, detail="no NVIDIA driver: GPU checks skipped")]
    if isinstance(facts, str):
        return [Check(name="gpu driver", ok=False, detail=facts, fix="nvidia-smi should list the GPUs; reload the "
                      "driver (or reboot) until it does")]
    from relocator.cell.devices import driver_mounts

    major = _major(facts.driver)
    off = [str(i) for i, on in enumerate(facts.persistence) if not on]
    checks = [
        Check(name="gpu driver", ok=major >= MIN_CUDA_DRIVER and bool(facts.names),
              detail=f"NVIDIA {facts.driver}, {len(facts.names)} GPU(s)",
              fix=f"driver >= {MIN_CUDA_DRIVER} (cuda-checkpoint --action) with at least one GPU"),
        Check(name="gpu driver restores onto other GPUs", ok=major >= DEVICE_MAP_DRIVER, warning=True,
              detail=f"driver {facts.driver}", fix=f"driver >= {DEVICE_MAP_DRIVER} for --device-map; older ones restore "
                                                   "a worker only onto the very GPUs it left"),
        *_cuda_checkpoint(facts.driver),
        Check(name="gpu persistence mode", ok=not off, detail="on for every GPU" if not off else f"off on GPU {','.join(off)}",
              fix="nvidia-smi -pm 1 (as root; or run nvidia-persistenced): cuda-checkpoint fails without it"),
        _gpu_criu(),
        driver_libs_check(_libcuda(), [mp for _, mp, _ in procs.mounts()], driver_mounts()),
        _gpu_models(facts.names),
    ]
    return checks


def run_checks() -> list[Check]:
    checks = [Check(name="root", ok=os.geteuid() == 0, detail=f"euid {os.geteuid()}",
                    fix="cells and CRIU need root (namespaces, ptrace, mknod)")]
    return checks + _kernel() + _tools() + _criu() + _python() + _lock() + transfer_checks() + gpu_checks()
