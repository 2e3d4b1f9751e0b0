"""GPU shares (issue 31): the one representation (relocator.shares), and the pure planner
seating and consolidating them (relocator.controller.scheduling on relocator.planner)."""

from __future__ import annotations

import pytest

from relocator import planner, shares
from relocator.controller import scheduling
from relocator.controller.scheduling import NodeView, Seat

GIB = 1 << 30


@pytest.mark.parametrize("text,want", [("0.25", 0.25), ("0.5", 0.5), ("0.01", 0.01), ("0.99", 0.99), ("1", 1),
                                       ("4", 4), (2, 2), (0.3, 0.3), ("2.0", 2), (" 0.75 ", 0.75)])
def test_parse_gpus_accepts_whole_and_hundredths(text, want):
    got = shares.parse_gpus(text)
    assert got == want
    assert isinstance(got, int) == (want >= 1)


@pytest.mark.parametrize("bad", ["0", "-1", "0.0001", "1.5", "abc", "", "nan", "inf", "0.255", True, None])
def test_parse_gpus_refuses_with_one_line(bad):
    with pytest.raises(ValueError) as e:
        shares.parse_gpus(bad)
    assert "\n" not in str(e.value) and "gpu" in str(e.value).lower()


def test_shape_and_engine_memory():
    assert shares.shape(0.25) == (1, 250)
    assert shares.shape(3) == (3, planner.MILLI)
    assert shares.count(3.0) == 3 and isinstance(shares.count(3.0), int)
    assert shares.count(0.1 + 0.2) == 0.3
    assert shares.engine_memory(0.25, 0.1) == 0.025
    assert shares.engine_memory(2, 0.1) is None


def _view(used: dict[str, float], total: int = 4) -> list[NodeView]:
    return [NodeView(n, total, total - u) for n, u in sorted(used.items())]


def _scattered() -> tuple[list[NodeView], list[Seat]]:
    """Eight 0.25 shares over 3 nodes of 4 GPUs, on 6 GPUs: (node, gpu) per worker."""
    where = {"w1": ("n1", 0), "w2": ("n1", 0), "w3": ("n1", 1), "w4": ("n2", 0), "w5": ("n2", 1),
             "w6": ("n3", 0), "w7": ("n3", 0), "w8": ("n3", 1)}
    seats = [Seat(w, n, 0.25, bytes=GIB, gpu_ids=(g,)) for w, (n, g) in sorted(where.items())]
    used: dict[str, float] = {}
    for s in seats:
        used[s.node] = used.get(s.node, 0) + s.gpus
    return _view(used), seats


def _after(nodes, seats, moves):
    """The cluster model after the moves, as Ray would place them (best fit on the target)."""
    cluster = scheduling.to_cluster(nodes, seats)
    for m in moves:
        cluster.move(m.worker, m.dst)
    return cluster


def test_to_cluster_puts_shares_on_their_gpu_ids():
    nodes, seats = _scattered()
    cluster = scheduling.to_cluster(nodes, seats)
    assert cluster.placement_of("w3").gpus == (1,)
    assert int(cluster.gpu_left[cluster.node_index("n1"), 0]) == 500
    assert planner.free_gpus(cluster) == 12 - 6


def test_consolidate_packs_eight_shares_onto_two_gpus_and_frees_a_node():
    nodes, seats = _scattered()
    plan = scheduling.consolidate(nodes, seats, max_moves=6)
    assert 1 <= len(plan["moves"]) <= 6
    assert len(plan["nodes_freed"]) >= 1
    cluster = _after(nodes, seats, plan["moves"])
    used_gpus = int(((cluster.gpu_cap - cluster.gpu_left) > 0).sum())
    assert used_gpus == 2
    assert plan["gpus_freed"] == 4
    assert {m.worker for m in plan["moves"]} <= {s.worker for s in seats}
    assert all(m.src != m.dst for m in plan["moves"])
    # then a 4-GPU launch fits on a freed node, without moves
    after_used: dict[str, float] = {n.id: 0 for n in nodes}
    for w in cluster.running():
        after_used[cluster.placement_of(w.id).node] += w.total_gpu_milli / planner.MILLI
    node = scheduling.fits(_view(after_used), 4)
    assert node in plan["nodes_freed"]


