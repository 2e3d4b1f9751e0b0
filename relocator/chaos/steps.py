"""One step of a chaos run: a forced move (with its fault), a suspend+resume, a make-room launch.
Each polls the controller through the helpers here, which check the run's budgets (budget.py)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

from relocator import waits
from relocator.chaos.budget import Watch
from relocator.chaos.config import MODEL, ChaosConfig
from relocator.chaos.faults import FAULTS, Step, StepKind
from relocator.chaos.hosts import LocalView
from relocator.chaos.injector import Injector
from relocator.chaos.probe import _post_ok, _Probe
from relocator.vocab import TransferMode


#: the budgets of the run whose steps this thread runs (run_chaos's step thread sets it): the
#: poll helpers check it, so a step thread the run gave up on stops at its next poll
_LOCAL = threading.local()


def _watch() -> Watch | None:
    return getattr(_LOCAL, "watch", None)


def _check() -> None:
    if (w := _watch()) is not None:
        w.check()


def _seen(event: str) -> None:
    if (w := _watch()) is not None:
        w.seen(event)


def _waiting(what: str) -> None:
    if (w := _watch()) is not None:
        w.waiting(what)


def _last_controller_event(view: LocalView, log: str | None) -> dict | None:
    """The last line of the controller's events.jsonl, read from disk (the controller may be
    gone); on emulated hosts from whichever host's directory has it."""
    if not log:
        return None
    for host in sorted(getattr(view, "hosts", {})) or [""]:
        p = view.path(host, log)
        try:
            with open(p, "rb") as fh:
                fh.seek(max(0, p.stat().st_size - 16384))
                lines = [ln for ln in fh.read().splitlines() if ln.strip()]
            return json.loads(lines[-1]) if lines else None
        except (OSError, ValueError):
            continue
    return None


def _rel(ctl, rid: str) -> dict:
    while True:
        _check()
        try:
            rel = ctl.get_relocation(rid) or {}
        except Exception:  # noqa: BLE001 - the controller is restarting
            time.sleep(0.1)
            continue
        _seen(f"relocation {rid}: {rel.get('phase')} ({rel.get('result')})")
        return rel


def _status(ctl, tries: int = 600) -> dict:
    for _ in range(tries):
        _check()
        try:
            return ctl.status()
        except Exception:  # noqa: BLE001
            time.sleep(0.2)
    return ctl.status()


def _detected_at(rel: dict, inj: Injector | None, lost_at: float | None = None) -> float | None:
    """Fault detection: the injection itself for a dead controller or router (Ray and the
    daemon notice at once), else the end of the first failed phase or the controller seeing
    the node lost (`lost_at`), whichever came first, else the injection."""
    if inj and inj.injected and inj.fault.name in ("kill-controller", "kill-controller-switch", "restart-router"):
        return inj.at
    seen = [float(p["ended"]) for p in rel.get("phases", []) if p.get("ok") is False and p.get("ended")]
    seen += [lost_at] if lost_at else []
    if seen:
        return min(seen)
    return inj.at if inj and inj.injected else None


def _freeze_end(rel: dict) -> float | None:
    """When the move stopped freezing its worker: the end of SWITCH, or of the relocation."""
    ends = [p["ended"] for p in rel.get("phases", []) if p.get("name") == "SWITCH" and p.get("ended")]
    return float(ends[-1]) if ends else rel.get("finished_at")


