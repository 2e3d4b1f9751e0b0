"""The preemption rule: what the controller does when a demand does not fit (the setting
`controller.preemption`, docs/scheduling.md). One of four, each a real policy of the
controller, so the scheduling benchmark compares schedulers, not scripts:

- `place-or-wait`: a queue and nothing else (no moves, no preemption): the demand waits until
  GPUs free up on one node (a FIFO-by-priority queue, as Kueue or Slurm without preemption);
- `evict-requeue`: a higher priority (or a worker past its time limit) evicts: the victim is
  killed (its in-flight requests fail: the work it had generated is lost) and requeued as a
  launch, which cold-starts when it fits again (Kubernetes / KAI eviction, Slurm REQUEUE);
- `suspend-in-place`: the victim is stopped where it is (SIGSTOP) and keeps its memory and its
  node: the preemptor runs on its GPUs; when they are free again it continues there, never
  anywhere else (Slurm's SUSPEND,GANG); its streams stall meanwhile;
- `moves` (the default): the fewest live moves make room, else lower priorities are suspended
  to the image store and resumed anywhere compatible later (docs/scheduling.md).

`plan` is pure (scheduling's view in, a Seating out). `SetAside` carries out a seating's
victims by the rule; `InPlace` pauses and continues workers for `suspend-in-place`.
"""

from __future__ import annotations

import logging
import signal
import time
import uuid
from typing import Any, Callable, Iterable

from relocator.controller import scheduling
from relocator.controller.claims import Claims, best_effort
from relocator.controller.events import EventKind
from relocator.controller.model import Demand, DemandKind, SuspendReason, WorkerRecord, WorkerState
from relocator.controller.scheduling import NodeView, Seat, Seating
from relocator.controller.states import transition
from relocator.controller.store import Store
from relocator.vocab import PreemptionRule

__all__ = ["InPlace", "PreemptionRule", "SetAside", "kept", "plan", "requeued_launch"]

log = logging.getLogger("relocator.controller")
S = WorkerState


def plan(rule: PreemptionRule, nodes: list[NodeView], seats: list[Seat], gpus: int, priority: int,
         max_moves: int = scheduling.DEFAULT_MAX_MOVES, policy: str = "best-fit",
         exclude: Iterable[str] = ()) -> Seating:
    """Where a demand of `gpus` GPUs at `priority` goes under `rule`: a node it fits on now,
    else (moves) the fewest live moves, else the fewest victims (`scheduling.preempt`: lower
    priorities, or past their time limit), set aside by the rule's way (`SetAside`); else pending."""
    rule = PreemptionRule(rule)
    exclude = tuple(exclude)
    if not any(n.gpus_total >= gpus for n in nodes if n.id not in scheduling.closed(nodes, exclude)):
        return Seating(None, reason=f"no node has {gpus} GPU(s) at all")
    node = scheduling.fits(nodes, gpus, policy, exclude=exclude)
    if node is not None:
        return Seating(node)
    if rule is PreemptionRule.PLACE_OR_WAIT:
        return Seating(None, reason=f"no node has {gpus} free GPU(s) (place-or-wait: no preemption)")
    seating = Seating(None, reason=f"no node has {gpus} free GPU(s)")
    if rule is PreemptionRule.MOVES:
        seating = scheduling.make_room(nodes, seats, gpus, max_moves=max_moves, policy=policy, exclude=exclude)
        if seating.node is not None:
            return seating
    if not any(scheduling.can_suspend(s, priority) for s in seats):
        return seating
    victims = scheduling.preempt(nodes, seats, gpus, priority, exclude=exclude)
    if victims.node is None:
        victims.reason = f"{seating.reason}; {victims.reason}"
    return victims


def requeued_launch(w: WorkerRecord, reason: str) -> Demand:
    """An evicted worker comes back as a new launch of the same id, model and priority."""
    return Demand(id=w.id, kind=DemandKind.LAUNCH, model=w.model, gpus=w.gpus, priority=w.priority,
                  engine=w.engine, model_dir=w.model_dir, time_limit_s=w.time_limit_s, reason=reason)


class SetAside:
    """A seating's victims, set aside by the rule: suspended to the image store (moves),
    killed and requeued (evict-requeue) or stopped in place (suspend-in-place)."""

    def __init__(self, rule: PreemptionRule, store: Store, backend: Any, claims: Claims, emit: Callable[..., Any],
                 router: Callable[[], Any], queue: Callable[[Demand, str], dict],
                 suspend: Callable[..., dict], free_gpus: Callable[[], dict[str, int]] = dict) -> None:
        self.rule, self.store, self.backend, self.claims, self.emit = PreemptionRule(rule), store, backend, claims, emit
        self.router, self.queue, self._suspend = router, queue, suspend
        self.in_place = InPlace(store, backend, claims, emit, free_gpus)

    def __call__(self, worker_id: str, reason: str = SuspendReason.PREEMPTED, by: str | None = None) -> dict:
        if self.rule is PreemptionRule.EVICT_REQUEUE:
            return self.evict(worker_id, reason, by)
        if self.rule is PreemptionRule.SUSPEND_IN_PLACE:
            return self.in_place.pause(worker_id, reason, by)
        return self._suspend(worker_id, reason=reason, by=by)

    def evict(self, worker_id: str, reason: str, by: str | None) -> dict:
        """Kill the worker (no checkpoint: its in-flight requests end with it) and requeue it as
        a launch that cold-starts when it fits."""
        t0 = time.monotonic()
        self.claims.take(worker_id, f"worker {worker_id} is busy")
        try:
            w = self.store.worker(worker_id)
            if w is None or w.state != S.RUNNING:
                raise RuntimeError(f"worker {worker_id} is {w.state if w else 'gone'}, not running")
            node = w.node
            best_effort(f"router: removing {worker_id}", lambda: self.router().remove_replica(worker_id))
            self.backend.kill(node, w.cell_id)
            if w.reservation:
                self.backend.free(w.reservation)
            self.store.delete_worker(worker_id)
            why = f"evicted ({SuspendReason(reason).value}{' by ' + by if by else ''})"
            self.queue(requeued_launch(w, why), why)
            out = {"worker": worker_id, "node": node, "reason": SuspendReason(reason).value, "by": by,
                   "seconds": round(time.monotonic() - t0, 3)}
            self.emit(EventKind.WORKER_EVICTED, **out)
            return out
        finally:
            self.claims.release(worker_id)
            self.claims.wake.set()


