"""The preemption rules (relocator.controller.preemption): each rule's decision on a fake
inventory (pure), and how a seating's victims are set aside (fake agents, a real store)."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from relocator.controller.claims import Claims
from relocator.controller.inventory import NodeInfo
from relocator.controller.model import Demand, DemandKind, WorkerState
from relocator.controller.preemption import InPlace, PreemptionRule, SetAside, kept, plan
from relocator.controller.scheduling import NodeView, Seat
from relocator.controller.store import Store
from tests.test_controller_managers import Agents, Events, worker

R = PreemptionRule
S = WorkerState
#: the bench's fragmented start: one 1-GPU worker on each node, no node has 4 free
NODES = [NodeView("n1", 4, 3), NodeView("n2", 4, 3), NodeView("n3", 4, 3)]
SEATS = [Seat("b1", "n1", 1), Seat("b2", "n2", 1), Seat("b3", "n3", 1)]


@pytest.mark.parametrize("rule", list(R))
def test_a_demand_that_fits_goes_where_it_fits_under_every_rule(rule: R) -> None:
    s = plan(rule, NODES, SEATS, 2, priority=0)
    assert s.node in {"n1", "n2", "n3"} and s.moves == [] and s.suspends == []
    assert plan(rule, NODES, SEATS, 5, priority=9).node is None  # bigger than any node: waits under all


def test_place_or_wait_never_moves_nor_preempts() -> None:
    s = plan(R.PLACE_OR_WAIT, NODES, SEATS, 4, priority=9)
    assert s.node is None and s.moves == [] and s.suspends == [] and "place-or-wait" in s.reason
    expired = [Seat(x.worker, x.node, 1, expired=True) for x in SEATS]
    assert plan(R.PLACE_OR_WAIT, NODES, expired, 4, priority=0).node is None  # not even past a time limit


@pytest.mark.parametrize("rule", [R.EVICT_REQUEUE, R.SUSPEND_IN_PLACE])
def test_stock_preemption_takes_the_fewest_lower_priorities_and_never_moves(rule: R) -> None:
    s = plan(rule, NODES, SEATS, 4, priority=1)
    assert s.node is not None and s.moves == [] and s.suspends == [f"b{s.node[1]}"] and s.how == "preempt"
    # same priority, within its limit: nobody may be taken; it waits
    assert plan(rule, NODES, SEATS, 4, priority=0).node is None
    # past its time limit: any demand may take it (the one past its limit, not another)
    seats = [SEATS[0], Seat("b2", "n2", 1, expired=True), SEATS[2]]
    assert plan(rule, NODES, seats, 4, priority=0).suspends == ["b2"]
    # a busy (not movable) worker is never a victim
    busy = [Seat(x.worker, x.node, 1, priority=0, movable=False) for x in SEATS]
    assert plan(rule, NODES, busy, 4, priority=1).node is None


def test_moves_makes_room_first_and_preempts_only_when_moves_cannot() -> None:
    s = plan(R.MOVES, NODES, SEATS, 4, priority=1)
    assert s.how == "make_room" and len(s.moves) == 1 and s.suspends == []
    full = [NodeView("n1", 4, 2), NodeView("n2", 4, 0)]
    seats = [Seat("lo", "n1", 2), Seat("x", "n2", 4, priority=3)]
    s = plan(R.MOVES, full, seats, 4, priority=1)
    assert (s.node, s.suspends, s.moves) == ("n1", ["lo"], [])
    assert plan(R.MOVES, NODES, SEATS, 4, priority=1, max_moves=0).how == "preempt"


def test_an_unknown_rule_is_refused_with_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid: place-or-wait, evict-requeue, suspend-in-place, moves"):
        plan("preempt-all", NODES, SEATS, 4, priority=1)


def test_the_rule_is_a_validated_controller_setting(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from relocator.cluster.config import LocalConfig
    from relocator.controller.config import ControllerConfig

    assert LocalConfig.load(None).controller.preemption is R.MOVES
    cfg = LocalConfig.load(None, controller={"preemption": "evict-requeue"})
    assert ControllerConfig.of({"base_dir": tmp_path, **cfg.controller.model_dump()}).preemption is R.EVICT_REQUEUE
    with pytest.raises(ValidationError):
        LocalConfig.load(None, controller={"preemption": "cancel"})


# -- carrying a seating out ---------------------------------------------------------------------
class Router:
    def __init__(self) -> None:
        self.removed: list[str] = []

    def remove_replica(self, wid: str) -> dict:
        self.removed.append(wid)
        return {}


class SignalAgents(Agents):
    """The fake agents, with the agent's `signal` (SIGSTOP / SIGCONT of a cell)."""

    @property
    def agents(self) -> Any:
        fake = self

        class Typed:
            def signal(self, node: str, cell: str, sig: int) -> None:
                fake.calls.append(("signal", node, cell, sig))

        return Typed()


