"""Pure parts of the chaos tool: fault catalogue, schedule, targets, outcome checks, leak diff."""

from __future__ import annotations

import random

import pytest

from relocator.chaos import FAULTS, check_outcome, diff_leaks, make_schedule, parse_faults
from relocator.chaos.faults import SMOKE_FAULTS, pick_target
from relocator.chaos.leaks import KINDS, total


def test_catalogue_covers_the_issue() -> None:
    need = {"kill-source-agent": "DUMP", "cut-transfer": "DUMP", "flip-byte": "RESTORE",
            "kill-target-cell": "RESTORE", "kill-controller": "DUMP", "restart-router": "DUMP",
            "node-loss": "RESTORE"}
    for name, phase in need.items():
        assert FAULTS[name].phase == phase
    assert FAULTS["cut-transfer"].transfer == "stream"
    assert FAULTS["flip-byte"].relocate_faults() == {"pause": {"phase": "RESTORE", "s": 1.0}}
    assert set(SMOKE_FAULTS) == set(FAULTS)


def test_parse_faults() -> None:
    assert parse_faults("all") == list(FAULTS)
    assert parse_faults("none") == [] and parse_faults("") == [] and parse_faults(None) == []
    assert parse_faults("flip-byte, cut-transfer") == ["flip-byte", "cut-transfer"]
    with pytest.raises(ValueError, match="unknown fault"):
        parse_faults("flip-bit")


def test_schedule_every_fault_once_destructive_last_seeded() -> None:
    workers = {"w1": "n1", "w2": "n2"}
    s = make_schedule(5, list(FAULTS), workers, ["n1", "n2", "n3"], seed=3)
    assert len(s) == 5 + len(FAULTS)
    assert sorted(x.fault for x in s if x.fault) == sorted(FAULTS)
    destructive = [f for f in FAULTS if FAULTS[f].destructive]
    assert sorted(x.fault for x in s[-len(destructive):]) == sorted(destructive)
    assert all(x.dst != workers[x.worker] for x in s)
    assert [x.to_dict() for x in s] == [x.to_dict() for x in make_schedule(5, list(FAULTS), workers,
                                                                          ["n1", "n2", "n3"], seed=3)]
    assert [x.index for x in s] == list(range(len(s)))


def test_pick_target() -> None:
    rng = random.Random(0)
    free = {"n1": 3, "n2": 0, "n3": 4}
    assert pick_target("n1", 1, free, ["n1", "n2", "n3"], "n3", rng) == "n3"
    assert pick_target("n1", 1, free, ["n1", "n2", "n3"], "n2", rng) == "n3"  # n2 full
    assert pick_target("n1", 1, free, ["n1", "n2"], "n3", rng) is None  # n3 gone, n2 full


def _rel(result: str, **kw) -> dict:
    return {"result": result, "error": kw.pop("error", ""), "rollback": kw.pop("rollback", {}), **kw}


def test_outcome_plain_move() -> None:
    ok = check_outcome(None, _rel("done"), injected=False, serving=True, serve_again_s=None,
                       failed_requests=0, leaked={"cells": []})
    assert ok.ok and not ok.problems
    bad = check_outcome(None, _rel("rolled_back", error="DUMP: x"), injected=False, serving=True,
                        serve_again_s=None, failed_requests=2, leaked={"cells": ["n2/w1-r1"]})
    assert not bad.ok and len(bad.problems) == 3


def test_outcome_fault_expectations() -> None:
    f = FAULTS["kill-source-agent"]
    good = check_outcome(f, _rel("rolled_back", rollback={"errors": []}), injected=True, serving=True,
                         serve_again_s=0.4, failed_requests=0, leaked={})
    assert good.ok, good.problems
    for kw, frag in ((dict(injected=False), "not injected"), (dict(serve_again_s=3.1), "serving again after"),
                     (dict(serving=False), "not serving"), (dict(failed_requests=1), "request(s) failed")):
        args = dict(injected=True, serving=True, serve_again_s=0.4, failed_requests=0, leaked={}) | kw
        o = check_outcome(f, _rel("rolled_back"), **args)
        assert not o.ok and any(frag in p for p in o.problems), (kw, o.problems)
    wrong = check_outcome(f, _rel("done"), injected=True, serving=True, serve_again_s=0.1, failed_requests=0,
                          leaked={})
    assert not wrong.ok and "expected rolled_back" in wrong.problems[0]
    rb = check_outcome(f, _rel("rolled_back", rollback={"errors": ["resume source: boom"]}), injected=True,
                       serving=True, serve_again_s=0.1, failed_requests=0, leaked={})
    assert not rb.ok and "rollback errors" in rb.problems[0]
    # a router restart is a hand-over now: a failed request in its window is a failure
    r = check_outcome(FAULTS["restart-router"], _rel("done"), injected=True, serving=True, serve_again_s=0.2,
                      failed_requests=3, leaked={})
    assert not r.ok and "3 request(s) failed" in r.problems
    # a fault declared to cut client connections gets its failed requests attributed, not failed
    from dataclasses import replace

    cuts = replace(FAULTS["restart-router"], requests_may_fail=True)
    assert check_outcome(cuts, _rel("done"), injected=True, serving=True, serve_again_s=0.2,
                         failed_requests=3, leaked={}).ok
    assert check_outcome(f, None, injected=True, serving=True, serve_again_s=0.1, failed_requests=0,
                         leaked={}).problems == ["relocation record missing"]


