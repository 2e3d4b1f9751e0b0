"""Planner unit tests on hand-built clusters where the best moves are known."""

from __future__ import annotations

import numpy as np
import pytest

from relocator.planner import (
    Cluster,
    NodeSpec,
    PlannerError,
    TypicalPods,
    Workload,
    apply_plan,
    consolidate,
    defragment,
    evacuate,
    get_policy,
    place,
    policy_names,
)
from relocator.planner.cluster import Placement


def W(id, cpu=1000, mem=1024, num=1, milli=1000, **kw):
    return Workload(id, cpu, mem, num, milli if num else 0, **kw)


def two_nodes():
    return Cluster([NodeSpec("a", 32000, 65536, 4, "A100"), NodeSpec("b", 32000, 65536, 4, "A100")])


def test_registry_has_the_four_policies():
    assert set(policy_names()) >= {"random", "best-fit", "dot-product", "fgd"}
    assert get_policy("BestFit").name == "best-fit"
    with pytest.raises(PlannerError):
        get_policy("nope")


def test_add_remove_and_books():
    c = two_nodes()
    c.add(W("w1", num=2), "a")
    c.add(W("w2", num=1, milli=500), "a")
    assert c.allocated_gpu_milli == 2500
    assert c.placement_of("w1") == type(c.placement_of("w1"))("a", (0, 1))
    assert c.placement_of("w2").gpus == (2,)
    c.check()
    with pytest.raises(PlannerError):
        c.add(W("w3", num=3), "a")  # only 1.5 GPUs left
    c.remove("w1")
    assert c.allocated_gpu_milli == 500
    c.check()


def test_workload_validation():
    with pytest.raises(PlannerError):
        Workload("x", -1)
    with pytest.raises(PlannerError):
        Workload("x", 0, 0, 2, 500)  # multi-GPU must take whole GPUs
    with pytest.raises(PlannerError):
        Workload("x", 0, 0, 0, 500)


@pytest.mark.parametrize("policy", ["best-fit", "dot-product"])
def test_packing_policies_prefer_the_fuller_node(policy):
    c = two_nodes()
    c.add(W("w1", num=2), "b")
    pl = place(c, W("new", num=1), policy=policy)
    assert pl is not None and pl.node == "b"


def test_best_fit_picks_fullest_gpu_for_sharing():
    c = Cluster([NodeSpec("a", 32000, 65536, 2)])
    c.add(W("s1", milli=300), "a", [0])
    c.add(W("s2", milli=600), "a", [1])
    pl = place(c, W("s3", milli=300), policy="best-fit")
    assert pl is not None and pl.gpus == (1,)


def test_fgd_avoids_fragmenting_a_whole_gpu():
    # Typical workload: whole GPUs. A 0.5 share should go on the GPU already shared.
    typ = TypicalPods.from_workloads([W(f"t{i}", num=1) for i in range(9)] + [W("s", milli=500)])
    c = Cluster([NodeSpec("a", 32000, 65536, 2)])
    c.add(W("s1", milli=500), "a", [1])
    pl = place(c, W("s2", milli=500), policy=get_policy("fgd", typical=typ))
    assert pl is not None and pl.gpus == (1,)


def test_place_none_when_nothing_fits_and_model_constraint():
    c = two_nodes()
    assert place(c, W("big", num=8)) is None
    assert place(c, W("t4", num=1, gpu_model="T4")) is None
    assert place(c, W("a100", num=1, gpu_model="A100")) is not None


