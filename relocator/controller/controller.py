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
from relocator.controller.inventory import NodeInfo, best_fit, ray_nodes
from relocator.controller.machine import Machine, PhaseFault, check_faults
from relocator.controller.model import FailureReason, RUNNING, Relocation, TransferMode, WorkerRecord, tokenizer_of
from relocator.controller.store import Store

CONTROLLER_NAME = "relocator-controller"
ORPHAN_AFTER_S = 60.0  # a cell nobody owns is killed once it is this old
NODE_WATCH_S = 0.5  # how often Ray's node table is read for nodes declared dead
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
        self._lost_nodes: dict[str, float] = {}  # node -> when this controller saw it lost
        self._fenced_nodes: set[str] = set()
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
                                                str(self.node_dir(name) / "images"))
        for w in self.store.workers():  # a launch the previous controller did not finish
            if w.state == "starting" and w.id not in self._busy:
                self._abandon_launch(w)
            elif w.state == "replacing" and w.id not in self._busy:  # its half-started copy goes
                self._abandon_launch(w, keep_record=True)
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
                known = {d["ray_node_id"]: d["id"] for d in self.store.all("node")}
                self._nodes = ray_nodes(known)
                for n in self._nodes.values():  # remembered: Ray lists a dead node without its name
                    if n.alive and known.get(n.ray_node_id) != n.id:
                        self.store.put("node", n.ray_node_id, {"id": n.id, "ray_node_id": n.ray_node_id})
                    if not n.alive and n.id not in self._lost_nodes:  # first seen dead
                        self._lost_nodes[n.id] = time.time()
                        self._wake.set()
                        doc = self.store.get("node", n.ray_node_id) or {"id": n.id, "ray_node_id": n.ray_node_id}
                        if not doc.get("lost_at"):  # once per node, also across controller restarts
                            self.store.put("node", n.ray_node_id, {**doc, "lost_at": self._lost_nodes[n.id]})
                            self.emit(EventKind.NODE_LOST, node=n.id, ray_node_id=n.ray_node_id)
                self._nodes_at = time.monotonic()
            return dict(self._nodes)

    def place(self, gpus: int, exclude: tuple[str, ...] = (), refresh: bool = False) -> str | None:
        """The live node the planner's policy puts a `gpus`-GPU worker on (None: no room)."""
        nodes = self.inventory(refresh=refresh)
        return best_fit({n.id: n.gpus_free for n in nodes.values() if n.alive}, gpus, exclude=exclude,
                        totals={n.id: n.gpus_total for n in nodes.values()}, policy=self.policy)

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
                     self.update_cells):
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
        killed (a lost node's copies must never serve again next to their replacements)."""
        nodes = self.inventory(refresh=True)
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
                return "restored from its last image", self.backend.restore(node, w.last_image, w.cell_id)
            except Exception as exc:  # noqa: BLE001 - fall back to a cold start
                log.warning("warm restart of %s from %s failed (%s); launching cold", w.id, w.last_image, exc)
                self._best_effort(f"removing the failed restore of {w.id}", lambda: self.backend.kill(node, w.cell_id))
        return "cold launch", self.backend.call(node, "launch", w.cell_id, w.model_dir, w.model,
                                              engine=w.engine)

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
            node = self.place(w.gpus, refresh=True)
            if node is None:
                raise RuntimeError(f"no live node has {w.gpus} free GPU(s)")
            tag = uuid.uuid4().hex[:6]
            w.node, w.cell_id, w.reservation, w.endpoint = node, f"{w.id}-x{tag}", f"relocator-{w.id}-x{tag}", ""
            w.state = "replacing"  # a controller restarted now kills this copy and starts again
            self.store.save_worker(w)
            self.backend.reserve(w, node, w.reservation)
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
        ids = {w.id for w in self.store.workers()}
        i = 1
        while f"w{i}" in ids:
            i += 1
        return f"w{i}"

    def launch(self, model: str = "tiny-llama", gpus: int = 1, node: str | None = None,
               worker_id: str | None = None, engine: str | None = None) -> dict:
        """Start a worker (placed by the planner unless `node` is given), wait until it serves,
        register it with the router."""
        from adapters.base import DEFAULT_ENGINE, Engine
        from relocator.tinymodel import ensure_tiny_model

        engine = Engine(engine or DEFAULT_ENGINE).value  # an unknown engine: ValueError naming them

        if model in ("tiny", "tiny-llama"):
            model_dir, served = str(ensure_tiny_model()), "tiny-llama"
        else:
            model_dir, served = model, Path(model).name
        with self._lock:
            wid = worker_id or self._new_worker_id()
            if self.store.worker(wid):
                raise ValueError(f"worker {wid} exists")
            nodes = self.inventory(refresh=True)
            if node is None:
                node = self.place(gpus)
                if node is None:
                    raise RuntimeError(f"no node has {gpus} free GPU(s)")
            elif node not in nodes:
                raise ValueError(f"unknown node {node!r}; nodes: {', '.join(nodes)}")
            elif not nodes[node].alive:
                raise ValueError(f"node {node!r} is lost")
            # cell (and netns) names are machine-wide: another cluster on this host has a w1 too
            w = WorkerRecord(id=wid, model=served, node=node, gpus=gpus, cell_id=f"{wid}-c{uuid.uuid4().hex[:6]}",
                             reservation=f"relocator-{wid}-launch", model_dir=model_dir, state="starting",
                             engine=engine)
            self._pending_reservations.add(w.reservation)
            self.store.save_worker(w)
            self._busy.add(wid)
        try:
            self.backend.reserve(w, node, w.reservation)
            t0 = time.monotonic()
            info = self.backend.call(node, "launch", w.cell_id, model_dir, served, engine=w.engine)
            w.launch_s = round(time.monotonic() - t0, 3)
            w.endpoint = info["endpoint"]
            self.router().add_replica(wid, served, w.endpoint, tokenizer_of(w), engine)
            w.state = "running"
            self.store.save_worker(w)
            return {**w.to_dict(), "ready_s": info["ready_s"]}
        except BaseException as exc:
            self.backend.free(w.reservation)
            try:
                self.backend.kill(node, w.cell_id)
            except Exception:  # noqa: BLE001
                pass
            w.state, w.error = "failed", str(exc)
            self.store.delete_worker(wid)
            raise
        finally:
            with self._lock:
                self._busy.discard(wid)
                self._pending_reservations.discard(w.reservation)

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
            self.backend.kill(w.node, w.cell_id)
            self.backend.free(w.reservation)
            self._drop_last_image(w)
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
        nodes = self.inventory()
        if to is not None and to not in nodes:
            raise ValueError(f"unknown node {to!r}")
        if to is not None and not nodes[to].alive:
            raise ValueError(f"node {to!r} is lost")
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

    def drain(self, node: str, parallel: int = 1, transfer: str | None = None) -> dict:
        """Move every worker off `node`, live; `parallel` relocations at a time."""
        if node not in self.inventory():
            raise ValueError(f"unknown node {node!r}")
        transfer = TransferMode(transfer) if transfer is not None else None
        t0 = time.monotonic()
        todo = [w for w in self.store.workers() if w.node == node and w.state == "running"]
        # plan all targets up front (evacuation), biggest first
        todo.sort(key=lambda w: -w.gpus)
        free = {n.id: n.gpus_free for n in self.inventory(refresh=True).values() if n.alive and n.id != node}
        totals = {n.id: n.gpus_total for n in self.inventory().values() if n.id != node}
        plan: list[tuple[str, str]] = []
        for w in todo:
            dst = best_fit(free, w.gpus, totals=totals, policy=self.policy)
            if dst is None:
                raise RuntimeError(f"cannot drain {node}: no room for {w.id} ({w.gpus} GPU) elsewhere")
            free[dst] -= w.gpus
            plan.append((w.id, dst))
        results: list[dict] = []
        pending = list(plan)
        running: list[str] = []
        while pending or running:
            while pending and len(running) < max(1, parallel):
                wid, dst = pending.pop(0)
                running.append(self.relocate(wid, to=dst, transfer=transfer, wait=False)["id"])
            time.sleep(0.2)
            for rid in list(running):
                rel = self.store.relocation(rid)
                if rel.result != RUNNING:
                    running.remove(rid)
                    results.append(rel.summary())
        left = [w.id for w in self.store.workers() if w.node == node]
        return {"node": node, "relocations": results, "workers_left": left,
                "drained": not left, "seconds": round(time.monotonic() - t0, 3)}

    # -- reporting ---------------------------------------------------------------------------------
    def status(self) -> dict:
        nodes = self.inventory(refresh=True)
        return {
            "router_url": self.router_url,
            "router_control_url": self.router_control_url,
            "nodes": [{**n.to_dict(), "lost_at": self._lost_nodes.get(n.id)} for n in nodes.values()],
            "workers": [{"id": w.id, "model": w.model, "node": w.node, "state": w.state, "endpoint": w.endpoint,
                         "gpus": w.gpus, "cell": w.cell_id, "reservation": w.reservation,
                         "replacements": w.replacements, "last_image": w.last_image,
                         "error": w.error} for w in self.store.workers()],
            "relocations": [r.summary() for r in self.store.relocations()],
            "controller": {**self.ping(), "loop": self.loop_stats},
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


def start_controller(config: dict[str, Any]):
    """The controller actor, created (detached, restarted by Ray if it dies) or found."""
    import ray

    # Pinned to the head node, like Ray Serve's controller: the cluster lives and dies with the
    # head (GCS) anyway, and a controller on a node that is lost would linger a moment next to
    # the copy Ray restarts elsewhere (seen: two controllers replacing one lost worker twice).
    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_concurrency=64, num_cpus=0, resources={"node:__internal_head__": 0.001},
    ).remote(config)
