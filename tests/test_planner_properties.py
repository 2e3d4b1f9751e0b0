"""Property tests: a plan never overcommits a node at any step, and applying it makes the
workload fit."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from relocator.planner import Cluster, NodeSpec, Workload, apply_plan, defragment, evacuate, PlannerError

shares = st.sampled_from([250, 500, 750, 1000])


@st.composite
def clusters(draw):
    n = draw(st.integers(2, 5))
    nodes = [NodeSpec(f"n{i}", 16000, 65536, draw(st.sampled_from([1, 2, 4])), "X") for i in range(n)]
    c = Cluster(nodes)
    for k in range(draw(st.integers(0, 14))):
        num = draw(st.sampled_from([0, 1, 1, 1, 2]))
        milli = 1000 if num > 1 else (draw(shares) if num == 1 else 0)
        w = Workload(f"w{k}", draw(st.integers(0, 6000)), draw(st.integers(0, 16000)), num, milli,
                     relocatable=draw(st.booleans()) or True, move_cost_bytes=draw(st.integers(0, 10**6)))
        feas = c.feasible(w).nonzero()[0]
        if len(feas):
            c.add(w, int(feas[draw(st.integers(0, len(feas) - 1))]))
    num = draw(st.sampled_from([1, 2, 4]))
    job = Workload("job", draw(st.integers(0, 8000)), draw(st.integers(0, 16000)), num,
                   1000 if num > 1 else draw(shares))
    return c, job


@settings(max_examples=60, deadline=None)
@given(clusters(), st.sampled_from(["best-fit", "fgd", "dot-product"]), st.integers(1, 3))
def test_defragment_plans_are_valid_step_by_step(cj, policy, k):
    c, job = cj
    plan = defragment(c, job, max_moves=k, policy=policy)
    c.check()  # planning left the cluster as it was
    if plan is None:
        return
    assert plan.num_moves <= k
    apply_plan(c, plan, job, check=True)  # check=True re-verifies capacity after every step
    assert "job" in c


@settings(max_examples=40, deadline=None)
@given(clusters())
def test_evacuate_plans_are_valid_or_refused(cj):
    c, _ = cj
    node = c.node_ids[0]
    try:
        plan = evacuate(c, node, policy="best-fit")
    except PlannerError:
        return
    apply_plan(c, plan, check=True)
    assert c.workloads_on(node) == []


@st.composite
def tight_clusters(draw):
    """Small clusters packed with GPU shares and CPU-heavy CPU-only jobs, where a job often needs
    several moves (GPU slivers to merge, CPU to free)."""
    n = draw(st.integers(2, 5))
    nodes = [NodeSpec(f"n{i}", draw(st.sampled_from([8000, 16000])), 65536, draw(st.sampled_from([1, 2, 4])), "X") for i in range(n)]
    c = Cluster(nodes)
    for k in range(draw(st.integers(0, 24))):
        num = draw(st.sampled_from([0, 1, 1, 1, 1, 2]))
        milli = 1000 if num > 1 else (draw(st.sampled_from([100, 200, 300, 470, 810, 1000])) if num == 1 else 0)
        w = Workload(f"w{k}", draw(st.sampled_from([0, 1000, 4000, 7000])), draw(st.integers(0, 16000)), num, milli,
                     relocatable=draw(st.integers(0, 5)) > 0, move_cost_bytes=draw(st.integers(0, 10**6)))
        feas = c.feasible(w).nonzero()[0]
        if len(feas):
            c.add(w, int(feas[draw(st.integers(0, len(feas) - 1))]))
    num = draw(st.sampled_from([1, 1, 2]))
    job = Workload("job", draw(st.sampled_from([0, 2000, 6000])), draw(st.integers(0, 16000)), num,
                   1000 if num > 1 else draw(st.sampled_from([300, 600, 1000])))
    return c, job


@settings(max_examples=80, deadline=None)
@given(tight_clusters(), st.sampled_from(["best-fit", "fgd"]), st.integers(1, 4))
def test_multi_move_plans_never_overcommit_and_make_the_job_fit(cj, policy, k):
    c, job = cj
    before = c.allocated_gpu_milli
    plan = defragment(c, job, max_moves=k, policy=policy)
    c.check()
    assert c.allocated_gpu_milli == before  # planning changed nothing
    if plan is None:
        return
    assert plan.num_moves <= k and plan.placement is not None
    moved = {m.workload for m in plan.moves}
    assert len(moved) == plan.num_moves  # no workload moved twice
    apply_plan(c, plan, job, check=True)  # every step re-verified
    assert "job" in c and c.allocated_gpu_milli == before + job.total_gpu_milli


@settings(max_examples=60, deadline=None)
@given(tight_clusters())
def test_victim_sets_free_enough_on_their_node(cj):
    from relocator.planner.planners import victim_sets

    c, job = cj
    for k, _, node, slots in victim_sets(c, job, 4):
        assert k == len(slots) <= 4
        trial = c.copy()
        for s in slots:
            w = c._workloads[s]
            assert w is not None and w.relocatable and int(c._slots.node[s]) == node
            trial.remove(w.id)
        assert trial.fits_on(job, node)