def test_defragment_single_best_move():
    # a: GPUs 0-2 taken by a 3-GPU job, GPU 3 half used; b: 3 GPUs used by 1-GPU jobs, 1 free
    # a 2-GPU job fits nowhere; moving the cheap share from a:3 to b makes room on a? No:
    # a would have 1 free GPU. Moving one 1-GPU job from b to a:3? a:3 is half used.
    # The known best plan: move the 0.5 share (cheapest) from a to b, then a has... still 1.
    # So: move one whole-GPU job off b into a's free... Build a clearer case instead:
    c = two_nodes()
    c.add(W("big", num=3, move_cost_bytes=10**12), "a")
    c.add(W("small", milli=500, move_cost_bytes=10**9), "b", [0])
    c.add(W("mid", num=1, move_cost_bytes=10**11), "b", [1])
    c.add(W("mid2", num=1, move_cost_bytes=10**11), "b", [2])
    # free: a: 1 GPU, b: 1 GPU + 0.5 -> a 2-GPU job fits nowhere
    job = W("job", num=2)
    assert place(c, job) is None
    plan = defragment(c, job, max_moves=2, policy="best-fit")
    assert plan is not None and plan.num_moves == 1
    # cheapest single move: the 0.5 share from b to a's free GPU, freeing b:0 (b then has 2 free)
    assert plan.moves[0].workload == "small" and plan.moves[0].dst == "a"
    assert plan.placement is not None and plan.placement.node == "b"
    before = c.allocated_gpu_milli
    apply_plan(c, plan, job, check=True)
    assert c.allocated_gpu_milli == before + 2000


def test_defragment_needs_two_moves_and_respects_budget():
    c = two_nodes()
    c.add(W("x", num=2), "a")
    c.add(W("s1", milli=400), "b", [0])
    c.add(W("s2", milli=400), "b", [1])
    c.add(W("y", num=2), "b", [2, 3])
    c.add(W("z", num=1), "a", [2])
    # free: a: GPU 3 (1000); b: 0.6 + 0.6. A 3-GPU job needs 2 moves? No node can hold 3.
    job = W("job", num=2)
    assert place(c, job) is None
    assert defragment(c, job, max_moves=0) is None
    plan = defragment(c, job, max_moves=2, policy="best-fit")
    assert plan is not None
    assert plan.num_moves <= 2
    apply_plan(c, plan, job, check=True)


def test_defragment_returns_no_moves_when_it_fits():
    c = two_nodes()
    plan = defragment(c, W("j", num=1))
    assert plan is not None and plan.num_moves == 0 and plan.placement is not None


def test_defragment_never_moves_pinned_workloads():
    c = Cluster([NodeSpec("a", 32000, 65536, 2), NodeSpec("b", 32000, 65536, 2)])
    c.add(W("p", num=1, relocatable=False), "a", [0])
    c.add(W("q", num=1, relocatable=False), "b", [0])
    assert defragment(c, W("j", num=2), max_moves=2) is None


def test_planners_do_not_change_the_cluster():
    c = two_nodes()
    c.add(W("x", num=3), "a")
    c.add(W("s", milli=500), "b")
    snap = (c.gpu_left.copy(), c.cpu_left.copy())
    defragment(c, W("j", num=4), max_moves=2)
    evacuate(c, "b")
    consolidate(c, max_moves=5)
    assert np.array_equal(snap[0], c.gpu_left) and np.array_equal(snap[1], c.cpu_left)


def test_evacuate_and_errors():
    c = two_nodes()
    c.add(W("x", num=2), "a")
    c.add(W("s", milli=500), "a")
    plan = evacuate(c, "a")
    assert {m.workload for m in plan.moves} == {"x", "s"} and all(m.dst == "b" for m in plan.moves)
    apply_plan(c, plan, check=True)
    assert c.workloads_on("a") == []
    c.add(W("y", num=3), "a")
    with pytest.raises(PlannerError, match="fits on no other node"):
        evacuate(c, "a")
    c.add(W("pin", cpu=1, num=0, relocatable=False), "a")
    with pytest.raises(PlannerError, match="not relocatable"):
        evacuate(c, "a")
    with pytest.raises(PlannerError, match="unknown node"):
        evacuate(c, "zzz")


