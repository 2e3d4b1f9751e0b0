"""The replay's baselines (issue 32): EASY backfill's reservation rule on hand-made traces, the
no-bypass rule for a head whose moves are under way, and arrivals resampled per seed."""

from __future__ import annotations

import math

import numpy as np
import pytest

from relocator.planner import Cluster, NodeSpec, TypicalPods, Workload
from relocator.sim.arrivals import make_stream, poisson_stream
from relocator.sim.baselines import shadow
from relocator.sim.replay import BlackoutModel, Job, Replay, ReplayConfig, ReplayError, Stream, build_stream, demand_class
from relocator.sim.trace import TracePod

TYP = TypicalPods.from_workloads([Workload("t", 1000, 1024, 1, 1000)])


def stream_of(specs):
    """specs: (id, num_gpu, arrival, duration); whole GPUs, all measured."""
    jobs = []
    for i, (n, g, a, d) in enumerate(specs):
        w = Workload(n, 1000, 1024, g, 1000 if g else 0, None, True, 1 << 30)
        jobs.append(Job(i, w, a, d, 1, True, demand_class(w)))
    return Stream(jobs, 1.0, (0.0, max(j.arrival for j in jobs)), 1.0)


def run(nodes, specs, queue, mode="none", **kw):
    rp = Replay(nodes, stream_of(specs), ReplayConfig(policy="best-fit", mode=mode, queue=queue, budget_per_100=100.0, **kw), TYP)
    rp.run()
    rp.cluster.check()
    assert rp.cluster.running() == [] and not rp.queue
    return rp.by_id


ONE = [NodeSpec("A", 64000, 262144, 4)]
# a 2-GPU pod runs to 100; the 4-GPU head can start only then; a 1-GPU pod arrives behind it
HEAD = [("a", 2, 0.0, 100.0), ("head", 4, 1.0, 50.0)]


def test_fifo_blocks_and_easy_backfills_a_short_pod():
    specs = HEAD + [("short", 1, 2.0, 10.0)]  # ends at 12, long before the head's 100
    fifo = run(ONE, specs, "fifo")
    easy = run(ONE, specs, "easy")
    assert fifo["head"].start == easy["head"].start == pytest.approx(100.0)
    assert fifo["short"].start == pytest.approx(150.0)  # behind the head, which takes the node to 150
    assert easy["short"].start == pytest.approx(2.0)


def test_easy_does_not_start_a_pod_that_would_delay_the_head():
    specs = HEAD + [("long", 1, 2.0, 500.0)]  # would hold a GPU the head needs at 100
    easy = run(ONE, specs, "easy")
    assert easy["head"].start == pytest.approx(100.0)
    assert easy["long"].start == pytest.approx(150.0)
    # without a reservation (the old backfill) it starts at once and the head waits for it
    free = run(ONE, specs, "backfill")
    assert free["long"].start == pytest.approx(2.0)
    assert free["head"].start == pytest.approx(502.0)


def test_easy_lets_a_long_pod_use_what_the_head_does_not_need():
    eight = [NodeSpec("A", 64000, 262144, 8)]
    base = [("a", 6, 0.0, 100.0), ("head", 4, 1.0, 50.0)]
    ok = run(eight, base + [("long", 2, 2.0, 500.0)], "easy")  # at 100: 8 - 2 = 6 free >= 4
    assert ok["long"].start == pytest.approx(2.0) and ok["head"].start == pytest.approx(100.0)
    big_head = [("a", 6, 0.0, 100.0), ("head", 7, 1.0, 50.0)]
    no = run(eight, big_head + [("long", 2, 2.0, 500.0)], "easy")  # 8 - 2 = 6 < 7: it must wait
    assert no["head"].start == pytest.approx(100.0) and no["long"].start == pytest.approx(150.0)


def test_easy_starts_a_long_pod_on_another_node():
    two = [NodeSpec("A", 64000, 262144, 4), NodeSpec("B", 64000, 262144, 2)]
    # b goes to B first (best-fit: the fuller node), so B has one GPU left and A two
    specs = [("b", 1, 0.0, 1000.0), ("a", 2, 0.1, 99.9), ("head", 4, 1.0, 50.0), ("long", 1, 2.0, 500.0)]
    easy = run(two, specs, "easy")
    assert easy["head"].start == pytest.approx(100.0)
    assert easy["long"].start == pytest.approx(2.0)  # on B, which the head's reservation does not use


