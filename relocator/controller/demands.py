"""Demands: GPUs wanted and not yet held (a launch that did not fit, a suspended worker to
resume). Planned on the scheduling view (scheduling.py, the planner's code), seated by making
room (live moves, else suspends of lower priority), queued when they cannot be met, retried by
the reconcile loop when capacity changes."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from relocator import shares
from relocator.controller import preemption, scheduling
from relocator.controller.claims import Claims, collect
from relocator.controller.events import EventKind
from relocator.controller.inventory import NodeInfo
from relocator.controller.machine import check_faults
from relocator.controller.model import (DONE, RUNNING, Demand, DemandKind, DemandState, SuspendReason, WorkerRecord,
                                        WorkerState, parse_duration)
from relocator.controller.scheduling import NodeView, Seat, Seating
from relocator.controller.states import HOLDING_STATES
from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")
DEMAND_RETRY_S = 30.0  # a pending demand is retried when capacity changes, and at least this often


@dataclass
class Seaters:
    """How a planned demand gets its worker: the calls of the workers', suspensions' and
    relocations' managers this one needs (narrow: nothing else of them)."""

    claim: Callable[..., WorkerRecord]  # (demand, node, timeout) -> a claimed new worker
    start: Callable[..., dict]  # (worker, demand, t0, extra) -> a started worker
    claim_resume: Callable[..., WorkerRecord]  # (worker, node, timeout) -> a claimed suspended worker
    restore: Callable[..., dict]  # (worker, demand, t0, extra) -> a resumed worker
    suspend: Callable[..., dict]  # (worker_id, reason, by) -> the suspend's summary
    run_moves: Callable[..., list[dict]]  # (moves, faults=) -> each move's summary