def test_consolidate_frees_nodes_within_budget():
    c = Cluster([NodeSpec(n, 32000, 65536, 4) for n in "abc"])
    c.add(W("a1", num=2), "a")
    c.add(W("b1", num=1), "b")
    c.add(W("c1", num=1), "c")
    plan = consolidate(c, max_moves=1)
    assert plan.num_moves == 1
    plan2 = consolidate(c, max_moves=5)
    apply_plan(c, plan2, check=True)
    used = [n for n in "abc" if c.workloads_on(n)]
    assert len(used) == 1
    assert consolidate(c, max_moves=0).num_moves == 0


def test_move_validation():
    c = two_nodes()
    c.add(W("x", num=4), "a")
    c.add(W("y", num=4), "b")
    with pytest.raises(PlannerError):
        c.move("x", "b")
    with pytest.raises(PlannerError):
        c.move("x", "a")
    c.check()


def test_planning_decision_is_fast_on_a_large_cluster():
    import time

    rng = np.random.default_rng(0)
    nodes = [NodeSpec(f"n{i:04d}", 96000, 393216, 8, "G2") for i in range(1213)]
    c = Cluster(nodes)
    k = 0
    for i in range(1213):
        for g in range(8):
            m = int(rng.choice([230, 470, 810, 1000]))
            c.add(W(f"w{k}", cpu=6000, mem=1000, milli=m), i, [g])
            k += 1
    typ = TypicalPods.from_workloads(c.running())
    pol = get_policy("fgd", typical=typ)
    place(c, W("warm", milli=110), policy=pol)
    t = time.perf_counter()
    for j in range(5):
        place(c, W(f"q{j}", cpu=1000, milli=110), policy=pol)
    per = (time.perf_counter() - t) / 5
    t = time.perf_counter()
    defragment(c, W("job", cpu=1000, num=1), max_moves=1, policy=pol)
    dt = time.perf_counter() - t
    assert per < 0.25 and dt < 1.0  # generous for shared CI; the benchmark reports real figures


# ---------------------------------------------------------------- multi-move defragment (victim sets)
from relocator.planner.planners import placeable_elsewhere, victim_sets  # noqa: E402


def test_defragment_moves_a_cpu_only_workload_off_a_cpu_starved_node():
    # a: 2 free GPUs but its CPU is taken by a CPU-only job; b: CPU free, GPUs full
    c = Cluster([NodeSpec("a", 16000, 65536, 2), NodeSpec("b", 32000, 65536, 2)])
    c.add(W("cpuhog", cpu=15000, num=0), "a")
    c.add(W("g1", cpu=1000), "b", [0])
    c.add(W("g2", cpu=1000), "b", [1])
    job = W("job", cpu=8000, num=2)
    assert place(c, job) is None
    plan = defragment(c, job, max_moves=4)
    assert plan is not None and plan.num_moves == 1
    assert plan.moves[0].workload == "cpuhog" and plan.moves[0].dst == "b"
    assert plan.placement is not None and plan.placement.node == "a"
    apply_plan(c, plan, job, check=True)
    assert c.allocated_gpu_milli == 4000


def test_defragment_clears_a_gpu_into_slivers_with_two_moves():
    # a: GPU 0 holds two 0.3 shares, GPU 1 is full; b: two GPUs with a 0.3 sliver each
    c = Cluster([NodeSpec("a", 32000, 65536, 2), NodeSpec("b", 32000, 65536, 2)])
    c.add(W("s1", milli=300, move_cost_bytes=5), "a", [0])
    c.add(W("s2", milli=300, move_cost_bytes=5), "a", [0])
    c.add(W("full", milli=1000), "a", [1])
    c.add(W("b0", milli=700), "b", [0])
    c.add(W("b1", milli=700), "b", [1])
    job = W("job", milli=1000)
    assert place(c, job) is None
    assert defragment(c, job, max_moves=1) is None  # one move frees only 0.7
    sets = victim_sets(c, job, 4)
    assert sets and sets[0][0] == 2 and c.node_ids[sets[0][2]] == "a"
    plan = defragment(c, job, max_moves=2)
    assert plan is not None and plan.num_moves == 2
    assert {m.workload for m in plan.moves} == {"s1", "s2"} and all(m.dst == "b" for m in plan.moves)
    assert plan.placement == Placement("a", (0,))
    apply_plan(c, plan, job, check=True)
    assert (c.gpu_left == 0).all()


