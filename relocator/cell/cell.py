"""A cell: one worker in its own PID, mount, IPC, UTS and network namespaces.

The worker's whole process tree then dumps and restores without PID or file collisions, even
while the original (stopped) processes still exist. A cell is described by a small JSON file
under the state directory, so whoever owns the node (an agent) can find it again after a
restart: cells are never the agent's children.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from adapters.base import DEFAULT_ENGINE
from relocator import procs, waits
from relocator.choices import Choice
from relocator.cell import devices, netns
from relocator.paths import state_dir, tail

REPO_ROOT = Path(__file__).resolve().parents[2]


class CellError(RuntimeError):
    pass


class CellFenced(CellError):
    """A fence (relocator.cell.fence: the cell's node was declared lost) came first: whoever
    is building the cell must not, and kills what it built."""


class CellState(Choice):
    """What a node's agent says of a cell (`cell_state`); LOST is the controller's word for a
    cell on a node Ray declared dead (no agent to ask)."""

    RUNNING = "running"
    STOPPED = "stopped"  # frozen: left stopped by a dump, resumable
    ABSENT = "absent"  # no such cell, or its tree is gone
    LOST = "lost"


def boot_id() -> str:
    """This host's boot id: a recorded PID means something only on the boot that wrote it."""
    return procs.boot_id()


_STATE_DIR_LOCK = threading.Lock()


@contextmanager
def using_state_dir(path: str | Path) -> Iterator[None]:
    """Act on another node's cell records (a local cluster keeps every node's state dir on
    this host): cleanup after `down`, leak checks, fencing a lost node."""
    with _STATE_DIR_LOCK:
        old = os.environ.get("RELOCATOR_STATE_DIR")
        os.environ["RELOCATOR_STATE_DIR"] = str(path)
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("RELOCATOR_STATE_DIR", None)
            else:
                os.environ["RELOCATOR_STATE_DIR"] = old


@dataclass
class Cell:
    id: str
    netns: str
    ip: str
    port: int
    init_pid: int
    engine: str = DEFAULT_ENGINE
    launch: dict[str, Any] = field(default_factory=dict)  # the engine LaunchSpec, as data
    origin: str = "launch"  # or "restore:<image>"
    created_at: float = field(default_factory=time.time)
    boot_id: str = field(default_factory=boot_id)  # the host boot its PIDs belong to
    #: its device profile (relocator.cell.devices.DeviceProfile as data); empty: no GPU
    devices: dict[str, Any] = field(default_factory=dict)
    #: when its init started (procs.started_at): a process with its PID that started at another
    #: time is someone else's (PIDs wrap around); None in records written before this field
    init_started: float | None = None

    def __post_init__(self) -> None:
        if self.init_started is None and procs.alive(self.init_pid) and self.boot_id == boot_id():
            self.init_started = procs.started_at(self.init_pid)

    @property
    def gpu_ids(self) -> list[int]:
        """Host indices of the GPUs this cell was given (empty on CPU)."""
        return devices.DeviceProfile.from_dict(self.devices).gpu_ids

    @property
    def endpoint(self) -> str:
        return f"http://{self.ip}:{self.port}"

    @property
    def dir(self) -> Path:
        return cells_dir() / self.id

    @property
    def log_path(self) -> Path:
        """The worker's log, inside the cell's private /run."""
        return procs.root(self.init_pid) / "run" / "worker.log"

    def log_tail(self, lines: int = 40) -> str:
        return tail(self.log_path, lines)

    # -- process tree ---------------------------------------------------------------------
    def pids(self) -> list[int]:
        """Host PIDs of the whole tree, init first."""
        return [self.init_pid, *procs.children(self.init_pid)]

    def is_alive(self) -> bool:
        if self.boot_id and self.boot_id != boot_id():
            return False  # recorded on another host or boot: its PID is someone else's now
        if not procs.alive(self.init_pid):
            return False
        if self.init_started is None:
            return True
        started = procs.started_at(self.init_pid)
        return started is not None and abs(started - self.init_started) < 1e-3

    def is_stopped(self) -> bool:
        return procs.all_stopped(self.pids())

    def state(self) -> CellState:
        if not self.is_alive():
            return CellState.ABSENT
        return CellState.STOPPED if self.is_stopped() else CellState.RUNNING

    def signal_tree(self, sig: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    def resume(self) -> None:
        """Continue a tree left stopped by a dump (after a failed restore elsewhere)."""
        self.signal_tree(signal.SIGCONT)

    def kill(self, timeout: float = 10.0) -> None:
        """Kill the whole tree and remove the cell's network namespace and record."""
        if self.is_alive():
            # PID 1 of a pid namespace: killing it kills every process in the namespace.
            try:
                os.kill(self.init_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            waits.gone(self.is_alive, timeout, every=0.05)
        netns.delete(self.netns)
        _remove_record(self.id)

    def save(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / "cell.json.tmp"
        tmp.write_text(json.dumps(asdict(self), indent=2))
        os.replace(tmp, self.dir / "cell.json")


def cells_dir() -> Path:
    return state_dir() / "cells"


def fence_marker(cell_id: str, state: Path | None = None) -> Path:
    """The file a fence of `cell_id` leaves under the state dir (`state`, default this node's):
    apart from the cell's own directory, so it outlives the records the fence removes. An agent
    cut off from the controller (its raylet died, the agent not yet) may still be starting the
    cell: this is how that start learns it must not."""
    return (state or state_dir()) / "fenced" / cell_id


def refuse_if_fenced(cell_id: str) -> None:
    """Raise CellFenced when `cell_id` was fenced: checked right before a cell is built."""
    if fence_marker(cell_id).exists():
        raise CellFenced(f"cell {cell_id} was fenced (its node was declared lost): not built")


def record_built(cell: Cell) -> Cell:
    """Record a cell just built; if a fence of it came first, kill it and raise CellFenced.
    Recorded before the check: a fence that marks it after the check finds the record."""
    cell.save()
    try:
        refuse_if_fenced(cell.id)
    except CellFenced:
        cell.kill()
        raise
    return cell


def _remove_record(cell_id: str) -> None:
    d = cells_dir() / cell_id
    for f in d.glob("*"):
        f.unlink(missing_ok=True)
    try:
        d.rmdir()
    except OSError:
        pass


def new_cell_id(prefix: str = "c") -> str:
    return f"{prefix}{uuid.uuid4().hex[:8]}"


def load_cell(cell_id: str) -> Cell:
    path = cells_dir() / cell_id / "cell.json"
    if not path.exists():
        raise CellError(f"no cell {cell_id!r} on this node (looked in {path.parent})")
    return Cell(**json.loads(path.read_text()))


def list_cells() -> list[Cell]:
    """Every cell recorded on this node (alive or not): what an agent re-adopts."""
    root = cells_dir()
    if not root.exists():
        return []
    cells = []
    for path in sorted(root.glob("*/cell.json")):
        try:
            cells.append(Cell(**json.loads(path.read_text())))
        except (OSError, ValueError, TypeError):
            continue
    return cells


def launch_cell(
    argv: list[str],
    env: dict[str, str],
    port: int,
    *,
    engine: str = DEFAULT_ENGINE,
    launch: dict[str, Any] | None = None,
    cell_id: str | None = None,
    shm_size: str = "2g",
    timeout: float = 20.0,
    gpu_ids: list[int] | None = None,
) -> Cell:
    """Start `argv` as a worker in a new cell listening on `port` inside its namespace.

    `gpu_ids`: host GPU indices the cell gets (their device nodes, driver view and environment,
    see relocator.cell.devices); none: a CPU cell, as before. An unknown index raises
    devices.DeviceError before anything is started.

    Returns once the cell's init has recorded its host PID; the worker itself may still be
    loading (use the engine adapter's readiness check on `cell.endpoint`).
    """
    # A cell replaces the host's /run and /dev/shm with its own tmpfs: code living there
    # would vanish inside it.
    for path in (sys.executable, str(REPO_ROOT), argv[0]):
        if os.path.abspath(path).startswith(("/run/", "/dev/shm/")):
            raise CellError(f"{path} is under /run or /dev/shm, which a cell replaces with its own tmpfs")
    profile = devices.profile_for(gpu_ids)
    cell_id = cell_id or new_cell_id()
    refuse_if_fenced(cell_id)
    link = netns.create(f"rl-{cell_id}")
    cdir = cells_dir() / cell_id
    cdir.mkdir(parents=True, exist_ok=True)
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "TMPDIR": "/run",
        "PYTHONPATH": str(REPO_ROOT),
        **env,
        **profile.env(),  # a GPU cell's CUDA ordinals are its own (0..n-1), never host indices
    }
    launch_record = {"argv": argv, "env": full_env, "shm_size": shm_size}
    if profile.gpus:
        launch_record["devices"] = profile.to_dict()
    (cdir / "launch.json").write_text(json.dumps(launch_record))
    (cdir / "init.pid").unlink(missing_ok=True)
    cmd = [
        "setsid", "-f", "ip", "netns", "exec", link.name,
        "unshare", "--pid", "--fork", "--mount", "--ipc", "--uts", "--propagation", "private",
        sys.executable, "-m", "relocator.cell.init", str(cdir),
    ]
    # the init's own errors (building the root) go to init.err in the cell's record; the init
    # drops that fd before the worker starts, so no host file stays open in the tree
    with open(cdir / "init.err", "ab") as err:
        subprocess.run(cmd, check=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
    pid_file = cdir / "init.pid"
    try:
        waits.until(pid_file.exists, timeout, every=0.02, what=f"cell {cell_id}'s init")
    except waits.WaitTimeout:
        netns.delete(link.name)
        raise CellError(f"cell {cell_id} did not start within {timeout:.0f}s: {tail(cdir / 'init.err', 20)}") from None
    cell = Cell(id=cell_id, netns=link.name, ip=link.cell_ip, port=port, init_pid=int(pid_file.read_text()),
                engine=engine, launch=launch or {}, devices=profile.to_dict() if profile.gpus else {})
    return record_built(cell)
