"""Fencing: stop the cells of a node whose agent cannot be asked (its node was declared lost).

A lost node's copy of a worker must never come back to serve next to its replacement. When the
node's state directory is readable from here and its records were written on this very boot
(a local multi-node cluster, or the node itself after a restart), the cells are killed here:
their trees, any `criu restore` still building one, their network namespaces and records.
Records from another host cannot be acted on; they are reported as `unreachable` (the node's
agent forgets them when it comes back, and the controller kills cells no worker owns).

A lost node's agent may still be running (Ray declared its raylet dead; the actor process
lives on for a while) and in the middle of starting one of the fenced cells: copying its warm
image, before its CRIU, or falling back to a cold start once its CRIU was killed. So a fence
first leaves a marker (cell.fence_marker) that every start checks right before it builds a
cell and right after it recorded one (cell.refuse_if_fenced, cell.record_built), then sweeps,
and sweeps again while it still finds something running.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path
from typing import Iterable

from relocator import waits
from relocator.cell import netns
from relocator.cell.cell import boot_id, fence_marker, list_cells, using_state_dir
from relocator.procs import alive, criu_processes, descendants, process_table

#: how long a fence sweeps again while the last sweep still found something running (a CRIU
#: restore killed mid-way, a start that passed its check right before the marker was written)
SETTLE_S = 5.0
SWEEP_EVERY_S = 0.2


def _criu_for(needles: list[str]) -> list[int]:
    """PIDs of `criu` runs working in one of `needles` (cell directories), and their children:
    CRIU itself (argv[0]) and, before it exec'd, its `unshare … sh -c … criu restore` wrapper
    (snapshot.criu.restore), whose arguments already name the cell's directory."""
    table = process_table()
    roots = {pid for n in needles for pid in criu_processes(table, n, wrapped=True)}
    return sorted(roots | {k for r in roots for k in descendants(r, table)})


def _kill(pids: list[int]) -> bool:
    """SIGKILL each of `pids`; whether one was still running (a zombie has exited already)."""
    running = False
    for pid in pids:
        running |= alive(pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return running


def fence_cells(state_dir: str | Path, cell_ids: Iterable[str] | None = None) -> dict[str, list[str]]:
    """Kill the recorded cells under `state_dir` (all, or only `cell_ids`) that belong to this
    boot, and whatever is still building one of them. Returns {"killed": [...], "unreachable": [...]}."""
    state = Path(state_dir)
    out: dict[str, list[str]] = {"killed": [], "unreachable": []}
    if not state.exists():
        return out
    cells_root = state / "cells"
    if cell_ids is None:  # all of the node's: every cell directory (a start makes it before CRIU)
        ids = {d.name for d in cells_root.iterdir() if d.is_dir()} if cells_root.is_dir() else set()
        needles = [f"{cells_root}/"]
    else:
        ids = set(cell_ids)
        # with the slash: CRIU's log and pidfile are in the cell dir, another cell's never are
        needles = [f"{cells_root / c}/" for c in ids]
    for cid in ids:  # first: a start of one of them from now on refuses to build it
        marker = fence_marker(cid, state)
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
    # again while a sweep still finds something running: what it killed may have been forking
    waits.settle(lambda: not _sweep(state, ids, needles, out), SETTLE_S, every=SWEEP_EVERY_S)
    return out


def _sweep(state: Path, ids: set[str], needles: list[str], out: dict[str, list[str]]) -> bool:
    """One pass over `ids`: CRIU runs first (a restore still building a tree has no record yet),
    then the recorded cells, then the network namespaces of the unrecorded ones. True when it
    found something running (a start may still be building: sweep again)."""
    running = _kill(_criu_for(needles))
    me = boot_id()
    done: set[str] = set()
    with using_state_dir(state):
        for cell in list_cells():
            if cell.id not in ids or cell.id in out["unreachable"]:
                continue
            if cell.boot_id and cell.boot_id != me:
                out["unreachable"].append(cell.id)
                continue
            running |= cell.is_alive()
            cell.kill()
            done.add(cell.id)
    for cid in sorted(ids - done - set(out["unreachable"])):
        if _kill_netns_tree(f"rl-{cid}"):  # restored, but its record was not written yet
            running = True
            done.add(cid)
        shutil.rmtree(state / "cells" / cid, ignore_errors=True)
    out["killed"] = sorted(set(out["killed"]) | done)
    return running


def _kill_netns_tree(name: str) -> bool:
    """Kill every process inside network namespace `name` (a cell's tree), then remove it."""
    found = _kill(netns.pids(name))
    netns.delete(name)
    return found