def _drive(ctl, rid: str, worker: dict, step: Step, cfg: ChaosConfig, inj: Injector | None,
           probe: _Probe | None) -> dict:
    """Poll the relocation until it ends (or cfg.move_timeout_s), injecting the fault at its
    phase; the relocation's last record."""
    state: dict[str, Any] = {}

    def still() -> dict:
        state["rel"] = _rel(ctl, rid)
        return state["rel"]

    def ended() -> bool:  # one poll: the relocation's record, the fault injected at its phase
        rel = still()
        if rel.get("result") != "running":
            return True
        if inj and not inj.injected and inj.ready(rel):
            try:
                inj.act(rel, still)
            except Exception as exc:  # noqa: BLE001
                inj.detail["error"] = f"{type(exc).__name__}: {exc}"
            if not inj.injected:
                inj.fault_missed = True
        # right after the injection too: the next status poll may wait on a restarting controller
        if probe and _detected_at(rel, inj) is not None:
            probe.add(worker["endpoint"])
            probe.add(rel.get("dst_endpoint"))
        return False

    _waiting(f"relocation {rid} of {worker['id']} ({step.fault or 'plain move'}) to finish")
    waits.settle(ended, cfg.move_timeout_s, every=0.02)
    return state["rel"]


def _await_node_loss(ctl, rel: dict, fault: Any, worker: dict, cfg: ChaosConfig,
                     probe: _Probe | None) -> tuple[bool, float | None]:
    """Ray declares the node dead after its health checks fail; a worker that ended up there
    (the move completed first) is then marked lost and replaced (from its last image).
    (the worker's node alive, when the lost node was seen lost)"""
    seen: dict[str, Any] = {"node_alive": True, "lost_at": None}

    def replaced() -> bool:
        st = _status(ctl)
        nodes = {n["id"]: n for n in st["nodes"]}
        w = next((x for x in st["workers"] if x["id"] == worker["id"]), None)
        if w:
            _seen(f"{w['id']}: {w['state']} on {w['node']}")
        node_alive = seen["node_alive"] = bool(w) and nodes.get(w["node"], {}).get("alive", False)
        lost_at = seen["lost_at"] = nodes.get(rel.get(fault.lost_node), {}).get("lost_at")
        if probe and w and w.get("endpoint"):
            probe.add(w["endpoint"])
        return bool(lost_at and node_alive and w["state"] in ("running", "failed"))

    _waiting(f"Ray to declare {rel.get(fault.lost_node)} dead and {worker['id']} running or failed on a live node")
    waits.settle(replaced, cfg.move_timeout_s, every=0.2)
    return seen["node_alive"], seen["lost_at"]


def _answers(w: dict | None) -> bool:
    """Serving again: a probe to the worker's endpoint now, answered (within 30 s)."""
    if not (w and w["state"] == "running"):
        return False
    ep = w["endpoint"]
    _waiting(f"{w['id']} to answer at {ep}")

    def answered() -> bool:
        _check()
        return _post_ok(ep, timeout=5)

    return bool(waits.settle(answered, 30, every=0.2))


def _serve_again(probe: _Probe, rel: dict, inj: Injector, fault: Any, ep: str | None,
                 lost_at: float | None) -> float | None:
    """Seconds from the fault's detection until the worker served again (probes), None if never."""
    det = _detected_at(rel, inj, lost_at)
    if det is not None and fault.spares_worker:
        # the worker is frozen by the move itself until SWITCH (or the rollback): that
        # blackout is the relocation's, not the fault's; count from its end
        det = max(det, _freeze_end(rel) or det)
    if det is None or not ep:
        return None
    at = probe.serving_at(ep, det)
    # never negative: a source that kept serving (its dump was cut short) counts as 0
    return round(max(0.0, at - det), 3) if at else None


def _move_record(step: Step, rid: str, worker: dict, dst: str, rel: dict, w: dict | None, t_start: float,
                 timed_out: bool, serving: bool, node_alive: bool, settle_s: float | None) -> dict[str, Any]:
    return {"step": step.index, "fault": step.fault, "relocation": rid, "worker": worker["id"],
            "from": rel.get("src"), "to": dst, "result": "timeout" if timed_out else rel.get("result"),
            "error": (rel.get("error") or "")[:300], "recovered": rel.get("recovered"),
            "phases": {p["name"]: round(p["ended"] - p["started"], 3) for p in rel.get("phases", []) if p.get("ended")},
            "phase_times": [(p["name"], p["started"], p["ended"]) for p in rel.get("phases", []) if p.get("ended")],
            "rollback": rel.get("rollback") or {}, "started_at": t_start, "ended_at": time.time(),
            "worker_after": {k: w.get(k) for k in ("node", "state", "cell", "endpoint")} if w else None,
            "serving": serving, "worker_node_alive": node_alive, "settle_s": settle_s}


