"""Workers: observed against recorded (a lost copy is replaced, the router's table repaired),
and their lifecycle outside moves and suspends: claimed, started, stopped, abandoned."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from relocator.controller.backend import NodeLost
from relocator.controller.claims import Claims, best_effort
from relocator.controller.events import EventKind
from relocator.controller.model import Demand, WorkerRecord, WorkerState, engine_extra, tokenizer_of
from relocator.controller.states import transition
from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")
S = WorkerState


def drop_last_image(backend: Any, w: WorkerRecord) -> None:
    if w.last_image:
        best_effort(f"removing {w.last_image}", lambda: backend.remove_image(w.last_image_node, w.last_image))


class WorkerManager:
    def __init__(self, store: Store, backend: Any, claims: Claims, emit: Callable[..., Any],
                 router: Callable[[], Any], place: Callable[..., str | None],
                 has_router: Callable[[], bool] = lambda: True,
                 spawn: Callable[..., None] | None = None) -> None:
        self.store, self.backend, self.claims, self.emit = store, backend, claims, emit
        self.router, self.place, self.has_router = router, place, has_router
        self.spawn = spawn or (lambda fn, w, name: threading.Thread(target=fn, args=(w,), name=name,
                                                                     daemon=True).start())
        #: warm images (issue 28): each worker's kind as its last start said, and which nodes
        #: hold a kind's image (set by the controller: controller/warmcopies.py), so a lost
        #: worker's copy goes where its image already is, when one of those has room
        self.kinds: dict[str, str] = {}
        self.image_holders: Callable[[str], tuple[set[str], set[str]]] = lambda key: (set(), set())

    # -- reconcile steps ----------------------------------------------------------------------
    def update(self) -> None:
        """A running worker whose node is lost or whose cell is gone is marked lost; every lost
        worker is replaced (a fresh copy elsewhere, see replace)."""
        for w in self.store.workers():
            if w.id in self.claims.busy or w.state not in (S.RUNNING, S.LOST):
                continue
            if w.state == S.RUNNING and not self._mark_if_lost(w):
                continue
            with self.claims.lock:
                if w.id in self.claims.busy:
                    continue
                self.claims.busy.add(w.id)
            self.spawn(self.replace, w, f"replace-{w.id}")

    def _mark_if_lost(self, w: WorkerRecord) -> bool:
        try:
            state = self.backend.agents.cell_state(w.node, w.cell_id, timeout=30)
        except NodeLost:
            state = "lost"
        if state not in ("absent", "lost"):
            return False
        words, how, crash = self._last_words(w) if state == "absent" else ("", "", False)  # a remote call: unlocked
        dropped: tuple[str, str] | None = None
        with self.claims.lock:
            cur = self.store.worker(w.id)
            if w.id in self.claims.busy or cur is None or cur.cell_id != w.cell_id or cur.state != S.RUNNING:
                return False
            w.error = f"node {w.node} is lost" if state == "lost" else f"cell {w.cell_id} is gone"
            if how:  # why, in the worker's own words (its log's fatal line, else its last)
                w.error += f"; its log ends: {how[:300]}"
            if crash and w.last_image:
                # it crashed: its next copy starts fresh, never from the memory it ran (a crash
                # in that memory comes back with it: CI restored one image 4 times, each copy
                # segfaulting seconds later); a lost node's or a killed copy's image is good
                dropped = (w.last_image_node, w.last_image)
                w.last_image, w.last_image_node = "", ""
            transition(w, S.LOST, w.error, self.emit)
            self.store.save_worker(w)
        if dropped:  # outside the lock: a remote call
            best_effort(f"removing {dropped[1]}", lambda: self.backend.remove_image(*dropped))
        self.emit(EventKind.WORKER_LOST, worker=w.id, node=w.node, error=w.error,
                  **({"last_words": words} if words else {}))
        return True

    def _last_words(self, w: WorkerRecord) -> tuple[str, str, bool]:
        """The end of a dead cell's log as its agent kept it, its line that says how it died,
        and whether it crashed (("", "", False) when it left nothing)."""
        from relocator.agent.lastwords import cause, crashed, summary

        try:
            text = self.backend.agents.last_words(w.node, w.cell_id)
        except Exception as exc:  # noqa: BLE001 - never in the way of the replacement
            log.warning("last words of %s: %s", w.cell_id, exc)
            return "", "", False
        return (summary(text), cause(text), crashed(text)) if text else ("", "", False)

    def update_router(self) -> None:
        """The router's table vs the workers: a router that restarted (empty table) or missed
        an update gets every running worker back at its current endpoint."""
        if not self.has_router():
            return
        rc = self.router()
        seen = {r["worker_id"]: r for reps in rc.replicas().get("models", {}).values() for r in reps}
        for w in self.store.workers():
            if w.state != S.RUNNING or w.id in self.claims.busy:
                continue
            r = seen.get(w.id)
            if r is None or r.get("endpoint", "").rstrip("/") != w.endpoint.rstrip("/"):
                with self.claims.lock:
                    # re-read under the lock: a relocation may have finished since the list
                    # was read, and a stale record must never point the router back
                    cur = self.store.worker(w.id)
                    if w.id in self.claims.busy or cur is None or cur.state != S.RUNNING or cur.endpoint != w.endpoint:
                        continue
                    rc.add_replica(w.id, w.model, w.endpoint, tokenizer_of(w), w.engine, w.gpus)
                    log.warning("router: re-registered %s at %s", w.id, w.endpoint)

    # -- replacement ----------------------------------------------------------------------------
    def start_copy(self, w: WorkerRecord, node: str) -> tuple[str, dict]:
        """A new copy of `w` on `node`: restored from its newest image when there is one (warm,
        seconds; dropped when its copy crashed: _mark_if_lost), else a launch (a warm image of its
        kind, else cold: the engine loads and compiles again)."""
        if w.last_image and Path(w.last_image).exists():
            try:
                return "restored from its last image", self.backend.restore(node, w.last_image, w.cell_id,
                                                                            gpu_ids=w.gpu_ids or None)
            except Exception as exc:  # noqa: BLE001 - fall back to a cold start
                log.warning("warm restart of %s from %s failed (%s); launching cold", w.id, w.last_image, exc)
                best_effort(f"removing the failed restore of {w.id}", lambda: self.backend.kill(node, w.cell_id))
        info = self.launch(w, node)
        return ("restored from a warm image" if info.get("warm", {}).get("how") == "warm" else "cold launch"), info

    def launch(self, w: WorkerRecord, node: str) -> dict:
        """The agent's start of `w` on `node` (a warm restore of its kind, else cold), and an
        event saying which and why."""
        t = time.monotonic()
        info = self.backend.agents.launch(node, w.cell_id, w.model_dir, w.model, engine=w.engine,
                                          gpu_ids=w.gpu_ids or None, extra=engine_extra(w.gpus))
        warm = info.get("warm") or {}
        if warm.get("key"):
            self.kinds[w.id] = warm["key"]
        self.emit(EventKind.WORKER_STARTED, worker=w.id, node=node, cell=w.cell_id, how=warm.get("how", "cold"),
                  key=warm.get("key"), reason=warm.get("reason", ""), capture=warm.get("capture"),
                  copied=warm.get("copied"), seconds=round(time.monotonic() - t, 3))
        return info

    def replace(self, w: WorkerRecord) -> None:
        """A lost worker gets a fresh copy on a live node: the router holds its requests (and
        the streams cut with the old copy) meanwhile and continues them on the new one."""
        t0 = time.monotonic()
        old_node = w.node
        self.emit(EventKind.REPLACEMENT_STARTED, worker=w.id, from_node=old_node, error=w.error)
        try:
            node, how = self._replace(w)
            log.warning("replaced lost worker %s (on %s) by %s on %s (%s) in %.1fs", w.id, old_node,
                        w.cell_id, node, how, time.monotonic() - t0)
            self.emit(EventKind.REPLACEMENT_FINISHED, worker=w.id, ok=True, from_node=old_node, to_node=node,
                      how=how, seconds=round(time.monotonic() - t0, 3), error="")
        except Exception as exc:  # noqa: BLE001
            log.error("could not replace lost worker %s: %s", w.id, exc)
            best_effort(f"cleaning up the failed replacement of {w.id}",
                        lambda: self.backend.kill(w.node, w.cell_id), lambda: self.backend.free(w.reservation),
                        lambda: self.router().remove_replica(w.id))  # held requests get their error now
            w.error = f"lost ({w.error}); replacement failed: {exc}"
            transition(w, S.FAILED, "replacement failed", self.emit)
            self.store.save_worker(w)
            self.emit(EventKind.REPLACEMENT_FINISHED, worker=w.id, ok=False, from_node=old_node, to_node=None,
                      how=None, seconds=round(time.monotonic() - t0, 3), error=str(exc))
        finally:
            self.claims.release(w.id)

    def _replace(self, w: WorkerRecord) -> tuple[str, str]:
        old_node, old_cell = w.node, w.cell_id
        try:
            self.backend.hold(w.id)
        except Exception as exc:  # noqa: BLE001 - the router may be restarting; switch registers
            log.warning("replace %s: hold failed: %s", w.id, exc)
        try:
            self.backend.kill(old_node, old_cell)
        except Exception as exc:  # noqa: BLE001 - left to update_cells / fencing
            log.warning("replace %s: could not kill %s on %s: %s", w.id, old_cell, old_node, exc)
        self.backend.free(w.reservation)
        node = self._place_near_image(w)
        if node is None:
            raise RuntimeError(f"no live node has {w.gpus} free GPU(s)")
        tag = uuid.uuid4().hex[:6]
        w.node, w.cell_id, w.reservation, w.endpoint = node, f"{w.id}-x{tag}", f"relocator-{w.id}-x{tag}", ""
        transition(w, S.REPLACING, f"a new copy on {node}", self.emit)  # a restarted controller starts again
        self.store.save_worker(w)
        w.gpu_ids = list(self.backend.reserve(w, node, w.reservation) or [])
        how, info = self.start_copy(w, node)
        w.endpoint = info["endpoint"]
        self.backend.switch(w.id, w.endpoint)
        w.error = ""
        transition(w, S.RUNNING, f"replaced ({how})", self.emit)
        w.replacements += 1
        self.store.save_worker(w)
        return node, how

    def _place_near_image(self, w: WorkerRecord) -> str | None:
        """A node with room for `w`, one holding its kind's warm image first (no copy then)."""
        holders, seen = self.image_holders(self.kinds.get(w.id, "")) if w.id in self.kinds else (set(), set())
        if holders:
            near = self.place(w.gpus, exclude=tuple(sorted((seen - holders) | {w.node})))
            if near is not None:
                return near
        return self.place(w.gpus)

    def abandon_launch(self, w: WorkerRecord, keep_record: bool = False) -> None:
        """A launch (or replacement) the previous controller did not finish: its copy goes."""
        best_effort(f"cleaning up interrupted launch of {w.id}",
                    lambda: self.backend.kill(w.node, w.cell_id), lambda: self.backend.free(w.reservation))
        if keep_record:  # a replacement: lost again, so it is replaced again
            transition(w, S.LOST, "its replacement was interrupted by a controller restart", self.emit)
            self.store.save_worker(w)
        else:
            self.store.delete_worker(w.id)

    # -- launches -------------------------------------------------------------------------------
    def claim(self, demand: Demand, node: str, timeout: float = 15.0) -> WorkerRecord:
        """A new worker's record and its GPUs reserved on `node` (recorded first: the reconcile
        loop never frees a reservation a record owns)."""
        w = WorkerRecord(id=demand.id, model=demand.model, node=node, gpus=demand.gpus,
                         cell_id=f"{demand.id}-c{uuid.uuid4().hex[:6]}", reservation=f"relocator-{demand.id}-launch",
                         model_dir=demand.model_dir, state=S.STARTING, engine=demand.engine,
                         priority=demand.priority, time_limit_s=demand.time_limit_s)
        c = self.claims
        with c.lock:
            c.placing.add(demand.id)
            c.reservations.add(w.reservation)
            self.store.save_worker(w)
            c.busy.add(w.id)
        try:
            w.gpu_ids = list(self.backend.reserve(w, node, w.reservation, timeout=timeout) or [])
            self.store.save_worker(w)
        except BaseException:
            best_effort(f"freeing {w.reservation}", lambda: self.backend.free(w.reservation))
            self.store.delete_worker(w.id)
            with c.lock:
                c.busy.discard(w.id)
                c.placing.discard(demand.id)
                c.reservations.discard(w.reservation)
            raise
        return w

    def start_claimed(self, w: WorkerRecord, demand: Demand, t0: float, extra: dict | None = None) -> dict:
        """Launch the claimed worker cold, register it with the router; the demand is met."""
        node = w.node
        try:
            t1 = time.monotonic()
            info = self.launch(w, node)
            w.launch_s = round(time.monotonic() - t1, 3)
            w.endpoint = info["endpoint"]
            self.router().add_replica(w.id, w.model, w.endpoint, tokenizer_of(w), w.engine, w.gpus)
            transition(w, S.RUNNING, "launched", self.emit)
            w.deadline = time.time() + w.time_limit_s if w.time_limit_s else None
            self.store.save_worker(w)
            self.store.delete_demand(demand.id)
            self.emit(EventKind.DEMAND_PLACED, demand=demand.id, demand_kind=demand.kind, worker=w.id, node=node,
                      seconds=round(time.monotonic() - t0, 3), **(extra or {}))
            return {**w.to_dict(), "ready_s": info["ready_s"], **(extra or {})}
        except BaseException as exc:
            best_effort(f"cleaning up the failed launch of {w.id}", lambda: self.backend.free(w.reservation),
                        lambda: self.backend.kill(node, w.cell_id))
            self.store.delete_worker(w.id)
            self.store.delete_demand(demand.id)
            log.warning("launch of %s failed: %s", w.id, exc)
            raise
        finally:
            with self.claims.lock:
                self.claims.busy.discard(w.id)
                self.claims.placing.discard(demand.id)
                self.claims.reservations.discard(w.reservation)

    def new_worker_id(self) -> str:
        ids = ({w.id for w in self.store.workers()} | {d.id for d in self.store.demands()}
               | set(self.claims.placing) | self.claims.naming)
        i = 1
        while f"w{i}" in ids:
            i += 1
        return f"w{i}"

    def stop(self, worker_id: str, cancel: Callable[[str], dict]) -> dict:
        w = self.store.worker(worker_id)
        if w is None:
            if self.store.demand(worker_id) is not None:  # a launch still pending
                return {**cancel(worker_id), "stopped": True}
            raise KeyError(f"unknown worker {worker_id!r}")
        self.claims.take(worker_id, f"worker {worker_id} is being relocated")
        try:
            best_effort(f"router: removing {worker_id}", lambda: self.router().remove_replica(worker_id))
            if w.node and w.cell_id:
                self.backend.kill(w.node, w.cell_id)
            if w.reservation:
                self.backend.free(w.reservation)
            drop_last_image(self.backend, w)
            if w.image:  # a suspended worker's image
                best_effort(f"removing {w.image}", lambda: self.backend.remove_image(w.image_node, w.image))
            self.store.delete_demand(worker_id)
            self.store.delete_worker(worker_id)
            return {"id": worker_id, "stopped": True}
        finally:
            self.claims.release(worker_id)
