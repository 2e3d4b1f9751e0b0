"""The controller's state managers, each built on fakes (a store on disk, fake agents, a fixed
node table, an event sink): no Ray, no threads of their own."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from relocator.controller.claims import Claims
from relocator.controller.inventory import NodeInfo
from relocator.controller.model import Demand, DemandKind, Relocation, SuspendReason, WorkerRecord, WorkerState
from relocator.controller.states import BadTransition, transition
from relocator.controller.store import Store

S = WorkerState


class Agents:
    """Fake agents: every call recorded; answers set per test."""

    def __init__(self, cell_state: str = "running") -> None:
        self.calls: list[tuple] = []
        self.state = cell_state

    def call(self, node: str, method: str, *args: Any, **kw: Any) -> Any:
        self.calls.append((method, node, *args))
        return {"cell_state": self.state, "gpus": [], "cells": [],
                "launch": {"endpoint": f"http://{node}", "ready_s": 0.1}}.get(method)

    def cell_state(self, node: str, cell: str) -> str:
        return self.state

    @property
    def agents(self) -> "TypedAgents":  # the backend's typed agent client
        return TypedAgents(self)

    def reserve(self, w: WorkerRecord, node: str, name: str, timeout: float = 15.0) -> list[int]:
        self.calls.append(("reserve", node, name))
        return [0]

    def dump(self, node: str, cell: str, image: str) -> dict:
        self.calls.append(("dump", node, cell))
        return {"bytes": 7}

    def __getattr__(self, name: str):
        return lambda *a, **k: self.calls.append((name, *a))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


class TypedAgents:
    """RayBackend.agents' methods over the fake's recorded `call`."""

    def __init__(self, fake: Agents) -> None:
        self.fake = fake

    def gpus(self, node: str, timeout: float = 30) -> Any:
        return self.fake.call(node, "gpus")

    def cells(self, node: str, timeout: float = 60) -> Any:
        return self.fake.call(node, "cells")

    def kill_all(self, node: str, timeout: float = 120) -> Any:
        return self.fake.call(node, "kill_all")

    def cell_state(self, node: str, cell_id: str, timeout: float = 600) -> Any:
        return self.fake.call(node, "cell_state", cell_id)

    def compatible(self, node: str, fingerprint: dict, launch: dict | None = None, engine: str | None = None,
                   timeout: float = 60) -> Any:
        return self.fake.call(node, "compatible", fingerprint)

    def launch(self, node: str, cell_id: str, model_dir: str, served_name: str, timeout: float = 600,
               **kw: Any) -> Any:
        return self.fake.call(node, "launch", cell_id, model_dir, served_name, **kw)


class Events(list):
    def __call__(self, kind: Any, **fields: Any) -> None:
        self.append((str(kind), fields))

    def kinds(self) -> list[str]:
        return [k for k, _ in self]


def worker(wid: str = "w1", node: str = "n1", gpus: int = 1, state: str = "running", **kw: Any) -> WorkerRecord:
    return WorkerRecord(id=wid, model="m", node=node, gpus=gpus, cell_id=f"{wid}-c", reservation=f"relocator-{wid}",
                        state=state, endpoint=f"http://{node}/{wid}", **kw)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "controller.db")


# -- states ----------------------------------------------------------------------------------
def test_a_stored_state_comes_back_as_the_enum_and_edges_are_checked(store: Store) -> None:
    store.save_worker(worker(state="running"))
    w = store.worker("w1")
    assert w.state is S.RUNNING
    ev = Events()
    transition(w, S.SUSPENDING, "a test", ev)
    assert w.state is S.SUSPENDING and ev == [("worker_state", {"worker": "w1", "node": "n1", "from": "running",
                                                               "to": "suspending", "why": "a test"})]
    with pytest.raises(BadTransition, match="suspending -> starting"):
        transition(w, S.STARTING, "never")
    assert w.state is S.SUSPENDING
    with pytest.raises(ValueError):
        WorkerRecord.from_dict({**w.to_dict(), "state": "dancing"})


# -- nodes -------------------------------------------------------------------------------------
def test_nodes_a_lost_node_is_announced_once_and_its_cells_fenced_as_they_appear(store: Store, tmp_path: Path) -> None:
    from relocator.controller.nodes import NodeManager

    table = {"n1": NodeInfo("n1", "r1", 4, 4), "n2": NodeInfo("n2", "r2", 4, 4, alive=False)}
    agents, ev, claims = Agents(), Events(), Claims()
    fenced: list[list[str]] = []

    def fence(node: str, cells: list[str]) -> dict:  # kills and removes them, one from another boot
        fenced.append(cells)
        for c in cells:
            if c != "w8-old":
                (tmp_path / node / "state" / "cells" / c).rmdir()
        return {"killed": [c for c in cells if c != "w8-old"], "unreachable": [c for c in cells if c == "w8-old"]}

    agents.fence = fence
    pgs = [{"name": "relocator-w1", "state": "CREATED"}, {"name": "relocator-old", "state": "CREATED"},
           {"name": "other", "state": "CREATED"}]
    store.save_worker(worker("w1", "n1"))
    nodes = NodeManager(store, agents, claims, ev, lambda n: tmp_path / n, list_nodes=lambda known, named: table,
                        placement_groups=lambda: pgs)
    cells = tmp_path / "n2" / "state" / "cells"
    for c in ("w5-x1", "w8-old"):
        (cells / c).mkdir(parents=True)
    nodes.update()
    nodes.update()
    assert ev.kinds() == ["node_lost"] and claims.wake.is_set()
    assert fenced == [["w5-x1", "w8-old"]]  # once each, however many rounds
    # its agent outlived its raylet and went on with a start: the cell appears after the fence
    (cells / "w6-r1").mkdir()
    nodes.update()
    assert fenced == [["w5-x1", "w8-old"], ["w6-r1"]]
    assert agents.names().count("gpus") == 1  # the live node's report is kept with its record
    assert store.get("node", "r1")["gpus"] == []
    nodes.update_reservations()
    assert [c for c in agents.calls if c[0] == "free"] == [("free", "relocator-old")]
    nodes.cordon("n1", 0.0)
    with pytest.raises(ValueError, match="cordoned"):
        nodes.check_target("n1")
    with pytest.raises(ValueError, match="'n2' is lost"):
        nodes.check_target("n2")


# -- workers -----------------------------------------------------------------------------------
def _workers(store: Store, agents: Agents, ev: Events, place: Any = lambda gpus: "n2") -> Any:
    from relocator.controller.workers import WorkerManager

    spawned: list = []
    router = type("R", (), {"remove_replica": lambda self, w: None, "add_replica": lambda self, *a: None})()
    m = WorkerManager(store, agents, Claims(), ev, lambda: router, place,
                      spawn=lambda fn, w, name: spawned.append((fn, w)))
    return m, spawned


def test_workers_a_gone_cell_is_lost_then_replaced(store: Store) -> None:
    store.save_worker(worker())
    agents, ev = Agents(cell_state="absent"), Events()
    m, spawned = _workers(store, agents, ev)
    m.update()
    assert store.worker("w1").state is S.LOST and "gone" in store.worker("w1").error
    assert [w.id for _, w in spawned] == ["w1"] and "w1" in m.claims.busy
    fn, w = spawned[0]
    fn(w)  # the replacement thread's body
    got = store.worker("w1")
    assert (got.state, got.node, got.replacements) == (S.RUNNING, "n2", 1)
    assert "w1" not in m.claims.busy
    assert [f["to"] for k, f in ev if k == "worker_state"] == ["lost", "replacing", "running"]
    assert ev.kinds()[-1] == "replacement_finished" and ev[-1][1]["ok"] is True


def test_workers_a_replacement_with_no_room_fails_the_worker(store: Store) -> None:
    store.save_worker(worker(state="lost"))
    ev = Events()
    m, _ = _workers(store, Agents(), ev, place=lambda gpus: None)
    m.claims.busy.add("w1")
    m.replace(store.worker("w1"))
    assert store.worker("w1").state is S.FAILED and "no live node" in store.worker("w1").error
    assert ev[-1][1]["ok"] is False and not m.claims.busy


# -- demands -----------------------------------------------------------------------------------
def _demands(store: Store, nodes: dict[str, NodeInfo], ev: Events) -> Any:
    from relocator.controller.demands import DemandManager

    spawned: list = []
    m = DemandManager(store, Claims(), ev, lambda refresh=False: nodes, lambda: set(), "best-fit", 4,
                      spawn=lambda fn, todo: spawned.append(todo))
    return m, spawned


def test_demands_queue_once_retry_when_capacity_changes_cancel_refused_while_placing(store: Store) -> None:
    nodes = {"n1": NodeInfo("n1", "r1", 2, 0)}
    ev = Events()
    m, spawned = _demands(store, nodes, ev)
    d = Demand(id="w9", kind=DemandKind.LAUNCH, model="m", gpus=2)
    assert m.seat(d)["state"] == "pending"
    assert m.seat(store.demand("w9"))["state"] == "pending"
    assert ev.kinds() == ["demand_pending"] and store.demand("w9").attempts == 2
    m.update()
    m.update()  # nothing changed: not retried again
    assert len(spawned) == 1
    m._retrying.clear()
    nodes["n1"] = NodeInfo("n1", "r1", 2, 2)  # capacity came back
    m.update()
    assert len(spawned) == 2
    m.claims.placing.add("w9")
    with pytest.raises(RuntimeError, match="being placed"):
        m.cancel("w9")
    m.claims.placing.clear()
    assert m.cancel("w9") == {"id": "w9", "cancelled": True} and store.demand("w9") is None


def test_demands_preempt_a_lower_priority_worker_through_the_seaters(store: Store) -> None:
    from relocator.controller.demands import Seaters

    store.save_worker(worker("low", "n1", 2, priority=0))
    ev = Events()
    m, _ = _demands(store, {"n1": NodeInfo("n1", "r1", 2, 0)}, ev)
    done: list = []

    def suspend(wid: str, reason: str, by: str) -> dict:
        done.append((wid, str(reason), by))
        w = store.worker(wid)
        w.state, w.node, w.reservation = S.SUSPENDED, "", ""
        store.save_worker(w)
        return {}

    m.seaters = Seaters(claim=lambda d, node, timeout: worker(d.id, node, d.gpus, state="starting"),
                        start=lambda w, d, t0, extra: {"id": w.id, "node": w.node, **extra},
                        claim_resume=None, restore=None, suspend=suspend, run_moves=lambda moves, faults=None: [])
    out = m.seat(Demand(id="hi", kind=DemandKind.LAUNCH, model="m", gpus=2, priority=5))
    assert done == [("low", "preempted", "hi")]
    assert (out["id"], out["node"], out["suspended"]) == ("hi", "n1", ["low"])
    assert "room_planned" in ev.kinds()


# -- suspensions -------------------------------------------------------------------------------
def _suspensions(store: Store, agents: Agents, ev: Events, tmp_path: Path) -> Any:
    from relocator.controller.model import TransferMode
    from relocator.controller.suspensions import SuspensionManager

    queued: list = []
    router = type("R", (), {"remove_replica": lambda self, w: None})()
    m = SuspensionManager(store, agents, Claims(), ev, lambda: router, lambda n: tmp_path / n,
                          lambda d, reason: queued.append((d.id, d.kind, reason)), TransferMode.SHARED)
    return m, queued


def test_suspensions_a_preempted_worker_is_suspended_and_requeued(store: Store, tmp_path: Path) -> None:
    store.save_worker(worker())
    agents, ev = Agents(), Events()
    m, queued = _suspensions(store, agents, ev, tmp_path)
    out = m.suspend("w1", reason=SuspendReason.PREEMPTED, by="x")
    w = store.worker("w1")
    assert (w.state, w.node, w.reservation, w.suspend_reason) == (S.SUSPENDED, "", "", "preempted")
    assert out["image_bytes"] == 7 and ("free", "relocator-w1") in agents.calls
    assert queued == [("w1", DemandKind.RESUME, "suspended (preempted by x)")]
    assert not m.claims.busy
    with pytest.raises(RuntimeError, match="not running"):
        m.suspend("w1")


def test_suspensions_an_interrupted_resume_is_undone_and_requeued(store: Store, tmp_path: Path) -> None:
    store.save_worker(worker(state="resuming", image="/img", image_node="n1", suspend_reason="preempted"))
    agents, ev = Agents(), Events()
    m, queued = _suspensions(store, agents, ev, tmp_path)
    m.recover(store.worker("w1"))
    w = store.worker("w1")
    assert (w.state, w.node, w.cell_id, w.image) == (S.SUSPENDED, "", "", "/img")
    assert {"kill", "free"} <= set(agents.names())
    assert queued == [("w1", DemandKind.RESUME, "requeued by a controller restart")]


# -- relocations and drains ----------------------------------------------------------------------
class Machine:
    """Runs a relocation at once: done, the worker on its target."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def run(self, rel: Relocation) -> None:
        rel.result, rel.dst = "done", rel.dst or "n2"
        self.store.save_relocation(rel)


