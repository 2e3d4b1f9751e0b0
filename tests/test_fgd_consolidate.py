"""FGD's score in live consolidation (issue 31): where workers hold GPU shares, the controller's
`consolidate` (scheduling.consolidate on planner.consolidate and planner.pack_shares) picks
its moves by the fall in fragmentation (planner/fall.py), at the GPUs Ray gives. Fake views
(NodeView, Seat), no cluster."""

from __future__ import annotations

import numpy as np
import pytest

from relocator import planner
from relocator.controller import scheduling
from relocator.controller.scheduling import NodeView, Seat
from relocator.planner import fall

GIB = 1 << 30


def _nodes(used: dict[str, float], total: dict[str, int]) -> list[NodeView]:
    return [NodeView(n, total[n], total[n] - used.get(n, 0)) for n in sorted(total)]


def _view(seats: list[Seat], total: dict[str, int]) -> list[NodeView]:
    used: dict[str, float] = {}
    for s in seats:
        used[s.node] = used.get(s.node, 0) + s.gpus
    return _nodes(used, total)


def _moves(plan: dict) -> list[tuple[str, str, str]]:
    return [(m.worker, m.src, m.dst) for m in plan["moves"]]


@pytest.mark.parametrize("seed", range(5))
def test_fall_is_the_fragmentation_change_at_rays_gpus(seed):
    rng = np.random.default_rng(seed)
    cluster = planner.Cluster([planner.NodeSpec(f"n{i}", 64000, 10**6, int(rng.integers(1, 5))) for i in range(6)])
    for i in range(12):
        milli = int(rng.choice([250, 500, 750, 1000]))
        w = planner.Workload(f"w{i}", cpu_milli=int(rng.integers(0, 8000)), num_gpu=1, gpu_milli=milli)
        ok = np.nonzero(cluster.feasible(w))[0]
        if len(ok):
            cluster.add(w, int(rng.choice(ok)))
    typical = fall.target_shapes(cluster, cluster.running())
    for w in [planner.Workload("s", cpu_milli=4000, num_gpu=1, gpu_milli=250),
              planner.Workload("h", num_gpu=1, gpu_milli=500), planner.Workload("g2", num_gpu=2, gpu_milli=1000)]:
        f, take = fall.fall(cluster, w, np.arange(cluster.num_nodes), typical)
        for n in range(cluster.num_nodes):
            if not cluster.fits_on(w, n):
                assert f[n] == -np.inf, f"node {n} cannot take {w} but its fall is {f[n]}"
                continue
            gpus = cluster.default_gpus(w, n)
            assert tuple(np.nonzero(take[n])[0]) == gpus, f"node {n}: Ray's GPUs {gpus}, fall took {take[n]}"
            before = planner.cluster_fragmentation_milli(cluster, typical)
            cluster.add(w, n, gpus)
            after = planner.cluster_fragmentation_milli(cluster, typical)
            cluster.remove(w.id)
            assert f[n] == pytest.approx(before - after), f"node {n}: fall {f[n]} vs measured {before - after}"


def test_target_shapes_count_demands_and_add_a_whole_gpu_and_node():
    cluster = planner.Cluster([planner.NodeSpec("a", 1, 1, 4), planner.NodeSpec("b", 1, 1, 2)])
    typ = fall.target_shapes(cluster, [planner.Workload("w", num_gpu=1, gpu_milli=250)] * 30,
                             [planner.Workload("d", num_gpu=1, gpu_milli=500)])
    shapes = dict(zip(zip(typ.num_gpu.tolist(), typ.gpu_milli.tolist()), typ.freq.tolist()))
    assert set(shapes) == {(1, 250), (1, 500), (1, 1000), (4, 1000)}, f"no popularity cut: {shapes}"
    assert shapes[(1, 250)] == pytest.approx(30 / 33)


def test_consolidate_with_shares_sends_a_share_where_fragmentation_falls_not_to_the_best_fit():
    # c1 leaves c (a node freed): a's GPU would keep 0.25 (best fit), b's 0.5, which the pending
    # 0.5 demands can still use: FGD sends it to b
    total = {"a": 1, "b": 1, "c": 1}
    seats = [Seat("a1", "a", 0.5, movable=False, gpu_ids=(0,)), Seat("b1", "b", 0.25, movable=False, gpu_ids=(0,)),
             Seat("c1", "c", 0.25, bytes=GIB, gpu_ids=(0,))]
    plan = scheduling.consolidate(_view(seats, total), seats, max_moves=4, demands=[0.5] * 4)
    assert _moves(plan) == [("c1", "c", "b")], f"plan {plan}"
    assert plan["nodes_freed"] == ["c"], f"plan {plan}"
    # best fit (the whole-GPU policy) would have sent it to a
    cluster = scheduling.to_cluster(_view(seats, total), seats)
    assert [m.dst for m in planner.consolidate(cluster, 4, policy="best-fit").moves] == ["a"]