def test_shadow_is_the_earliest_fit_from_known_end_times():
    c = Cluster([NodeSpec("A", 64000, 262144, 4), NodeSpec("B", 64000, 262144, 4)])
    ends = {"a1": 50.0, "a2": 300.0, "b1": 200.0, "b2": 400.0}
    c.add(Workload("a1", 1000, 1024, 2, 1000), "A")
    c.add(Workload("a2", 1000, 1024, 1, 1000), "A")
    c.add(Workload("b1", 1000, 1024, 3, 1000), "B")
    c.add(Workload("b2", 1000, 1024, 1, 1000), "B")
    three = Workload("h", 1000, 1024, 3, 1000)
    assert shadow(c, three, ends.__getitem__) == (0, 50.0)  # A after a1: 3 free
    four = Workload("h", 1000, 1024, 4, 1000)
    assert shadow(c, four, ends.__getitem__) == (0, 300.0)  # A at 300, B only at 400
    only_b = np.array([False, True])
    assert shadow(c, four, ends.__getitem__, only_b) == (1, 400.0)
    assert shadow(c, Workload("h", 1000, 1024, 5, 1000), ends.__getitem__) == (None, math.inf)
    assert shadow(c, four, {**ends, "a2": math.inf}.__getitem__) == (1, 400.0)  # an unknown end never frees
    assert shadow(c, four, {**ends, "b2": 300.0}.__getitem__) == (0, 300.0)  # ties: the lowest node


# ------------------------------------------------------------------------- no bypass
# p2 (3 GPUs) fills A once p1 leaves, p3 (1 GPU) sits on B: the 4-GPU head needs one move (p3 to
# A, B held for the head meanwhile); a CPU-only pod behind it could start on A at once
TWO = [NodeSpec("A", 64000, 262144, 4), NodeSpec("B", 64000, 262144, 4)]
SPLIT = [
    ("p1", 1, 0.0, 10.0),
    ("p2", 3, 1.0, 1000.0),
    ("p3", 1, 2.0, 1000.0),
    ("head", 4, 20.0, 100.0),
    ("later", 0, 21.0, 100.0),
]


@pytest.mark.parametrize("queue", ["fifo", "easy"])
def test_a_head_whose_moves_are_under_way_still_blocks_as_its_discipline_says(queue):
    by = run(TWO, SPLIT, queue, mode="moves")
    blackout = BlackoutModel().move_s(by["p3"].workload)
    assert by["p3"].moves == 1
    assert by["head"].start == pytest.approx(20.0 + blackout, abs=1e-3)
    if queue == "fifo":  # like a head that fits nowhere: nothing behind it starts before it
        assert by["later"].start == pytest.approx(by["head"].start)
    else:  # EASY would start it (it cannot delay the head, whose node is held): so may moves
        assert by["later"].start == pytest.approx(21.0)
    base = run(TWO, SPLIT, queue)  # the baseline: the head waits for p2, the later pod as above
    assert base["head"].start == pytest.approx(1001.0)
    assert base["later"].start == pytest.approx(1001.0 if queue == "fifo" else 21.0)


# ------------------------------------------------------------------------- resampled arrivals
def pods_with_times(n=60, seed=3):
    import random

    r = random.Random(seed)
    out, t = [], 0
    for i in range(n):
        t += r.randint(1, 30)
        num = r.choice([0, 1, 1, 1, 2, 4])
        milli = 0 if num == 0 else (r.choice([300, 500, 1000]) if num == 1 else 1000)
        w = Workload(f"p{i:03d}", r.choice([1000, 4000]), 4096, num, milli, None, True, 8 << 30)
        out.append(TracePod(w, t, t + r.randint(20, 400), t, r.choice(["LS", "BE", "Burstable"]), "Running"))
    return out


def _key(s: Stream):
    return [(j.workload.id, round(j.arrival, 6), j.duration) for j in s.jobs]


def test_poisson_arrivals_change_with_the_seed_and_keep_the_mix():
    pods = pods_with_times()
    cap = 16000
    a, a2, b = (poisson_stream(pods, 1.3, cap, seed=s, passes=3) for s in (42, 42, 43))
    assert _key(a) == _key(a2)  # same seed, same stream
    assert _key(a) != _key(b)
    for s in (a, b):
        assert s.offered_load == pytest.approx(1.3, rel=1e-3)
        assert [j.arrival for j in s.jobs] == sorted(j.arrival for j in s.jobs)
        assert sum(j.measured for j in s.jobs) == 2 * len(pods)
        for k in range(3):  # every pass is the whole list, each pod with its own duration
            ids = sorted(j.workload.id.split("#")[0] for j in s.jobs[k * len(pods):(k + 1) * len(pods)])
            assert ids == sorted(p.workload.id for p in pods)
        dur = {p.workload.id: p.duration for p in pods}
        assert all(j.duration == max(1, dur[j.workload.id.split("#")[0]]) for j in s.jobs)
    # the trace's own stream does not change with the seed (the old replay)
    assert _key(build_stream(pods, 1.3, cap, 42, 3)) == _key(build_stream(pods, 1.3, cap, 43, 3))
    with pytest.raises(ReplayError, match="out of reach"):
        poisson_stream(pods, 50.0, cap, passes=2)
    with pytest.raises(ValueError, match="valid: trace, poisson"):
        make_stream("uniform", pods, 1.0, cap, 42, 2, 1)


