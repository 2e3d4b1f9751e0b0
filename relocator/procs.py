"""The tree's one process module: liveness, command lines, memory, namespaces and process tables
(on psutil), and the few host facts read from /proc. No other module reads /proc.

Every reader answers "nothing" (False, [], None, 0) for a process that is gone or unreadable:
processes come and go between two calls, and callers treat that as the ordinary case.

Code that runs under `python -S` (the post-copy keeper and pump) cannot import psutil and keeps
its own few stdlib readers: see relocator/agent/postcopy/keeper.py.
"""

from __future__ import annotations

import os
import re
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import psutil

_GONE = (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError, ValueError)
_DEAD = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
_STOPPED = (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)


def _proc(pid: int | None) -> psutil.Process | None:
    if not pid or pid <= 0:  # never a process group or "every process"
        return None
    try:
        return psutil.Process(pid)
    except _GONE:
        return None


def status(pid: int | None) -> str | None:
    """psutil's status of `pid` ('running', 'sleeping', 'stopped', 'zombie', ...); None: gone."""
    p = _proc(pid)
    try:
        return p.status() if p else None
    except _GONE:
        return None


def alive(pid: int | None) -> bool:
    """`pid` exists and is not a zombie (a zombie has exited: only its parent's wait is left)."""
    return status(pid) not in (None, *_DEAD)


def started_at(pid: int | None) -> float | None:
    """When `pid` started (psutil's create_time: boot time + the start ticks of /proc/<pid>/stat,
    the same number for the same process every time); None: gone. With `pid` it names one
    process: PIDs are reused (pid_max is 32768 on the machines we run on; CI wrapped around)."""
    p = _proc(pid)
    try:
        return p.create_time() if p else None
    except _GONE:
        return None


def stopped(pid: int | None) -> bool:
    """`pid` is stopped (SIGSTOP, or by a tracer such as CRIU)."""
    return status(pid) in _STOPPED


def cmdline(pid: int | None) -> list[str]:
    """The argument vector of `pid`; [] when gone or a kernel thread."""
    p = _proc(pid)
    try:
        return p.cmdline() if p else []
    except _GONE:
        return []


def name(pid: int | None) -> str:
    """The short command name (comm) of `pid`; '' when gone."""
    p = _proc(pid)
    try:
        return p.name() if p else ""
    except _GONE:
        return ""


def environ(pid: int | None) -> dict[str, str]:
    """The environment `pid` started with; {} when gone or not ours to read."""
    p = _proc(pid)
    try:
        return p.environ() if p else {}
    except _GONE:
        return {}


def children(pid: int | None, recursive: bool = True) -> list[int]:
    """The PIDs below `pid` (all generations unless `recursive` is False), not `pid` itself."""
    p = _proc(pid)
    try:
        return [c.pid for c in p.children(recursive=recursive)] if p else []
    except _GONE:
        return []


def autogroup(pid: int) -> tuple[str, int] | None:
    """(name, nice) of `pid`'s scheduler autogroup (/proc/PID/autogroup); None: gone, or none."""
    try:
        name, _, nice = Path(f"/proc/{pid}/autogroup").read_text().split()
        return name, int(nice)
    except (OSError, ValueError):
        return None


def set_group_nice(pids: list[int], nice: int) -> list[str]:
    """Set the nice value of the scheduler autogroups of `pids` (with autogroups on, the kernel
    shares the CPU between sessions first, whatever each thread's own nice: a cell, its own
    session, weighed no more than the raylets' beside it however its threads were niced), never
    this process's own (the agent's, shared with the raylets and the router); the groups set."""
    mine = autogroup(os.getpid())
    done: list[str] = []
    for pid in pids:
        g = autogroup(pid)
        if g is None or g[0] in done or (mine is not None and g[0] == mine[0]):
            continue
        try:
            Path(f"/proc/{pid}/autogroup").write_text(str(nice))
            done.append(g[0])
        except OSError:
            pass
    return done


