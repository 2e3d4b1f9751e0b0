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
    WorkerState,
    failure_reason,
    phase_index,
)
from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")

I_HOLD, I_DUMP, I_RESTORE, I_SWITCH = (PHASES.index(p) for p in ("HOLD", "DUMP", "RESTORE", "SWITCH"))
I_RESERVE = PHASES.index("RESERVE")


#: a relocation's worker once the relocation has finished, by result: done, it serves from the
#: target (SWITCH recorded it there); rolled back, from the source (rollback recorded it there);
#: failed after PLAN took it, no copy is left: lost (the reconcile loop replaces it)
STATE_AFTER = {DONE: WorkerState.RUNNING, ROLLED_BACK: WorkerState.RUNNING, FAILED: WorkerState.LOST}


def worker_state_after(rel: Relocation) -> WorkerState:
    return STATE_AFTER[rel.result]


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


class PostCopyFailed(RelocationError):
    """`transfer: postcopy`: the memory did not all arrive after the switch. `why`: target (the
    copy died), source (its page server went away: node lost), stall (no answer: network cut),
    daemon (the lazy-pages daemon failed). The target copy was killed by its keeper (it must
    not run on without its memory); the move rolls back to the frozen source, or, the source
    lost too, the worker is lost and replaced."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why
        self.reason = FailureReason.TARGET_LOST if why == "target" else (
            FailureReason.NODE_LOST if why == "source" else FailureReason.ERROR)


class SimulatedCrash(BaseException):
    """Raised by a test's crash hook: the machine stops dead, as if its process had died."""


class PhaseFault(Choice):
    """A failure injected at the end of a phase (`relocate(faults={"dump": True})`)."""

    DUMP = "dump"
    TRANSFER = "transfer"
    RESTORE = "restore"


#: fault hooks that act when a phase starts: {"phase": PHASE, ...}
HOOKS = ("crash", "pause")
#: post-copy knobs for tests and chaos: {"postcopy": {"throttle_bps": 2e8, "stall_s": 2}}: the
#: target's keeper paces the background transfer (a window to act on) / declares a cut sooner
POSTCOPY_KNOBS = ("throttle_bps", "stall_s")


def check_faults(faults: dict[str, Any] | None) -> dict[str, Any]:
    """The faults of one relocation, checked: phase faults by name, hooks with a known phase.
    A wrong name is refused (ValueError naming the valid ones), never ignored."""
    out = dict(faults or {})
    for key, value in out.items():
        if key == "postcopy":
            if not isinstance(value, dict) or any(k not in POSTCOPY_KNOBS or not isinstance(v, (int, float))
                                                  for k, v in value.items()):
                raise ValueError(f"fault 'postcopy' takes numbers for {', '.join(POSTCOPY_KNOBS)}, not {value!r}")
        elif key in HOOKS:
            if not isinstance(value, dict) or value.get("phase") not in PHASES:
                raise ValueError(f"fault {key!r} needs {{'phase': one of {', '.join(PHASES)}}}, not {value!r}")
        elif key not in PhaseFault.values():
            raise ValueError(f"unknown fault {key!r}; valid: {', '.join(PhaseFault.values() + HOOKS + ('postcopy',))}")
    return out


