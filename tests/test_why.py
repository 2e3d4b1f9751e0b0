"""`relocator why`: the pure explainer (relocator/controller/why.py) on hand-built inventories,
and the scheduling view's real plans (controller/scheduling.py) as its plan function."""

from __future__ import annotations

import pytest

from relocator.controller import scheduling
from relocator.controller.why import (Ask, BlackoutRates, Cause, NodeSnap, NodeState, explain, never_fits,
                                      plan_cost)

GIB = 1 << 30


def no_plan(reason: str = "nothing to move"):
    return lambda ask: {"node": None, "how": "pending", "moves": [], "suspends": [], "reason": reason}


def planner_of(nodes: list[NodeSnap], seats: list[scheduling.Seat]):
    """The controller's make-room planner on the same inventory (whole GPUs)."""
    views = [scheduling.NodeView(n.id, n.gpus_total or 0, n.whole_free, cordoned=n.state is NodeState.CORDONED)
             for n in nodes if n.state in (NodeState.READY, NodeState.CORDONED)]
    return lambda ask: scheduling.make_room(views, seats, int(ask.gpus), max_moves=4).to_dict()


def three_nodes(states=(NodeState.READY,) * 3, free=(2, 2, 2)):
    return [NodeSnap.whole(f"n{i + 1}", 4, f, s) for i, (s, f) in enumerate(zip(states, free))]


def test_more_gpus_than_any_node_never_fits():
    nodes = three_nodes()
    e = explain(Ask("d1", 8), nodes, [], no_plan())
    assert e.cause is Cause.NEVER_FITS
    assert "largest node" in e.line and "4" in e.line
    assert e.checks[0].name == "fits_at_all" and not e.checks[0].ok
    assert never_fits(8, nodes) is not None
    assert never_fits(4, nodes) is None
    assert never_fits(0.5, nodes) is None
    assert never_fits(0.5, [NodeSnap.whole("c1", 0, 0)]) is not None  # a CPU-only node: no GPU at all


def test_a_lost_node_of_unknown_size_keeps_never_open():
    nodes = three_nodes() + [NodeSnap("n9", None, (), NodeState.LOST, since=12.0)]
    assert never_fits(8, nodes) is None
    e = explain(Ask("d1", 8), nodes, [], no_plan())
    assert e.cause is Cause.NODES  # the lost node may have been the big one
    assert e.checks[0].ok and "unknown size" in e.checks[0].line
    lost = e.checks[1].evidence["unavailable"]
    assert lost == [{"id": "n9", "state": "lost", "gpus_total": None, "since": 12.0}]
    assert never_fits(8, []) is None  # nothing known yet: not refused


def test_only_cordoned_or_unregistered_nodes_are_big_enough():
    nodes = [NodeSnap.whole("n1", 2, 2), NodeSnap.whole("n2", 8, 8, NodeState.CORDONED),
             NodeSnap.whole("n3", 8, 8, NodeState.UNREGISTERED)]
    e = explain(Ask("d1", 4), nodes, [], no_plan())
    assert e.cause is Cause.NODES
    assert "no ready node" in e.line and "n2 (cordoned)" in e.line and "n3 (unregistered)" in e.line


def test_fits_now_on_a_cordoned_node_only():
    nodes = three_nodes((NodeState.READY, NodeState.CORDONED, NodeState.READY), (1, 4, 1))
    e = explain(Ask("d1", 3), nodes, [], no_plan())
    assert e.cause is Cause.NODES
    assert e.checks[1].evidence["would_fit_on"] == ["n2"]


def test_priority_names_the_demands_ahead_that_are_seated_first():
    nodes = three_nodes(free=(4, 0, 0))
    mine = Ask("low", 4, priority=0, since=100.0)
    high = Ask("high", 4, priority=5, since=200.0)
    older = Ask("older", 4, priority=0, since=50.0)
    younger = Ask("younger", 4, priority=0, since=300.0)
    e = explain(mine, nodes, [mine, high, older, younger], planner_of(nodes, []))
    assert e.cause is Cause.PRIORITY
    ahead = e.checks[2].evidence["ahead"]
    assert [r["id"] for r in ahead] == ["high", "older"]  # the younger one of equal priority is behind
    assert all(r["seatable"] and r["node"] == "n1" for r in ahead)
    assert "high (priority 5" in e.line