def test_consolidate_frees_whole_gpus_where_no_node_can_be_freed():
    # each node holds an immovable whole-GPU worker: no node can be freed, but shares can pack
    nodes = _view({"n1": 1.5, "n2": 1.25}, total=2)
    seats = [Seat("big1", "n1", 1, movable=False, gpu_ids=(0,)), Seat("big2", "n2", 1, movable=False, gpu_ids=(0,)),
             Seat("s1", "n1", 0.5, gpu_ids=(1,)), Seat("s2", "n2", 0.25, gpu_ids=(1,))]
    plan = scheduling.consolidate(nodes, seats, max_moves=4)
    assert plan["nodes_freed"] == []
    assert [(m.worker, m.src, m.dst) for m in plan["moves"]] == [("s2", "n2", "n1")]  # the fewest moves
    assert plan["gpus_freed"] == 1


def test_pack_shares_prefers_fewest_moves_then_fewest_bytes():
    cluster = planner.Cluster([planner.NodeSpec(n, 10**6, 10**6, 1) for n in ("a", "b", "c")])
    cluster.add(planner.Workload("a1", num_gpu=1, gpu_milli=250, move_cost_bytes=5 * GIB), "a")
    cluster.add(planner.Workload("b1", num_gpu=1, gpu_milli=250, move_cost_bytes=1 * GIB), "b")
    cluster.add(planner.Workload("c1", num_gpu=1, gpu_milli=250, move_cost_bytes=2 * GIB), "c")
    cluster.add(planner.Workload("c2", num_gpu=1, gpu_milli=250, move_cost_bytes=2 * GIB), "c")
    plan = planner.pack_shares(cluster, max_moves=1)
    assert [m.workload for m in plan.moves] == ["b1"]  # one share, the cheapest
    plan = planner.pack_shares(cluster, max_moves=5)
    assert len(plan.moves) == 2 and planner.free_gpus(cluster) == 0  # the cluster is left as given
    for m in plan.moves:
        cluster.move(m.workload, m.dst, m.gpus)
    cluster.check()
    assert planner.free_gpus(cluster) == 2


def test_pack_shares_never_breaks_a_free_gpu_nor_targets_a_closed_node():
    cluster = planner.Cluster([planner.NodeSpec("a", 10**6, 10**6, 2), planner.NodeSpec("b", 10**6, 10**6, 2)])
    cluster.add(planner.Workload("a1", num_gpu=1, gpu_milli=500), "a")
    cluster.add(planner.Workload("b1", num_gpu=1, gpu_milli=250), "b")
    assert [(m.workload, m.dst) for m in planner.pack_shares(cluster, 4).moves] == [("b1", "a")]
    # a receives nothing: a's share goes to b's partly used GPU instead, never onto b's free one
    assert [(m.workload, m.dst, m.gpus) for m in planner.pack_shares(cluster, 4, exclude=["a"]).moves] == [
        ("a1", "b", (0,))]
    assert planner.pack_shares(cluster, 4, exclude=["a", "b"]).moves == ()


def test_a_share_demand_sits_on_a_partly_used_gpu_and_a_whole_on_a_free_one():
    nodes = _view({"n1": 0.75, "n2": 3}, total=4)
    seats = [Seat("s1", "n1", 0.75, gpu_ids=(0,)), Seat("big", "n2", 3, gpu_ids=(0, 1, 2))]
    seating = scheduling.make_room(nodes, seats, 0.25)
    assert seating.node is not None and not seating.moves
    assert scheduling.make_room(nodes, seats, 4).node is None or scheduling.make_room(nodes, seats, 4).moves


