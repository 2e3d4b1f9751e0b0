"""Drain: every worker off a node, live, `parallel` moves at a time; with a deadline the node is
cordoned and what cannot move (no room, or too late) is suspended instead."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from relocator.controller.claims import collect_into
from relocator.controller import scheduling
from relocator.controller.inventory import NodeInfo, best_fit
from relocator.controller.model import RUNNING, SuspendReason, TransferMode, WorkerState, parse_duration
from relocator.controller.scheduling import NodeView
from relocator.controller.store import Store
from relocator.waits import until

POLL_S = 0.2  # how often the running moves are looked at


def deadline_of(by: float | str | None) -> float | None:
    """An epoch time, or a duration from now (600, "10m")."""
    if by is None:
        return None
    try:
        epoch = float(by)
    except (TypeError, ValueError):
        epoch = 0.0
    return epoch if epoch > 1e9 else time.time() + parse_duration(by)


class DrainManager:
    def __init__(self, store: Store, inventory: Callable[..., dict[str, NodeInfo]],
                 nodes_view: Callable[[], list[NodeView]], cordon: Callable[[str, float], None], policy: Any,
                 relocate: Callable[..., dict], suspend: Callable[..., dict]) -> None:
        self.store, self.inventory, self.nodes_view, self.cordon = store, inventory, nodes_view, cordon
        self.policy, self.relocate, self.suspend = policy, relocate, suspend

    def drain(self, node: str, parallel: int = 1, transfer: str | None = None, by: float | str | None = None) -> dict:
        """See Controller.drain."""
        if node not in self.inventory():
            raise ValueError(f"unknown node {node!r}")
        transfer = TransferMode(transfer) if transfer is not None else None
        deadline = deadline_of(by)
        if deadline is not None:
            self.cordon(node, deadline)
        t0 = time.monotonic()
        plan, suspend = self.plan(node, deadline)
        results, suspended = self._run(plan, suspend, parallel, transfer, deadline)
        left = [w.id for w in self.store.workers() if w.node == node]
        return {"node": node, "relocations": results, "suspended": suspended, "workers_left": left,
                "drained": not left, "seconds": round(time.monotonic() - t0, 3),
                "by": deadline, "met_deadline": None if deadline is None else time.time() <= deadline}

    def plan(self, node: str, deadline: float | None) -> tuple[list[tuple[str, str]], list[str]]:
        """Every target up front (evacuation), biggest first; workers past their time limit
        last: when room runs out, they are the ones set aside. Returns (moves, suspends)."""
        todo = [w for w in self.store.workers() if w.node == node and w.state == WorkerState.RUNNING]
        now = time.time()
        todo.sort(key=lambda w: (w.past_deadline(now), -w.gpus))
        view = self.nodes_view()
        shut = scheduling.closed(view, (node,))  # the drained node and every cordoned one
        free = {n.id: n.gpus_free for n in view if n.id not in shut}
        totals = {n.id: n.gpus_total for n in view if n.id not in shut}
        plan: list[tuple[str, str]] = []
        suspend: list[str] = []
        for w in todo:
            dst = best_fit(free, w.gpus, totals=totals, policy=self.policy)
            if dst is None:
                if deadline is None:
                    raise RuntimeError(f"cannot drain {node}: no room for {w.id} ({w.gpus} GPU) elsewhere")
                suspend.append(w.id)
                continue
            free[dst] -= w.gpus
            plan.append((w.id, dst))
        return plan, suspend

    def _set_aside(self, out: list[dict], wids: list[str]) -> None:
        for wid in wids:
            collect_into(out, wid, lambda wid=wid: self.suspend(wid, reason=SuspendReason.DRAIN))

    def _run(self, plan: list[tuple[str, str]], suspend: list[str], parallel: int, transfer: TransferMode | None,
             deadline: float | None) -> tuple[list[dict], list[dict]]:
        run = _Run(pending=list(plan), set_aside=list(suspend))
        until(lambda: self._round(run, parallel, transfer, deadline), None, every=POLL_S, what="the drain's moves")
        return run.results, run.suspended

    def _round(self, run: "_Run", parallel: int, transfer: TransferMode | None, deadline: float | None) -> bool:
        """Moves started up to `parallel`, finished ones collected; True once none is left."""
        while run.pending and len(run.running) < max(1, parallel):
            wid, dst = run.pending.pop(0)
            if deadline is not None and time.time() >= deadline:  # too late to move: set aside
                self._set_aside(run.suspended, [wid])
                continue
            run.running.append(self.relocate(wid, to=dst, transfer=transfer, wait=False)["id"])
        if run.set_aside is not None:  # suspended only once the first moves are recorded: their
            self._set_aside(run.suspended, run.set_aside)  # requeued resumes must not take the GPUs
            run.set_aside = None  # these moves were planned onto
        for rid in list(run.running):
            rel = self.store.relocation(rid)
            if rel.result != RUNNING:
                run.running.remove(rid)
                run.results.append(rel.summary())
        return not (run.pending or run.running)


@dataclass
class _Run:
    """One drain's moves while they run."""

    pending: list[tuple[str, str]]
    set_aside: list[str] | None  # to suspend after the first moves started (None: done)
    running: list[str] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    suspended: list[dict] = field(default_factory=list)