class InPlace:
    """suspend-in-place: a paused worker is stopped in its cell (its memory and node kept, its
    GPUs lent to the preemptor); the reconcile step continues it on the same node once that
    node has its GPUs free again. The scheduling view keeps those GPUs for it (`kept`)."""

    def __init__(self, store: Store, backend: Any, claims: Claims, emit: Callable[..., Any],
                 free_gpus: Callable[[], dict[str, int]] = dict) -> None:
        self.store, self.backend, self.claims, self.emit = store, backend, claims, emit
        self.free_gpus = free_gpus  # node -> GPUs nothing holds (Ray's view)

    def pause(self, worker_id: str, reason: str = SuspendReason.PREEMPTED, by: str | None = None) -> dict:
        t0 = time.monotonic()
        self.claims.take(worker_id, f"worker {worker_id} is busy")
        try:
            w = self.store.worker(worker_id)
            if w is None or w.state != S.RUNNING:
                raise RuntimeError(f"worker {worker_id} is {w.state if w else 'gone'}, not running")
            # the router is not told (a stock stack's stopped job): its streams in flight stall
            # until it continues (a hold or a removal would cut them); new requests go to the
            # replicas with the fewest in flight, which a stalled one is not
            self.backend.agents.signal(w.node, w.cell_id, int(signal.SIGSTOP))
            if w.reservation:
                self.backend.free(w.reservation)
            w.reservation = ""
            transition(w, S.PAUSED, f"paused in place ({SuspendReason(reason).value})", self.emit)
            w.suspend_reason, w.suspended_at = SuspendReason(reason).value, time.time()
            w.suspensions += 1
            self.store.save_worker(w)
            out = {"worker": w.id, "node": w.node, "reason": w.suspend_reason, "by": by, "in_place": True,
                   "seconds": round(time.monotonic() - t0, 3)}
            self.emit(EventKind.WORKER_SUSPENDED, **out)
            return out
        finally:
            self.claims.release(worker_id)
            self.claims.wake.set()

    def update(self) -> None:
        """Every paused worker whose node has its GPUs free again continues there (oldest first)."""
        paused = sorted((w for w in self.store.workers() if w.state == S.PAUSED and w.id not in self.claims.busy),
                        key=lambda w: w.suspended_at or 0.0)
        if not paused:
            return
        free = self.free_gpus()
        for w in paused:
            if free.get(w.node, 0) < w.gpus:
                continue
            try:
                self.unpause(w)
                free[w.node] -= w.gpus
            except Exception as exc:  # noqa: BLE001 - it stays paused; tried again next round
                log.info("paused %s does not continue yet: %s", w.id, exc)

    def unpause(self, w: WorkerRecord) -> dict:
        t0 = time.monotonic()
        self.claims.take(w.id, f"worker {w.id} is busy")
        try:
            name = f"relocator-{w.id}-p{uuid.uuid4().hex[:6]}"
            with self.claims.lock:
                self.claims.reservations.add(name)
            try:
                self.backend.reserve(w, w.node, name, timeout=2.0)
                w.reservation = name
                self.store.save_worker(w)  # owned from here on (update_reservations leaves it)
                self.backend.agents.signal(w.node, w.cell_id, int(signal.SIGCONT))  # its streams go on
            except BaseException:
                best_effort(f"freeing {name}", lambda: self.backend.free(name))
                w.reservation = ""
                self.store.save_worker(w)
                raise
            finally:
                with self.claims.lock:
                    self.claims.reservations.discard(name)
            paused_s = round(time.time() - (w.suspended_at or time.time()), 3)
            if w.deadline is not None:  # time stopped does not count toward its time limit
                w.deadline += time.time() - (w.suspended_at or time.time())
            w.suspend_reason, w.suspended_at = "", None
            transition(w, S.RUNNING, f"continued in place on {w.node}", self.emit)
            self.store.save_worker(w)
            out = {"worker": w.id, "node": w.node, "seconds": round(time.monotonic() - t0, 3),
                   "suspended_s": paused_s, "in_place": True}
            self.emit(EventKind.WORKER_RESUMED, **out)
            self.claims.wake.set()
            return out
        finally:
            self.claims.release(w.id)


def kept(workers: Iterable[WorkerRecord]) -> dict[str, int]:
    """GPUs per node that paused workers keep (no demand is seated on them)."""
    out: dict[str, int] = {}
    for w in workers:
        if w.state == S.PAUSED and w.node:
            out[w.node] = out.get(w.node, 0) + w.gpus
    return out