def test_a_share_demand_makes_room_with_a_share_move():
    # both GPUs are half used: a 0.75 share needs one half moved onto the other
    nodes = _view({"n1": 0.5, "n2": 0.5}, total=1)
    seats = [Seat("a", "n1", 0.5, bytes=2 * GIB, gpu_ids=(0,)), Seat("c", "n2", 0.5, bytes=GIB, gpu_ids=(0,))]
    seating = scheduling.make_room(nodes, seats, 0.75, max_moves=2)
    assert [(m.worker, m.dst) for m in seating.moves] in ([("c", "n1")], [("a", "n2")])
    assert seating.node == seating.moves[0].src
    refused = scheduling.make_room(nodes, seats, 0.75, max_moves=0)
    assert refused.node is None and "0.75 share of one GPU" in refused.reason


def test_whole_gpu_plans_are_unchanged_without_gpu_ids():
    nodes = _view({"n1": 2, "n2": 2})
    seats = [Seat("w1", "n1", 2, bytes=3 * GIB), Seat("w2", "n2", 2, bytes=GIB)]
    seating = scheduling.make_room(nodes, seats, 4)
    assert seating.node is not None and [m.worker for m in seating.moves] == ["w2"]
    plan = scheduling.consolidate(nodes, seats)
    assert len(plan["moves"]) == 1 and len(plan["nodes_freed"]) == 1


@pytest.mark.parametrize("bad", ["0", "-1", "0.0001", "1.5", "abc"])
def test_cli_launch_refuses_a_bad_gpus_with_one_line_and_exit_2(bad, tmp_path):
    from typer.testing import CliRunner

    from relocator.cli import _register, app

    _register()
    res = CliRunner().invoke(app, ["launch", "--gpus", bad, "--cluster-dir", str(tmp_path)])
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--gpus" in lines[0], res.output


def test_worker_gpus_metric_shows_shares():
    from relocator.controller.metrics import ControllerCollector
    from relocator.controller.model import WorkerRecord, WorkerState

    ws = [WorkerRecord("w1", "m", "n1", 0.25, reservation="r1", state=WorkerState.RUNNING),
          WorkerRecord("w2", "m", "n1", 2, reservation="r2", state=WorkerState.RUNNING)]
    fams = {f.name: f for f in ControllerCollector.worker_metrics(ws, set())}
    got = {(s.labels["worker"], s.labels["kind"]): s.value for s in fams["relocator_worker_gpus"].samples}
    assert got == {("w1", "share"): 0.25, ("w2", "whole"): 2}


@pytest.mark.asyncio(loop_scope="session")
async def test_router_table_shows_and_keeps_shares(tmp_path):
    import json

    from relocator.router.client import ControlError, RouterControl
    from relocator.router.config import RouterSettings
    from relocator.router.server import RouterServer

    p = tmp_path / "state.json"
    srv = await RouterServer(RouterSettings(port=0, control_port=0, state_file=p)).start()
    try:
        async with RouterControl(srv.control_url) as rc:
            await rc.add_replica("w1", "m", "http://x:1", gpus=0.25)
            await rc.add_replica("w2", "m", "http://y:1", gpus=2)
            (reps,) = (await rc.replicas())["models"].values()
            assert {r["worker_id"]: r["gpus"] for r in reps} == {"w1": 0.25, "w2": 2}
            for bad in ("x", 0, -1, True):
                with pytest.raises(ControlError) as e:
                    await rc._call("POST", "/control/replicas", {"worker_id": "w3", "model": "m", "url": "http://z:1",
                                                                  "gpus": bad})
                assert e.value.status == 400 and "gpus" in json.dumps(e.value.body)
        assert {e["worker_id"]: e.get("gpus") for e in json.loads(p.read_text())["replicas"]} == {"w1": 0.25, "w2": 2}
    finally:
        await srv.stop()
    srv2 = await RouterServer(RouterSettings(port=0, control_port=0, state_file=p)).start()  # restored with shares
    try:
        assert srv2.rt.table.get("w1").gpus == 0.25
    finally:
        await srv2.stop()


