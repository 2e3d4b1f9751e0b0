"""A pending demand the reconcile loop seats starts on a thread of its own: the next pending
demand (on other GPUs) is planned at once, not after the first one's start (relocator.controller
.demands._retry; the scheduling bench's 4-GPU launch waited behind a 2-GPU launch's start)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from relocator.controller.claims import Claims
from relocator.controller.demands import DemandManager, Seaters
from relocator.controller.inventory import NodeInfo
from relocator.controller.model import Demand, DemandKind, DemandState, WorkerRecord
from relocator.controller.store import Store


def _manager(tmp_path: Path, fail: set[str] = frozenset()) -> tuple[DemandManager, list, list, Store]:
    store = Store(tmp_path / "controller.db")
    nodes = {"n1": NodeInfo("n1", "r1", 4, 2), "n2": NodeInfo("n2", "r2", 4, 4)}
    jobs: list = []  # what the manager spawned, run by the test when it chooses
    started: list[str] = []
    m = DemandManager(store, Claims(), lambda *a, **k: None, lambda refresh=False: nodes, lambda: set(),
                      "best-fit", 0, spawn=lambda fn, arg: jobs.append((fn, arg)))

    def claim(d: Demand, node: str, timeout: float) -> WorkerRecord:
        w = WorkerRecord(id=d.id, model="m", node=node, gpus=d.gpus, cell_id=f"{d.id}-c",
                         reservation=f"relocator-{d.id}", state="starting")
        store.save_worker(w)  # its GPUs are held from the claim on (the view counts them)
        return w

    def start(w: WorkerRecord, d: Demand, t0: float, extra: dict) -> dict[str, Any]:
        if d.id in fail:
            store.delete_worker(d.id)
            store.delete_demand(d.id)
            raise RuntimeError(f"launch of {d.id} failed")
        started.append(d.id)
        store.delete_demand(d.id)
        return {"id": w.id, "node": w.node}

    m.seaters = Seaters(claim=claim, start=start, claim_resume=None, restore=None, suspend=None,
                        run_moves=lambda moves, faults=None: [])
    for wid, gpus, since in (("big", 4, 1.0), ("small", 2, 2.0)):
        store.save_demand(Demand(id=wid, kind=DemandKind.LAUNCH, model="m", gpus=gpus, since=since,
                                 state=DemandState.PENDING))
    return m, jobs, started, store


def test_the_next_demand_is_planned_while_the_first_one_starts(tmp_path: Path) -> None:
    m, jobs, started, store = _manager(tmp_path)
    m._retry(store.demands())
    # the 4-GPU demand (oldest) is claimed on n2 and its start handed to a thread: not run yet
    assert [j[1][0] for j in jobs] == ["big"] and started == [] and "big" in m.claims.placing, (jobs, started)
    assert store.worker("big").node == "n2"
    m._retry([d for d in store.demands() if d.id not in m.claims.placing])
    assert [j[1][0] for j in jobs] == ["big", "small"], f"the second demand waited for the first's start: {jobs}"
    assert store.worker("small").node == "n1", store.worker("small")
    for fn, arg in jobs:
        fn(arg)
    assert started == ["big", "small"] and store.demands() == [], (started, store.demands())
    assert m.claims.wake.is_set(), "a finished start must wake the loop to plan again"


def test_a_failed_start_is_logged_and_the_loop_plans_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    m, jobs, started, store = _manager(tmp_path, fail={"big"})
    m._retry(store.demands())
    m.claims.wake.clear()
    fn, arg = jobs[0]
    fn(arg)  # raises inside: never out of the thread
    assert "launch of big failed" in caplog.text, caplog.text
    assert m.claims.wake.is_set() and store.worker("big") is None, store.workers()
