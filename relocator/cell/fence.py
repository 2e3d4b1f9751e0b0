"""Fencing: stop the cells of a node whose agent cannot be asked (its node was declared lost).

A lost node's copy of a worker must never come back to serve next to its replacement. When the
node's state directory is readable from here and its records were written on this very boot
(a local multi-node cluster, or the node itself after a restart), the cells are killed here:
their trees, any `criu restore` still building one, their network namespaces and records.
Records from another host cannot be acted on; they are reported as `unreachable` (the node's
agent forgets them when it comes back, and the controller kills cells no worker owns).
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Iterable

from relocator.cell import netns
from relocator.cell.cell import boot_id, list_cells, using_state_dir
from relocator.procs import criu_processes, descendants, process_table


def _criu_for(cell_dirs: list[str]) -> list[int]:
    """PIDs of `criu` processes (and their children) working on one of `cell_dirs`."""
    table = process_table()
    roots = {pid for cd in cell_dirs for pid in criu_processes(table, cd)}
    return sorted(roots | {k for r in roots for k in descendants(r, table)})


def fence_cells(state_dir: str | Path, cell_ids: Iterable[str] | None = None) -> dict[str, list[str]]:
    """Kill the recorded cells under `state_dir` (all, or only `cell_ids`) that belong to this
    boot. Returns {"killed": [...], "unreachable": [...]}."""
    state = Path(state_dir)
    wanted = set(cell_ids) if cell_ids is not None else None
    me = boot_id()
    out: dict[str, list[str]] = {"killed": [], "unreachable": []}
    if not state.exists():
        return out
    cells_root = state / "cells"
    dirs = [str(cells_root / c) for c in wanted] if wanted is not None else [str(cells_root)]
    for pid in _criu_for(dirs):  # a restore still building a tree has no record yet
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    with using_state_dir(state):
        for cell in list_cells():
            if wanted is not None and cell.id not in wanted:
                continue
            if cell.boot_id and cell.boot_id != me:
                out["unreachable"].append(cell.id)
                continue
            cell.kill()
            out["killed"].append(cell.id)
    for cid in sorted((wanted or set()) - set(out["killed"]) - set(out["unreachable"])):
        if _kill_netns_tree(f"rl-{cid}"):  # restored, but its record was not written yet
            out["killed"].append(cid)
        shutil.rmtree(cells_root / cid, ignore_errors=True)
    return out


def _kill_netns_tree(name: str) -> bool:
    """Kill every process inside network namespace `name` (a cell's tree), then remove it."""
    found = netns.pids(name)
    for pid in found:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    netns.delete(name)
    return bool(found)
