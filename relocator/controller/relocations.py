"""Relocations: each one run by the machine (machine.py) on a thread of its own; started by an
operator, by a demand making room, by consolidation or a drain; a restarted controller first
finishes those it left open."""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import Any, Callable

from relocator import shares
from relocator.controller import scheduling, transfers
from relocator.controller.claims import Claims
from relocator.controller.events import EventKind
from relocator.controller.inventory import NodeInfo
from relocator.controller.machine import PhaseFault, check_faults
from relocator.controller.model import DONE, FAILED, RUNNING, DemandState, FailureReason, Relocation, TransferMode
from relocator.controller.scheduling import MovePlan, NodeView, Seat
from relocator.controller.states import HOLDING_STATES
from relocator.controller.store import Store
from relocator.waits import WaitTimeout, until

log = logging.getLogger("relocator.controller")
#: the phases in which a moving worker's new requests wait or its streams stall
BLACKOUT_PHASES = ("HOLD", "DUMP", "TRANSFER", "RESTORE", "SWITCH")
WAIT_EVERY_S = 0.1


def blackout_phases(rel: dict) -> tuple[str, ...]:
    """The phases of a finished move (a summary) its worker was blacked out in: its mode's."""
    mode = transfers.STRATEGIES.get(rel.get("transfer"))  # type: ignore[arg-type]
    return mode.blackout_phases if mode is not None else BLACKOUT_PHASES


def env_faults() -> dict[str, Any]:
    """Fault injection from the environment: RELOCATOR_FAULTS="dump,transfer,restore"."""
    raw = os.environ.get("RELOCATOR_FAULTS", "")
    try:
        return {PhaseFault(p.strip().lower()).value: True for p in raw.split(",") if p.strip()}
    except ValueError as exc:
        raise ValueError(f"RELOCATOR_FAULTS: {exc}") from None


