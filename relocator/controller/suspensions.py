"""Suspensions: a running worker checkpointed to the image store and its GPUs freed (its
traffic to a sibling, or held), then resumed anywhere compatible; a failed suspend backs off;
one the previous controller left half done is finished or undone."""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from relocator.controller.claims import Claims, best_effort
from relocator.controller.events import EventKind
from relocator.controller.model import Demand, DemandKind, SuspendReason, TransferMode, WorkerRecord, WorkerState
from relocator.controller.states import transition
from relocator.controller.store import Store
from relocator.controller.workers import drop_last_image

log = logging.getLogger("relocator.controller")
S = WorkerState
#: a failed suspend: no automatic suspend of that worker for 30 s, 60 s, 120 s, ... at most 30 min
SUSPEND_BACKOFF_S, SUSPEND_BACKOFF_MAX_S = 30.0, 1800.0
LIVE_CELL = ("stopped", "running")  # a source cell that can serve again


def resume_demand(w: WorkerRecord, reason: str = "") -> Demand:
    return Demand(id=w.id, kind=DemandKind.RESUME, model=w.model, gpus=w.gpus, priority=w.priority,
                  engine=w.engine, model_dir=w.model_dir, time_limit_s=w.time_limit_s, reason=reason)


def image_fingerprint(image: str) -> dict | None:
    try:
        return json.loads((Path(image) / "manifest.json").read_text()).get("fingerprint")
    except (OSError, ValueError):
        return None


def unseat(w: WorkerRecord) -> None:
    """A suspended worker holds no node, cell, reservation or endpoint."""
    w.node, w.cell_id, w.reservation, w.endpoint, w.gpu_ids = "", "", "", "", []