def move_transfer(fault: Any, cfg: ChaosConfig) -> str | None:
    """A move's transfer mode: its fault's (cut-transfer streams, the handoff's hand off), else the
    run's `--transfer`, else None (the controller's default); a freezing fault's move under a
    run's mode that freezes nothing (`handoff`) is `shared`."""
    if fault is not None and fault.transfer:
        return fault.transfer
    if fault is not None and fault.freezing and cfg.transfer and not _freezes(cfg.transfer):
        return TransferMode.SHARED
    return cfg.transfer


def _freezes(mode: str) -> bool:
    """Whether `mode` freezes the source (`auto`: may not, it may hand off)."""
    from relocator.controller import transfers

    try:
        strategy = transfers.STRATEGIES.get(TransferMode(mode))
    except ValueError:
        return False
    return strategy is not None and strategy.freezes_source


def one_move(ctl, base: Path, step: Step, worker: dict, dst: str, cfg: ChaosConfig, say,
             view: LocalView | None = None) -> dict[str, Any]:
    fault = FAULTS[step.fault] if step.fault else None
    t_start = time.time()
    s = ctl.relocate(worker["id"], to=dst, transfer=move_transfer(fault, cfg),
                     faults=fault.relocate_faults() if fault else None, wait=False)
    rid = s["id"]
    inj = Injector(ctl, base, fault, worker, view) if fault else None
    # probes go to the worker directly, so they start only once the fault is detected: a
    # connection waiting in the accept queue while CRIU dumps makes the dump fail
    probe = _Probe().start() if fault else None
    rel = _drive(ctl, rid, worker, step, cfg, inj, probe)
    if inj:
        inj.cleanup()
    timed_out = rel.get("result") == "running"
    node_alive, lost_at = True, None
    if fault and fault.destructive:
        node_alive, lost_at = _await_node_loss(ctl, rel, fault, worker, cfg, probe)
    st = _status(ctl)
    w = next((x for x in st["workers"] if x["id"] == worker["id"]), None)
    ep = w["endpoint"] if w else None
    serve_again = None
    if probe:
        probe.add(worker["endpoint"])
        probe.add(rel.get("dst_endpoint"))
    serving = _answers(w)
    if probe:
        serve_again = _serve_again(probe, rel, inj, fault, ep, lost_at)
        probe.stop()
    out = _move_record(step, rid, worker, dst, rel, w, t_start, timed_out, serving, node_alive, _settle(ctl))
    if inj:
        out.update(injected=inj.injected, injected_at=inj.at, detected_at=_detected_at(rel, inj, lost_at),
                   serve_again_s=serve_again, source_serving_s=(rel.get("rollback") or {}).get("source_serving_s"),
                   detail=inj.detail)
    say(f"  move {step.index}: {worker['id']} {rel.get('src')}→{dst} {step.fault or 'plain'}: {out['result']}"
        + (f", serving again {serve_again}s" if serve_again is not None else "")
        + ("" if serving else " NOT SERVING"))
    return out


def _serving(ctl, ids: list[str] | None = None, timeout: float = 30.0) -> list[str]:
    """The workers (`ids`, default all) that are not running or do not answer within `timeout`."""
    st = _status(ctl)
    bad = []
    for w in st["workers"]:
        if ids is not None and w["id"] not in ids:
            continue
        if not waits.settle(lambda: _answering(ctl, w), timeout, every=0.3):
            bad.append(w["id"])
    return bad


