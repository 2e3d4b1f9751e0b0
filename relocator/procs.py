"""The host's process table from /proc: who runs what, and whose children they are."""

from __future__ import annotations

import os
from pathlib import Path


def process_table() -> dict[int, tuple[int, list[str]]]:
    """{pid: (ppid, argv)} of every process readable now."""
    out: dict[int, tuple[int, list[str]]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = Path(f"/proc/{d}/cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        out[int(d)] = (ppid, argv[:-1] if argv and argv[-1] == "" else argv)
    return out


def status_bytes(pids: list[int], fields: tuple[str, ...] = ("VmRSS",)) -> int:
    """The sum of `fields` (kB lines of /proc/<pid>/status: VmRSS, VmSwap, ...) over `pids`, in
    bytes; a process gone meanwhile counts 0."""
    keys = tuple(f"{f}:" for f in fields)
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(keys):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def descendants(root: int, table: dict[int, tuple[int, list[str]]]) -> list[int]:
    """Every process below `root` (not `root` itself)."""
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def criu_processes(table: dict[int, tuple[int, list[str]]], *needles: str) -> list[int]:
    """PIDs of `criu` runs whose arguments contain every one of `needles` (as whole arguments
    or inside one)."""
    return [pid for pid, (_, argv) in table.items()
            if argv and argv[0].endswith("criu") and all(any(n in a for a in argv) for n in needles)]
