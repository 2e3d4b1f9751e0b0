"""One warm image step of a chaos run (`relocator chaos --warm-faults`, relocator.warm.faults):
the warm image of a running worker's kind is damaged in its node's store (this machine's: the
loopback and emulated clusters), a worker of that kind is launched on that node under the run's
load, and its start must be cold with the fault named in its `worker_started` event, then
serve; it is stopped again after. A store full and the only holder lost need a store bound or a
lost node set up for them: they are unit-tested (tests/test_warm_faults.py), not run live.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

from relocator import waits
from relocator.choices import parse_names
from relocator.chaos.config import MODEL, ChaosConfig
from relocator.chaos.faults import Step, StepKind
from relocator.chaos.steps import _check, _serving, _stopped, _waiting
from relocator.warm import faults as F

Say = Callable[[str], None]
#: the warm faults a live run injects (the others are unit-tested only, see the module's doc)
LIVE = ("corrupt", "truncate")
FILED_WAIT_S = 120.0  # a capture is filed (hashed, signed) in the background after the launch
START_EVENT_WAIT_S = 30.0


def parse_warm_faults(spec: str | list[str] | None) -> list[str]:
    """"all", "none", "" or a comma list of LIVE's names."""
    items = [s.strip() for s in (spec.split(",") if isinstance(spec, str) else spec or []) if s.strip()]
    only = [i for i in items if i in F.WARM_FAULTS and i not in LIVE]
    why = f" ({', '.join(only)}: unit-tested only, tests/test_warm_faults.py)" if only else ""
    return parse_names(spec, list(LIVE), "warm fault", why=why)


def _started(ctl: Any, worker_id: str, since: int = 0) -> dict | None:
    """The `worker_started` event of `worker_id` (how its start went), None if there is none."""
    for ev in ctl.events(since=since, kinds=["worker_started"], idle_timeout=0):
        if ev.get("worker") == worker_id:
            return ev
    return None


def _store(base: Path, node: str):
    from relocator.warm.roots import open_cluster_store

    return open_cluster_store(base, node)


def warm_step(ctl: Any, base: Path, step: Step, worker: dict, cfg: ChaosConfig, say: Say) -> dict[str, Any]:
    """Damage the image of `worker`'s kind on its node, launch one more of that kind there, check
    how it started and that it serves, stop it."""
    fault = F.WARM_FAULTS[step.warm or ""]
    node = worker["node"]
    rec: dict[str, Any] = {"step": step.index, "kind": StepKind.WARM.value, "fault": None, "warm": fault.name,
                           "worker": worker["id"], "node": node, "started_at": time.time(), "injected": False}
    launched = None
    try:
        first = _started(ctl, worker["id"])
        key = (first or {}).get("key")
        if not key:
            raise RuntimeError(f"no warm image key for {worker['id']} (its worker_started event: {first})")
        store = _store(base, node)
        _waiting(f"the warm image {key} filed on {node}")
        if not waits.settle(lambda: _check() or store.path_of(key).is_dir(), FILED_WAIT_S, every=1.0):
            raise RuntimeError(f"{node}'s store never held {key} (its capture: {(first or {}).get('capture')})")
        rec["detail"] = getattr(F, fault.name)(store.path_of(key))
        rec.update(injected=True, injected_at=time.time())
        cursor = max([e["seq"] for e in ctl.events(since=0, kinds=["worker_started"], idle_timeout=0)] or [0])
        _waiting(f"a launch of {MODEL} on {node} after the {fault.name} fault")
        w = ctl.launch(MODEL, gpus=cfg.gpus, node=node, engine=cfg.engine, make_room=False)
        launched = w["id"]
        rec.update(launched=launched, cells=[w["cell_id"]] if w.get("cell_id") else [])
        ev = waits.settle(lambda: _check() or _started(ctl, launched, cursor), START_EVENT_WAIT_S, every=0.5)
        rec["start"] = {k: (ev or {}).get(k) for k in ("how", "key", "reason", "seconds")}
        rec["problems"] = F.check_start(fault, ev, None if w.get("state") == "running" else f"the launch is {w}")
        rec["not_serving"] = _serving(ctl)  # the new worker and every other one
        rec["serving"] = not rec["not_serving"]
    except Exception as exc:  # noqa: BLE001 - the step's outcome says it
        rec["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if launched:
            waits.settle(lambda: _stopped(ctl, launched), 120, every=1.0)
    rec["ended_at"] = time.time()
    rec["result"] = "done" if not rec.get("error") and not rec.get("problems") else "failed"
    say(f"  step {step.index}: warm image {fault.name} on {node}: start {rec.get('start', {}).get('how')} "
        f"({(rec.get('start', {}).get('reason') or rec.get('error') or '')[:100]})")
    return rec
