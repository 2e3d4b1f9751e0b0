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
from pathlib import Path
from typing import Any

from relocator.agent.agent import NAMESPACE, start_agent
from relocator.controller.backend import RayBackend
from relocator.controller.inventory import NodeInfo, best_fit, ray_nodes
from relocator.controller.machine import Machine
from relocator.controller.model import DONE, RUNNING, Relocation, WorkerRecord
from relocator.controller.store import Store

CONTROLLER_NAME = "relocator-controller"
log = logging.getLogger("relocator.controller")


def env_faults() -> dict[str, Any]:
    """Fault injection from the environment: RELOCATOR_FAULTS="dump,transfer,restore"."""
    raw = os.environ.get("RELOCATOR_FAULTS", "")
    return {p.strip().lower(): True for p in raw.split(",") if p.strip()}


class Controller:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = dict(config)
        self.base_dir = Path(config["base_dir"])
        self.router_control_url = config.get("router_control_url")
        self.router_token = config.get("router_token")
        self.router_url = config.get("router_url")
        self.transfer = config.get("transfer", "shared")
        self.policy = config.get("policy", "best-fit")
        self.interval = float(config.get("reconcile_interval_s", 2.0))
        self.store = Store(self.base_dir / "controller.db")
        self.backend = RayBackend(self)
        self.machine = Machine(self.store, self.backend, keep_images=bool(config.get("keep_images", False)))
        self._lock = threading.RLock()
        self._busy: set[str] = set()
        self._threads: dict[str, threading.Thread] = {}
        self._nodes: dict[str, NodeInfo] = {}
        self._nodes_at = 0.0
        self.loop_stats: dict[str, Any] = {}
        self.started_at = time.time()
        self._stop = threading.Event()
        self._pending_reservations: set[str] = set()
        self.agents = {}
        for name, info in self.inventory(refresh=True).items():
            self.agents[name] = start_agent(name, info.ray_node_id, str(self.node_dir(name) / "state"),
                                            str(self.node_dir(name) / "images"))
        for w in self.store.workers():  # a launch the previous controller did not finish
            if w.state == "starting":
                self._abandon_launch(w)
        self.recovering = [r.id for r in self.store.open_relocations()]
        for rel in self.store.open_relocations():
            self._busy.add(rel.worker)
            self._spawn(rel, recover=True)
        threading.Thread(target=self._loop, name="reconcile", daemon=True).start()

    # -- plumbing -------------------------------------------------------------------------------
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
                self._nodes = ray_nodes()
                self._nodes_at = time.monotonic()
            return dict(self._nodes)

    def ping(self) -> dict:
        return {"pid": os.getpid(), "started_at": self.started_at, "recovering": self.recovering}

    # -- reconcile loop ---------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.reconcile_once()

    def reconcile_once(self) -> dict:
        stats = {}
        for step in (self.update_nodes, self.update_workers, self.update_router, self.update_reservations):
            t0 = time.monotonic()
            try:
                step()
                stats[step.__name__] = {"ok": True, "s": round(time.monotonic() - t0, 4)}
            except Exception as exc:  # noqa: BLE001 - one failing step never stops the loop
                stats[step.__name__] = {"ok": False, "s": round(time.monotonic() - t0, 4), "error": str(exc)}
        self.loop_stats = {"at": time.time(), **stats}
        return self.loop_stats

    def update_nodes(self) -> None:
        self.inventory(refresh=True)

    def update_workers(self) -> None:
        """Observed vs recorded: a running worker whose cell is gone is marked failed."""
        for w in self.store.workers():
            if w.state != "running" or w.id in self._busy:
                continue
            state = self.backend.call(w.node, "cell_state", w.cell_id, timeout=30)
            with self._lock:
                cur = self.store.worker(w.id)
                if w.id in self._busy or cur is None or cur.cell_id != w.cell_id or cur.state != "running":
                    continue
                if state == "absent":
                    w.state, w.error = "failed", f"cell {w.cell_id} is gone"
                    self.store.save_worker(w)

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
                    rc.add_replica(w.id, w.model, w.endpoint)
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
               worker_id: str | None = None) -> dict:
        """Start a worker (placed by the planner unless `node` is given), wait until it serves,
        register it with the router."""
        from relocator.tinymodel import ensure_tiny_model

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
                node = best_fit({n.id: n.gpus_free for n in nodes.values() if n.alive}, gpus,
                                totals={n.id: n.gpus_total for n in nodes.values()}, policy=self.policy)
                if node is None:
                    raise RuntimeError(f"no node has {gpus} free GPU(s)")
            elif node not in nodes:
                raise ValueError(f"unknown node {node!r}; nodes: {', '.join(nodes)}")
            w = WorkerRecord(id=wid, model=served, node=node, gpus=gpus, cell_id=f"{wid}-c0",
                             reservation=f"relocator-{wid}-launch", model_dir=model_dir, state="starting")
            self._pending_reservations.add(w.reservation)
            self.store.save_worker(w)
            self._busy.add(wid)
        try:
            self.backend.reserve(w, node, w.reservation)
            t0 = time.monotonic()
            info = self.backend.call(node, "launch", w.cell_id, model_dir, served, 8000)
            w.launch_s = round(time.monotonic() - t0, 3)
            w.endpoint = info["endpoint"]
            self.router().add_replica(wid, served, w.endpoint)
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

    def _abandon_launch(self, w: WorkerRecord) -> None:
        for fn in (lambda: self.backend.kill(w.node, w.cell_id), lambda: self.backend.free(w.reservation)):
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                log.warning("cleaning up interrupted launch of %s: %s", w.id, exc)
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
                rel.finished_at = time.time()
                self.store.save_relocation(rel)
            finally:
                with self._lock:
                    self._busy.discard(rel.worker)

        t = threading.Thread(target=body, name=f"relocation-{rel.id}", daemon=True)
        self._threads[rel.id] = t
        t.start()

    def relocate(self, worker_id: str, to: str | None = None, transfer: str | None = None,
                 faults: dict | None = None, wait: bool = True, timeout: float = 900.0) -> dict:
        w = self.store.worker(worker_id)
        if w is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        if to is not None and to not in self.inventory():
            raise ValueError(f"unknown node {to!r}")
        with self._lock:
            if worker_id in self._busy:
                raise RuntimeError(f"worker {worker_id} is already being relocated or started")
            self._busy.add(worker_id)
        rel = Relocation(id=Relocation.new_id(), worker=worker_id, src=w.node, dst=to,
                         transfer=transfer or self.transfer, faults={**env_faults(), **(faults or {})})
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
            "nodes": [n.to_dict() for n in nodes.values()],
            "workers": [{"id": w.id, "model": w.model, "node": w.node, "state": w.state, "endpoint": w.endpoint,
                         "gpus": w.gpus, "cell": w.cell_id, "error": w.error} for w in self.store.workers()],
            "relocations": [r.summary() for r in self.store.relocations()],
            "controller": {**self.ping(), "loop": self.loop_stats},
        }

    def cells(self) -> dict[str, list[dict]]:
        return {name: self.backend.call(name, "cells", timeout=60) for name in self.inventory()}

    def shutdown(self) -> dict:
        """Stop every worker and free every reservation (the cluster itself is stopped by `down`)."""
        self._stop.set()
        out = {"killed": {}, "freed": []}
        for name in self.inventory():
            try:
                out["killed"][name] = self.backend.call(name, "kill_all", timeout=120)
            except Exception as exc:  # noqa: BLE001
                out["killed"][name] = f"error: {exc}"
        for w in self.store.workers():
            try:
                self.router().remove_replica(w.id)
            except Exception:  # noqa: BLE001
                pass
            self.backend.free(w.reservation)
            out["freed"].append(w.reservation)
            self.store.delete_worker(w.id)
        return out


def start_controller(config: dict[str, Any]):
    """The controller actor, created (detached, restarted by Ray if it dies) or found."""
    import ray

    return ray.remote(Controller).options(
        name=CONTROLLER_NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
        max_restarts=-1, max_concurrency=64, num_cpus=0,
    ).remote(config)
