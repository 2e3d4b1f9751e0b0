"""Carrying out an action's steps: the controller's operations through narrow ports (no
controller import). Moves run `parallel` at a time, those expected to meet the firing's deadline
first (highest priority first); at the deadline, a move not yet started is a suspend instead.
Every step's outcome is counted (`relocator_policy_actions_total{policy,action,result}`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from relocator.policies.base import Firing, Step
from relocator.waits import until

log = logging.getLogger("relocator.controller")
POLL_S = 0.2
COUNTS = "policy_actions"  # store kind: {policy, action, result, n}


@dataclass(frozen=True)
class PolicyPorts:
    """What the policies use of the controller, and nothing else."""

    store: Any  # get/put/all/delete (counts, GPU states, labels)
    emit: Callable[..., Any]  # emit(kind, **fields)
    workers: Callable[[], list[dict]]
    nodes: Callable[[], dict[str, dict]]  # {node: {gpus_total, gpus_free, alive, cordoned}}
    health: Callable[[str], dict]  # a node agent's health report
    pending: Callable[[], list[dict]]  # demands waiting
    relocations: Callable[[], list[dict]]  # relocation summaries
    relocate: Callable[..., dict]  # relocate(worker, to=, transfer=, wait=False) -> summary with id
    relocation: Callable[[str], dict | None]
    suspend: Callable[[str], dict]
    replace: Callable[[str], Any]  # the worker's copy is gone: the reconcile loop replaces it
    consolidate: Callable[[int], dict]
    cordon: Callable[[str, float | None], None]
    uncordon: Callable[[str], Any]
    hold_gpu: Callable[[str, int], None]
    release_gpu: Callable[[str, int], None]
    prefetch: Callable[[str, str], dict] | None = None  # (worker, node): its kind's warm image there


def count(store: Any, policy: str, action: str, result: str) -> None:
    key = f"{policy}|{action}|{result}"
    row = store.get(COUNTS, key) or {"policy": policy, "action": action, "result": result, "n": 0}
    row["n"] += 1
    store.put(COUNTS, key, row)


@dataclass
class _Moves:
    todo: list[Step]
    move_s: float = 0.0
    running: dict[str, Step] = field(default_factory=dict)  # relocation id -> its step
    results: list[dict] = field(default_factory=list)


class Runner:
    def __init__(self, ports: PolicyPorts, clock: Callable[[], float] = time.time,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.ports, self.clock, self.sleep = ports, clock, sleep

    def run(self, policy: str, firing: Firing, steps: list[Step], parallel: int = 4,
            transfer: str | None = None, move_s: float = 0.0) -> list[dict]:
        """Every step, in order: cordons, then moves (deadline-aware: a move that would not end
        before the deadline, `move_s` being what one takes, is a suspend instead), then the rest."""
        out: list[dict] = []
        for s in [s for s in steps if s.op == "cordon"]:
            out.append(self._one(policy, s, lambda s=s: self.ports.cordon(s.node, s.args.get("until"))))
        moves = [s for s in steps if s.op == "move"]
        moves.sort(key=lambda s: (not s.fits_deadline, -s.priority))
        if moves:
            out += self._moves(policy, firing, moves, parallel, transfer, move_s)
        for s in [s for s in steps if s.op not in ("cordon", "move")]:
            out.append(self._one(policy, s, self._op(s)))
        return out

    def _op(self, s: Step) -> Callable[[], Any]:
        p = self.ports
        table: dict[str, Callable[[], Any]] = {
            "suspend": lambda: p.suspend(s.worker),
            "replace": lambda: p.replace(s.worker),
            "consolidate": lambda: p.consolidate(int(s.args.get("max_moves", 4))),
            "prefetch": lambda: (p.prefetch or _unsupported)(s.worker, s.to),
        }
        return table[s.op]

    def _one(self, policy: str, s: Step, fn: Callable[[], Any]) -> dict:
        try:
            detail = fn()
            result = "ok"
        except Exception as exc:  # noqa: BLE001 - one failing step never stops the others
            detail, result = str(exc), "failed"
            log.warning("policy %s: %s %s failed: %s", policy, s.op, s.worker or s.node, exc)
        count(self.ports.store, policy, s.op, result)
        return {**s.to_dict(), "result": result, "detail": _brief(detail)}

    def _moves(self, policy: str, firing: Firing, moves: list[Step], parallel: int,
               transfer: str | None, move_s: float) -> list[dict]:
        run = _Moves(todo=list(moves), move_s=move_s)
        until(lambda: self._round(policy, firing, run, parallel, transfer), None, every=POLL_S,
              what=f"policy {policy}'s moves", sleep=self.sleep)
        return run.results

    def _round(self, policy: str, firing: Firing, run: _Moves, parallel: int, transfer: str | None) -> bool:
        while run.todo and len(run.running) < parallel:
            s = run.todo.pop(0)
            if firing.deadline is not None and self.clock() + run.move_s > firing.deadline:  # too late: set aside
                run.results.append(self._one(policy, Step("suspend", worker=s.worker, node=s.node,
                                                          priority=s.priority), lambda s=s: self.ports.suspend(s.worker)))
                continue
            try:
                rel = self.ports.relocate(s.worker, to=s.to, transfer=transfer, wait=False)
                run.running[rel["id"]] = s
            except Exception as exc:  # noqa: BLE001 - refused up front (busy, no room): counted
                count(self.ports.store, policy, "move", "failed")
                run.results.append({**s.to_dict(), "result": "failed", "detail": _brief(str(exc))})
        for rid, s in list(run.running.items()):
            rel = self.ports.relocation(rid) or {"result": "failed", "error": "relocation record gone"}
            if rel.get("result") == "running":
                continue
            del run.running[rid]
            result = "ok" if rel.get("result") == "done" else "failed"
            count(self.ports.store, policy, "move", result)
            run.results.append({**s.to_dict(), "result": result, "relocation": rid, "ended": rel.get("finished_at"),
                                "detail": _brief(rel.get("error") or rel.get("result"))})
        return not (run.todo or run.running)


def _unsupported(worker: str, node: str) -> dict:
    raise RuntimeError("prefetch-image is not wired on this controller")


def _brief(detail: Any) -> Any:
    if isinstance(detail, dict):
        return {k: detail[k] for k in ("id", "result", "state", "error", "node") if k in detail}
    return detail if detail is None or isinstance(detail, (int, float)) else str(detail)[:300]