def test_relocations_moves_run_and_a_busy_worker_is_refused(store: Store) -> None:
    from relocator.controller.relocations import RelocationManager
    from relocator.controller.scheduling import MovePlan

    store.save_worker(worker())
    nodes = {n: NodeInfo(n, n, 4, 4) for n in ("n1", "n2")}
    m = RelocationManager(store, Machine(store), Claims(), Events(), lambda refresh=False: nodes,
                          lambda node, nodes=None: None, lambda: ([], []), "shared")
    m.spawn = lambda rel, recover=False: m._body(rel, recover)  # on this thread
    out = m.run_moves([MovePlan("w1", "n1", "n2", 1)])
    assert [(r["worker"], r["result"], r["blackout_s"]) for r in out] == [("w1", "done", 0.0)]
    assert not m.claims.busy
    m.claims.busy.add("w1")
    with pytest.raises(RuntimeError, match="already being relocated"):
        m.relocate("w1", to="n2")


def test_drain_without_a_deadline_refuses_when_a_worker_fits_nowhere(store: Store) -> None:
    from relocator.controller.drain import DrainManager
    from relocator.controller.scheduling import NodeView

    store.save_worker(worker("big", "n1", 3))
    view = [NodeView("n1", 4, 1), NodeView("n2", 4, 2)]
    moved: list = []
    d = DrainManager(store, lambda: {"n1": None, "n2": None}, lambda: view, lambda n, t: None, "best-fit",
                     relocate=lambda *a, **k: moved.append(a), suspend=lambda *a, **k: moved.append(a))
    with pytest.raises(RuntimeError, match="no room for big"):
        d.drain("n1")
    assert moved == []
    assert d.plan("n1", deadline=1.0) == ([], ["big"])  # with a deadline: set aside instead


