"""The relocation state machine: PLAN → RESERVE → HOLD → DUMP → TRANSFER → RESTORE → SWITCH →
RELEASE, with rollback and crash recovery.

Pure logic: every effect goes through a `Backend` (agents, reservations, router), so the machine
is tested with fakes and run for real against Ray agents, placement groups and the router.
Each phase is persisted *before* it starts; `recover()` reads that record after a controller
restart and completes (from SWITCH on) or rolls back (before SWITCH) the relocation.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

from tenacity import Retrying, stop_after_delay, wait_fixed

from relocator.choices import Choice
from relocator.controller.events import EventKind
from relocator.controller.model import (
    DONE,
    FAILED,
    PHASES,
    ROLLBACK_BEFORE,
    ROLLED_BACK,
    RUNNING,
    FailureReason,
    Relocation,
    TransferMode,
    WorkerRecord,
    failure_reason,
    phase_index,
)
from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")

I_HOLD, I_DUMP, I_RESTORE, I_SWITCH = (PHASES.index(p) for p in ("HOLD", "DUMP", "RESTORE", "SWITCH"))
I_RESERVE = PHASES.index("RESERVE")


class RelocationError(RuntimeError):
    pass


class PlanError(RelocationError):
    """The relocation cannot start (no target, incompatible, busy); nothing was touched."""

    reason = FailureReason.PLAN_REFUSED


class FaultInjected(RelocationError):
    reason = FailureReason.FAULT_INJECTED


class TargetLost(RelocationError):
    """The restored copy is not running any more (before or right after the switch)."""

    reason = FailureReason.TARGET_LOST


class SimulatedCrash(BaseException):
    """Raised by a test's crash hook: the machine stops dead, as if its process had died."""


class PhaseFault(Choice):
    """A failure injected at the end of a phase (`relocate(faults={"dump": True})`)."""

    DUMP = "dump"
    TRANSFER = "transfer"
    RESTORE = "restore"


#: fault hooks that act when a phase starts: {"phase": PHASE, ...}
HOOKS = ("crash", "pause")


def check_faults(faults: dict[str, Any] | None) -> dict[str, Any]:
    """The faults of one relocation, checked: phase faults by name, hooks with a known phase.
    A wrong name is refused (ValueError naming the valid ones), never ignored."""
    out = dict(faults or {})
    for key, value in out.items():
        if key in HOOKS:
            if not isinstance(value, dict) or value.get("phase") not in PHASES:
                raise ValueError(f"fault {key!r} needs {{'phase': one of {', '.join(PHASES)}}}, not {value!r}")
        elif key not in PhaseFault.values():
            raise ValueError(f"unknown fault {key!r}; valid: {', '.join(PhaseFault.values() + HOOKS)}")
    return out


class Backend(Protocol):
    # planning
    def pick_target(self, worker: WorkerRecord) -> str: ...
    def compatible(self, worker: WorkerRecord, node: str) -> list[str]: ...
    def image_dir(self, node: str, relocation_id: str) -> str: ...
    # reservations (placement groups)
    def reserve(self, worker: WorkerRecord, node: str, name: str) -> list[int] | None: ...  # its GPU ids
    def free(self, name: str) -> None: ...
    # router
    def hold(self, worker_id: str) -> None: ...
    def switch(self, worker_id: str, endpoint: str) -> dict: ...
    def release(self, worker_id: str) -> None: ...
    # agents
    def dump(self, node: str, cell_id: str, image_dir: str) -> dict: ...
    def transfer(self, src: str, dst: str, image_dir: str, dst_image_dir: str) -> dict: ...
    def restore(self, node: str, image_dir: str, cell_id: str, verified: bool = False,
                gpu_ids: list[int] | None = None) -> dict: ...
    def cell_state(self, node: str, cell_id: str) -> str: ...  # running | stopped | absent | lost
    def resume(self, node: str, cell_id: str) -> None: ...
    def kill(self, node: str, cell_id: str) -> None: ...
    def remove_image(self, node: str, image_dir: str) -> None: ...


def _default_crash(after_s: float) -> None:  # pragma: no cover - kills the process
    import os
    import threading

    threading.Timer(after_s, lambda: os._exit(17)).start()


