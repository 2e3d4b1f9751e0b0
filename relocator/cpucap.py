"""A hard CPU cap for background work beside a serving copy: the cgroup v1 `cpu` controller's
quota (cpu.cfs_quota_us), on one shared group per host (`relocator-lowstart`).

Why a cap and not a priority: on the 2-vCPU reference a handoff's target start (the warm image's
copy, CRIU filling ~1 GB of memory) took the CPU the source, the router and the clients need, and
the clients saw 0.6-1.3 s gaps although the start ran at nice 19 (issue 29). A nice value weighs
threads against the other threads of their session only (the kernel's autogroups share the CPU
between sessions first), and a start that wants a whole CPU gets it whenever the weights say so.
A quota bounds what the start can ever take, whatever else runs.

cgroup v1 lets a single thread join a group (its `tasks` file takes thread ids), so the agent's
start thread joins the group for the start and leaves it after; what it forks (CRIU, and the
tree CRIU restores with --manage-cgroups=ignore) stays in the group until `release` moves it
home. Where there is no v1 `cpu` hierarchy (a cgroup v2 only host) or it is not writable, nothing
is capped (said once in the log) and the start keeps its nice value alone.
"""

from __future__ import annotations

import logging
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from relocator import procs

log = logging.getLogger("relocator.cpucap")

#: the v1 cpu hierarchy (the reference: cgroup v1 with cpu mounted here)
CPU_ROOT = Path("/sys/fs/cgroup/cpu")
#: the shared group of every capped start on this host
GROUP = "relocator-lowstart"
PERIOD_US = 100_000
_said = threading.Event()


def _dir(cgroup: str) -> Path:
    return CPU_ROOT / cgroup.lstrip("/")


def cap_group(cpus: float, root: Path | None = None) -> Path | None:
    """The capped group, made or updated: at most `cpus` CPUs for all its tasks together; None
    where there is no writable v1 cpu hierarchy (said once)."""
    base = root or CPU_ROOT
    d = base / GROUP
    try:
        d.mkdir(exist_ok=True)
        (d / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (d / "cpu.cfs_quota_us").write_text(str(max(1000, int(cpus * PERIOD_US))))
        return d
    except OSError as exc:
        if not _said.is_set():
            _said.set()
            log.warning("no CPU cap for background starts (%s: %s): nice values only", d, exc)
        return None


def _move(tid: int, group: Path) -> bool:
    try:
        (group / "tasks").write_text(str(tid))
        return True
    except OSError:
        return False


@contextmanager
def this_thread_capped(cpus: float | None) -> Iterator[bool]:
    """Run the block with this thread (and what it forks) in the capped group at `cpus` CPUs,
    then move the thread back where it was (threads of a pool are reused); yields whether it
    is capped. None: unchanged."""
    group = cap_group(cpus) if cpus else None
    home = procs.cgroup_of()
    tid = threading.get_native_id()
    capped = group is not None and home is not None and _move(tid, group)
    try:
        yield capped
    finally:
        if capped and home is not None:
            _move(tid, _dir(home))


def release(pids: list[int]) -> int:
    """Move every thread of `pids` that is in the capped group to this process's own cpu group
    (the agent's: where a copy it starts normally runs); the threads moved."""
    home = procs.cgroup_of(os.getpid())
    if home is None:
        return 0
    n = 0
    for pid in pids:
        for tid in procs.thread_ids(pid):
            where = procs.cgroup_of(pid, tid)
            if where is not None and where.rstrip("/").endswith("/" + GROUP) and _move(tid, _dir(home)):
                n += 1
    return n


__all__ = ["CPU_ROOT", "GROUP", "cap_group", "release", "this_thread_capped"]