class SuspensionManager:
    def __init__(self, store: Store, backend: Any, claims: Claims, emit: Callable[..., Any],
                 router: Callable[[], Any], node_dir: Callable[[str], Path], queue: Callable[[Demand, str], dict],
                 transfer: TransferMode, keep_last_image: bool = True) -> None:
        self.store, self.backend, self.claims, self.emit = store, backend, claims, emit
        self.router, self.node_dir, self.queue = router, node_dir, queue
        self.transfer, self.keep_last_image = transfer, keep_last_image

    # -- suspend ------------------------------------------------------------------------------
    def suspend(self, worker_id: str, reason: str = SuspendReason.OPERATOR, by: str | None = None) -> dict:
        """See Controller.suspend."""
        reason = SuspendReason(reason)
        w = self.store.worker(worker_id)
        if w is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        with self.claims.lock:
            if worker_id in self.claims.busy:
                raise RuntimeError(f"worker {worker_id} is being relocated or started")
            if w.state != S.RUNNING:
                raise RuntimeError(f"worker {worker_id} is {w.state}, not running")
            self.claims.busy.add(worker_id)
        try:
            return self._suspend(w, reason, by)
        finally:
            self.claims.release(worker_id)
            self.claims.wake.set()

    def _suspend(self, w: WorkerRecord, reason: SuspendReason, by: str | None) -> dict:
        t0 = time.monotonic()
        node, cell, reservation = w.node, w.cell_id, w.reservation
        image = str(self.node_dir(node) / "images" / f"suspend-{w.id}-{uuid.uuid4().hex[:6]}")
        siblings = [x.id for x in self.store.workers() if x.id != w.id and x.model == w.model
                    and x.state == S.RUNNING and x.id not in self.claims.busy]
        transition(w, S.SUSPENDING, f"suspend ({reason.value})", self.emit)
        self.store.save_worker(w)
        try:
            self.backend.hold(w.id)
            info = self.backend.dump(node, cell, image)
        except Exception as exc:
            self.undo(w, image)
            retry_in = self.failed(w, reason, exc)
            raise RuntimeError(f"suspend of {w.id} failed, it serves again (no automatic suspend for "
                               f"{retry_in:.0f}s): {exc}") from None
        if siblings:  # the cut streams and new requests go to a sibling, not to the hold queue
            best_effort(f"router: removing {w.id}", lambda: self.router().remove_replica(w.id))
        best_effort(f"killing the suspended source of {w.id}", lambda: self.backend.kill(node, cell))
        self.backend.free(reservation)
        transition(w, S.SUSPENDED, f"suspended ({reason.value})", self.emit)
        w.image, w.image_node, w.deadline = image, node, None
        unseat(w)
        w.suspend_reason, w.suspended_at, w.suspensions = reason.value, time.time(), w.suspensions + 1
        w.suspend_failures, w.suspend_retry_at, w.suspend_error = 0, None, ""
        self.store.save_worker(w)
        out = {"worker": w.id, "node": node, "reason": reason.value, "image": image,
               "image_bytes": int(info.get("bytes", 0)), "sibling": siblings[0] if siblings else None,
               "seconds": round(time.monotonic() - t0, 3), "by": by}
        self.emit(EventKind.WORKER_SUSPENDED, **out)
        if reason is not SuspendReason.OPERATOR:  # requeued: resumed when capacity returns
            self.queue(resume_demand(w), f"suspended ({reason.value}{' by ' + by if by else ''})")
        return out

    def failed(self, w: WorkerRecord, reason: SuspendReason, exc: Exception) -> float:
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

    def undo(self, w: WorkerRecord, image: str) -> None:
        """A suspend that failed before the source was killed: the source serves again."""
        def resume_source() -> None:
            if self.backend.cell_state(w.node, w.cell_id) in LIVE_CELL:
                self.backend.resume(w.node, w.cell_id)

        best_effort(f"undoing the suspend of {w.id}", resume_source, lambda: self.backend.release(w.id),
                    *([lambda: self.backend.remove_image(w.node, image)] if image else []))
        transition(w, S.RUNNING, "its suspend was undone", self.emit)
        self.store.save_worker(w)

    # -- resume -------------------------------------------------------------------------------
    def resume(self, worker_id: str, node: str | None, seat: Callable[..., dict],
               check_target: Callable[[str], None]) -> dict:
        """See Controller.resume."""
        w = self.store.worker(worker_id)
        if w is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        if w.state != S.SUSPENDED:
            raise RuntimeError(f"worker {worker_id} is {w.state}, not suspended")
        demand = self.store.demand(worker_id) or resume_demand(w, "resumed by the operator")
        if worker_id in self.claims.placing:
            raise RuntimeError(f"worker {worker_id} is being resumed")
        if node is None:
            return seat(demand, make_room=True, queue=True)
        check_target(node)
        t0 = time.monotonic()
        with self.claims.seating:
            claimed = self.claim(w, node)
        return self.restore(claimed, demand, t0)

    def claim(self, w: WorkerRecord, node: str, timeout: float = 15.0) -> WorkerRecord:
        """The fingerprint gate, then the suspended worker's GPUs reserved on `node`."""
        fp = image_fingerprint(w.image)
        if fp is not None:
            mismatches = self.backend.agents.compatible(node, fp, timeout=60)
            if mismatches:
                raise RuntimeError(f"{node} cannot restore {w.id}: " + "; ".join(mismatches))
        tag = uuid.uuid4().hex[:6]
        with self.claims.lock:
            if w.id in self.claims.busy:
                raise RuntimeError(f"worker {w.id} is busy")
            self.claims.busy.add(w.id)
            self.claims.placing.add(w.id)
            w.node, w.cell_id, w.reservation = node, f"{w.id}-s{tag}", f"relocator-{w.id}-s{tag}"
            transition(w, S.RESUMING, f"resume on {node}", self.emit)
            self.store.save_worker(w)
        try:
            w.gpu_ids = list(self.backend.reserve(w, node, w.reservation, timeout=timeout) or [])
            self.store.save_worker(w)
        except BaseException:
            best_effort(f"freeing {w.reservation}", lambda: self.backend.free(w.reservation))
            unseat(w)
            transition(w, S.SUSPENDED, "its GPUs could not be reserved", self.emit)
            self.store.save_worker(w)
            with self.claims.lock:
                self.claims.busy.discard(w.id)
                self.claims.placing.discard(w.id)
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

    def restore(self, w: WorkerRecord, demand: Demand, t0: float, extra: dict | None = None) -> dict:
        """Restore the claimed suspended worker and switch its traffic back."""
        node = w.node
        try:
            out = self._restore(w, node, t0, extra)
            self.emit(EventKind.WORKER_RESUMED, **out)
            self.emit(EventKind.DEMAND_PLACED, demand=demand.id, demand_kind=DemandKind.RESUME, worker=w.id, node=node,
                      seconds=out["seconds"], **(extra or {}))
            return {**w.to_dict(), **out}
        except BaseException as exc:
            best_effort(f"cleaning up the failed resume of {w.id}", lambda: self.backend.kill(node, w.cell_id),
                        lambda: self.backend.free(w.reservation))
            unseat(w)
            w.error = f"resume on {node} failed: {exc}"
            transition(w, S.SUSPENDED, w.error, self.emit)
            self.store.save_worker(w)
            if self.store.demand(w.id) is not None or w.suspend_reason != SuspendReason.OPERATOR:
                self.queue(demand, w.error)
            raise
        finally:
            with self.claims.lock:
                self.claims.busy.discard(w.id)
                self.claims.placing.discard(w.id)

    def _restore(self, w: WorkerRecord, node: str, t0: float, extra: dict | None) -> dict:
        image = w.image
        travels = node != w.image_node and self._image_travels(w.image_node, node)
        if travels:  # a suspended worker's image is on disk: the chunked, checksummed stream
            image = str(self.node_dir(node) / "images" / Path(w.image).name)
            self.backend.transfer(w.image_node, node, w.image, image)
        info = self.backend.restore(node, image, w.cell_id, gpu_ids=w.gpu_ids or None)
        w.endpoint = info["endpoint"]
        self.backend.switch(w.id, w.endpoint)  # registers it again if the router forgot it
        suspended_s = round(time.time() - (w.suspended_at or time.time()), 3)
        keep = self.keep_last_image and not travels and (
            self.transfer is not TransferMode.STREAM and self.transfer is not TransferMode.POSTCOPY)
        if keep:
            drop_last_image(self.backend, w)
            w.last_image, w.last_image_node = w.image, w.image_node
        else:
            best_effort(f"removing {w.image}", lambda: self.backend.remove_image(w.image_node, w.image))
        if image != w.image:
            best_effort(f"removing {image}", lambda: self.backend.remove_image(node, image))
        w.image, w.image_node, w.suspend_reason, w.suspended_at = "", "", "", None
        w.error = ""
        transition(w, S.RUNNING, f"resumed on {node}", self.emit)
        w.deadline = time.time() + w.time_limit_s if w.time_limit_s else None
        self.store.save_worker(w)
        self.store.delete_demand(w.id)
        return {"worker": w.id, "node": node, "seconds": round(time.monotonic() - t0, 3),
                "suspended_s": suspended_s, "restore": info.get("seconds"), **(extra or {})}

    # -- a restarted controller -----------------------------------------------------------------
    def recover(self, w: WorkerRecord) -> None:
        """A suspend or resume the previous controller did not finish. Suspending: a source
        that still exists serves again (the suspend is undone); one already killed left its
        image, so the worker is suspended. Resuming: the half-restored copy goes, the worker
        stays suspended and its resume is requeued."""
        if w.state == S.SUSPENDING:
            state = "absent"
            try:
                state = self.backend.cell_state(w.node, w.cell_id)
            except Exception as exc:  # noqa: BLE001
                log.warning("recovering the suspend of %s: %s", w.id, exc)
            if state in LIVE_CELL:
                self.undo(w, "")
                return
            image = next(iter(sorted((self.node_dir(w.node) / "images").glob(f"suspend-{w.id}-*"))), None)
            if image is None or not (image / "manifest.json").exists():
                w.error = "its suspend was interrupted and left no image"
                transition(w, S.LOST, w.error, self.emit)
                self.store.save_worker(w)
                return
            best_effort(f"freeing {w.reservation}", lambda: self.backend.free(w.reservation))
            w.image, w.image_node, w.suspend_reason = str(image), w.node, w.suspend_reason or SuspendReason.PREEMPTED
        else:
            best_effort(f"cleaning up the interrupted resume of {w.id}",
                        lambda: self.backend.kill(w.node, w.cell_id), lambda: self.backend.free(w.reservation))
        transition(w, S.SUSPENDED, "recovered by a controller restart", self.emit)
        unseat(w)
        self.store.save_worker(w)
        if w.suspend_reason != SuspendReason.OPERATOR and self.store.demand(w.id) is None:
            self.queue(resume_demand(w), "requeued by a controller restart")