class RelocationManager:
    def __init__(self, store: Store, machine: Any, claims: Claims, emit: Callable[..., Any],
                 inventory: Callable[..., dict[str, NodeInfo]], check_target: Callable[..., None],
                 view: Callable[[], tuple[list[NodeView], list[Seat]]], transfer: TransferMode) -> None:
        self.store, self.machine, self.claims, self.emit = store, machine, claims, emit
        self.inventory, self.check_target, self.view, self.transfer = inventory, check_target, view, transfer
        self.threads: dict[str, threading.Thread] = {}

    def recover(self) -> list[str]:
        """Every relocation the previous controller left open, finished or rolled back (its
        worker is frozen or held meanwhile). Returns their ids."""
        rels = self.store.open_relocations()
        for rel in rels:
            self.claims.busy.add(rel.worker)
            self.spawn(rel, recover=True)
        return [r.id for r in rels]

    def spawn(self, rel: Relocation, recover: bool = False) -> None:
        t = threading.Thread(target=self._body, args=(rel, recover), name=f"relocation-{rel.id}", daemon=True)
        self.threads[rel.id] = t
        t.start()

    def _body(self, rel: Relocation, recover: bool) -> None:
        try:
            if recover:
                self.machine.recover(rel)
            else:
                self.machine.run(rel)
        except Exception as exc:  # noqa: BLE001
            rel.result, rel.error = FAILED, f"internal: {exc}\n{traceback.format_exc()}"
            rel.reason = FailureReason.ERROR
            rel.finished_at = time.time()
            self.store.save_relocation(rel)
            self.machine.settle_worker(rel)  # never left `relocating`: lost, so it is replaced
            self.emit(EventKind.RELOCATION_FINISHED, relocation=rel.id, worker=rel.worker, result=rel.result,
                      reason=rel.reason, error=f"internal: {exc}", src=rel.src, dst=rel.dst,
                      phases=rel.phase_seconds(), image_bytes=rel.image_bytes, rollback_from=None,
                      recovered=rel.recovered)
        finally:
            self.claims.release(rel.worker)
            self.claims.wake.set()  # e.g. its worker landed on a node lost meanwhile: replace it now

    def relocate(self, worker_id: str, to: str | None = None, transfer: str | None = None,
                 faults: dict | None = None, wait: bool = True, timeout: float = 900.0) -> dict:
        w = self.store.worker(worker_id)
        if w is None:
            raise KeyError(f"unknown worker {worker_id!r}")
        if to is not None:
            self.check_target(to, self.inventory())
        mode = TransferMode(transfer) if transfer is not None else self.transfer
        faults = check_faults({**env_faults(), **(faults or {})})
        self.claims.take(worker_id, f"worker {worker_id} is already being relocated or started")
        rel = Relocation(id=Relocation.new_id(), worker=worker_id, src=w.node, dst=to,
                         transfer=mode, faults=faults, engine=w.engine)
        self.store.save_relocation(rel)
        self.spawn(rel)
        if not wait:
            return rel.summary()
        return self.wait(rel.id, timeout)

    def finished(self, relocation_id: str) -> dict | None:
        """The summary of a finished relocation, None while it runs (KeyError: unknown)."""
        rel = self.store.relocation(relocation_id)
        if rel is None:
            raise KeyError(f"unknown relocation {relocation_id!r}")
        return None if rel.result == RUNNING else rel.summary()

    def wait(self, relocation_id: str, timeout: float = 900.0) -> dict:
        try:
            return until(lambda: self.finished(relocation_id), timeout, every=WAIT_EVERY_S,
                         what=f"relocation {relocation_id}")
        except WaitTimeout:
            raise TimeoutError(f"relocation {relocation_id} still running after {timeout:.0f}s") from None

    def run_moves(self, moves: list[MovePlan], transfer: str | None = None, faults: dict | None = None) -> list[dict]:
        """Independent live moves, all at once; each one's summary (with `blackout_s`)."""
        started: list[str] = []
        results: list[dict] = []
        for i, m in enumerate(moves):
            try:
                started.append(self.relocate(m.worker, to=m.dst, transfer=transfer, faults=faults if i == 0 else None,
                                             wait=False)["id"])
            except Exception as exc:  # noqa: BLE001 - the others still run; this one failed to start
                results.append({"worker": m.worker, "from": m.src, "to": m.dst, "result": FAILED.value,
                                "error": str(exc), "phases": {}, "blackout_s": 0.0})
        for rid in started:
            r = self.wait(rid)
            r["blackout_s"] = round(sum(v for k, v in r["phases"].items() if k in blackout_phases(r)), 4)
            results.append(r)
        return results

    def consolidate(self, dry_run: bool = False, max_moves: int = 10, transfer: str | None = None) -> dict:
        """Pack the running workers onto the fewest nodes with live moves (planner.consolidate)."""
        if int(max_moves) < 1:
            raise ValueError(f"max_moves must be >= 1, not {max_moves}")
        transfer = TransferMode(transfer).value if transfer is not None else None
        t0 = time.monotonic()
        with self.claims.seating:
            nodes, seats = self.view()
            pending = [d.gpus for d in self.store.demands() if d.state == DemandState.PENDING]
            plan = scheduling.consolidate(nodes, seats, max_moves=int(max_moves), demands=pending)  # FGD's target
            moves = plan["moves"]
            out = {"nodes_freed": plan["nodes_freed"], "moves": [m.to_dict() for m in moves],
                   "gpus_moved": shares.count(sum(m.gpus for m in moves)), "gpus_freed": plan["gpus_freed"]}
            if dry_run:
                return {"dry_run": True, **out}
            results = self.run_moves(moves, transfer=transfer)
        by_worker = {r["worker"]: r for r in results}
        still = {w.node for w in self.store.workers() if w.state in HOLDING_STATES}
        out["nodes_freed"] = [n for n in plan["nodes_freed"] if n not in still]
        out["moves"] = [{**m.to_dict(), "result": by_worker[m.worker]["result"],
                         "blackout_s": by_worker[m.worker].get("blackout_s", 0.0),
                         "relocation": by_worker[m.worker].get("id"), "error": by_worker[m.worker].get("error", "")}
                        for m in moves]
        out["gpus_moved"] = shares.count(sum(m["gpus"] for m in out["moves"] if m["result"] == DONE))
        out["seconds"] = round(time.monotonic() - t0, 3)
        self.emit(EventKind.CONSOLIDATED, moves=len(moves), nodes_freed=out["nodes_freed"],
                  gpus_moved=out["gpus_moved"], results=[m["result"] for m in out["moves"]])
        return out
