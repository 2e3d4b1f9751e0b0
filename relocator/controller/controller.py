"""The controller: one named, detached Ray actor holding the inventory (nodes, GPUs, workers,
relocations), running relocations on threads and a reconcile loop in the style of Ray Serve's
controller (one loop calling a few `update_*` steps, each caught and timed).

Everything it must remember lives in a sqlite file; on (re)start it re-reads it and completes or
rolls back every relocation that was open when it died.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

from relocator.agent.agent import NAMESPACE, start_agent
from relocator.controller.backend import NodeLost, RayBackend
from relocator.controller.events import EventKind, EventLog
from relocator.controller.inventory import GpuFact, NodeInfo, best_fit, ray_nodes
from relocator.controller.machine import Machine, PhaseFault, check_faults
from relocator.controller.model import (
    RUNNING,
    Demand,
    DemandKind,
    DemandState,
    FailureReason,
    Relocation,
    SuspendReason,
    TransferMode,
    WorkerRecord,
    WorkerState,
    parse_duration,
    tokenizer_of,
)
from relocator.controller import scheduling
from relocator.controller.scheduling import MovePlan, NodeView, Seat, Seating
from relocator.controller.store import Store

CONTROLLER_NAME = "relocator-controller"
ORPHAN_AFTER_S = 60.0  # a cell nobody owns is killed once it is this old
NODE_WATCH_S = 0.5  # how often Ray's node table is read for nodes declared dead
DEMAND_RETRY_S = 30.0  # a pending demand is retried when capacity changes, and at least this often
#: a failed suspend: no automatic suspend of that worker for 30 s, 60 s, 120 s, ... at most 30 min
SUSPEND_BACKOFF_S, SUSPEND_BACKOFF_MAX_S = 30.0, 1800.0
#: states in which a worker holds GPUs on its node (through its reservation)
HOLDING_STATES = (WorkerState.STARTING, WorkerState.RUNNING, WorkerState.RELOCATING, WorkerState.REPLACING,
                  WorkerState.SUSPENDING, WorkerState.RESUMING)
#: the phases in which a moving worker's new requests wait or its streams stall
BLACKOUT_PHASES = ("HOLD", "DUMP", "TRANSFER", "RESTORE", "SWITCH")
log = logging.getLogger("relocator.controller")


def env_faults() -> dict[str, Any]:
    """Fault injection from the environment: RELOCATOR_FAULTS="dump,transfer,restore"."""
    raw = os.environ.get("RELOCATOR_FAULTS", "")
    try:
        return {PhaseFault(p.strip().lower()).value: True for p in raw.split(",") if p.strip()}
    except ValueError as exc:
        raise ValueError(f"RELOCATOR_FAULTS: {exc}") from None


class Controller:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = dict(config)
        self.base_dir = Path(config["base_dir"])
        self.router_control_url = config.get("router_control_url")
        self.router_token = config.get("router_token")
        self.router_url = config.get("router_url")
        from relocator.planner.policies import PlacementPolicy

        self.transfer = TransferMode(config.get("transfer", TransferMode.SHARED))
        self.policy = PlacementPolicy(config.get("policy", PlacementPolicy.BEST_FIT))
        self.interval = float(config.get("reconcile_interval_s", 2.0))
        self.store = Store(self.base_dir / "controller.db")
        self.event_log = EventLog(self.store, self.base_dir / "events.jsonl")
        self.backend = RayBackend(self)
        self.machine = Machine(self.store, self.backend, keep_images=bool(config.get("keep_images", False)),
                               keep_last_image=bool(config.get("keep_last_image", True)),
                               on_event=self.event_log.emit)
        self._lock = threading.RLock()
        self._busy: set[str] = set()
        self._threads: dict[str, threading.Thread] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = 0.0
        self.loop_stats: dict[str, Any] = {}
        self.started_at = time.time()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set: run the reconcile loop now
        self._pending_reservations: set[str] = set()
        self.max_moves = int(config.get("make_room_max_moves", scheduling.DEFAULT_MAX_MOVES))
        self._seating = threading.RLock()  # one demand (or consolidation) planned and seated at a time
        self._placing: set[str] = set()  # demands being seated now
        self._naming: set[str] = set()  # worker ids chosen by launches not yet recorded
        self._retrying = threading.Event()
        self._demand_sig: tuple | None = None
        self._demand_tried_at = 0.0
        self._lost_nodes: dict[str, float] = {}  # node -> when this controller saw it lost
        self._fenced_nodes: set[str] = set()
        self._announced: set[tuple[str, float]] = set()  # (worker, deadline) announced preemptible
        from relocator.controller.periodic import PeriodicConsolidation

        self.periodic = PeriodicConsolidation(
            config.get("consolidate"), plan=lambda k: self.consolidate(dry_run=True, max_moves=k),
            run=lambda k: self.consolidate(max_moves=k), busy=self._scheduling_busy)
        self.metrics = self._serve_metrics()
        nodes = self.inventory(refresh=True)
        for name, info in nodes.items():  # agents of a running cluster: handles before recovery
            if info.alive:
                try:
                    self.backend.agent(name)
                except ValueError:  # a new cluster: created below
                    pass
        # a restarted controller first finishes the relocations it left open (their workers are
        # frozen or held meanwhile); the agents of a running cluster exist already
        self.recovering = [r.id for r in self.store.open_relocations()]
        for rel in self.store.open_relocations():
            self._busy.add(rel.worker)
            self._spawn(rel, recover=True)
        self.agents = {}
        for name, info in nodes.items():
            if info.alive:
                self.agents[name] = start_agent(name, info.ray_node_id, str(self.node_dir(name) / "state"),
                                                str(self.node_dir(name) / "images"),
                                                (self.config.get("credentials") or {}).get(name))
        for w in self.store.workers():  # a launch the previous controller did not finish
            if w.state == "starting" and w.id not in self._busy:
                self._abandon_launch(w)
            elif w.state == "replacing" and w.id not in self._busy:  # its half-started copy goes
                self._abandon_launch(w, keep_record=True)
            elif w.state in (WorkerState.SUSPENDING, WorkerState.RESUMING) and w.id not in self._busy:
                self._recover_suspension(w)
        for d in self.store.demands():  # a seating the previous controller did not finish: retried
            if d.state != DemandState.PENDING:
                d.state, d.reason = DemandState.PENDING, "interrupted by a controller restart"
                self.store.save_demand(d)
        threading.Thread(target=self._loop, name="reconcile", daemon=True).start()
        threading.Thread(target=self._watch_nodes, name="node-watch", daemon=True).start()
        self.init_s = round(time.time() - self.started_at, 3)

    # -- plumbing -------------------------------------------------------------------------------
    def _serve_metrics(self):
        """The controller's /metrics (relocator.controller.metrics), or None if it cannot listen:
        metrics never keep the controller from running."""
        from relocator.controller.metrics import MetricsServer

        try:
            return MetricsServer(self.store, self.inventory, host=self.config.get("metrics_host", "127.0.0.1"),
                                 port=self.config.get("metrics_port"))
        except Exception as exc:  # noqa: BLE001
            log.error("controller metrics not served: %s", exc)
            return None

    def emit(self, kind: EventKind, **fields: Any) -> None:
        self.event_log.emit(kind, fields)

    def node_dir(self, node: str) -> Path:
        return self.base_dir / "nodes" / node

    def router(self):
        from relocator.router.client import RouterControlSync

        if not self.router_control_url:
            raise RuntimeError("the controller has no router configured")
        return RouterControlSync(self.router_control_url, token=self.router_token)

    def inventory(self, refresh: bool = False) -> dict[str, NodeInfo]:
        with self._lock:
            if refresh or time.monotonic() - self._nodes_at > 1.0:
                docs = {d["ray_node_id"]: d for d in self.store.all("node")}
                known = {k: d["id"] for k, d in docs.items()}
                self._nodes = ray_nodes(known, self.config.get("node_names"))
                for n in self._nodes.values():  # remembered: Ray lists a dead node without its name
                    if n.alive and known.get(n.ray_node_id) != n.id:
                        self.store.put("node", n.ray_node_id, {"id": n.id, "ray_node_id": n.ray_node_id})
                    n.gpus = [GpuFact(**g) for g in (docs.get(n.ray_node_id) or {}).get("gpus") or []]
                    if not n.alive and n.id not in self._lost_nodes:  # first seen dead
                        self._lost_nodes[n.id] = time.time()
                        self._wake.set()
                        doc = self.store.get("node", n.ray_node_id) or {"id": n.id, "ray_node_id": n.ray_node_id}
                        if not doc.get("lost_at"):  # once per node, also across controller restarts
                            self.store.put("node", n.ray_node_id, {**doc, "lost_at": self._lost_nodes[n.id]})
                            self.emit(EventKind.NODE_LOST, node=n.id, ray_node_id=n.ray_node_id)
                self._nodes_at = time.monotonic()
            return dict(self._nodes)

    def place(self, gpus: int, exclude: tuple[str, ...] = ()) -> str | None:
        """The live, uncordoned node the planner's policy puts a `gpus`-GPU worker on (None: no
        room): the scheduling view every placement plans on (`_view`)."""
        return scheduling.fits(self._view()[0], gpus, self.policy.value, exclude=exclude)

    def _check_target(self, node: str, nodes: dict[str, NodeInfo] | None = None) -> None:
        """An operator's explicit target (`--to`, `--node`): known, alive and not cordoned."""
        nodes = self.inventory(refresh=True) if nodes is None else nodes
        if node not in nodes:
            raise ValueError(f"unknown node {node!r}; nodes: {', '.join(nodes)}")
        if not nodes[node].alive:
            raise ValueError(f"node {node!r} is lost")
        if node in self.cordoned():
            raise ValueError(f"node {node!r} is cordoned (drained with --by): nothing is placed there "
                             f"until `relocator uncordon {node}`")

    def ping(self) -> dict:
        return {"pid": os.getpid(), "started_at": self.started_at, "init_s": getattr(self, "init_s", None),
                "recovering": self.recovering}

    # -- reconcile loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if not self._stop.is_set():
                self.reconcile_once()

    def _watch_nodes(self) -> None:
        """Ray's node table every NODE_WATCH_S (one cheap GCS call): a node newly declared dead
        wakes the reconcile loop at once, so its workers are replaced without waiting a round."""
        while not self._stop.wait(NODE_WATCH_S):
            try:
                self.inventory(refresh=True)
            except Exception as exc:  # noqa: BLE001
                log.warning("node watch: %s", exc)

    def reconcile_once(self) -> dict:
        stats = {}
        for step in (self.update_nodes, self.update_workers, self.update_router, self.update_reservations,
                     self.update_cells, self.update_deadlines, self.update_demands, self.update_consolidation):
            t0 = time.monotonic()
            try:
                step()
                stats[step.__name__] = {"ok": True, "s": round(time.monotonic() - t0, 4)}
            except Exception as exc:  # noqa: BLE001 - one failing step never stops the loop
                stats[step.__name__] = {"ok": False, "s": round(time.monotonic() - t0, 4), "error": str(exc)}
        self.loop_stats = {"at": time.time(), **stats}
        return self.loop_stats

    def update_nodes(self) -> None:
        """A node Ray declares dead is fenced once: what of it runs here and nobody owns is
        killed (a lost node's copies must never serve again next to their replacements). A live
        node's agent reports its real GPUs once (kept with the node's record)."""
        nodes = self.inventory(refresh=True)
        for name, info in nodes.items():
            if info.alive and "gpus" not in (self.store.get("node", info.ray_node_id) or {}):
                try:
                    gpus = self.backend.call(name, "gpus", timeout=30)
                except Exception as exc:  # noqa: BLE001 - asked again next round
                    log.debug("GPU report of %s: %s", name, exc)
                else:
                    doc = self.store.get("node", info.ray_node_id) or {"id": name, "ray_node_id": info.ray_node_id}
                    self.store.put("node", info.ray_node_id, {**doc, "gpus": gpus})
                    self._nodes_at = 0.0  # the next inventory carries them
        for name, info in nodes.items():
            if info.alive or name in self._fenced_nodes:
                continue
            self._fenced_nodes.add(name)
            with self._lock:
                # only cells nobody owns: a worker's own copy is killed by its replacement, after
                # the router holds its traffic, and a relocation's copies by its rollback
                cells = {c.name for c in (self.node_dir(name) / "state" / "cells").glob("*")}
                cells -= {w.cell_id for w in self.store.workers()}
                for r in self.store.open_relocations():
                    cells -= {r.src_cell, r.dst_cell}
            try:
                log.warning("node %s is lost; fenced: %s", name, self.backend.fence(name, sorted(cells)))
            except Exception as exc:  # noqa: BLE001
                log.warning("node %s is lost; fencing failed: %s", name, exc)

    def update_workers(self) -> None:
        """Observed vs recorded: a running worker whose node is lost or whose cell is gone is
        marked lost; every lost worker is replaced (a fresh launch elsewhere, see _replace)."""
        for w in self.store.workers():
            if w.id in self._busy or w.state not in ("running", "lost"):
                continue
            if w.state == "running":
                try:
                    state = self.backend.call(w.node, "cell_state", w.cell_id, timeout=30)
                except NodeLost:
                    state = "lost"
                if state not in ("absent", "lost"):
                    continue
                with self._lock:
                    cur = self.store.worker(w.id)
                    if w.id in self._busy or cur is None or cur.cell_id != w.cell_id or cur.state != "running":
                        continue
                    w.state = "lost"
                    w.error = f"node {w.node} is lost" if state == "lost" else f"cell {w.cell_id} is gone"
                    self.store.save_worker(w)
                self.emit(EventKind.WORKER_LOST, worker=w.id, node=w.node, error=w.error)
            with self._lock:
                if w.id in self._busy:
                    continue
                self._busy.add(w.id)
            threading.Thread(target=self._replace, args=(w,), name=f"replace-{w.id}", daemon=True).start()

    def _start_copy(self, w: WorkerRecord, node: str) -> tuple[str, dict]:
        """A new copy of `w` on `node`: restored from its newest image when there is one (warm,
        seconds), else a cold launch (the engine loads and compiles again)."""
        if w.last_image and Path(w.last_image).exists():
            try:
                return "restored from its last image", self.backend.restore(node, w.last_image, w.cell_id,
                                                                            gpu_ids=w.gpu_ids or None)
            except Exception as exc:  # noqa: BLE001 - fall back to a cold start
                log.warning("warm restart of %s from %s failed (%s); launching cold", w.id, w.last_image, exc)
                self._best_effort(f"removing the failed restore of {w.id}", lambda: self.backend.kill(node, w.cell_id))
        return "cold launch", self.backend.call(node, "launch", w.cell_id, w.model_dir, w.model,
                                              engine=w.engine, gpu_ids=w.gpu_ids or None)

    def _drop_last_image(self, w: WorkerRecord) -> None:
        if w.last_image:
            self._best_effort(f"removing {w.last_image}",
                              lambda: self.backend.remove_image(w.last_image_node, w.last_image))

    def update_cells(self) -> None:
        """Cells on live nodes that no worker or open relocation owns (left by a failed kill, a
        node that came back, an interrupted launch) are killed once they are a minute old."""
        listed = {name: self.backend.call(name, "cells", timeout=30)
                  for name, info in self.inventory().items() if info.alive}
        # the store is read after the agents: a cell is recorded before it is created
        owned = {w.cell_id for w in self.store.workers()}
        for r in self.store.open_relocations():
            owned |= {r.src_cell, r.dst_cell}
        for node, cells in listed.items():
            for c in cells:
                if c["id"] not in owned and time.time() - float(c.get("created_at", 0)) > ORPHAN_AFTER_S:
                    log.warning("killing orphan cell %s on %s", c["id"], node)
                    self.backend.kill(node, c["id"])

    def _replace(self, w: WorkerRecord) -> None:
        """A lost worker gets a fresh copy on a live node: the router holds its requests (and
        the streams cut with the old copy) meanwhile and continues them on the new one."""
        t0 = time.monotonic()
        old_node, old_cell, old_reservation = w.node, w.cell_id, w.reservation
        self.emit(EventKind.REPLACEMENT_STARTED, worker=w.id, from_node=old_node, error=w.error)
        try:
            try:
                self.backend.hold(w.id)
            except Exception as exc:  # noqa: BLE001 - the router may be restarting; switch registers
                log.warning("replace %s: hold failed: %s", w.id, exc)
            try:
                self.backend.kill(old_node, old_cell)
            except Exception as exc:  # noqa: BLE001 - left to update_cells / fencing
                log.warning("replace %s: could not kill %s on %s: %s", w.id, old_cell, old_node, exc)
            self.backend.free(old_reservation)
            node = self.place(w.gpus)
            if node is None:
                raise RuntimeError(f"no live node has {w.gpus} free GPU(s)")
            tag = uuid.uuid4().hex[:6]
            w.node, w.cell_id, w.reservation, w.endpoint = node, f"{w.id}-x{tag}", f"relocator-{w.id}-x{tag}", ""
            w.state = "replacing"  # a controller restarted now kills this copy and starts again
            self.store.save_worker(w)
            w.gpu_ids = list(self.backend.reserve(w, node, w.reservation) or [])
            how, info = self._start_copy(w, node)
            w.endpoint = info["endpoint"]
            self.backend.switch(w.id, w.endpoint)
            w.state, w.error = "running", ""
            w.replacements += 1
            self.store.save_worker(w)
            log.warning("replaced lost worker %s (%s on %s) by %s on %s (%s) in %.1fs", w.id, old_cell, old_node,
                        w.cell_id, node, how, time.monotonic() - t0)
            self.emit(EventKind.REPLACEMENT_FINISHED, worker=w.id, ok=True, from_node=old_node, to_node=node,
                      how=how, seconds=round(time.monotonic() - t0, 3), error="")
        except Exception as exc:  # noqa: BLE001
            log.error("could not replace lost worker %s: %s", w.id, exc)
            self._best_effort(f"cleaning up the failed replacement of {w.id}",
                              lambda: self.backend.kill(w.node, w.cell_id), lambda: self.backend.free(w.reservation),
                              lambda: self.router().remove_replica(w.id))  # held requests get their error now
            w.state, w.error = "failed", f"lost ({w.error}); replacement failed: {exc}"
            self.store.save_worker(w)
            self.emit(EventKind.REPLACEMENT_FINISHED, worker=w.id, ok=False, from_node=old_node, to_node=None,
                      how=None, seconds=round(time.monotonic() - t0, 3), error=str(exc))
        finally:
            with self._lock:
                self._busy.discard(w.id)

    def update_router(self) -> None:
        """The router's table vs the workers: a router that restarted (empty table) or missed
        an update gets every running worker back at its current endpoint."""
        if not self.router_control_url:
            return
        rc = self.router()
        table = rc.replicas()
        seen = {r["worker_id"]: r for reps in table.get("models", {}).values() for r in reps}
        for w in self.store.workers():
            if w.state != "running" or w.id in self._busy:
                continue
            r = seen.get(w.id)
            if r is None or r.get("endpoint", "").rstrip("/") != w.endpoint.rstrip("/"):
                with self._lock:
                    # re-read under the lock: a relocation may have finished since the list
                    # was read, and a stale record must never point the router back
                    cur = self.store.worker(w.id)
                    if w.id in self._busy or cur is None or cur.state != "running" or cur.endpoint != w.endpoint:
                        continue
                    rc.add_replica(w.id, w.model, w.endpoint, tokenizer_of(w), w.engine)
                    log.warning("router: re-registered %s at %s", w.id, w.endpoint)

    def update_reservations(self) -> None:
        """Placement groups named relocator-* that no worker or open relocation owns are freed."""
        import ray

        with self._lock:
            owned = {w.reservation for w in self.store.workers()}
            owned |= {r.reservation for r in self.store.open_relocations()}
            owned |= {r.src_reservation for r in self.store.open_relocations()}
            pending = set(self._pending_reservations)
        for pg in ray.util.placement_group_table().values():
            name = pg.get("name", "")
            if name.startswith("relocator-") and pg.get("state") != "REMOVED" and name not in owned | pending:
                self.backend.free(name)

    # -- workers -----------------------------------------------------------------------------------
    def _new_worker_id(self) -> str:
        ids = ({w.id for w in self.store.workers()} | {d.id for d in self.store.demands()}
               | set(self._placing) | self._naming)
        i = 1
        while f"w{i}" in ids:
            i += 1
        return f"w{i}"

    def launch(self, model: str = "tiny-llama", gpus: int = 1, node: str | None = None,
               worker_id: str | None = None, engine: str | None = None, priority: int = 0,
               time_limit: str | float | None = None, make_room: bool = True, dry_run: bool = False,
               faults: dict | None = None) -> dict:
        """Start a worker and register it with the router once it serves. Placed by the planner
        unless `node` is given; when no node has `gpus` free GPUs it makes room (the fewest live
        moves, else, for a higher `priority`, the fewest lower-priority workers suspended) unless
        `make_room` is False (then: RuntimeError, as a stock scheduler). A demand that cannot be
        met now is queued: returns {"id", "state": "pending", "demand"}; the reconcile loop starts
        it when capacity allows. `dry_run`: the plan only. `time_limit` (90, "90s", "15m", "2h"):
        after running that long it is preemptible: suspended and requeued only when a waiting
        demand or a drain's deadline needs its GPUs. `faults`: injected into the first move."""
        from adapters.base import DEFAULT_ENGINE, Engine
        from relocator.tinymodel import ensure_tiny_model

        engine = Engine(engine or DEFAULT_ENGINE).value  # an unknown engine: ValueError naming them
        time_limit_s = parse_duration(time_limit)
        if int(gpus) < 1:
            raise ValueError(f"gpus must be >= 1, not {gpus}")
        faults = check_faults({**(faults or {})}) if faults else None
        if model in ("tiny", "tiny-llama"):
            model_dir, served = str(ensure_tiny_model()), "tiny-llama"
        else:
            model_dir, served = model, Path(model).name
        with self._lock:
            wid = worker_id or self._new_worker_id()
            if self.store.worker(wid) or self.store.demand(wid) or wid in self._placing or wid in self._naming:
                raise ValueError(f"worker {wid} exists")
            if node is not None:
                self._check_target(node)
            # the id is taken from here on: two launches at once (the demo starts two) must
            # not both pick the first free one before either is recorded
            self._naming.add(wid)
        try:
            return self._launch(wid, served, model_dir, gpus, node, engine, priority, time_limit_s,
                                make_room, dry_run, faults)
        finally:
            with self._lock:
                self._naming.discard(wid)

    def _launch(self, wid: str, served: str, model_dir: str, gpus: int, node: str | None, engine: str,
                priority: int, time_limit_s: float | None, make_room: bool, dry_run: bool,
                faults: dict | None) -> dict:
        demand = Demand(id=wid, kind=DemandKind.LAUNCH, model=served, gpus=int(gpus), priority=int(priority),
                        engine=engine, model_dir=model_dir, time_limit_s=time_limit_s)
        if node is not None:  # the operator chose: no planning, no queue
            if dry_run:
                return {"dry_run": True, "demand": demand.summary(), "plan": Seating(node).to_dict()}
            with self._seating:
                w = self._claim(demand, node)
            return self._start_claimed(w, demand, t0=time.monotonic())
        return self._seat_demand(demand, make_room=make_room, dry_run=dry_run, queue=make_room, faults=faults)

    # -- the scheduling layer: demands, making room, suspend and resume ---------------------------
    def _view(self) -> tuple[list[NodeView], list[Seat]]:
        """Live nodes (free GPUs: the lower of Ray's view and the records', as either may lag
        the other) and the workers holding GPUs on them."""
        nodes = {n.id: n for n in self.inventory(refresh=True).values() if n.alive}
        workers = self.store.workers()
        held: dict[str, int] = {}
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
        cordoned = self.cordoned()  # nothing is planned onto them (scheduling.closed)
        view = [NodeView(n.id, n.gpus_total, max(0, min(n.gpus_free, n.gpus_total - held.get(n.id, 0))),
                         cordoned=n.id in cordoned)
                for n in nodes.values()]
        now = time.time()
        seats = [Seat(w.id, w.node, w.gpus, w.priority, movable=w.state == WorkerState.RUNNING and w.id not in self._busy,
                      bytes=sizes.get(w.id, 0), expired=w.past_deadline(now),
                      suspendable=not w.suspend_backing_off(now))
                 for w in workers if w.node in nodes and w.reservation and w.state in HOLDING_STATES]
        return view, seats

    def _plan_seating(self, demand: Demand, make_room: bool, exclude: tuple[str, ...] = ()) -> Seating:
        nodes, seats = self._view()  # cordoned nodes are marked there: never a target
        policy = self.policy.value
        if not make_room:
            node = scheduling.fits(nodes, demand.gpus, policy, exclude=exclude)
            return Seating(node, reason="" if node else f"no node has {demand.gpus} free GPU(s)")
        seating = scheduling.make_room(nodes, seats, demand.gpus, max_moves=self.max_moves, policy=policy,
                                       exclude=exclude)
        if seating.node is None and any(scheduling.can_suspend(s, demand.priority) for s in seats):
            preempt = scheduling.preempt(nodes, seats, demand.gpus, demand.priority, exclude=exclude)
            if preempt.node is not None:
                return preempt
            seating.reason += f"; {preempt.reason}"
        return seating

    def _queue(self, demand: Demand, reason: str) -> dict:
        """The demand waits: stored as pending, retried by the reconcile loop."""
        demand.state, demand.reason = DemandState.PENDING, reason
        demand.attempts += 1
        demand.last_try = time.time()
        first = self.store.demand(demand.id) is None or self.store.demand(demand.id).state != DemandState.PENDING
        self.store.save_demand(demand)
        with self._lock:
            self._placing.discard(demand.id)
        if first:
            self.emit(EventKind.DEMAND_PENDING, demand=demand.id, demand_kind=demand.kind, model=demand.model,
                      gpus=demand.gpus, priority=demand.priority, reason=reason)
        return {"id": demand.id, "state": DemandState.PENDING.value, "demand": demand.summary()}

    def _seat_demand(self, demand: Demand, make_room: bool = True, dry_run: bool = False, queue: bool = True,
                     faults: dict | None = None, stored: bool = False) -> dict:
        """Plan and seat one demand: moves and suspends first (one seating at a time), the GPUs
        reserved, then the worker started (a cold launch or a restore) outside the lock.
        `stored`: a pending demand taken from the store, which may have been cancelled while
        this waited for the seating lock (it is then left alone)."""
        t0 = time.monotonic()
        with self._seating:
            if stored:
                with self._lock:
                    if self.store.demand(demand.id) is None:
                        return {"id": demand.id, "state": "cancelled"}
                    self._placing.add(demand.id)  # from here on a cancel is refused
            try:
                if demand.kind is DemandKind.RESUME:
                    w = self.store.worker(demand.id)
                    if w is None or w.state != WorkerState.SUSPENDED:
                        self.store.delete_demand(demand.id)
                        raise RuntimeError(f"worker {demand.id} is not suspended")
                seating = self._plan_seating(demand, make_room)
                if dry_run:
                    return {"dry_run": True, "demand": demand.summary(), "plan": seating.to_dict()}
                if seating.node is None:
                    if not queue:
                        raise RuntimeError(seating.reason)
                    return self._queue(demand, seating.reason)
                with self._lock:
                    self._placing.add(demand.id)
                if seating.moves or seating.suspends:
                    demand.state = DemandState.PLACING
                    self.store.save_demand(demand)
                    self.emit(EventKind.ROOM_PLANNED, demand=demand.id, node=seating.node,
                              moves=[m.to_dict() for m in seating.moves], suspends=seating.suspends)
                    error = self._make_room(demand, seating, faults)
                    if error:
                        log.warning("demand %s: making room failed: %s", demand.id, error)
                        if not queue:
                            with self._lock:
                                self._placing.discard(demand.id)
                            self.store.delete_demand(demand.id)
                            raise RuntimeError(error)
                        return self._queue(demand, f"making room failed: {error}")
                try:
                    claimed = (self._claim(demand, seating.node, timeout=60.0 if seating.moves or seating.suspends else 15.0)
                               if demand.kind is DemandKind.LAUNCH else
                               self._claim_resume(self.store.worker(demand.id), seating.node,
                                                  timeout=60.0 if seating.moves or seating.suspends else 15.0))
                except Exception as exc:  # noqa: BLE001
                    with self._lock:
                        self._placing.discard(demand.id)
                    if queue:
                        return self._queue(demand, f"could not reserve {demand.gpus} GPU(s) on {seating.node}: {exc}")
                    raise
            except BaseException:
                if stored:  # taken up above: a failure before the claim leaves it to the next retry
                    with self._lock:
                        self._placing.discard(demand.id)
                raise
        extra = {"moves": [m.to_dict() for m in seating.moves], "suspended": seating.suspends}
        if demand.kind is DemandKind.LAUNCH:
            return self._start_claimed(claimed, demand, t0, extra)
        return self._restore_claimed(claimed, demand, t0, extra)

    def _make_room(self, demand: Demand, seating: Seating, faults: dict | None = None) -> str:
        """Suspend, then move, as the seating says (independent steps concurrently). Returns ""
        or what failed: the plan stops there, and every worker still serves."""
        errors: list[str] = []
        now = time.time()
        # past its time limit: that is why it goes (whatever the priorities); else a priority
        why = {wid: SuspendReason.TIME_LIMIT if (w := self.store.worker(wid)) is not None and w.past_deadline(now)
               else SuspendReason.PREEMPTED for wid in seating.suspends}
        threads = [threading.Thread(target=lambda wid=wid: self._collect(errors, f"suspend {wid}", lambda: self.suspend(
            wid, reason=why[wid], by=demand.id)), daemon=True) for wid in seating.suspends]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            return "; ".join(errors)
        results = self._run_moves(seating.moves, faults=faults)
        bad = [f"move of {r['worker']} to {r['to']} {r['result']}: {r['error'][:300]}" for r in results
               if r["result"] != "done"]
        return "; ".join(bad)

    @staticmethod
    def _collect(errors: list[str], what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{what}: {exc}")

    def _run_moves(self, moves: list[MovePlan], transfer: str | None = None, faults: dict | None = None) -> list[dict]:
        """Independent live moves, all at once; each one's summary (with `blackout_s`)."""
        started: list[str] = []
        results: list[dict] = []
        for i, m in enumerate(moves):
            try:
                started.append(self.relocate(m.worker, to=m.dst, transfer=transfer, faults=faults if i == 0 else None,
                                             wait=False)["id"])
            except Exception as exc:  # noqa: BLE001 - the others still run; this one failed to start
                results.append({"worker": m.worker, "from": m.src, "to": m.dst, "result": "failed",
                                "error": str(exc), "phases": {}, "blackout_s": 0.0})
        for rid in started:
            r = self.wait_relocation(rid)
            r["blackout_s"] = round(sum(v for k, v in r["phases"].items() if k in BLACKOUT_PHASES), 4)
            results.append(r)
        return results

    def _claim(self, demand: Demand, node: str, timeout: float = 15.0) -> WorkerRecord:
        """A new worker's record and its GPUs reserved on `node` (recorded first: the reconcile
        loop never frees a reservation a record owns)."""
        w = WorkerRecord(id=demand.id, model=demand.model, node=node, gpus=demand.gpus,
                         cell_id=f"{demand.id}-c{uuid.uuid4().hex[:6]}", reservation=f"relocator-{demand.id}-launch",
                         model_dir=demand.model_dir, state=WorkerState.STARTING, engine=demand.engine,
                         priority=demand.priority, time_limit_s=demand.time_limit_s)
        with self._lock:
            self._placing.add(demand.id)
            self._pending_reservations.add(w.reservation)
            self.store.save_worker(w)
            self._busy.add(w.id)
        try:
            w.gpu_ids = list(self.backend.reserve(w, node, w.reservation, timeout=timeout) or [])
            self.store.save_worker(w)
        except BaseException:
            self._best_effort(f"freeing {w.reservation}", lambda: self.backend.free(w.reservation))
            self.store.delete_worker(w.id)
            with self._lock:
                self._busy.discard(w.id)
                self._placing.discard(demand.id)
                self._pending_reservations.discard(w.reservation)
            raise
        return w

    def _start_claimed(self, w: WorkerRecord, demand: Demand, t0: float, extra: dict | None = None) -> dict:
        """Launch the claimed worker cold, register it with the router; the demand is met."""
        node = w.node
        try:
            t1 = time.monotonic()
            info = self.backend.call(node, "launch", w.cell_id, w.model_dir, w.model, engine=w.engine,
                                     gpu_ids=w.gpu_ids or None)
            w.launch_s = round(time.monotonic() - t1, 3)
            w.endpoint = info["endpoint"]
            self.router().add_replica(w.id, w.model, w.endpoint, tokenizer_of(w), w.engine)
            w.state = WorkerState.RUNNING
            w.deadline = time.time() + w.time_limit_s if w.time_limit_s else None
            self.store.save_worker(w)
            self.store.delete_demand(demand.id)
            self.emit(EventKind.DEMAND_PLACED, demand=demand.id, demand_kind=demand.kind, worker=w.id, node=node,
                      seconds=round(time.monotonic() - t0, 3), **(extra or {}))
            return {**w.to_dict(), "ready_s": info["ready_s"], **(extra or {})}
        except BaseException as exc:
            self._best_effort(f"cleaning up the failed launch of {w.id}", lambda: self.backend.free(w.reservation),
                              lambda: self.backend.kill(node, w.cell_id))
            self.store.delete_worker(w.id)
            self.store.delete_demand(demand.id)
            log.warning("launch of %s failed: %s", w.id, exc)
            raise
        finally:
            with self._lock:
                self._busy.discard(w.id)
                self._placing.discard(demand.id)
                self._pending_reservations.discard(w.reservation)

    def suspend(self, worker_id: str, reason: str = SuspendReason.OPERATOR, by: str | None = None) -> dict:
        """Checkpoint a running worker to the image store and free its GPUs. The router sends its
        model's new requests to a sibling (the streams the suspend cuts continue there), or holds
        them (bounded, 503 on timeout) with the cut streams until it resumes. Suspended for any
        reason but `operator`, it is requeued: a resume demand waits in `pending`."""
        reason = SuspendReason(reason)
        w = self.store.worker(worker_id)
        if w is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        with self._lock:
            if worker_id in self._busy:
                raise RuntimeError(f"worker {worker_id} is being relocated or started")
            if w.state != WorkerState.RUNNING:
                raise RuntimeError(f"worker {worker_id} is {w.state}, not running")
            self._busy.add(worker_id)
        t0 = time.monotonic()
        node, cell, reservation = w.node, w.cell_id, w.reservation
        image = str(self.node_dir(node) / "images" / f"suspend-{w.id}-{uuid.uuid4().hex[:6]}")
        try:
            siblings = [x.id for x in self.store.workers() if x.id != w.id and x.model == w.model
                        and x.state == WorkerState.RUNNING and x.id not in self._busy]
            w.state = WorkerState.SUSPENDING
            self.store.save_worker(w)
            try:
                self.backend.hold(w.id)
                info = self.backend.dump(node, cell, image)
            except Exception as exc:
                self._undo_suspend(w, image)
                retry_in = self._suspend_failed(w, reason, exc)
                raise RuntimeError(f"suspend of {w.id} failed, it serves again (no automatic suspend for "
                                   f"{retry_in:.0f}s): {exc}") from None
            if siblings:  # the cut streams and new requests go to a sibling, not to the hold queue
                self._best_effort(f"router: removing {w.id}", lambda: self.router().remove_replica(w.id))
            self._best_effort(f"killing the suspended source of {w.id}", lambda: self.backend.kill(node, cell))
            self.backend.free(reservation)
            w.state, w.image, w.image_node = WorkerState.SUSPENDED, image, node
            w.node, w.cell_id, w.reservation, w.endpoint, w.deadline, w.gpu_ids = "", "", "", "", None, []
            w.suspend_reason, w.suspended_at, w.suspensions = reason.value, time.time(), w.suspensions + 1
            w.suspend_failures, w.suspend_retry_at, w.suspend_error = 0, None, ""
            self.store.save_worker(w)
            out = {"worker": w.id, "node": node, "reason": reason.value, "image": image,
                   "image_bytes": int(info.get("bytes", 0)), "sibling": siblings[0] if siblings else None,
                   "seconds": round(time.monotonic() - t0, 3), "by": by}
            self.emit(EventKind.WORKER_SUSPENDED, **out)
            if reason is not SuspendReason.OPERATOR:  # requeued: resumed when capacity returns
                self._queue(Demand(id=w.id, kind=DemandKind.RESUME, model=w.model, gpus=w.gpus, priority=w.priority,
                                   engine=w.engine, model_dir=w.model_dir, time_limit_s=w.time_limit_s),
                            f"suspended ({reason.value}{' by ' + by if by else ''})")
            return out
        finally:
            with self._lock:
                self._busy.discard(worker_id)
            self._wake.set()

    def _suspend_failed(self, w: WorkerRecord, reason: SuspendReason, exc: Exception) -> float:
        """A failed suspend backs off (exponential, capped): the planner does not pick the
        worker again before `suspend_retry_at`, so a suspend that keeps failing is not retried
        (hold, freeze, dump, resume) at every round. Reported: an event, the worker's record
        (status), a metric. Returns the back-off in seconds."""
        w.suspend_failures += 1
        delay = min(SUSPEND_BACKOFF_MAX_S, SUSPEND_BACKOFF_S * 2 ** (w.suspend_failures - 1))
        w.suspend_retry_at, w.suspend_error = time.time() + delay, str(exc)
        self.store.save_worker(w)
        log.warning("suspend of %s (%s) failed %d time(s) in a row, next automatic try in %.0fs: %s", w.id,
                    reason.value, w.suspend_failures, delay, exc)
        self.emit(EventKind.SUSPEND_FAILED, worker=w.id, node=w.node, reason=reason.value, error=str(exc),
                  failures=w.suspend_failures, retry_in_s=delay)
        return delay

    def _undo_suspend(self, w: WorkerRecord, image: str) -> None:
        """A suspend that failed before the source was killed: the source serves again."""
        def resume_source() -> None:
            if self.backend.cell_state(w.node, w.cell_id) in ("stopped", "running"):
                self.backend.resume(w.node, w.cell_id)

        self._best_effort(f"undoing the suspend of {w.id}", resume_source, lambda: self.backend.release(w.id),
                          *([lambda: self.backend.remove_image(w.node, image)] if image else []))
        w.state = WorkerState.RUNNING
        self.store.save_worker(w)

    def resume(self, worker_id: str, node: str | None = None) -> dict:
        """Restore a suspended worker on `node` (or wherever the planner seats it, making room as
        a launch does) and switch its traffic back: held requests are released and cut streams
        continue token-exactly. No room now: its resume demand waits in `pending`."""
        w = self.store.worker(worker_id)
        if w is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        if w.state != WorkerState.SUSPENDED:
            raise RuntimeError(f"worker {worker_id} is {w.state}, not suspended")
        demand = self.store.demand(worker_id) or Demand(
            id=w.id, kind=DemandKind.RESUME, model=w.model, gpus=w.gpus, priority=w.priority, engine=w.engine,
            model_dir=w.model_dir, time_limit_s=w.time_limit_s, reason="resumed by the operator")
        if worker_id in self._placing:
            raise RuntimeError(f"worker {worker_id} is being resumed")
        if node is None:
            return self._seat_demand(demand, make_room=True, queue=True)
        self._check_target(node)
        t0 = time.monotonic()
        with self._seating:
            claimed = self._claim_resume(w, node)
        return self._restore_claimed(claimed, demand, t0)

    def _recover_suspension(self, w: WorkerRecord) -> None:
        """A suspend or resume the previous controller did not finish. Suspending: a source
        that still exists serves again (the suspend is undone); one already killed left its
        image, so the worker is suspended. Resuming: the half-restored copy goes, the worker
        stays suspended and its resume is requeued."""
        if w.state == WorkerState.SUSPENDING:
            state = "absent"
            try:
                state = self.backend.cell_state(w.node, w.cell_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("recovering the suspend of %s: %s", w.id, exc)
            if state in ("stopped", "running"):
                self._undo_suspend(w, "")
                return
            image = next(iter(sorted((self.node_dir(w.node) / "images").glob(f"suspend-{w.id}-*"))), None)
            if image is None or not (image / "manifest.json").exists():
                w.state, w.error = WorkerState.LOST, "its suspend was interrupted and left no image"
                self.store.save_worker(w)
                return
            self._best_effort(f"freeing {w.reservation}", lambda: self.backend.free(w.reservation))
            w.image, w.image_node, w.suspend_reason = str(image), w.node, w.suspend_reason or SuspendReason.PREEMPTED
        else:
            self._best_effort(f"cleaning up the interrupted resume of {w.id}",
                              lambda: self.backend.kill(w.node, w.cell_id), lambda: self.backend.free(w.reservation))
        w.state = WorkerState.SUSPENDED
        w.node, w.cell_id, w.reservation, w.endpoint, w.gpu_ids = "", "", "", "", []
        self.store.save_worker(w)
        if w.suspend_reason != SuspendReason.OPERATOR and self.store.demand(w.id) is None:
            self._queue(Demand(id=w.id, kind=DemandKind.RESUME, model=w.model, gpus=w.gpus, priority=w.priority,
                               engine=w.engine, model_dir=w.model_dir, time_limit_s=w.time_limit_s),
                        "requeued by a controller restart")

    def _image_fingerprint(self, image: str) -> dict | None:
        import json

        try:
            return json.loads((Path(image) / "manifest.json").read_text()).get("fingerprint")
        except (OSError, ValueError):
            return None

    def _claim_resume(self, w: WorkerRecord, node: str, timeout: float = 15.0) -> WorkerRecord:
        """The fingerprint gate, then the suspended worker's GPUs reserved on `node`."""
        fp = self._image_fingerprint(w.image)
        if fp is not None:
            mismatches = self.backend.call(node, "compatible", fp, timeout=60)
            if mismatches:
                raise RuntimeError(f"{node} cannot restore {w.id}: " + "; ".join(mismatches))
        tag = uuid.uuid4().hex[:6]
        with self._lock:
            if w.id in self._busy:
                raise RuntimeError(f"worker {w.id} is busy")
            self._busy.add(w.id)
            self._placing.add(w.id)
            w.node, w.cell_id, w.reservation, w.state = node, f"{w.id}-s{tag}", f"relocator-{w.id}-s{tag}", WorkerState.RESUMING
            self.store.save_worker(w)
        try:
            w.gpu_ids = list(self.backend.reserve(w, node, w.reservation, timeout=timeout) or [])
            self.store.save_worker(w)
        except BaseException:
            self._best_effort(f"freeing {w.reservation}", lambda: self.backend.free(w.reservation))
            w.node, w.cell_id, w.reservation, w.state = "", "", "", WorkerState.SUSPENDED
            w.gpu_ids = []
            self.store.save_worker(w)
            with self._lock:
                self._busy.discard(w.id)
                self._placing.discard(w.id)
            raise
        return w

    def _image_travels(self, src: str, dst: str) -> bool:
        """Whether an image on `src` must be sent to `dst` (the cluster's transfer mode; with
        `auto`, whether `dst` sees `src`'s image store)."""
        if self.transfer is TransferMode.SHARED:
            return False
        if self.transfer is TransferMode.AUTO:
            try:
                return not self.backend.shared_storage(src, dst)
            except Exception:  # noqa: BLE001 - unknown: send it (always correct)
                return True
        return True

    def _restore_claimed(self, w: WorkerRecord, demand: Demand, t0: float, extra: dict | None = None) -> dict:
        node = w.node
        try:
            image = w.image
            travels = node != w.image_node and self._image_travels(w.image_node, node)
            if travels:  # a suspended worker's image is on disk: the chunked, checksummed stream
                image = str(self.node_dir(node) / "images" / Path(w.image).name)
                self.backend.transfer(w.image_node, node, w.image, image)
            info = self.backend.restore(node, image, w.cell_id, gpu_ids=w.gpu_ids or None)
            w.endpoint = info["endpoint"]
            self.backend.switch(w.id, w.endpoint)  # registers it again if the router forgot it
            suspended_s = round(time.time() - (w.suspended_at or time.time()), 3)
            keep = bool(self.config.get("keep_last_image", True)) and not travels and (
                self.transfer is not TransferMode.STREAM and self.transfer is not TransferMode.POSTCOPY)
            if keep:
                self._drop_last_image(w)
                w.last_image, w.last_image_node = w.image, w.image_node
            else:
                self._best_effort(f"removing {w.image}", lambda: self.backend.remove_image(w.image_node, w.image))
            if image != w.image:
                self._best_effort(f"removing {image}", lambda: self.backend.remove_image(node, image))
            w.image, w.image_node, w.suspend_reason, w.suspended_at = "", "", "", None
            w.state, w.error = WorkerState.RUNNING, ""
            w.deadline = time.time() + w.time_limit_s if w.time_limit_s else None
            self.store.save_worker(w)
            self.store.delete_demand(w.id)
            out = {"worker": w.id, "node": node, "seconds": round(time.monotonic() - t0, 3),
                   "suspended_s": suspended_s, "restore": info.get("seconds"), **(extra or {})}
            self.emit(EventKind.WORKER_RESUMED, **out)
            self.emit(EventKind.DEMAND_PLACED, demand=demand.id, demand_kind=DemandKind.RESUME, worker=w.id, node=node,
                      seconds=out["seconds"], **(extra or {}))
            return {**w.to_dict(), **out}
        except BaseException as exc:
            self._best_effort(f"cleaning up the failed resume of {w.id}", lambda: self.backend.kill(node, w.cell_id),
                              lambda: self.backend.free(w.reservation))
            w.node, w.cell_id, w.reservation, w.endpoint, w.state, w.gpu_ids = "", "", "", "", WorkerState.SUSPENDED, []
            w.error = f"resume on {node} failed: {exc}"
            self.store.save_worker(w)
            if self.store.demand(w.id) is not None or w.suspend_reason != SuspendReason.OPERATOR:
                self._queue(demand, w.error)
            raise
        finally:
            with self._lock:
                self._busy.discard(w.id)
                self._placing.discard(w.id)

    def pending(self) -> list[dict]:
        """Demands waiting for GPUs, highest priority first, then oldest."""
        return [d.summary() for d in sorted(self.store.demands(), key=lambda d: (-d.priority, d.since))]

    def cancel(self, demand_id: str) -> dict:
        """Drop a pending demand (a suspended worker stays suspended: `resume` or `stop` it)."""
        with self._lock:  # atomic with a retry taking it up (`_seat_demand`)
            d = self.store.demand(demand_id)
            if d is None:
                raise KeyError(f"unknown demand {demand_id!r}")
            if demand_id in self._placing:
                raise RuntimeError(f"demand {demand_id} is being placed")
            self.store.delete_demand(demand_id)
        return {"id": demand_id, "cancelled": True}

    def consolidate(self, dry_run: bool = False, max_moves: int = 10, transfer: str | None = None) -> dict:
        """Pack the running workers onto the fewest nodes with live moves (planner.consolidate)."""
        if int(max_moves) < 1:
            raise ValueError(f"max_moves must be >= 1, not {max_moves}")
        transfer = TransferMode(transfer).value if transfer is not None else None
        t0 = time.monotonic()
        with self._seating:
            nodes, seats = self._view()
            plan = scheduling.consolidate(nodes, seats, max_moves=int(max_moves))
            moves = plan["moves"]
            out = {"nodes_freed": plan["nodes_freed"], "moves": [m.to_dict() for m in moves],
                   "gpus_moved": sum(m.gpus for m in moves)}
            if dry_run:
                return {"dry_run": True, **out}
            results = self._run_moves(moves, transfer=transfer)
        by_worker = {r["worker"]: r for r in results}
        still = {w.node for w in self.store.workers() if w.state in HOLDING_STATES}
        out["nodes_freed"] = [n for n in plan["nodes_freed"] if n not in still]
        out["moves"] = [{**m.to_dict(), "result": by_worker[m.worker]["result"],
                         "blackout_s": by_worker[m.worker].get("blackout_s", 0.0),
                         "relocation": by_worker[m.worker].get("id"), "error": by_worker[m.worker].get("error", "")}
                        for m in moves]
        out["gpus_moved"] = sum(m["gpus"] for m in out["moves"] if m["result"] == "done")
        out["seconds"] = round(time.monotonic() - t0, 3)
        self.emit(EventKind.CONSOLIDATED, moves=len(moves), nodes_freed=out["nodes_freed"],
                  gpus_moved=out["gpus_moved"], results=[m["result"] for m in out["moves"]])
        return out

    # -- reconcile steps of the scheduling layer -------------------------------------------------
    def update_deadlines(self) -> None:
        """A worker past its time limit becomes preemptible; it is not suspended here. A waiting
        demand that needs its GPUs suspends it (update_demands: any priority may, see
        scheduling.can_suspend), as does a drain's deadline; with nobody waiting it serves on
        (a suspend and a resume on its own GPUs would be a blackout for nothing). Announced once
        per deadline (an event); the new seat view makes update_demands retry at once."""
        now = time.time()
        for w in self.store.workers():
            if w.past_deadline(now) and (w.id, w.deadline) not in self._announced:
                self._announced.add((w.id, w.deadline))
                self.emit(EventKind.WORKER_PREEMPTIBLE, worker=w.id, node=w.node, deadline=w.deadline,
                          priority=w.priority)

    def update_consolidation(self) -> None:
        """Periodic consolidation (config controller.consolidate; off by default)."""
        self.periodic.update()

    def _scheduling_busy(self) -> bool:
        """A demand waiting or being seated, a relocation open, or a node cordoned (a drain with
        a deadline: the packing plan does not know to avoid it): no packing now."""
        return bool(self.store.demands() or self._placing or self.store.open_relocations() or self.cordoned())

    def update_demands(self) -> None:
        """Pending demands, highest priority first then oldest, retried on a thread whenever
        capacity changed (or every DEMAND_RETRY_S): a demand that still cannot be met stays."""
        todo = [d for d in self.store.demands() if d.state == DemandState.PENDING and d.id not in self._placing]
        if not todo or self._retrying.is_set():
            return
        nodes, seats = self._view()
        sig = (tuple((n.id, n.gpus_free) for n in nodes),
               tuple(sorted((s.worker, s.node, s.movable, s.expired, s.suspendable) for s in seats)),
               tuple(sorted(d.id for d in todo)))
        if sig == self._demand_sig and time.monotonic() - self._demand_tried_at < DEMAND_RETRY_S:
            return
        self._demand_sig, self._demand_tried_at = sig, time.monotonic()
        self._retrying.set()
        threading.Thread(target=self._retry_demands, args=(todo,), name="demands", daemon=True).start()

    def _retry_demands(self, todo: list[Demand]) -> None:
        try:
            for d in sorted(todo, key=lambda d: (-d.priority, d.since)):
                cur = self.store.demand(d.id)
                if cur is None or cur.state != DemandState.PENDING or cur.id in self._placing:
                    continue
                try:
                    out = self._seat_demand(cur, make_room=True, queue=True, stored=True)
                except Exception as exc:  # noqa: BLE001 - one demand failing never stops the others
                    log.warning("demand %s: %s", d.id, exc)
                    continue
                if out.get("state") != DemandState.PENDING:
                    break  # capacity changed: the next round plans the rest on the new state
        finally:
            self._retrying.clear()
            self._wake.set()

    @staticmethod
    def _best_effort(what: str, *steps: Callable[[], Any]) -> None:
        """Each cleanup step in turn: one that fails is logged and the rest still run."""
        for fn in steps:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                log.warning("%s: %s", what, exc)

    def _abandon_launch(self, w: WorkerRecord, keep_record: bool = False) -> None:
        self._best_effort(f"cleaning up interrupted launch of {w.id}",
                          lambda: self.backend.kill(w.node, w.cell_id), lambda: self.backend.free(w.reservation))
        if keep_record:
            w.state = "lost"
            self.store.save_worker(w)
        else:
            self.store.delete_worker(w.id)

    def stop_worker(self, worker_id: str) -> dict:
        w = self.store.worker(worker_id)
        if w is None:
            if self.store.demand(worker_id) is not None:  # a launch still pending
                return {**self.cancel(worker_id), "stopped": True}
            raise KeyError(f"unknown worker {worker_id!r}")
        with self._lock:
            if worker_id in self._busy:
                raise RuntimeError(f"worker {worker_id} is being relocated")
            self._busy.add(worker_id)
        try:
            try:
                self.router().remove_replica(worker_id)
            except Exception:  # noqa: BLE001
                pass
            if w.node and w.cell_id:
                self.backend.kill(w.node, w.cell_id)
            if w.reservation:
                self.backend.free(w.reservation)
            self._drop_last_image(w)
            if w.image:  # a suspended worker's image
                self._best_effort(f"removing {w.image}", lambda: self.backend.remove_image(w.image_node, w.image))
            self.store.delete_demand(worker_id)
            self.store.delete_worker(worker_id)
            return {"id": worker_id, "stopped": True}
        finally:
            with self._lock:
                self._busy.discard(worker_id)

    # -- relocations ---------------------------------------------------------------------------------
    def _spawn(self, rel: Relocation, recover: bool = False) -> None:
        def body() -> None:
            try:
                if recover:
                    self.machine.recover(rel)
                else:
                    self.machine.run(rel)
            except Exception as exc:  # noqa: BLE001
                rel.result, rel.error = "failed", f"internal: {exc}\n{traceback.format_exc()}"
                rel.reason = FailureReason.ERROR
                rel.finished_at = time.time()
                self.store.save_relocation(rel)
                self.machine.settle_worker(rel)  # never left `relocating`: lost, so it is replaced
                self.emit(EventKind.RELOCATION_FINISHED, relocation=rel.id, worker=rel.worker, result=rel.result,
                          reason=rel.reason, error=f"internal: {exc}", src=rel.src, dst=rel.dst,
                          phases=rel.phase_seconds(), image_bytes=rel.image_bytes, rollback_from=None,
                          recovered=rel.recovered)
            finally:
                with self._lock:
                    self._busy.discard(rel.worker)
                self._wake.set()  # e.g. its worker landed on a node lost meanwhile: replace it now

        t = threading.Thread(target=body, name=f"relocation-{rel.id}", daemon=True)
        self._threads[rel.id] = t
        t.start()

    def relocate(self, worker_id: str, to: str | None = None, transfer: str | None = None,
                 faults: dict | None = None, wait: bool = True, timeout: float = 900.0) -> dict:
        w = self.store.worker(worker_id)
        if w is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        if to is not None:
            self._check_target(to, self.inventory())
        mode = TransferMode(transfer) if transfer is not None else self.transfer
        faults = check_faults({**env_faults(), **(faults or {})})
        with self._lock:
            if worker_id in self._busy:
                raise RuntimeError(f"worker {worker_id} is already being relocated or started")
            self._busy.add(worker_id)
        rel = Relocation(id=Relocation.new_id(), worker=worker_id, src=w.node, dst=to,
                         transfer=mode, faults=faults, engine=w.engine)
        self.store.save_relocation(rel)
        self._spawn(rel)
        if not wait:
            return rel.summary()
        return self.wait_relocation(rel.id, timeout)

    def wait_relocation(self, relocation_id: str, timeout: float = 900.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rel = self.store.relocation(relocation_id)
            if rel is None:
                raise KeyError(f"unknown relocation {relocation_id!r}")
            if rel.result != RUNNING:
                return rel.summary()
            time.sleep(0.1)
        raise TimeoutError(f"relocation {relocation_id} still running after {timeout:.0f}s")

    def get_relocation(self, relocation_id: str) -> dict | None:
        rel = self.store.relocation(relocation_id)
        return rel.to_dict() if rel else None

    def drain(self, node: str, parallel: int = 1, transfer: str | None = None, by: float | str | None = None) -> dict:
        """Move every worker off `node`, live; `parallel` relocations at a time. With `by` (an
        epoch time, or a duration from now: 600, "10m"), the node is cordoned (nothing is placed
        or resumed on it until `uncordon`), and a worker that fits nowhere else, or whose move
        has not started by then, is suspended instead (requeued: it resumes elsewhere when
        capacity returns). Without `by`, a worker that fits nowhere fails the drain up front."""
        if node not in self.inventory():
            raise ValueError(f"unknown node {node!r}")
        transfer = TransferMode(transfer) if transfer is not None else None
        deadline = None
        if by is not None:
            try:
                epoch = float(by)
            except (TypeError, ValueError):
                epoch = 0.0
            deadline = epoch if epoch > 1e9 else time.time() + parse_duration(by)
            self.store.put("cordon", node, {"node": node, "at": time.time(), "by": deadline})
        t0 = time.monotonic()
        todo = [w for w in self.store.workers() if w.node == node and w.state == "running"]
        # plan all targets up front (evacuation), biggest first; workers past their time limit
        # last: when room runs out, they are the ones set aside
        now = time.time()
        todo.sort(key=lambda w: (w.past_deadline(now), -w.gpus))
        view = self._view()[0]
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
        results: list[dict] = []
        suspended: list[dict] = []
        pending = list(plan)
        running: list[str] = []
        first = True
        while pending or running:
            while pending and len(running) < max(1, parallel):
                wid, dst = pending.pop(0)
                if deadline is not None and time.time() >= deadline:  # too late to move: set aside
                    self._collect_into(suspended, wid, lambda wid=wid: self.suspend(wid, reason=SuspendReason.DRAIN))
                    continue
                running.append(self.relocate(wid, to=dst, transfer=transfer, wait=False)["id"])
            if first:  # suspended only once the first moves are recorded: their requeued resumes
                first = False  # must not take the GPUs these moves were planned onto
                for wid in suspend:
                    self._collect_into(suspended, wid, lambda wid=wid: self.suspend(wid, reason=SuspendReason.DRAIN))
            time.sleep(0.2)
            for rid in list(running):
                rel = self.store.relocation(rid)
                if rel.result != RUNNING:
                    running.remove(rid)
                    results.append(rel.summary())
        if first:  # nothing to move: only suspends
            for wid in suspend:
                self._collect_into(suspended, wid, lambda wid=wid: self.suspend(wid, reason=SuspendReason.DRAIN))
        left = [w.id for w in self.store.workers() if w.node == node]
        return {"node": node, "relocations": results, "suspended": suspended, "workers_left": left,
                "drained": not left, "seconds": round(time.monotonic() - t0, 3),
                "by": deadline, "met_deadline": None if deadline is None else time.time() <= deadline}

    def _collect_into(self, out: list[dict], wid: str, fn: Callable[[], dict]) -> None:
        try:
            out.append(fn())
        except Exception as exc:  # noqa: BLE001 - the rest of the drain goes on
            out.append({"worker": wid, "error": str(exc)})

    def cordoned(self) -> set[str]:
        """Nodes drained with a deadline: nothing is placed or resumed on them until uncordoned."""
        return {d["node"] for d in self.store.all("cordon")}

    def uncordon(self, node: str) -> dict:
        self.store.delete("cordon", node)
        self._wake.set()
        return {"node": node, "cordoned": False}

    # -- reporting ---------------------------------------------------------------------------------
    def status(self) -> dict:
        nodes = self.inventory(refresh=True)
        return {
            "router_url": self.router_url,
            "router_control_url": self.router_control_url,
            "nodes": [{**n.to_dict(), "lost_at": self._lost_nodes.get(n.id)} for n in nodes.values()],
            "workers": [{"id": w.id, "model": w.model, "node": w.node, "state": w.state, "endpoint": w.endpoint,
                         "gpus": w.gpus, "gpu_ids": w.gpu_ids, "cell": w.cell_id, "reservation": w.reservation,
                         "replacements": w.replacements, "last_image": w.last_image,
                         "priority": w.priority, "time_limit_s": w.time_limit_s, "deadline": w.deadline,
                         "image": w.image, "suspend_reason": w.suspend_reason, "suspended_at": w.suspended_at,
                         "suspensions": w.suspensions, "preemptible": w.past_deadline(time.time()),
                         "suspend_failures": w.suspend_failures, "suspend_retry_at": w.suspend_retry_at,
                         "suspend_error": w.suspend_error, "error": w.error} for w in self.store.workers()],
            "pending": self.pending(),
            "cordoned": sorted(self.cordoned()),
            "relocations": [r.summary() for r in self.store.relocations()],
            "controller": {**self.ping(), "loop": self.loop_stats, "consolidation": self.periodic.last},
            # where Prometheus scrapes (docs/observability.md) and where events go
            "metrics": {"controller": self.metrics.url if self.metrics else None,
                        "router": f"{self.router_url.rstrip('/')}/metrics" if self.router_url else None},
            "events": {"log": str(self.base_dir / "events.jsonl"), "last": self.event_log.last},
        }

    # -- events ------------------------------------------------------------------------------------
    def events_cursor(self) -> int:
        """The number of the newest event: a subscriber that starts now passes it to wait_events."""
        return self.event_log.last

    def wait_events(self, after: int, timeout: float = 20.0, limit: int = 1000) -> dict:
        """Events numbered above `after`, waiting up to `timeout` s for one (a long poll)."""
        return self.event_log.wait(after, min(float(timeout), 60.0), limit)

    def cells(self) -> dict[str, list[dict]]:
        return {name: self.backend.call(name, "cells", timeout=60) for name, info in self.inventory().items()
                if info.alive}

    def shutdown(self) -> dict:
        """Stop every worker and free every reservation (the cluster itself is stopped by `down`)."""
        self._stop.set()
        self._wake.set()
        out = {"killed": {}, "freed": []}
        for name, info in self.inventory().items():
            try:
                out["killed"][name] = (self.backend.call(name, "kill_all", timeout=120) if info.alive
                                       else self.backend.fence(name)["killed"])
            except Exception as exc:  # noqa: BLE001
                out["killed"][name] = f"error: {exc}"
        for w in self.store.workers():
            try:
                self.router().remove_replica(w.id)
            except Exception:  # noqa: BLE001
                pass
            self.backend.free(w.reservation)
            out["freed"].append(w.reservation)
            self._drop_last_image(w)
            self.store.delete_worker(w.id)
        return out


def start_controller(config: dict[str, Any], ray_node_id: str | None = None):
    """The controller actor, created (detached, restarted by Ray if it dies) or found; on the
    head node, or on `ray_node_id` (`relocator deploy`'s `controller.node`)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    # Pinned to the head node, like Ray Serve's controller: the cluster lives and dies with the
    # head (GCS) anyway, and a controller on a node that is lost would linger a moment next to
    # the copy Ray restarts elsewhere (seen: two controllers replacing one lost worker twice).
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_concurrency=64, num_cpus=0,
        **({"scheduling_strategy": NodeAffinitySchedulingStrategy(ray_node_id, soft=False)} if ray_node_id
           else {"resources": {"node:__internal_head__": 0.001}}),
    ).remote(config)