def cgroup_of(pid: int | None = None, tid: int | None = None, controller: str = "cpu") -> str | None:
    """The cgroup v1 path ("/", "/a/b") of `controller` for thread `tid` of `pid` (cgroup v1
    places threads one by one); both None: the calling thread; `tid` None: `pid`'s main thread.
    None: gone, or no such hierarchy."""
    if pid is None:
        path = Path("/proc/thread-self/cgroup")
    else:
        path = Path(f"/proc/{pid}/task/{tid or pid}/cgroup")
    try:
        for line in path.read_text().splitlines():
            _, ctrls, where = line.split(":", 2)
            if controller in ctrls.split(","):
                return where
    except (OSError, ValueError):
        return None
    return None


def thread_ids(pid: int) -> list[int]:
    """The thread ids of `pid`; [] if gone."""
    p = _proc(pid)
    try:
        return [t.id for t in p.threads()] if p else []
    except _GONE:
        return []


def set_nice(pids: list[int], nice: int, group: int | None = None) -> int:
    """Set the nice value of every thread of `pids` (Linux schedules threads: a process's
    setpriority moves its main thread only), and with `group` their autogroups' (set_group_nice);
    the threads changed. Gone or not allowed: skipped."""
    if group is not None:
        set_group_nice(pids, group)
    n = 0
    for pid in pids:
        for tid in thread_ids(pid):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                n += 1
            except OSError:
                pass
    return n


@contextmanager
def this_thread_niced(nice: int | None = 19) -> Iterator[None]:
    """Run the block with this thread at `nice` (background work that must not take the CPU
    from what serves or moves), then put its old value back (threads of a pool are reused).
    None: unchanged."""
    if nice is None:
        yield
        return
    tid = threading.get_native_id()
    old = os.getpriority(os.PRIO_PROCESS, tid)
    try:
        os.setpriority(os.PRIO_PROCESS, tid, nice)
    except OSError:
        pass
    try:
        yield
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, old)
        except OSError:  # lowering a nice needs CAP_SYS_NICE: an unprivileged agent stays niced
            pass


def tree(pid: int | None) -> list[int]:
    """`pid` and every process below it, `pid` first; [] when `pid` is gone."""
    return [pid, *children(pid)] if pid and alive(pid) else []


def namespace(kind: str, pid: int | str = "self") -> str | None:
    """The `kind` namespace ('net', 'mnt', 'pid', ...) of `pid` (this process by default), as
    its link reads ('net:[4026531840]'), to tell whose a process is; None: gone or none."""
    try:
        return os.readlink(f"/proc/{pid}/ns/{kind}") if pid else None
    except OSError:
        return None


def pid_ns(pid: int | None) -> str | None:
    """The PID namespace of `pid` ('pid:[4026531836]'); None: gone."""
    return namespace("pid", pid) if pid else None


def all_stopped(pids: list[int]) -> bool:
    """Every one of `pids` still there is stopped, and one at least is there."""
    states = [s for s in map(status, pids) if s is not None]
    return bool(states) and all(s in _STOPPED for s in states)


def maps_text(pid: int) -> str:
    """`/proc/<pid>/maps` (its mappings, one a line); '' when gone."""
    try:
        return Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return ""


def process_table() -> dict[int, tuple[int, list[str]]]:
    """{pid: (ppid, argv)} of every process readable now."""
    out: dict[int, tuple[int, list[str]]] = {}
    for p in psutil.process_iter():
        try:
            out[p.pid] = (p.ppid(), p.cmdline())
        except _GONE:
            continue
    return out


def _status_kb(pid: int, keys: tuple[str, ...]) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(keys):
            total += int(line.split()[1])
    return total