def _answering(ctl, w: dict) -> bool:
    """`w` running and answering; updated in place from the controller's status when not."""
    if w["state"] == "running" and bool(w.get("endpoint")) and _post_ok(w["endpoint"], timeout=5):
        return True
    w.update(next((x for x in _status(ctl)["workers"] if x["id"] == w["id"]), {}))
    return False


def suspend_resume(ctl, base: Path, step: Step, worker: dict, cfg: ChaosConfig, say) -> dict[str, Any]:
    """Suspend the worker (image to the store, GPUs released, its streams held or sent to a
    sibling) and resume it wherever the controller seats it; then it must serve."""
    out: dict[str, Any] = {"step": step.index, "kind": StepKind.SUSPEND_RESUME.value, "fault": step.fault,
                           "worker": worker["id"], "from": worker["node"], "started_at": time.time(),
                           "suspended": False, "resumed": False, "cells": [worker["cell"]]}
    try:
        s = ctl.suspend(worker["id"])
        out.update(suspended=True, suspend_s=s.get("seconds"), image_bytes=s.get("image_bytes"),
                   sibling=s.get("sibling"))
        r = ctl.resume(worker["id"])
        out.update(resumed=r.get("state") == "running", resume_s=r.get("seconds"), to=r.get("node"),
                   result="done" if r.get("state") == "running" else r.get("state"))
        if r.get("cell_id"):
            out["cells"].append(r["cell_id"])
    except Exception as exc:  # noqa: BLE001 - checked below
        out.update(error=f"{type(exc).__name__}: {exc}", result="failed")
    out["not_serving"] = _serving(ctl, [worker["id"]])
    out["serving"] = not out["not_serving"]
    out["ended_at"] = time.time()
    out["settle_s"] = _settle(ctl)
    say(f"  step {step.index}: suspend+resume {worker['id']} {out['from']}→{out.get('to')}: {out['result']}"
        + ("" if out["serving"] else " NOT SERVING"))
    return out


def _fragment(ctl, gpus: int, tag: str) -> list[Any]:
    """1-GPU placeholders (another tenant's reservations, never moved) on every node with all
    its GPUs free, so that no node has `gpus` free GPUs and a launch of that size needs moves."""
    import ray
    from ray.util import placement_group

    # Ray frees a stopped worker's reservation asynchronously (seen lagging seconds on a loaded
    # machine): wait until its view agrees with the records, or a node that is about to be free
    # gets no filler and the launch needs no move
    def agrees() -> bool:
        st = _status(ctl)
        held: dict[str, int] = {}
        for w in st["workers"]:
            if w.get("state") in ("running", "starting", "relocating"):
                held[w["node"]] = held.get(w["node"], 0) + int(w.get("gpus") or 0)
        return all(n["gpus_free"] == n["gpus_total"] - held.get(n["id"], 0) for n in st["nodes"]
                   if n.get("alive", True))

    waits.settle(agrees, 30, every=0.5)
    pgs = []
    for n in _status(ctl)["nodes"]:
        if n.get("alive", True) and n["gpus_free"] >= gpus:
            pg = placement_group([{"GPU": 1.0, f"relocator_node:{n['id']}": 0.001}], strategy="STRICT_PACK",
                                 name=f"chaos-filler-{tag}-{n['id']}")
            ray.get(pg.ready(), timeout=60)
            pgs.append(pg)
    return pgs