def test_seeds_change_a_replay_with_resampled_arrivals_only():
    from relocator.sim.replay import replay

    pods = pods_with_times(40)
    nodes = [NodeSpec(f"n{i}", 16000, 65536, g) for i, g in enumerate([2, 4, 4, 8])]

    def waits(arrivals, seed):
        r = replay(nodes, pods, ReplayConfig(policy="best-fit", queue="easy", load=1.3, seed=seed, passes=3, arrivals=arrivals))
        return r["wait_s_p99_all"], r["wait_by_class"], r["alloc_ratio_mean"]

    assert waits("trace", 42) == waits("trace", 43)
    assert waits("poisson", 42) != waits("poisson", 43)
    assert waits("poisson", 42) == waits("poisson", 42)


# ------------------------------------------------------------------------- the bench
def test_cli_bench_replay_compares_moves_with_the_best_baseline(tmp_path):
    import csv
    import json

    from typer.testing import CliRunner

    from relocator.cli import _register, app

    _register()
    d = tmp_path / "trace"
    d.mkdir()
    with (d / "openb_node_list_gpu_node.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows([["sn", "cpu_milli", "memory_mib", "gpu", "model"]] +
                                 [[f"n{i}", 16000, 65536, g, "G"] for i, g in enumerate([2, 4, 4, 8])])
    with (d / "openb_pod_list_default.csv").open("w", newline="") as fh:
        csv.writer(fh).writerows([["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos", "pod_phase",
                                   "creation_time", "deletion_time", "scheduled_time"]] +
                                 [[p.workload.id, p.workload.cpu_milli, p.workload.memory_mib, p.workload.num_gpu,
                                   p.workload.gpu_milli, "", p.qos, "Running", p.creation_time, p.deletion_time, ""]
                                  for p in pods_with_times(40)])
    runner = CliRunner()
    png = tmp_path / "arms.png"
    res = runner.invoke(app, ["bench", "replay", "--trace", str(d), "--policy", "best-fit", "--mode", "none,moves", "--load", "1.3",
                              "--queue", "fifo,easy", "--seeds", "2", "--passes", "3", "--jobs", "1", "--json",
                              "--plot", str(tmp_path / "r.png"), "--plot-arms", str(png)])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    runs = doc["runs"]
    assert {(r["queue"], r["mode"], r["seed"]) for r in runs} == {(q, m, s) for q in ("fifo", "easy") for m in ("none", "moves")
                                                                   for s in (42, 43)}
    assert len({r["wait_s_p99_all"] for r in runs if r["mode"] == "none" and r["queue"] == "easy"}) == 2  # seeds differ
    for r in runs:
        if r["mode"] != "moves" or r["wait_s_p99"] is None:
            continue
        base = [b for b in runs if b["mode"] == "none" and b["seed"] == r["seed"] and b["wait_s_p99"] is not None]
        best = min(base, key=lambda b: b["wait_s_p99"])
        assert r["best_baseline"] == best["queue"]
        if best["wait_s_p99"]:
            assert r["p99_vs_best_baseline"] == pytest.approx(r["wait_s_p99"] / best["wait_s_p99"], abs=1e-3)
    groups = {(e["queue"], e["mode"]) for e in doc["results"]}
    assert groups == {("fifo", "none"), ("fifo", "moves"), ("easy", "none"), ("easy", "moves")}
    assert png.stat().st_size > 0
    bad = runner.invoke(app, ["bench", "replay", "--trace", str(d), "--queue", "fifo,sjf"])
    assert bad.exit_code == 2 and "valid: fifo, backfill, easy" in bad.output
    bad = runner.invoke(app, ["bench", "replay", "--trace", str(d), "--arrivals", "uniform"])
    assert bad.exit_code == 2 and "uniform" in bad.output
