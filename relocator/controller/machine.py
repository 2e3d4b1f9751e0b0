"""The relocation state machine: PLAN → RESERVE → HOLD → DUMP → TRANSFER → RESTORE → SWITCH →
RELEASE, with rollback and crash recovery.

Pure logic: every effect goes through a `Backend` (agents, reservations, router), so the machine
is tested with fakes and run for real against Ray agents, placement groups and the router.
The machine keeps the phase order; what a transfer mode does in a phase is its strategy's
(relocator.controller.transfers). Each phase is persisted *before* it starts; `recover()` reads
that record after a controller restart and completes (from SWITCH on) or rolls back (before
SWITCH) the relocation.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Protocol

from tenacity import Retrying, stop_after_delay, wait_fixed

from relocator.cell.cell import CellState
from relocator.controller import transfers
from relocator.controller.errors import (FaultInjected, PlanError, PostCopyFailed, RelocationError,
                                         RollbackAfterSwitch, SimulatedCrash, TargetLost)
from relocator.controller.events import EventKind
from relocator.controller.faults import HOOKS, POSTCOPY_KNOBS, PhaseFault, check_faults
from relocator.controller.model import (
    DONE,
    FAILED,
    PHASES,
    ROLLED_BACK,
    RUNNING,
    FailureReason,
    Phase,
    Relocation,
    RelocationResult,
    TransferMode,
    WorkerRecord,
    WorkerState,
    failure_reason,
    phase_index,
)
from relocator.controller.states import transition
from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")

I_HOLD, I_DUMP, I_RESTORE, I_SWITCH, I_RELEASE = (PHASES.index(p) for p in (
    Phase.HOLD, Phase.DUMP, Phase.RESTORE, Phase.SWITCH, Phase.RELEASE))
I_RESERVE = PHASES.index(Phase.RESERVE)


#: a relocation's worker once the relocation has finished, by result: done, it serves from the
#: target (SWITCH recorded it there); rolled back, from the source (rollback recorded it there);
#: failed after PLAN took it, no copy is left: lost (the reconcile loop replaces it)
STATE_AFTER = {DONE: WorkerState.RUNNING, ROLLED_BACK: WorkerState.RUNNING, FAILED: WorkerState.LOST}


def worker_state_after(rel: Relocation) -> WorkerState:
    return STATE_AFTER[rel.result]


class Backend(Protocol):
    """The machine's effects, whatever the mode; each mode's own calls (open_page_server,
    dump_lazy, ...) are its strategy's (relocator.controller.transfers)."""

    # planning
    def pick_target(self, worker: WorkerRecord) -> str: ...
    def compatible(self, worker: WorkerRecord, node: str) -> list[str]: ...
    def image_dir(self, node: str, relocation_id: str) -> str: ...
    # (path, "tmpfs" | "disk", why) of a stream/postcopy target's image: it lives until restored
    def transient_image_dir(self, worker: WorkerRecord, node: str, relocation_id: str) -> tuple[str, str, str]: ...
    # reservations (placement groups)
    def reserve(self, worker: WorkerRecord, node: str, name: str) -> list[int] | None: ...  # its GPU ids
    def free(self, name: str) -> None: ...
    # router
    def hold(self, worker_id: str) -> dict | None: ...
    def switch(self, worker_id: str, endpoint: str) -> dict: ...
    def release(self, worker_id: str) -> None: ...
    # agents
    def dump(self, node: str, cell_id: str, image_dir: str) -> dict: ...
    def transfer(self, src: str, dst: str, image_dir: str, dst_image_dir: str) -> dict: ...
    def restore(self, node: str, image_dir: str, cell_id: str, verified: bool = False,
                gpu_ids: list[int] | None = None) -> dict: ...
    def cell_state(self, node: str, cell_id: str) -> str: ...  # a CellState: running | stopped | absent | lost
    def resume(self, node: str, cell_id: str) -> None: ...
    def kill(self, node: str, cell_id: str) -> None: ...
    def remove_image(self, node: str, image_dir: str) -> None: ...


def _default_crash(after_s: float) -> None:  # pragma: no cover - kills the process
    import os
    import threading

    threading.Timer(after_s, lambda: os._exit(17)).start()


#: what a failed phase means: (relocation, phase, error) -> the finished relocation
OnError = Callable[[Relocation, Phase, Exception], Relocation]


