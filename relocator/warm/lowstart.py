"""A start at low CPU priority: a handoff's target copy starts next to the serving source, and on
a host with few CPUs its start (CRIU restore of the warm image, the engine's health) took the
CPU from the source, the router and the clients (issue 29: the handoff's longest gap fell there).

The start runs with its thread at `nice` (procs.this_thread_niced: the CRIU restore or the cold
engine it forks inherits it); a restored tree is niced again once it exists (CRIU puts back each
thread's own nice from the image); a cold copy is at normal priority only while its warm image is captured (an image
must never carry the low priority into the next start). The controller sets the copy back to
normal once it has started (relocator.controller.transfers.handoff.to_normal): normal_nice."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, TypeVar

from relocator import cpucap, procs

log = logging.getLogger("relocator.warm")
T = TypeVar("T")


#: a low start from a warm image (its copy from a peer, CRIU's restore, the ready wait) takes at
#: most this many CPUs (relocator/cpucap.py): at nice 19 the copy and the restore beside a serving
#: source still took 0.3-1 CPU of the reference's 2, and the clients saw 0.6-1.3 s gaps (issue 29).
#: A cold start is not capped (a minute's work at a quarter CPU would outlast its ready wait).
START_CPUS = 0.25


def normal_nice() -> int:
    """The nice a copy started here has when nothing lowers it: this process's own (the agent's:
    Ray starts its workers at nice 15, and every cell inherits it), not 0."""
    return os.getpriority(os.PRIO_PROCESS, os.getpid())


def group_nice(nice: int) -> int:
    """The autogroup nice that goes with a copy's thread nice `nice`: 0 (every session's) for the
    normal one (normal_nice), else `nice` itself. The kernel weighs sessions against each other
    first (autogroups), so a thread nice alone moves a cell only against its own threads."""
    return 0 if nice == normal_nice() else nice


def set_priority(cell: Any, nice: int | None) -> int:
    """`cell`'s threads at `nice` and its session at group_nice(nice); None: normal again
    (normal_nice, the agent's own, and out of a low start's CPU cap); the threads changed (a
    handoff's source and target)."""
    pids = cell.pids()
    if nice is None:  # normal again: out of a low start's CPU cap too
        cpucap.release(pids)
    nice = normal_nice() if nice is None else nice
    return procs.set_nice(pids, nice, group=group_nice(nice))


def renice(cell: Any, nice: int | None) -> int:
    """Every thread of `cell`'s tree at `nice`, and its session's autogroup at group_nice(nice)
    (None: nothing); the threads changed. Best effort: a start never fails for it (logged)."""
    if nice is None:
        return 0
    try:
        return procs.set_nice(cell.pids(), nice, group=group_nice(nice))
    except Exception as exc:  # noqa: BLE001 - a priority is never worth a failed start
        log.warning("cell %s not set to nice %d: %s", getattr(cell, "id", "?"), nice, exc)
        return 0


def captured_at_normal(cell: Any, nice: int | None, capture: Callable[[], T]) -> T:
    """`capture()` (the warm image of a cold copy) with `cell` at normal priority (normal_nice),
    then back at `nice`: CRIU keeps each thread's nice in the image, and every later start from it
    would inherit it."""
    if nice is None:
        return capture()
    renice(cell, normal_nice())
    try:
        return capture()
    finally:
        renice(cell, nice)


__all__ = ["START_CPUS", "captured_at_normal", "group_nice", "normal_nice", "renice", "set_priority"]