# -- the facade -----------------------------------------------------------------------------------
def test_reconcile_once_runs_every_step_in_order_and_catches_a_failing_one(tmp_path: Path) -> None:
    from relocator.controller.controller import Controller

    c = Controller.without_ray({"base_dir": tmp_path}, Agents(), Events(), {"n1": NodeInfo("n1", "n1", 4, 4)})
    c.nodes.update_cells = lambda: (_ for _ in ()).throw(RuntimeError("agent down"))
    stats = c.reconcile_once()
    names = [k for k in stats if k != "at"]
    assert names == ["update_nodes", "update_workers", "update_router", "update_reservations", "update_cells",
                     "update_deadlines", "update_paused", "update_demands", "update_consolidation",
                     "update_policies", "update_warm_copies"]
    assert stats["update_cells"] == {"ok": False, "s": stats["update_cells"]["s"], "error": "agent down"}
    assert all(stats[n]["ok"] for n in names if n != "update_cells")
    assert isinstance(c.claims.lock, type(threading.RLock()))
    c.store.save_worker(worker())
    st = c.status()  # the same shape as before the split
    assert [(w["id"], w["state"], w["cell"], w["preemptible"]) for w in st["workers"]] == [("w1", "running", "w1-c",
                                                                                         False)]
    assert set(st["workers"][0]) == {
        "id", "model", "node", "state", "endpoint", "gpus", "gpu_ids", "cell", "reservation", "replacements",
        "last_image", "priority", "time_limit_s", "deadline", "image", "suspend_reason", "suspended_at", "suspensions",
        "preemptible", "suspend_failures", "suspend_retry_at", "suspend_error", "error"}
    assert set(st) >= {"nodes", "workers", "pending", "cordoned", "relocations", "controller", "metrics", "events"}


def test_the_config_is_validated_and_still_read_by_name(tmp_path: Path) -> None:
    from relocator.controller.config import ControllerConfig

    c = ControllerConfig.of({"base_dir": str(tmp_path), "transfer": "stream", "transient_images": "disk",
                             "credentials": {"n1": {"key": "k"}}, "later": 1})
    assert c.base_dir == tmp_path and c.transfer == "stream" and c.make_room_max_moves == 4
    assert (c.get("transient_images"), c.get("later"), c.get("absent", 5)) == ("disk", 1, 5)
    assert c.credentials_of("n1") == {"key": "k"} and c.credentials_of("n2") is None
    with pytest.raises(ValueError, match="transfer"):
        ControllerConfig.of({"base_dir": str(tmp_path), "transfer": "rsync"})