class Machine:
    """Runs one relocation at a time per call; the controller runs several on threads."""

    def __init__(self, store: Store, backend: Backend, *, keep_images: bool = False, keep_last_image: bool = False,
                 on_crash: Callable[[float], None] = _default_crash,
                 on_update: Callable[[Relocation], None] | None = None,
                 on_event: Callable[[EventKind, dict[str, Any]], Any] | None = None,
                 switch_retries: int = 3, router_retry_s: float = 5.0, postcopy_timeout_s: float = 600.0,
                 handoff_window_s: float = 30.0) -> None:
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
        self.postcopy_timeout_s = postcopy_timeout_s
        self.handoff_window_s = handoff_window_s  # a handoff's inexact streams on the source
        #: the phase order: each phase's handler, run in this order by `_run_phases`
        self.handlers: dict[Phase, Callable[[Relocation, WorkerRecord], dict | None]] = {
            Phase.PLAN: self._plan, Phase.RESERVE: self._reserve, Phase.HOLD: self._hold,
            Phase.DUMP: self._dump, Phase.TRANSFER: self._transfer, Phase.RESTORE: self._restore,
            Phase.SWITCH: self._switch, Phase.RELEASE: self._release,
        }

    # -- bookkeeping ----------------------------------------------------------------------
    def save(self, rel: Relocation) -> None:
        self.store.save_relocation(rel)
        if self.on_update:
            self.on_update(rel)

    def _event(self, kind: EventKind, rel: Relocation, **fields: Any) -> None:
        if self.on_event is not None:
            self.on_event(kind, {"relocation": rel.id, "worker": rel.worker, **fields})

    def _enter(self, rel: Relocation, phase: Phase) -> None:
        rel.phase = phase
        rel.phases.append({"name": phase, "started": time.time(), "ended": None, "ok": None, "info": {}})
        self.save(rel)  # persisted before the phase starts
        self._event(EventKind.PHASE_STARTED, rel, phase=phase, src=rel.src, dst=rel.dst)
        crash = rel.faults.get("crash")
        if crash and crash.get("phase") == phase and not crash.get("fired"):
            crash["fired"] = True
            self.save(rel)
            self.on_crash(float(crash.get("after_s", 0.0)))
        pause = rel.faults.get("pause")  # chaos: a window to act from outside before the phase
        if pause and pause.get("phase") == phase:
            time.sleep(float(pause.get("s", 1.0)))

    def _leave(self, rel: Relocation, ok: bool, info: dict | None = None) -> None:
        cur = rel.phases[-1]
        cur["ended"], cur["ok"] = time.time(), ok
        cur["info"].update(info or {})
        self.save(rel)
        self._event(EventKind.PHASE_ENDED, rel, phase=cur["name"], ok=ok,
                    seconds=round(cur["ended"] - cur["started"], 4), error=cur["info"].get("error", ""))

    def _fault(self, rel: Relocation, phase: Phase) -> None:
        if rel.faults.get(PhaseFault(phase.lower())):
            raise FaultInjected(f"fault injected at {phase}")

    # -- the run ---------------------------------------------------------------------------
    def _run_phases(self, rel: Relocation, w: WorkerRecord, phases: tuple[Phase, ...], on_error: OnError) -> Relocation:
        """The one phase loop (run and recover): each phase entered (persisted), its handler
        run, left with its info; a failure goes to `on_error`, which finishes the relocation."""
        for phase in phases:
            self._enter(rel, phase)
            try:
                info = self.handlers[phase](rel, w) or {}
            except SimulatedCrash:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is handled by on_error
                self._leave(rel, False, {"error": str(exc)})
                return on_error(rel, phase, exc)
            self._leave(rel, True, info)
        return self._finish(rel, DONE)

    def run(self, rel: Relocation) -> Relocation:
        worker = self.store.worker(rel.worker)
        if worker is None:
            raise PlanError(f"unknown worker {rel.worker!r}")
        rel.engine = rel.engine or worker.engine
        self._event(EventKind.RELOCATION_STARTED, rel, src=rel.src, dst=rel.dst, transfer=rel.transfer,
                    engine=rel.engine)
        return self._run_phases(rel, worker, PHASES, self._failed)

    def _failed(self, rel: Relocation, phase: Phase, exc: Exception) -> Relocation:
        rel.error = f"{phase}: {exc}"
        rel.reason = failure_reason(exc)
        log.warning("relocation %s failed at %s: %s", rel.id, phase, exc)
        if phase is Phase.RELEASE and not isinstance(exc, RollbackAfterSwitch):
            # the worker serves from its target; the stopped source is cleaned up later
            return self._finish(rel, DONE)
        if phase is Phase.PLAN:  # nothing was touched (the worker is marked last): not ours
            return self._finish(rel, FAILED, settle=False)
        return self.rollback(rel, phase_index(phase))

    def _finish(self, rel: Relocation, result: RelocationResult, settle: bool = True) -> Relocation:
        rel.result = result
        rel.finished_at = time.time()
        self.save(rel)
        if settle:
            self.settle_worker(rel)
        self._event(EventKind.RELOCATION_FINISHED, rel, result=result, reason=rel.reason, error=rel.error,
                    src=rel.src, dst=rel.dst, phases=rel.phase_seconds(), image_bytes=rel.image_bytes,
                    rollback_from=rel.rollback.get("from_phase"), recovered=rel.recovered)
        return rel

    def settle_worker(self, rel: Relocation) -> None:
        """The one place a relocation hands its worker back: the state follows from the
        outcome (STATE_AFTER), whichever phase or path (run, rollback, recovery) finished it.
        Only a worker this relocation took (`relocating`); a PLAN refusal does not call it."""
        w = self.store.worker(rel.worker)
        if w is None or w.state != WorkerState.RELOCATING or rel.result not in STATE_AFTER:
            return
        # no event: RELOCATION_FINISHED reports the outcome (WORKER_STATE is for changes outside a move)
        transition(w, worker_state_after(rel), f"relocation {rel.id} {rel.result}")
        if w.state == WorkerState.LOST and not w.error:
            w.error = f"relocation {rel.id} failed: {rel.error}"
        self.store.save_worker(w)

    # -- phases ----------------------------------------------------------------------------
    def _plan(self, rel: Relocation, w: WorkerRecord) -> dict:
        rel.transfer = TransferMode(rel.transfer)  # unknown mode or fault: refused before anything moves
        check_faults(rel.faults)
        if w.state is not WorkerState.RUNNING:
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
        requested = rel.transfer
        mode, why = transfers.choose(self.backend, w, rel.dst, requested)  # auto resolved; possible?
        rel.transfer = mode.mode
        rel.src_cell, rel.src_endpoint, rel.src_reservation = w.cell_id, w.endpoint, w.reservation
        rel.dst_cell = f"{w.id}-{rel.id}"
        rel.image_dir = self.backend.image_dir(rel.src, rel.id)
        rel.dst_image_dir, image_on, image_why = mode.target_image(self.backend, rel, w)
        # handed back by settle_worker when the relocation finishes
        transition(w, WorkerState.RELOCATING, f"relocation {rel.id} to {rel.dst}")
        self.store.save_worker(w)
        out = {"to": rel.dst, "transfer": rel.transfer.value, "image_on": image_on}
        if image_why:
            out["image_why"] = image_why
        if requested is not rel.transfer or why:
            out.update(requested=requested.value, why=why)
        return out

    def _reserve(self, rel: Relocation, w: WorkerRecord) -> dict:
        transfers.strategy(rel.transfer).before_reserve(self, rel)
        rel.reservation = f"relocator-{w.id}-{rel.id}"
        self.save(rel)
        rel.dst_gpu_ids = list(self.backend.reserve(w, rel.dst, rel.reservation) or [])
        self.save(rel)
        return {"reservation": rel.reservation, "gpus": w.gpus, "gpu_ids": rel.dst_gpu_ids}

    def _hold(self, rel: Relocation, w: WorkerRecord) -> dict:
        if not transfers.strategy(rel.transfer).freezes_source:
            return {"skipped": "the source serves on"}  # make-before-break: nothing is held
        info = self.backend.hold(w.id) or {}
        # the streams an active sibling took over at once (router: RoutingTable.hold)
        return {"moved_streams": info.get("moved_streams", 0)}

    def _dump(self, rel: Relocation, w: WorkerRecord) -> dict:
        info = transfers.strategy(rel.transfer).dump(self, rel)
        self.save(rel)
        self._fault(rel, Phase.DUMP)
        return info

    def _transfer(self, rel: Relocation, w: WorkerRecord) -> dict:
        info = transfers.strategy(rel.transfer).transfer(self, rel)
        self._fault(rel, Phase.TRANSFER)
        return info

    def _restore(self, rel: Relocation, w: WorkerRecord) -> dict:
        info = transfers.strategy(rel.transfer).restore(self, rel)
        rel.dst_endpoint = info["endpoint"]
        self.save(rel)
        self._fault(rel, Phase.RESTORE)
        return info

    def target_alive(self, rel: Relocation, when: str) -> None:
        # Until RELEASE the stopped source is the resumable copy: never point clients at, or
        # kill the source for, a target that died after RESTORE said it was healthy.
        state = self.backend.cell_state(rel.dst, rel.dst_cell)
        if state != CellState.RUNNING:
            exc = TargetLost(f"target copy {rel.dst_cell} on {rel.dst} is {state} {when}")
            if state == CellState.LOST:
                exc.reason = FailureReason.NODE_LOST
            raise exc

    def _switch(self, rel: Relocation, w: WorkerRecord) -> dict:
        self.target_alive(rel, "before the switch")
        mode = transfers.strategy(rel.transfer)
        last: Exception | None = None
        for attempt in range(self.switch_retries):
            try:
                info = mode.switch(self, rel, w)
                break
            except Exception as exc:  # noqa: BLE001
                last = exc
                time.sleep(0.2 * (attempt + 1))
        else:
            raise RelocationError(f"router switch failed: {last}")
        switched_at = time.time()
        self.target_alive(rel, "after the switch")
        w = self.store.worker(w.id) or w
        mode.on_switch(self, rel, w)
        w.node, w.cell_id, w.endpoint, w.reservation = rel.dst, rel.dst_cell, rel.dst_endpoint, rel.reservation
        w.gpu_ids = list(rel.dst_gpu_ids)
        self.store.save_worker(w)
        out = {"moved_streams": info.get("moved_streams"), "released": info.get("released")}
        # a handoff's: the streams kept on the source and the router's catch-up (rounds, tokens, s)
        out.update({k: info[k] for k in ("kept_streams", "catch_up") if info.get(k) is not None})
        out.update(mode.after_switch(self, rel, switched_at))
        return out

    def _release(self, rel: Relocation, w: WorkerRecord) -> dict:
        mode = transfers.strategy(rel.transfer)
        info = mode.release(self, rel)
        self.backend.kill(rel.src, rel.src_cell)
        if rel.src_reservation:
            self.backend.free(rel.src_reservation)
        w = self.store.worker(w.id) or w
        keep = self.keep_last_image and mode.keeps_image and bool(rel.image_dir)
        old_image = (w.last_image_node, w.last_image)
        self._cleanup_images(rel, keep=rel.image_dir if keep else None)
        if keep:
            w.last_image, w.last_image_node = rel.image_dir, rel.src
            if old_image[1] and old_image[1] != rel.image_dir and not self.keep_images:
                self._remove_image(*old_image)
        self.store.save_worker(w)
        return {**info, **({"kept_image": rel.image_dir} if keep else {})}

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
        (or in SWITCH itself, or a post-copy's RELEASE): target copy killed, source resumed,
        router back, GPUs freed."""
        t0 = time.monotonic()
        undo = _Undo()
        if failed_index >= I_RESTORE and rel.dst_cell and rel.dst:
            # never two live copies: the target copy goes before the source resumes
            undo.step("kill target copy", lambda: self.backend.kill(rel.dst, rel.dst_cell))
        source_ok = True
        frozen = rel.transfer not in transfers.STRATEGIES or transfers.strategy(rel.transfer).freezes_source
        if not frozen and failed_index < I_SWITCH:
            pass  # make-before-break: the source never stopped and the router still points at it
        elif failed_index >= I_DUMP:
            source_ok = self._resume_source(rel, undo)
            if source_ok:
                # streams cut during the freeze continue on the source; queued requests go there
                undo.step("router back to source",
                          lambda: self._router_call(lambda: self.backend.switch(rel.worker, rel.src_endpoint)))
            # else: the worker stays held; the controller replaces it and switches the router
        elif failed_index >= I_HOLD:
            undo.step("release hold", lambda: self._router_call(lambda: self.backend.release(rel.worker)))
        serving_s = time.monotonic() - t0
        if source_ok and rel.transfer in transfers.STRATEGIES:
            undo.step("source as before", lambda: transfers.strategy(rel.transfer).source_back(self, rel))
        if failed_index >= I_RESERVE and rel.reservation:
            undo.step("free reservation", lambda: self.backend.free(rel.reservation))
        if rel.dst_image_dir and rel.dst_image_dir != rel.image_dir and rel.dst:
            undo.step("remove target image", lambda: self.backend.remove_image(rel.dst, rel.dst_image_dir))
        if rel.image_dir and not self.keep_images and failed_index >= I_DUMP:
            undo.step("remove image", lambda: self.backend.remove_image(rel.src, rel.image_dir))
        self._worker_back(rel, source_ok)
        rel.rollback = {"from_phase": PHASES[failed_index] if failed_index >= 0 else None,
                        "source_serving_s": round(serving_s, 4),
                        "seconds": round(time.monotonic() - t0, 4), "steps": undo.steps, "errors": undo.errors}
        self._event(EventKind.ROLLBACK, rel, **rel.rollback, source_ok=source_ok)
        return self._finish(rel, ROLLED_BACK if source_ok else FAILED)

    def _resume_source(self, rel: Relocation, undo: "_Undo") -> bool:
        """Resume the stopped source; False if no source copy is left."""
        state = CellState.ABSENT
        try:
            state = self.backend.cell_state(rel.src, rel.src_cell)
        except Exception as exc:  # noqa: BLE001
            undo.errors.append(f"source state: {exc}")
        if state not in (CellState.STOPPED, CellState.RUNNING):
            undo.errors.append(f"source cell {rel.src_cell} is {state}")
            return False
        # "running" too: a dump cut short (its agent killed) released the tasks but may have
        # left CRIU's network lock; resuming is idempotent and drops it
        undo.step("resume source", lambda: self.backend.resume(rel.src, rel.src_cell))
        try:  # a tree that did not take the SIGCONT gets one more
            if self.backend.cell_state(rel.src, rel.src_cell) == CellState.STOPPED:
                undo.step("resume source again", lambda: self.backend.resume(rel.src, rel.src_cell))
        except Exception as exc:  # noqa: BLE001
            undo.errors.append(f"source state after resume: {exc}")
        return True

    def _worker_back(self, rel: Relocation, source_ok: bool) -> None:
        """The worker record points at the source again."""
        w = self.store.worker(rel.worker)
        if w is None:
            return
        w.node, w.cell_id, w.endpoint = rel.src, rel.src_cell or w.cell_id, rel.src_endpoint or w.endpoint
        w.reservation = rel.src_reservation or w.reservation
        if rel.transfer in transfers.STRATEGIES:
            transfers.strategy(rel.transfer).rollback(rel, w)
        # a worker with no copy left is "lost" (settle_worker): the reconcile loop replaces it
        if not source_ok:
            w.error = f"source copy {rel.src_cell} on {rel.src} is gone after a failed relocation"
        self.store.save_worker(w)

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
            state = CellState.ABSENT
            try:
                state = self.backend.cell_state(rel.dst, rel.dst_cell)
            except Exception as exc:  # noqa: BLE001
                rel.error = f"target state: {exc}"
            if state == CellState.RUNNING:
                w = self.store.worker(rel.worker)
                if w is None:
                    return self._finish(rel, FAILED)
                return self._run_phases(rel, w, PHASES[I_SWITCH:], self._failed_in_recovery)
            idx = I_SWITCH  # the target copy is gone: undo everything
        if idx == 0:  # PLAN touches nothing but the worker's state: settle_worker hands it back
            return self._finish(rel, ROLLED_BACK)
        return self.rollback(rel, idx)

    def _failed_in_recovery(self, rel: Relocation, phase: Phase, exc: Exception) -> Relocation:
        rel.error = f"{phase} (recovery): {exc}"
        if phase is Phase.SWITCH:
            return self.rollback(rel, I_SWITCH)
        if isinstance(exc, RollbackAfterSwitch):
            rel.reason = failure_reason(exc)
            return self.rollback(rel, I_RELEASE)
        return self._finish(rel, DONE)


class _Undo:
    """The rollback's steps: each tried, the rest undone even if one fails."""

    def __init__(self) -> None:
        self.steps: list[str] = []
        self.errors: list[str] = []

    def step(self, name: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
            self.steps.append(name)
        except Exception as exc:  # noqa: BLE001 - continue undoing the rest
            self.errors.append(f"{name}: {exc}")


__all__ = ["Backend", "FaultInjected", "HOOKS", "POSTCOPY_KNOBS", "Machine", "Phase", "PhaseFault", "PlanError", "PostCopyFailed",
           "RelocationError", "RelocationResult", "RollbackAfterSwitch", "SimulatedCrash", "TargetLost",
           "check_faults", "worker_state_after",
           "RUNNING", "DONE", "ROLLED_BACK", "FAILED"]