class Machine:
    """Runs one relocation at a time per call; the controller runs several on threads."""

    def __init__(self, store: Store, backend: Backend, *, keep_images: bool = False, keep_last_image: bool = False,
                 on_crash: Callable[[float], None] = _default_crash,
                 on_update: Callable[[Relocation], None] | None = None,
                 on_event: Callable[[EventKind, dict[str, Any]], Any] | None = None,
                 switch_retries: int = 3, router_retry_s: float = 5.0) -> None:
        self.store = store
        self.backend = backend
        self.keep_images = keep_images
        # a worker's newest image (shared storage) is kept: a lost worker restarts from it warm
        self.keep_last_image = keep_last_image
        self.on_crash = on_crash
        self.on_update = on_update
        self.on_event = on_event
        self.switch_retries = switch_retries
        self.router_retry_s = router_retry_s

    # -- bookkeeping ----------------------------------------------------------------------
    def _save(self, rel: Relocation) -> None:
        self.store.save_relocation(rel)
        if self.on_update:
            self.on_update(rel)

    def _event(self, kind: EventKind, rel: Relocation, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, {"relocation": rel.id, "worker": rel.worker, **fields})

    def _enter(self, rel: Relocation, phase: str) -> None:
        rel.phase = phase
        rel.phases.append({"name": phase, "started": time.time(), "ended": None, "ok": None, "info": {}})
        self._save(rel)  # persisted before the phase starts
        self._event(EventKind.PHASE_STARTED, rel, phase=phase, src=rel.src, dst=rel.dst)
        crash = rel.faults.get("crash")
        if crash and crash.get("phase") == phase and not crash.get("fired"):
            crash["fired"] = True
            self._save(rel)
            self.on_crash(float(crash.get("after_s", 0.0)))
        pause = rel.faults.get("pause")  # chaos: a window to act from outside before the phase
        if pause and pause.get("phase") == phase:
            time.sleep(float(pause.get("s", 1.0)))

    def _leave(self, rel: Relocation, ok: bool, info: dict | None = None) -> None:
        cur = rel.phases[-1]
        cur["ended"], cur["ok"] = time.time(), ok
        cur["info"].update(info or {})
        self._save(rel)
        self._event(EventKind.PHASE_ENDED, rel, phase=cur["name"], ok=ok,
                    seconds=round(cur["ended"] - cur["started"], 4), error=cur["info"].get("error", ""))

    def _fault(self, rel: Relocation, phase: str) -> None:
        if rel.faults.get(PhaseFault(phase.lower())):
            raise FaultInjected(f"fault injected at {phase}")

    # -- the run ---------------------------------------------------------------------------
    def run(self, rel: Relocation) -> Relocation:
        worker = self.store.worker(rel.worker)
        if worker is None:
            raise PlanError(f"unknown worker {rel.worker!r}")
        rel.engine = rel.engine or worker.engine
        self._event(EventKind.RELOCATION_STARTED, rel, src=rel.src, dst=rel.dst, transfer=rel.transfer,
                    engine=rel.engine)
        for phase in PHASES:
            self._enter(rel, phase)
            try:
                info = getattr(self, "_p_" + phase.lower())(rel, worker) or {}
            except SimulatedCrash:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is handled below
                self._leave(rel, False, {"error": str(exc)})
                rel.error = f"{phase}: {exc}"
                rel.reason = failure_reason(exc)
                log.warning("relocation %s failed at %s: %s", rel.id, phase, exc)
                if phase == "RELEASE":
                    # the worker serves from its target; the stopped source is cleaned up later
                    return self._finish(rel, DONE)
                if phase == "PLAN":  # nothing was touched (the worker is marked last)
                    return self._finish(rel, FAILED)
                self.rollback(rel, phase_index(phase))
                return rel
            self._leave(rel, True, info)
        return self._finish(rel, DONE)

    def _finish(self, rel: Relocation, result: str) -> Relocation:
        rel.result = result
        rel.finished_at = time.time()
        self._save(rel)
        self._event(EventKind.RELOCATION_FINISHED, rel, result=result, reason=rel.reason, error=rel.error,
                    src=rel.src, dst=rel.dst, phases=rel.phase_seconds(), image_bytes=rel.image_bytes,
                    rollback_from=rel.rollback.get("from_phase"), recovered=rel.recovered)
        return rel

    def _release_worker(self, worker: WorkerRecord) -> None:
        w = self.store.worker(worker.id)
        if w and w.state == "relocating":
            w.state = "running"
            self.store.save_worker(w)

    # -- phases ----------------------------------------------------------------------------
    def _p_plan(self, rel: Relocation, w: WorkerRecord) -> dict:
        rel.transfer = TransferMode(rel.transfer)  # unknown mode or fault: refused before anything moves
        check_faults(rel.faults)
        if w.state not in ("running",):
            raise PlanError(f"worker {w.id} is {w.state}, not running")
        if w.node != rel.src:
            raise PlanError(f"worker {w.id} runs on {w.node}, not {rel.src}")
        if not rel.dst:
            rel.dst = self.backend.pick_target(w)
        if rel.dst == rel.src:
            raise PlanError(f"worker {w.id} already runs on {rel.dst}")
        mismatches = self.backend.compatible(w, rel.dst)
        if mismatches:
            raise PlanError(f"{rel.dst} cannot restore {w.id}: " + "; ".join(mismatches))
        rel.src_cell, rel.src_endpoint, rel.src_reservation = w.cell_id, w.endpoint, w.reservation
        rel.dst_cell = f"{w.id}-{rel.id}"
        rel.image_dir = self.backend.image_dir(rel.src, rel.id)
        rel.dst_image_dir = (rel.image_dir if rel.transfer == TransferMode.SHARED
                             else self.backend.image_dir(rel.dst, rel.id))
        w.state = "relocating"
        self.store.save_worker(w)
        return {"to": rel.dst}

    def _p_reserve(self, rel: Relocation, w: WorkerRecord) -> dict:
        rel.reservation = f"relocator-{w.id}-{rel.id}"
        self._save(rel)
        rel.dst_gpu_ids = list(self.backend.reserve(w, rel.dst, rel.reservation) or [])
        self._save(rel)
        return {"reservation": rel.reservation, "gpus": w.gpus, "gpu_ids": rel.dst_gpu_ids}

    def _p_hold(self, rel: Relocation, w: WorkerRecord) -> dict:
        self.backend.hold(w.id)
        return {}

    def _p_dump(self, rel: Relocation, w: WorkerRecord) -> dict:
        info = self.backend.dump(rel.src, rel.src_cell, rel.image_dir)
        rel.image_bytes = int(info.get("bytes", 0))
        self._fault(rel, "DUMP")
        return info

    def _p_transfer(self, rel: Relocation, w: WorkerRecord) -> dict:
        mode = TransferMode(rel.transfer)  # every mode handled below; an unknown one is refused
        if mode is TransferMode.SHARED:
            info: dict = {"skipped": "shared storage"}
        elif mode is TransferMode.STREAM:
            info = self.backend.transfer(rel.src, rel.dst, rel.image_dir, rel.dst_image_dir)
        else:  # pragma: no cover - a mode added to TransferMode without its transfer
            raise RelocationError(f"transfer mode {mode} has no implementation")
        self._fault(rel, "TRANSFER")
        return info

    def _p_restore(self, rel: Relocation, w: WorkerRecord) -> dict:
        # a streamed image was hashed byte by byte on arrival: no second pass over it
        info = self.backend.restore(rel.dst, rel.dst_image_dir, rel.dst_cell,
                                    verified=rel.transfer == TransferMode.STREAM, gpu_ids=rel.dst_gpu_ids or None)
        rel.dst_endpoint = info["endpoint"]
        self._save(rel)
        self._fault(rel, "RESTORE")
        return info

    def _target_alive(self, rel: Relocation, when: str) -> None:
        # Until RELEASE the stopped source is the resumable copy: never point clients at, or
        # kill the source for, a target that died after RESTORE said it was healthy.
        state = self.backend.cell_state(rel.dst, rel.dst_cell)
        if state != "running":
            exc = TargetLost(f"target copy {rel.dst_cell} on {rel.dst} is {state} {when}")
            if state == "lost":
                exc.reason = FailureReason.NODE_LOST
            raise exc

    def _p_switch(self, rel: Relocation, w: WorkerRecord) -> dict:
        self._target_alive(rel, "before the switch")
        last: Exception | None = None
        for attempt in range(self.switch_retries):
            try:
                info = self.backend.switch(w.id, rel.dst_endpoint)
                break
            except Exception as exc:  # noqa: BLE001
                last = exc
                time.sleep(0.2 * (attempt + 1))
        else:
            raise RelocationError(f"router switch failed: {last}")
        self._target_alive(rel, "after the switch")
        w = self.store.worker(w.id) or w
        w.node, w.cell_id, w.endpoint, w.reservation = rel.dst, rel.dst_cell, rel.dst_endpoint, rel.reservation
        w.gpu_ids = list(rel.dst_gpu_ids)
        self.store.save_worker(w)
        return {"moved_streams": info.get("moved_streams"), "released": info.get("released")}

    def _p_release(self, rel: Relocation, w: WorkerRecord) -> dict:
        self.backend.kill(rel.src, rel.src_cell)
        if rel.src_reservation:
            self.backend.free(rel.src_reservation)
        w = self.store.worker(w.id) or w
        keep = self.keep_last_image and rel.transfer == TransferMode.SHARED and bool(rel.image_dir)
        old_image = (w.last_image_node, w.last_image)
        self._cleanup_images(rel, keep=rel.image_dir if keep else None)
        if keep:
            w.last_image, w.last_image_node = rel.image_dir, rel.src
            if old_image[1] and old_image[1] != rel.image_dir and not self.keep_images:
                self._remove_image(*old_image)
        w.state = "running"
        self.store.save_worker(w)
        return {"kept_image": rel.image_dir} if keep else {}

    def _remove_image(self, node: str, path: str) -> None:
        try:
            self.backend.remove_image(node, path)
        except Exception as exc:  # noqa: BLE001
            log.warning("could not remove image %s on %s: %s", path, node, exc)

    def _cleanup_images(self, rel: Relocation, keep: str | None = None) -> None:
        if self.keep_images:
            return
        for node, path in ((rel.src, rel.image_dir), (rel.dst, rel.dst_image_dir)):
            if path and node and path != keep:
                self._remove_image(node, path)

    # -- rollback & recovery ----------------------------------------------------------------
    def _router_call(self, fn: Callable[[], Any]) -> Any:
        """A router call on the rollback path, retried for a while: a router restarting (its
        daemon brings it back within ~2 s) must not leave the worker pointed at a dead copy."""
        retrying = Retrying(stop=stop_after_delay(self.router_retry_s), wait=wait_fixed(0.2), reraise=True)
        return retrying(fn)

    def rollback(self, rel: Relocation, failed_index: int) -> Relocation:
        """Undo a relocation that failed (or was interrupted) in phase `failed_index` < SWITCH
        (or in SWITCH itself): target copy killed, source resumed, router back, GPUs freed."""
        t0 = time.monotonic()
        steps: list[str] = []
        errors: list[str] = []

        def step(name: str, fn: Callable[[], Any]) -> None:
            try:
                fn()
                steps.append(name)
            except Exception as exc:  # noqa: BLE001 - continue undoing the rest
                errors.append(f"{name}: {exc}")

        if failed_index >= I_RESTORE and rel.dst_cell and rel.dst:
            # never two live copies: the target copy goes before the source resumes
            step("kill target copy", lambda: self.backend.kill(rel.dst, rel.dst_cell))
        source_ok = True
        if failed_index >= I_DUMP:
            state = "absent"
            try:
                state = self.backend.cell_state(rel.src, rel.src_cell)
            except Exception as exc:  # noqa: BLE001
                errors.append(f"source state: {exc}")
            if state in ("stopped", "running"):
                # "running" too: a dump cut short (its agent killed) released the tasks but may
                # have left CRIU's network lock; resuming is idempotent and drops it
                step("resume source", lambda: self.backend.resume(rel.src, rel.src_cell))
                try:  # a tree that did not take the SIGCONT gets one more
                    if self.backend.cell_state(rel.src, rel.src_cell) == "stopped":
                        step("resume source again", lambda: self.backend.resume(rel.src, rel.src_cell))
                except Exception as exc:  # noqa: BLE001
                    errors.append(f"source state after resume: {exc}")
            elif state != "running":
                source_ok = False
                errors.append(f"source cell {rel.src_cell} is {state}")
            if source_ok:
                # streams cut during the freeze continue on the source; queued requests go there
                step("router back to source",
                     lambda: self._router_call(lambda: self.backend.switch(rel.worker, rel.src_endpoint)))
            # else: the worker stays held; the controller replaces it and switches the router
        elif failed_index >= I_HOLD:
            step("release hold", lambda: self._router_call(lambda: self.backend.release(rel.worker)))
        serving_s = time.monotonic() - t0
        if failed_index >= I_RESERVE and rel.reservation:
            step("free reservation", lambda: self.backend.free(rel.reservation))
        if rel.dst_image_dir and rel.dst_image_dir != rel.image_dir and rel.dst:
            step("remove target image", lambda: self.backend.remove_image(rel.dst, rel.dst_image_dir))
        if rel.image_dir and not self.keep_images and failed_index >= I_DUMP:
            step("remove image", lambda: self.backend.remove_image(rel.src, rel.image_dir))
        w = self.store.worker(rel.worker)
        if w is not None:
            w.node, w.cell_id, w.endpoint = rel.src, rel.src_cell or w.cell_id, rel.src_endpoint or w.endpoint
            w.reservation = rel.src_reservation or w.reservation
            # a worker with no copy left is "lost": the controller's reconcile loop replaces it
            w.state = "running" if source_ok else "lost"
            if not source_ok:
                w.error = f"source copy {rel.src_cell} on {rel.src} is gone after a failed relocation"
            self.store.save_worker(w)
        rel.rollback = {"from_phase": PHASES[failed_index] if failed_index >= 0 else None,
                        "source_serving_s": round(serving_s, 4),
                        "seconds": round(time.monotonic() - t0, 4), "steps": steps, "errors": errors}
        self._event(EventKind.ROLLBACK, rel, **rel.rollback, source_ok=source_ok)
        return self._finish(rel, ROLLED_BACK if source_ok else FAILED)

    def recover(self, rel: Relocation) -> Relocation:
        """Finish an open relocation found after a controller restart: from SWITCH on, roll
        forward if the target copy runs; otherwise roll back. Never leaves two live copies."""
        rel.recovered = True
        rel.reason = FailureReason.CONTROLLER_RESTART
        idx = phase_index(rel.phase)
        log.warning("recovering relocation %s (worker %s, phase %s)", rel.id, rel.worker, rel.phase)
        self._event(EventKind.RELOCATION_RECOVERING, rel, phase=rel.phase)
        if rel.phases and rel.phases[-1].get("ended") is None:
            cur = rel.phases[-1]
            cur.update(ended=time.time(), ok=False, info={"interrupted": True})
            self._event(EventKind.PHASE_ENDED, rel, phase=cur["name"], ok=False,
                        seconds=round(cur["ended"] - cur["started"], 4), error="interrupted by a controller restart")
        if idx < 0:
            return self._finish(rel, ROLLED_BACK)
        if idx >= I_SWITCH:
            state = "absent"
            try:
                state = self.backend.cell_state(rel.dst, rel.dst_cell)
            except Exception as exc:  # noqa: BLE001
                rel.error = f"target state: {exc}"
            if state == "running":
                w = self.store.worker(rel.worker)
                if w is None:
                    return self._finish(rel, FAILED)
                for phase in PHASES[I_SWITCH:]:
                    self._enter(rel, phase)
                    try:
                        info = getattr(self, "_p_" + phase.lower())(rel, w) or {}
                    except Exception as exc:  # noqa: BLE001
                        self._leave(rel, False, {"error": str(exc)})
                        rel.error = f"{phase} (recovery): {exc}"
                        if phase == "SWITCH":
                            return self.rollback(rel, I_SWITCH)
                        return self._finish(rel, DONE)
                    self._leave(rel, True, info)
                return self._finish(rel, DONE)
            idx = I_SWITCH  # the target copy is gone: undo everything
        if idx == 0:
            self._release_worker_by_id(rel.worker)
            return self._finish(rel, ROLLED_BACK)
        return self.rollback(rel, idx)

    def _release_worker_by_id(self, wid: str) -> None:
        w = self.store.worker(wid)
        if w:
            self._release_worker(w)


__all__ = ["Backend", "FaultInjected", "Machine", "PhaseFault", "PlanError", "RelocationError", "SimulatedCrash",
           "TargetLost",
           "check_faults",
           "RUNNING", "DONE", "ROLLED_BACK", "FAILED"]
