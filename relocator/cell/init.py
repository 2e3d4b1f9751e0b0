"""PID 1 of a cell: build the cell's private mount tree, then run the worker as a minimal init.

Run by `relocator.cell.cell.launch` as `python -m relocator.cell.init STATE_DIR` inside new
PID, mount, IPC and UTS namespaces (and the cell's network namespace). Two steps:

1. setup, while the host's /proc is still mounted: record our host PID, bind `/` (not
   recursively) as a new root with its own proc, read-only sysfs, a tmpfs /dev with the usual
   nodes (plus the GPUs of its device profile, relocator.cell.devices), and private tmpfs
   /dev/shm and /run (TMPDIR); pivot into it and drop the old root.
   Nothing in the tree then keeps a host file open, so CRIU can dump it whole.
2. init: close every inherited fd, become a session leader (no --shell-job needed), start the
   worker with its output in /run/worker.log, forward TERM/INT to it and reap every child.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import signal
import sys
from pathlib import Path

from relocator.cell import devices

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_BIND, MS_REC, MS_PRIVATE = 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}[platform.machine()]
NEW_ROOT = "/run/relocator-cellroot"
DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8), "urandom": (1, 9), "tty": (5, 0)}

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str, target: str, fstype: str | None, flags: int = 0, data: str | None = None) -> None:
    _check(
        _libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None, flags,
                    data.encode() if data else None),
        f"mount {src} on {target}",
    )


def install_devices(profile: "devices.DeviceProfile", root: Path) -> None:
    """The cell's GPUs (relocator.cell.devices): the driver's library mounts bound recursively,
    the assigned GPUs' nodes in the tmpfs /dev, a tmpfs /proc/driver/nvidia with their view."""
    for mp in profile.driver_mounts:
        if os.path.isdir(mp) and os.path.isdir(str(root) + mp):
            _mount(mp, str(root) + mp, None, MS_BIND | MS_REC)
    devices.write_nodes(profile, root / "dev")
    proc_nvidia = root / "proc" / "driver" / "nvidia"
    if profile.proc_files and proc_nvidia.is_dir():
        _mount("tmpfs", str(proc_nvidia), "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=555,size=1m")
        devices.write_proc(profile, proc_nvidia)


def build_root(shm_size: str, profile: "devices.DeviceProfile | None" = None) -> None:
    os.makedirs(NEW_ROOT, exist_ok=True)
    _mount("none", "/", None, MS_REC | MS_PRIVATE)
    _mount("/", NEW_ROOT, None, MS_BIND)
    root = Path(NEW_ROOT)
    _mount("proc", str(root / "proc"), "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("sysfs", str(root / "sys"), "sysfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC)
    _mount("tmpfs", str(root / "dev"), "tmpfs", MS_NOSUID, "mode=755,size=1m")
    for name, (major, minor) in DEVICES.items():
        path = root / "dev" / name
        os.mknod(path, 0o666 | 0o020000, os.makedev(major, minor))
        os.chmod(path, 0o666)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, root / "dev" / name)
    if profile is not None and profile.gpus:
        install_devices(profile, root)
    os.makedirs(root / "dev" / "shm")
    _mount("tmpfs", str(root / "dev" / "shm"), "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={shm_size}")
    _mount("tmpfs", str(root / "run"), "tmpfs", MS_NOSUID | MS_NODEV, "mode=755")
    # /tmp stays the host's: the repository, its venv or the model may live there (CI clones
    # anywhere). The worker's temp files go to /run (TMPDIR), which is the cell's own.
    os.chdir(NEW_ROOT)
    # pivot_root(".", "."): the old root ends up stacked on "/", then is detached (pivot_root(2)).
    _check(_libc.syscall(SYS_PIVOT_ROOT, b".", b"."), "pivot_root")
    _check(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


def run_init(argv: list[str], env: dict[str, str]) -> int:
    os.closerange(3, 1 << 20)
    null = os.open("/dev/null", os.O_RDWR)
    log = os.open("/run/init.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    os.setsid()
    worker_log = os.open("/run/worker.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    pid = os.fork()
    if pid == 0:
        os.dup2(worker_log, 1)
        os.dup2(worker_log, 2)
        os.close(worker_log)
        try:
            os.execvpe(argv[0], argv, env)
        finally:
            os._exit(127)
    os.close(worker_log)

    def forward(signum: int, _frame) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    status = 0
    while True:
        try:
            reaped, code = os.wait()
        except ChildProcessError:
            return status
        except InterruptedError:
            continue
        if reaped == pid:
            status = os.waitstatus_to_exitcode(code)
            print(f"worker exited with {status}", flush=True)
            # Give the rest of the tree a moment, then take it down with us.
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.kill(-1, sig)
                except ProcessLookupError:
                    break


def main() -> None:
    if sys.argv[1] == "--run":
        spec = json.loads(Path(sys.argv[2]).read_text())
        sys.exit(run_init(spec["argv"], spec["env"]))
    state = Path(sys.argv[1])
    spec = json.loads((state / "launch.json").read_text())
    # Host PID while the host's /proc is still visible: the agent and CRIU need it.
    (state / "init.pid.tmp").write_text(os.readlink("/proc/self"))
    os.replace(state / "init.pid.tmp", state / "init.pid")
    build_root(spec.get("shm_size", "2g"), devices.DeviceProfile.from_dict(spec.get("devices")))
    Path("/run/launch.json").write_text(json.dumps(spec))
    # Exec again so that no mapping of ours (python, its libraries) points into the old root's
    # mount, which CRIU could not find.
    os.execve(sys.executable, [sys.executable, "-m", "relocator.cell.init", "--run", "/run/launch.json"],
              {**os.environ})


if __name__ == "__main__":
    main()