class DemandManager:
    def __init__(self, store: Store, claims: Claims, emit: Callable[..., Any],
                 inventory: Callable[..., dict[str, NodeInfo]], cordoned: Callable[[], set[str]],
                 policy: str, max_moves: int, seaters: Seaters | None = None,
                 spawn: Callable[..., None] | None = None,
                 rule: preemption.PreemptionRule = preemption.PreemptionRule.MOVES) -> None:
        self.store, self.claims, self.emit = store, claims, emit
        self.inventory, self.cordoned, self.policy, self.max_moves = inventory, cordoned, policy, max_moves
        self.rule = preemption.PreemptionRule(rule)  # what a demand that does not fit does
        self.seaters = seaters  # set by the controller once every manager exists
        #: why a request can never fit on this cluster (why.never_fits; None: it may), set by the controller
        self.refuse: Callable[[float], str | None] | None = None
        self.spawn = spawn or (lambda fn, todo: threading.Thread(target=fn, args=(todo,), name="demands",
                                                                 daemon=True).start())
        self._retrying = threading.Event()
        self._sig: tuple | None = None
        self._tried_at = 0.0
        self._announced: set[tuple[str, float]] = set()  # (worker, deadline) announced preemptible

    # -- the scheduling view ------------------------------------------------------------------
    def view(self) -> tuple[list[NodeView], list[Seat]]:
        """Live nodes (free GPUs: the lower of Ray's view and the records', as either may lag
        the other) and the workers holding GPUs on them."""
        nodes = {n.id: n for n in self.inventory(refresh=True).values() if n.alive}
        workers = self.store.workers()
        held: dict[str, float] = {}
        for w in workers:
            if w.node in nodes and w.reservation and w.state in HOLDING_STATES:
                held[w.node] = held.get(w.node, 0) + w.gpus
        sizes: dict[str, int] = {}
        for r in self.store.relocations():
            if r.image_bytes:
                sizes[r.worker] = r.image_bytes
            # a running move's target GPUs are claimed from the moment it is recorded (before
            # its RESERVE): a pending demand must not take them meanwhile
            if r.result == RUNNING and r.dst in nodes:
                held[r.dst] = held.get(r.dst, 0) + next((w.gpus for w in workers if w.id == r.worker), 0)
        for node, gpus in preemption.kept(workers).items():  # paused in place: theirs when free again
            held[node] = held.get(node, 0) + gpus
        cordoned = self.cordoned()  # nothing is planned onto them (scheduling.closed)
        view = [NodeView(n.id, n.gpus_total, shares.count(max(0, min(n.gpus_free, n.gpus_total - held.get(n.id, 0)))),
                         cordoned=n.id in cordoned)
                for n in nodes.values()]
        now = time.time()
        seats = [Seat(w.id, w.node, w.gpus, w.priority,
                      movable=w.state == WorkerState.RUNNING and w.id not in self.claims.busy,
                      bytes=sizes.get(w.id, 0), expired=w.past_deadline(now),
                      suspendable=not w.suspend_backing_off(now), gpu_ids=tuple(w.gpu_ids))
                 for w in workers if w.node in nodes and w.reservation and w.state in HOLDING_STATES]
        return view, seats

    def place(self, gpus: float, exclude: tuple[str, ...] = ()) -> str | None:
        """The live, uncordoned node the planner's policy puts a `gpus`-GPU worker (or a share
        of one GPU) on (None: no room)."""
        nodes, seats = self.view()
        return scheduling.fits(nodes, gpus, self.policy, exclude=exclude, seats=seats)

    def plan_seating(self, demand: Demand, make_room: bool, exclude: tuple[str, ...] = ()) -> Seating:
        nodes, seats = self.view()  # cordoned nodes are marked there: never a target
        if not make_room:
            node = scheduling.fits(nodes, demand.gpus, self.policy, exclude=exclude, seats=seats)
            return Seating(node, reason="" if node else scheduling.no_room(demand.gpus))
        if self.rule is not preemption.PreemptionRule.MOVES:  # a stock scheduler's rule
            return preemption.plan(self.rule, nodes, seats, demand.gpus, demand.priority, self.max_moves,
                                   self.policy, exclude)
        seating = scheduling.make_room(nodes, seats, demand.gpus, max_moves=self.max_moves, policy=self.policy,
                                       exclude=exclude)
        if seating.node is None and any(scheduling.can_suspend(s, demand.priority) for s in seats):
            preempt = scheduling.preempt(nodes, seats, demand.gpus, demand.priority, exclude=exclude)
            if preempt.node is not None:
                return preempt
            seating.reason += f"; {preempt.reason}"
        return seating

    # -- the queue ------------------------------------------------------------------------------
    def queue(self, demand: Demand, reason: str) -> dict:
        """The demand waits: stored as pending, retried by the reconcile loop."""
        demand.state, demand.reason = DemandState.PENDING, reason
        demand.attempts += 1
        demand.last_try = time.time()
        old = self.store.demand(demand.id)
        first = old is None or old.state != DemandState.PENDING
        self.store.save_demand(demand)
        self.claims.unplace(demand.id)
        if first:
            self.emit(EventKind.DEMAND_PENDING, demand=demand.id, demand_kind=demand.kind, model=demand.model,
                      gpus=demand.gpus, priority=demand.priority, reason=reason)
        return {"id": demand.id, "state": DemandState.PENDING.value, "demand": demand.summary()}

    def pending(self) -> list[dict]:
        """Demands waiting for GPUs, highest priority first, then oldest."""
        return [d.summary() for d in sorted(self.store.demands(), key=lambda d: (-d.priority, d.since))]

    def cancel(self, demand_id: str) -> dict:
        """Drop a pending demand (a suspended worker stays suspended: `resume` or `stop` it)."""
        with self.claims.lock:  # atomic with a retry taking it up (`seat`)
            if self.store.demand(demand_id) is None:
                raise KeyError(f"unknown demand {demand_id!r}")
            if demand_id in self.claims.placing:
                raise RuntimeError(f"demand {demand_id} is being placed")
            self.store.delete_demand(demand_id)
        return {"id": demand_id, "cancelled": True}

    def recover(self) -> None:
        """A seating the previous controller did not finish: retried."""
        for d in self.store.demands():
            if d.state != DemandState.PENDING:
                d.state, d.reason = DemandState.PENDING, "interrupted by a controller restart"
                self.store.save_demand(d)

    # -- launches ---------------------------------------------------------------------------------
    def launch(self, model: str, gpus: int, node: str | None, worker_id: str | None, engine: str | None,
               priority: int, time_limit: str | float | None, make_room: bool, dry_run: bool,
               faults: dict | None, new_id: Callable[[], str], check_target: Callable[[str], None]) -> dict:
        """See Controller.launch."""
        from adapters.base import DEFAULT_ENGINE, Engine
        from relocator.tinymodel import ensure_tiny_model

        engine = Engine(engine or DEFAULT_ENGINE).value  # an unknown engine: ValueError naming them
        time_limit_s = parse_duration(time_limit)
        gpus = shares.parse_gpus(gpus)  # whole >= 1 or a share in (0, 1): ValueError (one line) else
        faults = check_faults({**(faults or {})}) if faults else None
        never = self.refuse(float(gpus)) if self.refuse is not None else None
        if never:  # more GPUs (or a bigger share) than any node has: refused, never queued forever
            raise ValueError(never)
        if model in ("tiny", "tiny-llama"):
            model_dir, served = str(ensure_tiny_model()), "tiny-llama"
        else:
            model_dir, served = model, Path(model).name
        c = self.claims
        with c.lock:
            wid = worker_id or new_id()
            if self.store.worker(wid) or self.store.demand(wid) or wid in c.placing or wid in c.naming:
                raise ValueError(f"worker {wid} exists")
            if node is not None:
                check_target(node)
            # the id is taken from here on: two launches at once (the demo starts two) must
            # not both pick the first free one before either is recorded
            c.naming.add(wid)
        demand = Demand(id=wid, kind=DemandKind.LAUNCH, model=served, gpus=gpus, priority=int(priority),
                        engine=engine, model_dir=model_dir, time_limit_s=time_limit_s)
        try:
            if node is None:
                return self.seat(demand, make_room=make_room, dry_run=dry_run, queue=make_room, faults=faults)
            if dry_run:  # the operator chose: no planning, no queue
                return {"dry_run": True, "demand": demand.summary(), "plan": Seating(node).to_dict()}
            with c.seating:
                w = self.seaters.claim(demand, node)
            return self.seaters.start(w, demand, time.monotonic())
        finally:
            with c.lock:
                c.naming.discard(wid)

    # -- seating ----------------------------------------------------------------------------------
    def seat(self, demand: Demand, make_room: bool = True, dry_run: bool = False, queue: bool = True,
             faults: dict | None = None, stored: bool = False, start_later: bool = False) -> dict:
        """Plan and seat one demand: moves and suspends first (one seating at a time), the GPUs
        reserved, then the worker started (a cold launch or a restore) outside the lock.
        `stored`: a pending demand taken from the store, which may have been cancelled while
        this waited for the seating lock (it is then left alone). `start_later`: the start runs
        on a thread of its own (`spawn`) and this returns once the GPUs are claimed
        ({"state": "starting"})."""
        t0 = time.monotonic()
        with self.claims.seating:
            if stored:
                with self.claims.lock:
                    if self.store.demand(demand.id) is None:
                        return {"id": demand.id, "state": "cancelled"}
                    self.claims.placing.add(demand.id)  # from here on a cancel is refused
            try:
                out = self._plan_and_claim(demand, make_room, dry_run, queue, faults)
            except BaseException:
                if stored:  # taken up above: a failure before the claim leaves it to the next retry
                    self.claims.unplace(demand.id)
                raise
        if not isinstance(out, tuple):
            return out
        claimed, seating = out
        extra = {"moves": [m.to_dict() for m in seating.moves], "suspended": seating.suspends}
        go = self.seaters.start if demand.kind is DemandKind.LAUNCH else self.seaters.restore
        if start_later:
            self.spawn(self._start, (demand.id, lambda: go(claimed, demand, t0, extra)))
            return {"id": demand.id, "state": "starting", "node": claimed.node, **extra}
        return go(claimed, demand, t0, extra)

    def _start(self, job: tuple[str, Callable[[], dict]]) -> None:
        """A claimed demand's start (launch or restore), off the retry thread; a failure is
        logged (the start cleaned up after itself), and either way the loop plans again."""
        demand_id, go = job
        try:
            go()
        except Exception as exc:  # noqa: BLE001 - one start failing never stops the others
            log.warning("demand %s: %s", demand_id, exc)
        finally:
            self.claims.wake.set()

    def _plan_and_claim(self, demand: Demand, make_room: bool, dry_run: bool, queue: bool,
                        faults: dict | None) -> dict | tuple[WorkerRecord, Seating]:
        """Under the seating lock: the plan, the room made, the GPUs claimed (a tuple), or the
        answer to return (dry run, queued)."""
        if demand.kind is DemandKind.RESUME:
            w = self.store.worker(demand.id)
            if w is None or w.state != WorkerState.SUSPENDED:
                self.store.delete_demand(demand.id)
                raise RuntimeError(f"worker {demand.id} is not suspended")
        seating = self.plan_seating(demand, make_room)
        if dry_run:
            return {"dry_run": True, "demand": demand.summary(), "plan": seating.to_dict()}
        if seating.node is None:
            if not queue:
                raise RuntimeError(seating.reason)
            return self.queue(demand, seating.reason)
        with self.claims.lock:
            self.claims.placing.add(demand.id)
        if seating.moves or seating.suspends:
            demand.state = DemandState.PLACING
            self.store.save_demand(demand)
            self.emit(EventKind.ROOM_PLANNED, demand=demand.id, node=seating.node,
                      moves=[m.to_dict() for m in seating.moves], suspends=seating.suspends)
            error = self.make_room(demand, seating, faults)
            if error:
                log.warning("demand %s: making room failed: %s", demand.id, error)
                if not queue:
                    self.claims.unplace(demand.id)
                    self.store.delete_demand(demand.id)
                    raise RuntimeError(error)
                return self.queue(demand, f"making room failed: {error}")
        timeout = 60.0 if seating.moves or seating.suspends else 15.0
        try:
            claimed = (self.seaters.claim(demand, seating.node, timeout=timeout)
                       if demand.kind is DemandKind.LAUNCH else
                       self.seaters.claim_resume(self.store.worker(demand.id), seating.node, timeout=timeout))
        except Exception as exc:  # noqa: BLE001
            self.claims.unplace(demand.id)
            if queue:
                return self.queue(demand, f"could not reserve {demand.gpus} GPU(s) on {seating.node}: {exc}")
            raise
        return claimed, seating

    def make_room(self, demand: Demand, seating: Seating, faults: dict | None = None) -> str:
        """Suspend, then move, as the seating says (independent steps concurrently). Returns ""
        or what failed: the plan stops there, and every worker still serves."""
        errors: list[str] = []
        now = time.time()
        # past its time limit: that is why it goes (whatever the priorities); else a priority
        why = {wid: SuspendReason.TIME_LIMIT if (w := self.store.worker(wid)) is not None and w.past_deadline(now)
               else SuspendReason.PREEMPTED for wid in seating.suspends}
        threads = [threading.Thread(target=lambda wid=wid: collect(errors, f"suspend {wid}", lambda: self.seaters.suspend(
            wid, reason=why[wid], by=demand.id)), daemon=True) for wid in seating.suspends]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            return "; ".join(errors)
        results = self.seaters.run_moves(seating.moves, faults=faults)
        bad = [f"move of {r['worker']} to {r['to']} {r['result']}: {r['error'][:300]}" for r in results
               if r["result"] != DONE]
        return "; ".join(bad)

    # -- reconcile steps ----------------------------------------------------------------------
    def update_deadlines(self) -> None:
        """A worker past its time limit becomes preemptible; it is not suspended here. A waiting
        demand that needs its GPUs suspends it (update: any priority may, see
        scheduling.can_suspend), as does a drain's deadline; with nobody waiting it serves on
        (a suspend and a resume on its own GPUs would be a blackout for nothing). Announced once
        per deadline (an event); the new seat view makes update retry at once."""
        now = time.time()
        for w in self.store.workers():
            if w.past_deadline(now) and (w.id, w.deadline) not in self._announced:
                self._announced.add((w.id, w.deadline))
                self.emit(EventKind.WORKER_PREEMPTIBLE, worker=w.id, node=w.node, deadline=w.deadline,
                          priority=w.priority)

    def update(self) -> None:
        """Pending demands, highest priority first then oldest, retried on a thread whenever
        capacity changed (or every DEMAND_RETRY_S): a demand that still cannot be met stays."""
        todo = [d for d in self.store.demands() if d.state == DemandState.PENDING and d.id not in self.claims.placing]
        if not todo or self._retrying.is_set():
            return
        nodes, seats = self.view()
        sig = (tuple((n.id, n.gpus_free) for n in nodes),
               tuple(sorted((s.worker, s.node, s.movable, s.expired, s.suspendable) for s in seats)),
               tuple(sorted(d.id for d in todo)))
        if sig == self._sig and time.monotonic() - self._tried_at < DEMAND_RETRY_S:
            return
        self._sig, self._tried_at = sig, time.monotonic()
        self._retrying.set()
        self.spawn(self._retry, todo)

    def _retry(self, todo: list[Demand]) -> None:
        # a seated demand starts on its own thread: the next one (on other GPUs) is planned at
        # once, not after this one's start (a warm restore takes seconds, a cold vLLM start a
        # minute: a 4-GPU launch whose node just freed waited behind a 2-GPU one's start)
        try:
            for d in sorted(todo, key=lambda d: (-d.priority, d.since)):
                cur = self.store.demand(d.id)
                if cur is None or cur.state != DemandState.PENDING or cur.id in self.claims.placing:
                    continue
                try:
                    out = self.seat(cur, make_room=True, queue=True, stored=True, start_later=True)
                except Exception as exc:  # noqa: BLE001 - one demand failing never stops the others
                    log.warning("demand %s: %s", d.id, exc)
                    continue
                if out.get("state") != DemandState.PENDING:
                    break  # capacity changed: the next round plans the rest on the new state
        finally:
            self._retrying.clear()
            self.claims.wake.set()

    def busy(self) -> bool:
        """A demand waiting or being seated, a relocation open, or a node cordoned (a drain with
        a deadline: the packing plan does not know to avoid it): no packing now."""
        return bool(self.store.demands() or self.claims.placing or self.store.open_relocations() or self.cordoned())