def _set_aside(rule: R, store: Store, agents: Agents, ev: Events, free: dict[str, int] | None = None) -> Any:
    queued: list[tuple[Demand, str]] = []
    router = Router()
    sa = SetAside(rule, store, agents, Claims(), ev, lambda: router, lambda d, why: queued.append((d, why)) or {},
                  suspend=lambda wid, reason, by: {"suspended": wid}, free_gpus=lambda: dict(free or {}))
    return sa, queued, router


def test_evict_requeue_kills_the_victim_and_requeues_it_as_a_launch(tmp_path: Path) -> None:
    store, agents, ev = Store(tmp_path / "c.db"), Agents(), Events()
    store.save_worker(worker("lo", "n1", 2, priority=0, time_limit_s=30.0, model_dir="/m"))
    sa, queued, router = _set_aside(R.EVICT_REQUEUE, store, agents, ev)
    out = sa("lo", reason="preempted", by="hi")
    assert (out["worker"], out["by"]) == ("lo", "hi") and store.worker("lo") is None
    assert router.removed == ["lo"] and ("kill", "n1", "lo-c") in agents.calls and ("free", "relocator-lo") in agents.calls
    ((d, why),) = queued
    assert (d.id, d.kind, d.gpus, d.priority, d.time_limit_s, d.model_dir) == ("lo", DemandKind.LAUNCH, 2, 0, 30.0, "/m")
    assert "evicted" in why and "worker_evicted" in ev.kinds() and not sa.claims.busy
    with pytest.raises(RuntimeError, match="gone"):
        sa("lo")


def test_moves_sets_victims_aside_by_suspending_them(tmp_path: Path) -> None:
    sa, queued, _ = _set_aside(R.MOVES, Store(tmp_path / "c.db"), Agents(), Events())
    assert sa("lo", reason="preempted", by="hi") == {"suspended": "lo"} and queued == []


def test_suspend_in_place_pauses_keeps_its_gpus_and_continues_on_its_node(tmp_path: Path) -> None:
    store, agents, ev = Store(tmp_path / "c.db"), SignalAgents(), Events()
    w = worker("lo", "n1", 2, priority=0)
    w.deadline = time.time() + 10
    store.save_worker(w)
    free = {"n1": 0}
    sa, queued, router = _set_aside(R.SUSPEND_IN_PLACE, store, agents, ev, free)
    sa.in_place.free_gpus = lambda: dict(free)
    out = sa("lo", reason="preempted", by="hi")
    p = store.worker("lo")
    assert out["in_place"] and p.state == S.PAUSED and p.node == "n1" and p.cell_id == "lo-c" and p.reservation == ""
    assert ("signal", "n1", "lo-c", int(signal.SIGSTOP)) in agents.calls
    assert not any(c[0] in ("hold", "release") for c in agents.calls)  # its streams stall, are not cut
    assert ("free", "relocator-lo") in agents.calls and queued == [] and router.removed == []
    assert kept(store.workers()) == {"n1": 2}  # no demand is seated on its GPUs meanwhile
    sa.in_place.update()  # its GPUs are lent: it stays paused
    assert store.worker("lo").state == S.PAUSED and not any(c[0] == "reserve" for c in agents.calls)
    free["n1"] = 2
    sa.in_place.update()
    r = store.worker("lo")
    assert r.state == S.RUNNING and r.node == "n1" and r.reservation.startswith("relocator-lo-p")
    assert ("signal", "n1", "lo-c", int(signal.SIGCONT)) in agents.calls
    assert r.deadline > w.deadline  # time stopped did not count toward its limit
    assert "worker_resumed" in ev.kinds() and kept(store.workers()) == {}


def test_a_paused_workers_gpus_are_not_planned_for_anyone_else(tmp_path: Path) -> None:
    from relocator.controller.demands import DemandManager

    store = Store(tmp_path / "c.db")
    p = worker("lo", "n1", 2, state="running")
    p.state, p.reservation = S.PAUSED, ""
    store.save_worker(p)
    nodes = {"n1": NodeInfo("n1", "r1", 4, 4)}  # Ray: all four free (the preemptor left)
    m = DemandManager(store, Claims(), Events(), lambda refresh=False: nodes, lambda: set(), "best-fit", 4,
                      rule=R.SUSPEND_IN_PLACE)
    (view,), seats = m.view()
    assert view.gpus_free == 2 and seats == []
    d = Demand(id="new", kind=DemandKind.LAUNCH, model="m", gpus=4)
    assert m.plan_seating(d, make_room=True).node is None
    assert m.plan_seating(Demand(id="s", kind=DemandKind.LAUNCH, model="m", gpus=2), make_room=True).node == "n1"
