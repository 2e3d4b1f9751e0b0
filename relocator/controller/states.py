"""A worker's state changes in one place: `transition` checks the edge and reports it."""

from __future__ import annotations

import logging
from typing import Any, Callable

from relocator.controller.model import WorkerRecord, WorkerState

log = logging.getLogger("relocator.controller")
S = WorkerState

#: states in which a worker holds GPUs on its node (through its reservation)
HOLDING_STATES = frozenset({S.STARTING, S.RUNNING, S.RELOCATING, S.REPLACING, S.SUSPENDING, S.RESUMING})

#: every edge a worker record may take (the relocation machine's RUNNING -> RELOCATING -> RUNNING
#: | LOST is written by machine.settle_worker and listed here too)
EDGES: dict[WorkerState, frozenset[WorkerState]] = {
    S.STARTING: frozenset({S.RUNNING}),
    S.RUNNING: frozenset({S.LOST, S.RELOCATING, S.SUSPENDING, S.PAUSED}),
    S.RELOCATING: frozenset({S.RUNNING, S.LOST}),
    S.LOST: frozenset({S.REPLACING, S.FAILED}),
    S.REPLACING: frozenset({S.RUNNING, S.FAILED, S.LOST}),
    S.SUSPENDING: frozenset({S.RUNNING, S.SUSPENDED, S.LOST}),
    S.SUSPENDED: frozenset({S.RESUMING}),
    S.RESUMING: frozenset({S.RUNNING, S.SUSPENDED}),
    S.FAILED: frozenset(),
    S.PAUSED: frozenset({S.RUNNING}),  # continued in place (preemption.InPlace)
}


class BadTransition(RuntimeError):
    pass


def allowed(frm: WorkerState, to: WorkerState) -> bool:
    return frm == to or to in EDGES[frm]


def transition(w: WorkerRecord, to: WorkerState, why: str,
               emit: Callable[..., Any] | None = None) -> WorkerRecord:
    """Set `w.state` to `to` (not saved: the caller saves the record with its other fields).
    An edge not in EDGES raises BadTransition; a change is logged and, with `emit`, an event."""
    frm, to = WorkerState(w.state), WorkerState(to)
    if not allowed(frm, to):
        raise BadTransition(f"worker {w.id}: {frm.value} -> {to.value} is not allowed ({why})")
    w.state = to
    if frm != to:
        log.info("worker %s: %s -> %s (%s)", w.id, frm.value, to.value, why)
        if emit is not None:
            from relocator.controller.events import EventKind

            emit(EventKind.WORKER_STATE, worker=w.id, node=w.node, **{"from": frm.value, "to": to.value}, why=why)
    return w