class Backend(Protocol):
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
    def hold(self, worker_id: str) -> None: ...
    def switch(self, worker_id: str, endpoint: str) -> dict: ...
    def release(self, worker_id: str) -> None: ...
    # agents
    def dump(self, node: str, cell_id: str, image_dir: str) -> dict: ...  # + page_server=dict (stream)
    def transfer(self, src: str, dst: str, image_dir: str, dst_image_dir: str) -> dict: ...
    # transfer modes other than shared (relocator.agent.transfers): the mode for `auto` and
    # why, or PlanError; stream's page server on the target; postcopy's lazy dump and waits
    def transfer_plan(self, worker: WorkerRecord, dst: str, requested: TransferMode) -> tuple[TransferMode, str]: ...
    def open_page_server(self, node: str, image_dir: str) -> dict: ...
    def dump_lazy(self, node: str, cell_id: str, image_dir: str) -> dict: ...
    def postcopy_status(self, node: str, cell_id: str) -> dict: ...
    def postcopy_wait(self, node: str, cell_id: str, timeout: float = 1.0) -> dict: ...
    def lazy_dump_wait(self, node: str, cell_id: str, timeout: float = 1.0) -> dict: ...
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
                 switch_retries: int = 3, router_retry_s: float = 5.0, postcopy_timeout_s: float = 600.0) -> None:
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
                if phase == "RELEASE" and not isinstance(exc, PostCopyFailed):
                    # the worker serves from its target; the stopped source is cleaned up later
                    return self._finish(rel, DONE)
                if phase == "PLAN":  # nothing was touched (the worker is marked last): not ours
                    return self._finish(rel, FAILED, settle=False)
                self.rollback(rel, phase_index(phase))
                return rel
            self._leave(rel, True, info)
        return self._finish(rel, DONE)

    def _finish(self, rel: Relocation, result: str, settle: bool = True) -> Relocation:
        rel.result = result
        rel.finished_at = time.time()
        self._save(rel)
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
        w.state = worker_state_after(rel)
        if w.state == WorkerState.LOST and not w.error:
            w.error = f"relocation {rel.id} failed: {rel.error}"
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
        requested = rel.transfer
        why = ""
        if rel.transfer in (TransferMode.AUTO, TransferMode.POSTCOPY):  # auto resolved; postcopy possible?
            mode, why = self.backend.transfer_plan(w, rel.dst, rel.transfer)
            rel.transfer = TransferMode(mode)
        rel.src_cell, rel.src_endpoint, rel.src_reservation = w.cell_id, w.endpoint, w.reservation
        rel.dst_cell = f"{w.id}-{rel.id}"
        rel.image_dir = self.backend.image_dir(rel.src, rel.id)
        image_on, image_why = "disk", ""  # shared: the source's image store
        if rel.transfer == TransferMode.SHARED:
            rel.dst_image_dir = rel.image_dir
        else:
            # the target's copy lives only until it is restored: a tmpfs when the cluster's
            # transient_images allows it
            rel.dst_image_dir, image_on, image_why = self.backend.transient_image_dir(w, rel.dst, rel.id)
        w.state = WorkerState.RELOCATING  # handed back by settle_worker when the relocation finishes
        self.store.save_worker(w)
        out = {"to": rel.dst, "transfer": rel.transfer.value, "image_on": image_on}
        if image_why:
            out["image_why"] = image_why
        if requested is not rel.transfer or why:
            out.update(requested=requested.value, why=why)
        return out

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
        mode = TransferMode(rel.transfer)
        if mode is TransferMode.STREAM:
            # the target's page server first: the memory goes there while CRIU reads it
            ps = self.backend.open_page_server(rel.dst, rel.dst_image_dir)
            info = self.backend.dump(rel.src, rel.src_cell, rel.image_dir, page_server=ps)
            rel.image_bytes = int(info.get("bytes", 0))  # the small images; TRANSFER adds the pages
        elif mode is TransferMode.POSTCOPY:
            info = self.backend.dump_lazy(rel.src, rel.src_cell, rel.image_dir)
            rel.image_bytes = int(info.get("bytes", 0)) + int(info.get("lazy_bytes", 0))
            rel.postcopy = {"address": info["address"], "port": info["port"],
                            "pump_port": int(info.get("pump_port") or 0), "lazy_bytes": int(info.get("lazy_bytes", 0))}
        else:
            info = self.backend.dump(rel.src, rel.src_cell, rel.image_dir)
            rel.image_bytes = int(info.get("bytes", 0))
        self._save(rel)
        self._fault(rel, "DUMP")
        return info

    def _p_transfer(self, rel: Relocation, w: WorkerRecord) -> dict:
        mode = TransferMode(rel.transfer)  # every mode handled below; an unknown one is refused
        if mode is TransferMode.SHARED:
            info: dict = {"skipped": "shared storage"}
        elif mode in (TransferMode.STREAM, TransferMode.POSTCOPY):
            # stream: the images besides the memory the page server already has (completed and
            # stamped there); postcopy: every image but the memory left in the source
            info = self.backend.transfer(rel.src, rel.dst, rel.image_dir, rel.dst_image_dir)
            if mode is TransferMode.STREAM:
                rel.image_bytes = int(info.get("bytes", rel.image_bytes))
                self._save(rel)
        else:  # pragma: no cover - a mode added to TransferMode without its transfer (auto is resolved)
            raise RelocationError(f"transfer mode {mode} has no implementation")
        self._fault(rel, "TRANSFER")
        return info

    def _p_restore(self, rel: Relocation, w: WorkerRecord) -> dict:
        # a streamed image was hashed byte by byte on arrival: no second pass over it
        if rel.transfer == TransferMode.POSTCOPY:
            source = {"address": rel.postcopy["address"], "port": rel.postcopy["port"],
                      "pump_port": rel.postcopy.get("pump_port", 0),
                      **{k: v for k, v in (rel.faults.get("postcopy") or {}).items()}}
            info = self.backend.restore(rel.dst, rel.dst_image_dir, rel.dst_cell, verified=True,
                                        gpu_ids=rel.dst_gpu_ids or None, page_source=source)
        else:
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
        switched_at = time.time()
        self._target_alive(rel, "after the switch")
        w = self.store.worker(w.id) or w
        if rel.transfer == TransferMode.POSTCOPY and "src_gpu_ids" not in rel.postcopy:
            # a post-copy can still roll back after the switch: remember what the source had
            rel.postcopy["src_gpu_ids"] = list(w.gpu_ids)
            self._save(rel)
        w.node, w.cell_id, w.endpoint, w.reservation = rel.dst, rel.dst_cell, rel.dst_endpoint, rel.reservation
        w.gpu_ids = list(rel.dst_gpu_ids)
        self.store.save_worker(w)
        out = {"moved_streams": info.get("moved_streams"), "released": info.get("released")}
        if rel.transfer == TransferMode.POSTCOPY and "bytes_at_switch" not in rel.postcopy:
            try:
                st = self.backend.postcopy_status(rel.dst, rel.dst_cell)
            except Exception as exc:  # noqa: BLE001 - a figure only; RELEASE checks the post-copy
                st = {"error": str(exc)}
            rel.postcopy.update(bytes_at_switch=int(st.get("page_bytes", 0) or 0), switched_at=switched_at)
            self._save(rel)
            out["postcopy_bytes_at_switch"] = rel.postcopy["bytes_at_switch"]
        return out

    def _wait_postcopy(self, rel: Relocation) -> dict:
        """RELEASE of a post-copy: the source stays frozen and resumable until every page has
        arrived on the target (the target's keeper says done, the source's lazy dump ends)."""
        t0 = time.monotonic()
        while True:
            st = self.backend.postcopy_wait(rel.dst, rel.dst_cell, timeout=1.0)
            state = st.get("state")
            if state == "done":
                break
            if state in ("failed", "absent"):
                why = st.get("why") or ("target" if state == "absent" else "daemon")
                rel.postcopy.update(failed=why, error=st.get("error", ""), page_bytes=int(st.get("page_bytes", 0) or 0))
                self._save(rel)
                raise PostCopyFailed(f"post-copy failed ({why}): {st.get('error') or state}", why)
            if time.monotonic() - t0 > self.postcopy_timeout_s:
                raise PostCopyFailed(f"post-copy not done after {self.postcopy_timeout_s:.0f}s", "stall")
        page_bytes = int(st.get("page_bytes", 0) or 0)
        started, ended = st.get("started_at"), st.get("ended_at")
        rel.postcopy.update(
            page_bytes=page_bytes,
            pushed_bytes=int(st.get("pushed_bytes", 0) or 0),  # of them, by the source's push (relocator.agent.pump)
            pages_after_switch_bytes=max(0, page_bytes - int(rel.postcopy.get("bytes_at_switch", 0))),
            postcopy_s=round(ended - started, 3) if started and ended else None,
            after_switch_s=round(ended - rel.postcopy["switched_at"], 3) if ended and rel.postcopy.get("switched_at")
            else None)
        self._save(rel)
        # the source's page server ends once the target closed its session: then the tree is
        # stopped again and can go (a source node lost at this point no longer matters)
        deadline = time.monotonic() + 30
        src_done: dict = {}
        while time.monotonic() < deadline:
            try:
                src_done = self.backend.lazy_dump_wait(rel.src, rel.src_cell, timeout=1.0)
            except Exception as exc:  # noqa: BLE001
                src_done = {"done": False, "error": str(exc)}
                break
            if src_done.get("done"):
                break
        self._target_alive(rel, "after the post-copy")
        return {"postcopy_s": rel.postcopy.get("postcopy_s"), "page_bytes": page_bytes,
                "pushed_bytes": rel.postcopy["pushed_bytes"],
                "pages_after_switch_bytes": rel.postcopy["pages_after_switch_bytes"],
                "source_dump": src_done}

    def _p_release(self, rel: Relocation, w: WorkerRecord) -> dict:
        info: dict = {}
        if rel.transfer == TransferMode.POSTCOPY:
            info = self._wait_postcopy(rel)
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
            if "src_gpu_ids" in rel.postcopy:  # a post-copy rolled back after its switch
                w.gpu_ids = list(rel.postcopy["src_gpu_ids"])
            # a worker with no copy left is "lost" (settle_worker): the reconcile loop replaces it
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
                        if isinstance(exc, PostCopyFailed):
                            rel.reason = exc.reason
                            return self.rollback(rel, PHASES.index("RELEASE"))
                        return self._finish(rel, DONE)
                    self._leave(rel, True, info)
                return self._finish(rel, DONE)
            idx = I_SWITCH  # the target copy is gone: undo everything
        if idx == 0:  # PLAN touches nothing but the worker's state: settle_worker hands it back
            return self._finish(rel, ROLLED_BACK)
        return self.rollback(rel, idx)


__all__ = ["Backend", "FaultInjected", "Machine", "PhaseFault", "PlanError", "PostCopyFailed", "RelocationError",
           "SimulatedCrash", "TargetLost",
           "check_faults", "worker_state_after",
           "RUNNING", "DONE", "ROLLED_BACK", "FAILED"]