def test_leak_diff() -> None:
    before = {"cells": {"n1/w9-c0"}, "netns": {"rl-w9-c0"}, "images": set(), "placement_groups": {"relocator-w9-launch"},
              "processes": set()}
    after = {"cells": {"n1/w9-c0", "n2/w1-r1", "n3/w1-r2"}, "netns": {"rl-w9-c0", "rl-w1-r1", "rl-w1-r2"},
             "images": {"n1/r2"}, "placement_groups": {"relocator-w9-launch", "relocator-w1-r2"},
             "processes": {"123:vllm"}}
    expected = {"cells": {"n2/w1-r1"}, "netns": {"rl-w1-r1"}}
    d = diff_leaks(before, after, expected)
    assert set(d) == set(KINDS)
    assert d == {"cells": ["n3/w1-r2"], "netns": ["rl-w1-r2"], "images": ["n1/r2"],
                 "placement_groups": ["relocator-w1-r2"], "processes": ["123:vllm"], "transfers": []}
    assert total(d) == 5
    assert total(diff_leaks(after, after)) == 0
    # something that went away is not a leak
    assert total(diff_leaks(after, before)) == 0


def test_outcome_worker_on_dead_node() -> None:
    o = check_outcome(FAULTS["node-loss"], _rel("done"), injected=True, serving=True, serve_again_s=0.5,
                      failed_requests=0, leaked={}, worker_node_alive=False)
    assert not o.ok and "dead" in o.problems[0]


def test_freeze_end_is_the_switch_or_the_end_of_the_move() -> None:
    from relocator.chaos.runner import _freeze_end

    done = {"phases": [{"name": "DUMP", "ended": 5.0}, {"name": "SWITCH", "ended": 7.0},
                       {"name": "RELEASE", "ended": 8.0}], "finished_at": 8.0}
    rolled = {"phases": [{"name": "DUMP", "ended": 5.0, "ok": False}], "finished_at": 6.5}
    assert _freeze_end(done) == 7.0 and _freeze_end(rolled) == 6.5
    assert FAULTS["restart-router"].spares_worker and not FAULTS["kill-controller"].spares_worker


def test_serving_again_ignores_answers_before_a_later_outage() -> None:
    from relocator.chaos.runner import serving_again_at

    # answered at once, then frozen (late answer, a timeout), then serving again at 12.1
    probes = [(10.0, 10.1), (10.5, 13.0), (11.0, None), (12.0, 12.1), (12.5, 12.6)]
    assert serving_again_at(probes) == 12.1
    assert serving_again_at([(1.0, 1.2), (1.5, 1.6)]) == 1.2  # never interrupted
    assert serving_again_at([(1.0, None), (1.5, 4.0)]) is None  # never good again


def test_scheduling_steps_in_the_schedule() -> None:
    from relocator.chaos.faults import StepKind

    workers = {"w1": "n1", "w2": "n2"}
    s = make_schedule(2, ["fail-make-room-move", "node-loss"], workers, ["n1", "n2", "n3"], seed=1,
                      suspends=2, make_rooms=1)
    kinds = [x.kind for x in s]
    assert kinds.count(StepKind.MOVE) == 3 and kinds.count(StepKind.SUSPEND_RESUME) == 2
    assert kinds.count(StepKind.MAKE_ROOM) == 2  # one plain, one carrying the fault
    assert next(x for x in s if x.fault == "fail-make-room-move").kind is StepKind.MAKE_ROOM
    assert s[-1].fault == "node-loss" and s[-1].kind is StepKind.MOVE  # destructive last
    assert FAULTS["fail-make-room-move"].relocate_faults() == {"dump": True}
    with pytest.raises(ValueError, match="unknown step kind 'suspend'"):
        StepKind("suspend")


def test_scheduling_outcomes() -> None:
    from relocator.chaos.faults import check_scheduling_outcome

    f = FAULTS["fail-make-room-move"]
    failed = {"kind": "make-room", "result": "pending", "launch_state": "pending", "demand_pending": True,
              "moves": [{"result": "rolled_back"}], "serving": True, "not_serving": []}
    assert check_scheduling_outcome(failed, f).ok
    o = check_scheduling_outcome({**failed, "launch_state": "running", "not_serving": ["w1"]}, f)
    assert not o.ok and any("not pending" in p for p in o.problems) and any("w1" in p for p in o.problems)
    plain = {"kind": "make-room", "result": "done", "launch_state": "running", "moves": [{"result": "done"}],
             "serving": True}
    assert check_scheduling_outcome(plain, None).ok
    assert not check_scheduling_outcome({**plain, "moves": []}, None).ok
    sr = {"kind": "suspend-resume", "result": "done", "suspended": True, "resumed": True, "serving": True}
    assert check_scheduling_outcome(sr, None).ok
    bad = check_scheduling_outcome({**sr, "resumed": False, "failed_requests": 2}, None)
    assert not bad.ok and "not resumed" in bad.problems and "2 request(s) failed" in bad.problems