@pytest.mark.parametrize("bad", [0, -1, 0.0001, 1.5, "abc"])
def test_controller_launch_refuses_a_bad_gpus_before_anything_starts(bad, tmp_path):
    from relocator.controller.controller import Controller
    from relocator.controller.inventory import NodeInfo
    from tests.test_controller_managers import Agents, Events

    c = Controller.without_ray({"base_dir": tmp_path}, Agents(), Events(), {"n1": NodeInfo("n1", "n1", 4, 4)})
    with pytest.raises(ValueError, match="(?i)gpu"):
        c.launch("/nonexistent-model", gpus=bad, dry_run=True)
    assert c.store.workers() == [] and c.store.demands() == []


def test_controller_dry_run_seats_a_share_on_a_gpu_a_share_uses(tmp_path):
    from relocator.controller.controller import Controller
    from relocator.controller.inventory import NodeInfo
    from relocator.controller.model import WorkerRecord, WorkerState
    from tests.test_controller_managers import Agents, Events

    nodes = {"n1": NodeInfo("n1", "n1", 2, 1.5), "n2": NodeInfo("n2", "n2", 2, 1.75)}
    c = Controller.without_ray({"base_dir": tmp_path}, Agents(), Events(), nodes)
    c.store.save_worker(WorkerRecord("s1", "m", "n1", 0.5, reservation="r1", gpu_ids=[0], state=WorkerState.RUNNING))
    c.store.save_worker(WorkerRecord("s2", "m", "n2", 0.25, reservation="r2", gpu_ids=[1], state=WorkerState.RUNNING))
    out = c.launch("/nonexistent-model", gpus=0.5, dry_run=True)
    assert out["demand"]["gpus"] == 0.5 and out["plan"]["how"] == "fits" and out["plan"]["node"] in ("n1", "n2")
    plan = c.consolidate(dry_run=True, max_moves=4)
    assert [(m["worker"], m["to"]) for m in plan["moves"]] == [("s2", "n1")] and plan["gpus_freed"] == 1, plan


def test_preempt_for_a_share_suspends_on_the_gpu_it_frees():
    # n1: GPU0 0.5 (lo1) + 0.5 (hi), GPU1 0.5 (lo2) + 0.5 (hi2): a 0.75 share needs a GPU with both
    # halves gone; suspending lo1 and lo2 (1.0 summed) frees no GPU enough: refused there
    nodes = _view({"n1": 2.0}, total=2)
    seats = [Seat("lo1", "n1", 0.5, gpu_ids=(0,)), Seat("hi", "n1", 0.5, priority=9, gpu_ids=(0,)),
             Seat("lo2", "n1", 0.5, gpu_ids=(1,)), Seat("hi2", "n1", 0.5, priority=9, gpu_ids=(1,))]
    assert scheduling.preempt(nodes, seats, 0.75, priority=5).node is None
    seats[1] = Seat("hi", "n1", 0.5, priority=1, gpu_ids=(0,))  # now both halves of GPU0 may go
    got = scheduling.preempt(nodes, seats, 0.75, priority=5)
    assert got.node == "n1" and set(got.suspends) <= {"lo1", "hi", "lo2"} and {"lo1", "hi"} <= set(got.suspends)


def test_make_room_for_whole_gpus_moves_shares_off_a_node():
    nodes = _view({"n1": 0.25, "n2": 0.5})
    seats = [Seat("s1", "n1", 0.25, bytes=GIB, gpu_ids=(0,)), Seat("s2", "n2", 0.25, bytes=GIB, gpu_ids=(0,)),
             Seat("s3", "n2", 0.25, bytes=GIB, gpu_ids=(1,))]
    seating = scheduling.make_room(nodes, seats, 4)
    assert (seating.node, [(m.worker, m.dst, m.gpus) for m in seating.moves]) == ("n1", [("s1", "n2", 0.25)])