def make_room(ctl, base: Path, step: Step, worker: dict, cfg: ChaosConfig, say) -> dict[str, Any]:
    """A fragmented cluster (no node with all its GPUs free) and a launch of a node-sized
    worker: the controller's live moves seat it. With the step's fault, the first move fails:
    the plan stops, the demand stays pending, every worker serves; the demand is then dropped."""
    import ray

    fault = FAULTS[step.fault] if step.fault else None
    gpus = cfg.gpus_per_node
    out: dict[str, Any] = {"step": step.index, "kind": StepKind.MAKE_ROOM.value, "fault": step.fault,
                           "worker": f"mr{step.index}", "gpus": gpus, "started_at": time.time(), "moves": [],
                           "cells": []}
    pgs = _fragment(ctl, gpus, str(step.index))
    launched = None
    try:
        plan = ctl.launch(MODEL, gpus, worker_id=out["worker"], engine=cfg.engine, dry_run=True)["plan"]
        out["plan"] = plan
        if plan["how"] != "make_room":
            out.update(result="skipped", error=f"no make-room plan for {gpus} GPU(s): {plan['how']} {plan['reason']}")
            return out
        t = time.monotonic()
        res = ctl.launch(MODEL, gpus, worker_id=out["worker"], engine=cfg.engine,
                         faults=fault.relocate_faults() if fault else None)
        out["launch_s"] = round(time.monotonic() - t, 3)
        out["launch_state"] = res.get("state")
        out["demand_pending"] = any(d["id"] == out["worker"] for d in ctl.pending())
        launched = out["worker"]
        if res.get("cell_id"):
            out["cells"].append(res["cell_id"])
        mine = {m["worker"] for m in plan["moves"]}
        rels = [r for r in _status(ctl)["relocations"] if r["worker"] in mine and r["created_at"] >= out["started_at"]]
        out["moves"] = [{"relocation": r["id"], "worker": r["worker"], "from": r["from"], "to": r["to"],
                         "result": r["result"], "error": (r.get("error") or "")[:200]} for r in rels]
        out["relocations"] = [r["id"] for r in rels]
        if fault:  # the controller injects it into the plan's first move
            out["injected"], out["injected_at"] = bool(rels), min((r["created_at"] for r in rels), default=None)
            # the moved worker serving again after the failure: what its rollback measured
            rb = next(((r.get("rollback") or {}) for r in rels if r["result"] != "done"), {})
            out["serve_again_s"] = out["source_serving_s"] = rb.get("source_serving_s")
        out["result"] = ("done" if res.get("state") == "running" else res.get("state"))
    except Exception as exc:  # noqa: BLE001 - checked below
        out.update(error=f"{type(exc).__name__}: {exc}", result="failed")
    finally:
        for pg in pgs:
            try:
                ray.util.remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
    out["not_serving"] = _serving(ctl, [w["id"] for w in _status(ctl)["workers"] if w["id"] != out["worker"]])
    out["serving"] = not out["not_serving"]
    if launched:  # the node-sized worker (or its pending demand) goes again
        waits.settle(lambda: _stopped(ctl, launched), 120, every=1.0)
    out["ended_at"] = time.time()
    out["settle_s"] = _settle(ctl)
    say(f"  step {step.index}: make-room launch of {gpus} GPU(s) {step.fault or 'plain'}: {out['result']} "
        f"(moves {[m['result'] for m in out['moves']]})" + ("" if out["serving"] else " NOT SERVING"))
    return out


def _stopped(ctl, wid: str) -> bool:
    """Stop `wid`; False while it is being seated by the reconcile loop's retry (try again)."""
    try:
        ctl.stop_worker(wid)
    except KeyError:
        pass
    except RuntimeError:
        return False
    return True


def _settle(ctl, timeout: float = 60.0) -> float | None:
    """Until the router answers a request again (it may be restarting, or re-registering the
    workers): the next move starts on a serving cluster. Seconds waited, None if it never did."""
    t0 = time.monotonic()
    _waiting("the router to answer")

    def answers() -> bool:
        _check()
        return _post_ok(ctl.router_url, timeout=10)

    return round(time.monotonic() - t0, 3) if waits.settle(answers, timeout, every=0.2) else None


#: what each scheduling-layer step kind runs (forced moves run `one_move`)
SCHEDULING_STEPS: dict[StepKind, Callable[..., dict[str, Any]]] = {
    StepKind.SUSPEND_RESUME: suspend_resume,
    StepKind.MAKE_ROOM: make_room,
}
