"""The scheduling layer end to end, continued (issue 13), on the session's local Ray cluster
(3 nodes x 4 fake GPUs) with reference-engine workers (ready in ~1.5 s), real CRIU and the real
router: a worker past its time limit serves on until a launch needs its GPUs, which suspends and
requeues it, and the reconcile loop restores it once that launch stops; a
drain with a deadline moves what fits and suspends the rest, which resumes elsewhere when room
returns; chaos's make-room steps, one of them with a failing move (the plan stops, every worker
serves, the demand stays pending). Under streaming load: 0 client errors, 0 lost, duplicated or
mismatched tokens. Each test stops what it launched.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from relocator.cluster.streams import Load, reference
from tests.helpers import clean, wait_for, workers

pytestmark = pytest.mark.integration
MODEL = "tiny-llama"
ENGINE = "reference"
MAX_TOKENS = 48
TENANT = "test-tenant-requeue"  # another tenant's reservations: not workers, never moved


def stop_all(ctl, ids) -> None:
    for wid in ids:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                ctl.stop_worker(wid)
                break
            except KeyError:
                break
            except RuntimeError:  # busy a moment (a resume in flight)
                time.sleep(0.5)


def test_time_limit_makes_a_worker_preemptible_and_a_demand_requeues_it(relocator_cluster) -> None:
    """Past its limit a worker serves on while nobody waits (no suspend, no blackout); a launch
    that finds no other room suspends it (time_limit), takes its GPUs, and once that launch
    stops the reconcile loop restores it with a fresh limit."""
    import ray
    from ray.util import placement_group

    ctl = relocator_cluster
    cursor = ctl._call("events_cursor", timeout=60)
    w = ctl.launch(MODEL, 1, engine=ENGINE, time_limit="5s")
    x = None
    pgs = []
    try:
        assert w["state"] == "running" and w["time_limit_s"] == 5.0 and w["deadline"], w
        ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, 2, 2))
        load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, 2).start()
        wait_for(lambda: workers(ctl)[w["id"]]["preemptible"], 60, "past its time limit")
        time.sleep(6.0)  # three reconcile rounds: the old rule had suspended it by now
        now = workers(ctl)[w["id"]]
        assert (now["state"], now["suspensions"]) == ("running", 0), now
        # another tenant takes every other GPU: a new launch fits only on w's GPU
        free = {n["id"]: n["gpus_free"] for n in ctl.status()["nodes"] if n["alive"]}
        for n, f in free.items():
            if f:
                pgs.append(placement_group([{"GPU": float(f), f"relocator_node:{n}": 0.001}], strategy="STRICT_PACK",
                                           name=f"{TENANT}-{n}"))
        for pg in pgs:
            ray.get(pg.ready(), timeout=60)
        x = ctl.launch(MODEL, 1, engine=ENGINE)["id"]
        ws = workers(ctl)
        assert ws[x]["state"] == "running" and ws[x]["node"] == now["node"], ws
        assert ws[w["id"]]["state"] == "suspended" and ws[w["id"]]["suspend_reason"] == "time_limit", ws
        (d,) = ctl.pending()
        assert (d["id"], d["kind"]) == (w["id"], "resume"), d
        ctl.stop_worker(x)
        x = None
        wait_for(lambda: workers(ctl)[w["id"]]["state"] == "running", 90, "automatic restore")
        load.stop()
        clean(load.report())
        evs = list(ctl.events(since=cursor, kinds=["worker_preemptible", "worker_suspended", "demand_pending",
                                                   "worker_resumed"], idle_timeout=1.0, wait_s=1.0))
        assert [e["kind"] for e in evs][:1] == ["worker_preemptible"], evs
        sus = next(e for e in evs if e["kind"] == "worker_suspended")
        assert (sus["worker"], sus["reason"]) == (w["id"], "time_limit"), sus
        pend = next(e for e in evs if e["kind"] == "demand_pending" and e["demand"] == w["id"])
        assert pend["demand_kind"] == "resume", pend
        assert any(e["kind"] == "worker_resumed" and e["worker"] == w["id"] for e in evs), evs
        now = workers(ctl)[w["id"]]
        assert now["deadline"] and now["deadline"] > time.time() - 1, now  # a fresh limit from the restore
    finally:
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        stop_all(ctl, [i for i in (x, w["id"]) if i])
    assert ctl.pending() == []


def test_drain_by_moves_what_fits_and_suspends_the_rest(relocator_cluster) -> None:
    """n1 holds two 1-GPU workers; another tenant holds n2 and a 3-GPU worker n3, so one GPU is
    free elsewhere: the drain moves one worker there, suspends the other, cordons n1; the
    suspended one resumes off n1 when the tenant and the 3-GPU worker leave."""
    import ray
    from ray.util import placement_group

    ctl = relocator_cluster
    a = ctl.launch(MODEL, 1, node="n1", engine=ENGINE)["id"]
    b = ctl.launch(MODEL, 1, node="n1", engine=ENGINE)["id"]
    c = ctl.launch(MODEL, 3, node="n3", engine=ENGINE)["id"]
    pgs = [placement_group([{"GPU": 4.0, "relocator_node:n2": 0.001}], strategy="STRICT_PACK", name=TENANT)]
    try:
        for pg in pgs:
            ray.get(pg.ready(), timeout=60)
        ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, 2, 2))
        load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, 2).start()
        time.sleep(1.0)
        out = ctl.drain("n1", by="90s")
        assert [(r["result"], r["to"], r["error"]) for r in out["relocations"]] == [("done", "n3", "")], out
        assert out["drained"] and out["met_deadline"] and out["by"] > time.time(), out
        (sus,) = out["suspended"]
        assert sus["reason"] == "drain" and sus["node"] == "n1", sus
        moved = out["relocations"][0]["worker"]
        assert {moved, sus["worker"]} == {a, b}
        assert ctl.status()["cordoned"] == ["n1"]
        (d,) = ctl.pending()
        assert (d["id"], d["kind"]) == (sus["worker"], "resume"), d
        time.sleep(3.0)  # n1 has 4 free GPUs now but is cordoned: nothing resumes there
        assert workers(ctl)[sus["worker"]]["state"] == "suspended"
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        pgs = []
        ctl.stop_worker(c)
        wait_for(lambda: workers(ctl)[sus["worker"]]["state"] == "running", 90, "resume after the drain")
        load.stop()
        clean(load.report())  # siblings take new requests at HOLD: a continuation is not guaranteed
        ws = workers(ctl)
        assert ws[sus["worker"]]["node"] != "n1" and ws[moved]["node"] == "n3", ws
        assert ctl.pending() == []
    finally:
        for pg in pgs:
            ray.util.remove_placement_group(pg)
        ctl.uncordon("n1")
        stop_all(ctl, [a, b, c])
    assert ctl.status()["cordoned"] == []


def test_chaos_make_room_steps_and_a_failing_make_room_move(relocator_cluster) -> None:
    """`relocator chaos` steps of the scheduling layer: a suspend+resume, a make-room launch,
    and a make-room launch whose first move fails (the plan stops, the demand stays pending,
    every worker serves)."""
    from relocator.chaos.runner import ChaosConfig, run_chaos

    ctl = relocator_cluster
    cfg = ChaosConfig(moves=0, suspends=1, make_rooms=1, faults=["fail-make-room-move"], streams=2, workers=1,
                      output_tokens=(32,), engine=ENGINE, seed=1)
    rep = run_chaos(cfg, ctl=ctl)
    steps = {(o["kind"], o["fault"]): o for o in rep["scheduling_steps"]}
    assert set(steps) == {("suspend-resume", None), ("make-room", None), ("make-room", "fail-make-room-move")}, rep
    for o in steps.values():
        assert o["ok"], o
    failed = next(m for m in rep["moves"] if m.get("fault") == "fail-make-room-move")
    assert failed["launch_state"] == "pending" and failed["demand_pending"], failed
    assert [m["result"] for m in failed["moves"]][:1] == ["rolled_back"], failed
    assert rep["failed_requests"] == 0, rep["failed"]
    assert (rep["tokens_lost"], rep["tokens_duplicated"], rep["tokens_mismatched"]) == (0, 0, 0)
    assert rep["ok"], {k: rep[k] for k in ("faults", "scheduling_steps", "leaked")}
    assert ctl.pending() == [] and workers(ctl) == {}