def test_demands_ahead_that_cannot_be_seated_do_not_hold_it_back():
    nodes = three_nodes(free=(2, 2, 0))
    mine = Ask("mine", 2, since=10.0)
    big = Ask("big", 4, priority=9, since=1.0)
    e = explain(mine, nodes, [mine, big], lambda a: {"node": None if a.id == "big" else "n1", "how": "fits",
                                                     "moves": [], "suspends": [], "reason": ""})
    assert e.checks[2].ok and e.checks[2].evidence["ahead"][0]["seatable"] is False
    assert e.cause is Cause.FITS_NOW


def test_fragmentation_shows_the_free_map_and_the_plan_with_its_cost():
    # 2 free GPUs on each of three 4-GPU nodes; a 4-GPU demand: fragmentation, one 2-GPU worker
    # moved off one node seats it
    nodes = three_nodes(free=(2, 2, 2))
    seats = [scheduling.Seat("w1", "n1", 2, bytes=3 * GIB), scheduling.Seat("w2", "n2", 2, bytes=1 * GIB),
             scheduling.Seat("w3", "n3", 2, bytes=2 * GIB)]
    e = explain(Ask("d4", 4), nodes, [], planner_of(nodes, seats))
    assert e.cause is Cause.FRAGMENTATION
    assert [c.ok for c in e.checks] == [True, True, True, False]
    d = e.to_dict()
    assert d["free"] == {"n1": [1.0, 1.0, 0.0, 0.0], "n2": [1.0, 1.0, 0.0, 0.0], "n3": [1.0, 1.0, 0.0, 0.0]}
    assert d["checks"][3]["evidence"]["free_gpus"] == 6 and d["checks"][3]["evidence"]["largest_free"] == 2
    plan = d["plan"]
    assert plan["node"] is not None and plan["cost"]["moves"] == 1
    assert plan["moves"][0]["worker"] == "w2"  # the cheapest to move
    assert plan["cost"]["bytes"] == GIB
    assert plan["cost"]["blackout_s_max"] == pytest.approx(BlackoutRates().seconds(GIB))
    assert "1 move(s)" in e.line and "fragmentation" in e.line


def test_fragmentation_without_a_plan_says_why():
    nodes = three_nodes(free=(2, 2, 2))
    seats = [scheduling.Seat(f"w{i}", f"n{i}", 2, movable=False) for i in (1, 2, 3)]
    e = explain(Ask("d4", 4), nodes, [], planner_of(nodes, seats))
    assert e.cause is Cause.FRAGMENTATION
    assert e.plan["node"] is None and "no plan" in e.line and "not even after" in e.line


def test_capacity_when_the_free_gpus_are_not_there_at_all():
    nodes = three_nodes(free=(1, 0, 1))
    e = explain(Ask("d4", 4), nodes, [], no_plan("no node has 4 free GPU(s)"))
    assert e.cause is Cause.CAPACITY and "only 2 GPU(s)" in e.line


def test_shares_fragmentation_and_fit():
    # two GPUs with 0.3 free each: 0.5 does not fit on either GPU but 0.6 is free in all
    n = NodeSnap("n1", 2, (0.3, 0.3))
    e = explain(Ask("s", 0.5), [n], [], no_plan())
    assert e.cause is Cause.FRAGMENTATION and "any one GPU" in e.line
    assert explain(Ask("s", 0.25), [n], [], no_plan()).cause is Cause.FITS_NOW
    assert explain(Ask("s", 0.75), [n], [], no_plan()).cause is Cause.CAPACITY
    assert not n.fits(1) and n.whole_free == 0


def test_the_first_failing_check_is_the_cause():
    # never fits beats a lost node, a lost node beats priority
    nodes = three_nodes((NodeState.READY, NodeState.LOST, NodeState.READY))
    assert explain(Ask("d", 16), nodes, [], no_plan()).cause is Cause.NEVER_FITS
    small = [NodeSnap.whole("n1", 1, 1), NodeSnap.whole("n2", 4, 0, NodeState.LOST)]
    e = explain(Ask("d", 2, since=5.0), small, [Ask("x", 1, priority=3)], lambda a: {"node": "n1"})
    assert e.cause is Cause.NODES