def status_bytes(pids: list[int], fields: tuple[str, ...] = ("VmRSS",)) -> int:
    """The sum of `fields` (kB lines of /proc/<pid>/status: VmRSS, VmSwap, ...) over `pids`, in
    bytes; a process gone meanwhile counts 0. (VmSwap is in psutil only through smaps, which
    costs a walk of every mapping: the status file is what the callers need, cheaply.)"""
    keys = tuple(f"{f}:" for f in fields)
    total = 0
    for pid in pids:
        try:
            total += _status_kb(pid, keys) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def rss_bytes(pids: list[int]) -> int:
    """The resident memory of `pids` together, in bytes; a process gone meanwhile counts 0."""
    total = 0
    for pid in pids:
        p = _proc(pid)
        try:
            total += p.memory_info().rss if p else 0
        except _GONE:
            continue
    return total


def descendants(root: int, table: dict[int, tuple[int, list[str]]]) -> list[int]:
    """Every process below `root` in `table` (not `root` itself)."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def criu_processes(table: dict[int, tuple[int, list[str]]], *needles: str, wrapped: bool = False) -> list[int]:
    """PIDs of `criu` runs whose arguments contain every one of `needles` (as whole arguments
    or inside one); `wrapped`: also a command that names criu among its arguments, not only as
    its program (snapshot.criu's `unshare … sh -c … criu restore`, before it exec'd criu)."""
    return [pid for pid, (_, argv) in table.items()
            if argv and any(a.endswith("criu") for a in (argv if wrapped else argv[:1]))
            and all(any(n in a for a in argv) for n in needles)]


# -- host facts -----------------------------------------------------------------------------------
def listening_unix_paths(table: str = "/proc/net/unix") -> set[str]:
    """Paths of the unix sockets something listens on now (this network namespace's table;
    Flags bit 16, __SO_ACCEPTCON): a socket file not among them is left over."""
    out = set()
    try:
        lines = Path(table).read_text().splitlines()[1:]
    except OSError:
        return out
    for line in lines:
        parts = line.split()
        if len(parts) >= 8 and int(parts[3], 16) & (1 << 16) and parts[7].startswith("/"):
            out.add(parts[7])
    return out


def boot_id() -> str:
    """This boot of this host (a PID recorded under another boot is someone else's now)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def cpuinfo(field: str) -> str | None:
    """The value of the first `field` line of /proc/cpuinfo ('model name', 'flags'); None if none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(field) and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def root(pid: int) -> Path:
    """The root directory `pid` sees (a cell's, from the host): /proc/<pid>/root."""
    return Path(f"/proc/{pid}/root")


def ns_inode(kind: str, pid: int | str = "self") -> int | None:
    """The inode of `pid`'s `kind` namespace (what CRIU's --external net[...] names); None: gone."""
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _unescape(field: str) -> str:
    """A mounts field with its octal escapes (\\040 for a space, ...) undone."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mountinfo() -> str:
    """/proc/self/mountinfo (mount ids, roots, options, one mount a line); '' if unreadable."""
    try:
        return Path("/proc/self/mountinfo").read_text()
    except OSError:
        return ""


def mounts() -> list[tuple[str, str, str]]:
    """(device, mount point, type) of every mount this process sees, in mount order."""
    try:
        lines = Path("/proc/self/mounts").read_text().splitlines()
    except OSError:
        return []
    return [(_unescape(p[0]), _unescape(p[1]), p[2]) for p in (line.split() for line in lines) if len(p) >= 3]


def fs_type(path: str | Path) -> str | None:
    """The type of the filesystem holding `path` (the longest mount point above it); None: unknown."""
    target = str(Path(path).resolve())
    best, kind = "", None
    for _dev, mnt, typ in mounts():
        if (target == mnt or target.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, kind = mnt, typ
    return kind


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo, in bytes; None: unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def has_capability(bit: int) -> bool:
    """This process holds capability `bit` (CapEff of /proc/self/status)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> bit & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def sysctl(name: str) -> str | None:
    """A kernel setting by its dotted name ('fs.pipe-max-size'), from /proc/sys; None: unreadable."""
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None