def test_packing_sends_a_share_where_fragmentation_falls():
    # no node can be freed (a whole immovable worker on each): x1's GPU is emptied; onto y's
    # sliver (0.25 left after, best fit) or z's (0.5 left after): the 0.5 demands want z
    total = {"x": 2, "y": 2, "z": 2}
    seats = [Seat(f"big_{n}", n, 1, movable=False, gpu_ids=(0,)) for n in total]
    seats += [Seat("x1", "x", 0.25, bytes=GIB, gpu_ids=(1,)), Seat("y1", "y", 0.5, movable=False, gpu_ids=(1,)),
              Seat("z1", "z", 0.25, movable=False, gpu_ids=(1,))]
    plan = scheduling.consolidate(_view(seats, total), seats, max_moves=4, demands=[0.5] * 4)
    assert _moves(plan) == [("x1", "x", "z")], f"plan {plan}"
    assert plan["gpus_freed"] == 1 and plan["nodes_freed"] == [], f"plan {plan}"


def test_packing_empties_the_gpu_whose_emptying_lowers_fragmentation_most_before_the_cheapest():
    # p1 (5 GiB) is alone on p, whose other GPU is free: moving it frees a whole 2-GPU node;
    # q1 (1 GiB) shares q with an immovable whole worker: moving it frees one GPU only
    cluster = planner.Cluster([planner.NodeSpec(n, 10**6, 10**6, g) for n, g in (("p", 2), ("q", 2), ("r", 1))])
    cluster.add(planner.Workload("p1", num_gpu=1, gpu_milli=250, move_cost_bytes=5 * GIB), "p", (1,))
    cluster.add(planner.Workload("q0", num_gpu=1, gpu_milli=1000, relocatable=False), "q", (0,))
    cluster.add(planner.Workload("q1", num_gpu=1, gpu_milli=250, move_cost_bytes=GIB), "q", (1,))
    cluster.add(planner.Workload("r1", num_gpu=1, gpu_milli=500, relocatable=False), "r", (0,))
    typical = fall.target_shapes(cluster, cluster.running())
    plan = planner.pack_shares(cluster, max_moves=1, typical=typical)
    assert [m.workload for m in plan.moves] == ["p1"], f"plan {plan}"
    assert planner.free_gpus(cluster) == 1, "the cluster is left as it was given"


def test_packing_makes_no_move_that_does_not_lower_fragmentation():
    # measured against 0.25 shares only, every sliver already fits one: nothing to win
    cluster = planner.Cluster([planner.NodeSpec(n, 10**6, 10**6, 1) for n in ("a", "b")])
    cluster.add(planner.Workload("a1", num_gpu=1, gpu_milli=250), "a")
    cluster.add(planner.Workload("b1", num_gpu=1, gpu_milli=250), "b")
    only_shares = planner.TypicalPods.from_workloads([planner.Workload("s", num_gpu=1, gpu_milli=250)])
    assert planner.pack_shares(cluster, 4, typical=only_shares).moves == ()
    # the default target (running shapes, a whole GPU, a whole node) wins a free GPU: one move
    assert len(planner.pack_shares(cluster, 4).moves) == 1


def test_fgd_only_where_workers_or_demands_hold_shares(monkeypatch):
    used = []
    real = planner.consolidate

    def spy(cluster, max_moves, policy="best-fit", rng=None):
        used.append(policy)
        return real(cluster, max_moves, policy=policy, rng=rng)

    monkeypatch.setattr(scheduling.planner, "consolidate", spy)
    total = {"n1": 4, "n2": 4}
    whole = [Seat("w1", "n1", 2, bytes=3 * GIB), Seat("w2", "n2", 1, bytes=GIB)]
    scheduling.consolidate(_view(whole, total), whole)
    scheduling.consolidate(_view(whole, total), whole, demands=[0.5])
    share = [*whole, Seat("s1", "n2", 0.25, gpu_ids=(1,))]
    scheduling.consolidate(_view(share, total), share)
    assert used[0] == "best-fit", f"whole GPUs only: {used}"
    assert [type(p) for p in used[1:]] == [planner.RayGpuFGD] * 2, f"a share demand, a share worker: {used}"


def test_the_controllers_consolidate_measures_against_its_pending_demands(tmp_path, monkeypatch):
    from relocator.controller import relocations
    from relocator.controller.controller import Controller
    from relocator.controller.inventory import NodeInfo
    from relocator.controller.model import Demand, DemandKind, DemandState, WorkerRecord, WorkerState
    from tests.test_controller_managers import Agents, Events

    nodes = {"n1": NodeInfo("n1", "n1", 2, 1.5), "n2": NodeInfo("n2", "n2", 2, 1.75)}
    c = Controller.without_ray({"base_dir": tmp_path}, Agents(), Events(), nodes)
    c.store.save_worker(WorkerRecord("s1", "m", "n1", 0.5, reservation="r1", gpu_ids=[0], state=WorkerState.RUNNING))
    c.store.save_worker(WorkerRecord("s2", "m", "n2", 0.25, reservation="r2", gpu_ids=[1], state=WorkerState.RUNNING))
    c.store.save_demand(Demand("d1", DemandKind.LAUNCH, "m", 4))
    c.store.save_demand(Demand("d2", DemandKind.LAUNCH, "m", 0.5, state=DemandState.PLACING))
    seen = []
    real = scheduling.consolidate

    def spy(nodes, seats, max_moves=10, demands=()):
        seen.append(list(demands))
        return real(nodes, seats, max_moves=max_moves, demands=demands)

    monkeypatch.setattr(relocations.scheduling, "consolidate", spy)
    plan = c.consolidate(dry_run=True, max_moves=4)
    assert seen == [[4]], f"only the pending demand is part of FGD's target: {seen}"
    assert [(m["worker"], m["to"]) for m in plan["moves"]] == [("s2", "n1")], plan