def test_plan_cost_and_blackout_rates():
    rates = BlackoutRates()
    assert rates.seconds(0) == pytest.approx(0.004)
    one = rates.seconds(1_000_000_000)
    assert one == pytest.approx(1 / 1.03 + 1 / 0.95 + 1 / 1.7 + 0.004, abs=1e-3)
    assert BlackoutRates(shared_storage=True).seconds(10**9) < one
    p = plan_cost({"node": "n1", "moves": [{"worker": "a", "bytes": 10**9}, {"worker": "b", "bytes": 2 * 10**9}],
                   "suspends": ["c"]}, rates)
    assert p["cost"]["moves"] == 2 and p["cost"]["suspends"] == 1 and p["cost"]["bytes"] == 3 * 10**9
    assert p["cost"]["blackout_s_max"] == rates.seconds(2 * 10**9)


def test_bad_node_state_is_refused():
    with pytest.raises(ValueError, match="valid"):
        NodeSnap.whole("n1", 4, 4, "sleeping")  # type: ignore[arg-type]


# -- on the controller (its managers on fakes: no Ray) -------------------------------------------
def _controller(tmp_path, nodes):
    from relocator.controller.controller import Controller
    from tests.test_controller_managers import Agents, Events

    c = Controller.without_ray({"base_dir": tmp_path}, Agents(), Events(), nodes)
    c.reconcile_once()  # the agents report their GPUs: the nodes are registered
    return c


def test_controller_why_status_and_the_launch_refusal(tmp_path):
    from relocator.controller.inventory import NodeInfo
    from relocator.controller.model import Demand, DemandKind
    from tests.test_controller_managers import worker

    nodes = {"n1": NodeInfo("n1", "r1", 4, 2), "n2": NodeInfo("n2", "r2", 4, 2)}
    c = _controller(tmp_path, nodes)
    for wid, node in (("w1", "n1"), ("w2", "n2")):
        c.store.save_worker(worker(wid, node, 2))
    # more GPUs than any node has: refused at launch, nothing queued
    with pytest.raises(ValueError, match="can never fit: the largest node, n1, has 4"):
        c.launch("tiny-llama", gpus=8)
    assert c.store.demands() == []
    # a 4-GPU demand queued behind 2 + 2 free GPUs: fragmentation, with the one-move plan
    c.demands.queue(Demand(id="d4", kind=DemandKind.LAUNCH, model="m", gpus=4), "no node has 4 free GPU(s)")
    why = c.why("d4")
    assert why["cause"] == "fragmentation" and why["state"] == "pending"
    assert [ch["check"] for ch in why["checks"]] == ["fits_at_all", "nodes", "priority", "room"]
    assert why["free"] == {"n1": [1.0, 1.0, 0.0, 0.0], "n2": [1.0, 1.0, 0.0, 0.0]}
    assert why["plan"]["cost"]["moves"] == 1 and why["plan"]["node"] in ("n1", "n2")
    st = c.status()
    assert [p["id"] for p in st["pending"]] == ["d4"] and st["pending"][0]["why"]["cause"] == "fragmentation"
    # a lost node comes first
    nodes["n3"] = NodeInfo("n3", "r3", 0, 0, alive=False)
    c.nodes.inventory(refresh=True)
    assert c.why("d4")["checks"][1]["evidence"]["unavailable"][0]["id"] == "n3"
    with pytest.raises(KeyError, match="unknown demand 'nope'"):
        c.why("nope")


def test_the_http_api_answers_why_and_404s_json(tmp_path):
    import json
    import urllib.error
    import urllib.request

    from relocator.controller.httpapi import ApiServer
    from relocator.controller.store import Store

    def why(d):
        if d != "d4":
            raise KeyError(f"unknown demand {d!r}")
        return {"cause": "fragmentation", "demand": {"id": d}}

    store = Store(tmp_path / "c.db")
    api = ApiServer(store, why, lambda: [{"id": "d4", "why": why("d4")}])
    try:
        def get(path):
            try:
                with urllib.request.urlopen(api.url + path, timeout=10) as r:
                    return r.status, r.headers["Content-Type"], json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, e.headers["Content-Type"], json.loads(e.read())

        assert get("/v1/why/d4") == (200, "application/json", {"cause": "fragmentation", "demand": {"id": "d4"}})
        code, ctype, body = get("/v1/why/nope")
        assert (code, ctype, body) == (404, "application/json", {"error": "unknown demand 'nope'"})
        assert get("/v1/pending")[2]["pending"][0]["why"]["cause"] == "fragmentation"
        assert get("/v1/other")[0] == 404
        assert store.get("meta", "api") == {"port": api.port}
    finally:
        api.close()
    again = ApiServer(store, why, list)  # a restarted controller answers on the same port
    try:
        assert again.port == api.port
    finally:
        again.close()
