"""The policy engine: one reconcile step (`update`) that evaluates every enabled policy on one
context (the agents' health reports, the workers, the nodes, our own series), marks GPUs by
health, and starts the actions whose conditions held long enough, within each policy's budget,
on their own threads. One failing policy never stops the others; `dry_run` says what each
would do now without doing it."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any, Callable

from relocator.policies.actions import BUDGETED, MoveAction
from relocator.policies.base import Context, Firing, Step
from relocator.policies.gpustate import GpuBook
from relocator.policies.limits import PolicyLimits
from relocator.policies.runner import COUNTS, PolicyPorts, Runner
from relocator.policies.spec import PolicySpec, load, load_file
from relocator.policies.triggers import GpuHealthTrigger

log = logging.getLogger("relocator.controller")
DEFAULT_MOVE_S = 30.0  # what a move is assumed to take before any has been measured
LABELS = "labels"  # store kind: {worker: {k: v}}


def _thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="policy", daemon=True).start()


class PolicyEngine:
    def __init__(self, ports: PolicyPorts, path: str | Path | None = None, clock: Callable[[], float] = time.time,
                 spawn: Callable[[Callable[[], None]], None] = _thread,
                 sleep: Callable[[float], None] | None = None) -> None:
        self.ports, self.clock, self.spawn = ports, clock, spawn
        self.path = Path(path) if path else None
        self.runner = Runner(ports, clock, sleep)
        self.gpus = GpuBook(ports.store, ports.emit, ports.hold_gpu, ports.release_gpu)
        self.specs: list[PolicySpec] = []
        self.errors: list[dict[str, str]] = []
        self.limits: dict[str, PolicyLimits] = {}
        self.last: dict[str, dict[str, Any]] = {}  # per policy: its last round (firings, verdicts, error)
        if self.path is not None and self.path.is_file():
            self._install(*load_file(self.path))

    # -- configuration ------------------------------------------------------------------------
    def _install(self, specs: list[PolicySpec], errors: list[dict[str, str]]) -> None:
        self.specs, self.errors = specs, errors
        self.limits = {s.name: self.limits.get(s.name) or PolicyLimits(s.limits, self.clock) for s in specs}
        for s in specs:
            self.limits[s.name].limits = s.limits
        for e in errors:
            log.warning("policy %s not loaded: %s", e["name"] or "(file)", e["error"])

    def apply(self, doc: Any) -> dict:
        """Replace the policies with `doc`'s ({"policies": [...]}); invalid ones are reported."""
        self._install(*load(doc))
        return self.listing()

    def reload(self) -> dict:
        """The policies file's policies again (none without a file)."""
        self._install(*(load_file(self.path) if self.path is not None and self.path.is_file() else ([], [])))
        return self.listing()

    def listing(self) -> dict:
        return {"file": str(self.path) if self.path else None,
                "policies": [{**s.model_dump(mode="json"), "set": s.model_dump(mode="json", exclude_defaults=True),
                              "budget_left": self.limits[s.name].budget_left(),
                              "last": self.last.get(s.name, {})} for s in self.specs],
                "errors": self.errors, "gpus": self.gpus.states(), "counts": list(self.ports.store.all(COUNTS))}

    def set_labels(self, worker: str, labels: dict[str, str]) -> None:
        if labels:
            self.ports.store.put(LABELS, worker, {"worker": worker, "labels": dict(labels)})

    # -- one round ----------------------------------------------------------------------------
    def context(self) -> Context:
        now = self.clock()
        labels = {d["worker"]: d["labels"] for d in self.ports.store.all(LABELS)}
        workers = [{**w, "labels": labels.get(w["id"], {})} for w in self.ports.workers()]
        nodes = self.ports.nodes()
        ctx = Context(now=now, workers=workers, nodes=nodes, health=self._health(nodes), move_s=self._move_s())
        ctx.series = self._series(ctx)
        return ctx

    def _health(self, nodes: dict[str, dict]) -> dict[str, dict]:
        """Every live node's agent report, read side by side (a slow agent delays the round by
        its call's timeout once, not once per node)."""
        from concurrent.futures import ThreadPoolExecutor

        def one(n: str) -> dict:
            try:
                return self.ports.health(n)
            except Exception as exc:  # noqa: BLE001 - an agent that does not answer reports nothing
                return {"error": str(exc)}

        live = [n for n, v in nodes.items() if v.get("alive", True)]
        if not live:
            return {}
        with ThreadPoolExecutor(max_workers=min(16, len(live))) as pool:
            return dict(zip(live, pool.map(one, live)))

    def _move_s(self) -> float:
        took = [r["finished_at"] - r["created_at"] for r in self.ports.relocations()[-20:]
                if r.get("result") == "done" and r.get("finished_at")]
        return round(median(took), 2) if took else DEFAULT_MOVE_S

    def _series(self, ctx: Context) -> dict[str, float]:
        pending = self.ports.pending()
        return {"pending_demands": len(pending),
                "pending_demand_age_max_s": max((ctx.now - float(d.get("since") or ctx.now) for d in pending), default=0.0),
                "workers_running": sum(1 for w in ctx.workers if w.get("state") == "running"),
                "gpus_free": sum(float(v.get("gpus_free") or 0) for v in ctx.nodes.values() if v.get("alive", True)),
                "nodes_lost": sum(1 for v in ctx.nodes.values() if not v.get("alive", True)),
                "gpus_unhealthy": sum(1 for g in self.gpus.states() if g["state"] != "healthy")}

    def gpu_rules(self) -> GpuHealthTrigger:
        for s in self.specs:
            if isinstance(s.trigger, GpuHealthTrigger):
                return s.trigger
        return GpuHealthTrigger(kind="gpu-health")

    def update(self) -> None:
        """One reconcile round (the controller's `update_policies` step)."""
        ctx = self.context()
        self.gpus.update(ctx, self.gpu_rules())
        ctx.health = self.gpus.visible(ctx.health)  # held fake GPUs: by count, nothing to act on
        self._undo_windows(ctx)
        for spec in self.specs:
            if spec.enabled:
                self._guarded(spec, ctx, act=True)

    def dry_run(self) -> dict:
        """What each policy would do now: its firings, the steps and why it would wait."""
        ctx = self.context()
        ctx.health = self.gpus.visible(ctx.health)
        return {"now": ctx.now, "move_s": ctx.move_s,
                "policies": [{"name": s.name, "enabled": s.enabled, **self._guarded(s, ctx, act=False)}
                             for s in self.specs], "errors": self.errors}

    def _guarded(self, spec: PolicySpec, ctx: Context, act: bool) -> dict:
        try:
            out = self._evaluate(spec, ctx, act)
        except Exception as exc:  # noqa: BLE001 - one failing policy never stops the others
            log.warning("policy %s failed: %s", spec.name, exc)
            out = {"error": str(exc), "firings": []}
        if act:
            self.last[spec.name] = {"at": ctx.now, **out}
        return out

    def _evaluate(self, spec: PolicySpec, ctx: Context, act: bool) -> dict:
        firings = spec.trigger.fire(ctx)
        lim = self.limits[spec.name]
        if act:
            lim.observe({f.key for f in firings})
        workers = spec.filter.select(ctx.workers)
        out = []
        for f in firings:
            steps = spec.action.plan(f, workers, ctx)
            cost = sum(1 for s in steps if s.op in BUDGETED)
            why = lim.verdict(f.key, cost)  # a dry run observes nothing: a new key is still holding
            if not steps:
                why = why or "nothing to do"
            out.append({"firing": f.to_dict(), "steps": [s.to_dict() for s in steps], "would": why or "act"})
            if act and not why:
                lim.spend(f.key, cost)
                self._start(spec, f, steps, ctx)
        return {"firings": out}

    # -- acting -------------------------------------------------------------------------------
    def _start(self, spec: PolicySpec, f: Firing, steps: list[Step], ctx: Context) -> None:
        lim = self.limits[spec.name]
        lim.running.add(f.key)
        late = [s for s in steps if not s.fits_deadline]
        short_by = round(ctx.now + _need_s(steps, spec, ctx) - f.deadline, 1) if f.deadline and late else None
        self.ports.emit("policy_planned", policy=spec.name, trigger=spec.trigger.kind, action=spec.action.kind,
                        firing=f.to_dict(), steps=[s.to_dict() for s in steps], move_s=ctx.move_s,
                        short_by_s=short_by)
        parallel = spec.action.parallel if isinstance(spec.action, MoveAction) else 1
        transfer = spec.action.transfer if isinstance(spec.action, MoveAction) else None

        def body() -> None:
            t0 = self.clock()
            results: list[dict] = []
            try:
                results = self.runner.run(spec.name, f, steps, parallel, transfer, ctx.move_s)
            except Exception as exc:  # noqa: BLE001 - reported as the outcome
                results = [{"result": "failed", "detail": str(exc)}]
            finally:
                lim.running.discard(f.key)
            if f.until is not None:
                self.ports.store.put("policy_window", f.key, {"key": f.key, "node": f.node, "until": f.until})
            ends = [r.get("ended") for r in results if r.get("ended")]
            met = None if f.deadline is None else all(e <= f.deadline for e in ends) and self.clock() <= f.deadline
            self.ports.emit("policy_outcome", policy=spec.name, firing=f.to_dict(), results=results,
                            ok=all(r.get("result") == "ok" for r in results), met_deadline=met,
                            seconds=round(self.clock() - t0, 3))

        self.spawn(body)

    def _undo_windows(self, ctx: Context) -> None:
        """A window's node is uncordoned once the window is over ("resume after")."""
        for w in list(self.ports.store.all("policy_window")):
            if ctx.now >= float(w["until"]):
                self.ports.uncordon(w["node"])
                self.ports.store.delete("policy_window", w["key"])


def _need_s(steps: list[Step], spec: PolicySpec, ctx: Context) -> float:
    """How long the moves take in waves of `parallel`."""
    moves = sum(1 for s in steps if s.op == "move")
    parallel = spec.action.parallel if isinstance(spec.action, MoveAction) else 1
    return -(-moves // max(1, parallel)) * ctx.move_s