def test_victim_sets_prefer_fewest_moves_then_fewest_bytes():
    # two ways to free a whole GPU with one move: a cheap share on a, a dear one on b; c has room
    c = Cluster([NodeSpec("a", 32000, 65536, 1), NodeSpec("b", 32000, 65536, 1), NodeSpec("c", 32000, 65536, 2)])
    c.add(W("cheap", milli=600, move_cost_bytes=10), "a")
    c.add(W("dear", milli=600, move_cost_bytes=1000), "b")
    c.add(W("c0", milli=300, relocatable=False), "c", [0])
    c.add(W("c1", milli=300, relocatable=False), "c", [1])
    job = W("job", milli=900)
    sets = victim_sets(c, job, 3)
    assert [(k, c.node_ids[n]) for k, _, n, _ in sets][:2] == [(1, "a"), (1, "b")]
    plan = defragment(c, job, max_moves=3)
    assert plan is not None and plan.moves[0].workload == "cheap"


def test_placeable_elsewhere_excludes_the_own_node():
    c = Cluster([NodeSpec("a", 32000, 65536, 1), NodeSpec("b", 2000, 65536, 1)])
    c.add(W("big", cpu=20000, milli=500), "a")  # only a has the CPU for it
    c.add(W("small", cpu=1000, milli=200), "a")
    slots = np.array([c._slot_of["big"], c._slot_of["small"]])
    assert placeable_elsewhere(c, slots).tolist() == [False, True]


def test_defragment_respects_the_move_budget_and_pinned_workloads():
    # a: GPU 0 holds three 0.3 shares, GPU 1 a pinned job; c: three 0.3 slivers next to pinned 0.7s
    c = Cluster([NodeSpec("a", 32000, 65536, 2), NodeSpec("c", 32000, 65536, 3)])
    for i in range(3):
        c.add(W(f"s{i}", milli=300), "a", [0])
    c.add(W("pin", milli=1000, relocatable=False), "a", [1])
    for g in range(3):
        c.add(W(f"p{g}", milli=700, relocatable=False), "c", [g])
    job = W("job", milli=1000)
    assert place(c, job) is None
    assert defragment(c, job, max_moves=2) is None
    plan = defragment(c, job, max_moves=3)
    assert plan is not None and plan.num_moves == 3 and plan.placement == Placement("a", (0,))
    apply_plan(c, plan, job, check=True)
    assert c.placement_of("pin") == Placement("a", (1,))


def test_plan_gain_counts_gpus_unlocked_by_freeing_cpu():
    from relocator.planner.planners import plan_gain_milli

    # a: 3 idle GPUs, CPU taken by a CPU-only job; b: GPUs full, CPU free
    c = Cluster([NodeSpec("a", 40000, 262144, 4), NodeSpec("b", 64000, 262144, 1)])
    c.add(W("hog", cpu=38000, num=0), "a")
    c.add(W("g", cpu=1000), "a", [0])
    c.add(W("bg", cpu=1000), "b", [0])
    job = W("job", cpu=10000, num=1)
    plan = defragment(c, job, max_moves=2)
    assert plan is not None and plan.moves[0].workload == "hog"
    # the job's GPU plus the two GPUs the freed CPU (29 cores left at 10 per GPU) makes usable
    assert plan_gain_milli(c, plan, job, cpu_per_gpu=10000, mem_per_gpu=1024) == 3000
    c.check()
