"""The handoff's chaos faults (issue 29), their plumbing with fakes: each forces a handoff, stays
out of the smoke, has its injector action, and kills at the right moment (handoff_window: once
the target copy started, before the router switches)."""

from __future__ import annotations

import json

import pytest

from relocator.chaos import injector as I
from relocator.chaos.config import ChaosConfig
from relocator.chaos.faults import FAULTS, SMOKE_FAULTS, check_outcome, parse_faults
from relocator.chaos.steps import move_transfer
from relocator.vocab import TransferMode

HANDOFF_FAULTS = ("handoff-kill-target-warmup", "handoff-kill-target-switch", "handoff-kill-source-warmup",
                  "handoff-network-cut-switch")


def test_each_handoff_fault_forces_a_handoff_and_is_not_in_the_smoke() -> None:
    for name in HANDOFF_FAULTS:
        f = FAULTS[name]
        assert f.transfer == TransferMode.HANDOFF and name in I.ACTIONS, f
        assert name not in SMOKE_FAULTS and not f.smoke, f  # CI's smoke has no room for second copies
        assert f.relocate_faults()["pause"]["phase"] == "SWITCH", f.relocate_faults()  # the window
        assert parse_faults(name) == [name]
    assert FAULTS["handoff-kill-target-warmup"].expect == ("rolled_back",)
    assert not any(FAULTS[n].requests_may_fail for n in HANDOFF_FAULTS)  # the issue: 0 client errors


def test_a_moves_transfer_is_its_faults_else_the_runs() -> None:
    cfg = ChaosConfig(transfer="handoff")
    assert move_transfer(None, cfg) == "handoff"
    assert move_transfer(FAULTS["cut-transfer"], cfg) == TransferMode.STREAM  # the fault's own
    assert move_transfer(FAULTS["flip-byte"], ChaosConfig()) is None  # the controller's default
    assert move_transfer(FAULTS["handoff-kill-source-warmup"], ChaosConfig()) == TransferMode.HANDOFF
    # a fault that acts on a DUMP, an image or CRIU's restore never rides on a handoff
    # (restart-router: it acts while DUMP holds the streams; a handoff's DUMP is 5 ms, passed
    # before it could act in 2026-12-06's run)
    for name in ("kill-source-agent", "kill-controller", "flip-byte", "kill-target-cell", "restart-router"):
        assert move_transfer(FAULTS[name], cfg) == TransferMode.SHARED, name
        assert move_transfer(FAULTS[name], ChaosConfig(transfer="auto")) == TransferMode.SHARED, name
        assert move_transfer(FAULTS[name], ChaosConfig(transfer="stream")) == "stream", name
        assert move_transfer(FAULTS[name], ChaosConfig()) is None, name
    assert move_transfer(FAULTS["node-loss"], cfg) == "handoff"  # any mode's


@pytest.mark.parametrize("rel, now, want", [
    ({"phase": "DUMP", "result": "running"}, 0.0, None),
    ({"phase": "RESTORE", "result": "running", "dst_endpoint": ""}, 0.0, None),  # still starting
    ({"phase": "RESTORE", "result": "running", "dst_endpoint": "http://n2"}, 0.0, "warm-up"),
    ({"phase": "SWITCH", "result": "running", "phases": [{"started": 100.0}]}, 101.0, "pause"),
    ({"phase": "SWITCH", "result": "running", "phases": [{"started": 100.0}]}, 102.5, "over"),  # switching
    ({"phase": "RELEASE", "result": "running"}, 0.0, "over"),
    ({"phase": "RESTORE", "result": "rolled_back", "dst_endpoint": "http://n2"}, 0.0, "over"),
])
def test_the_handoff_window(rel, now, want) -> None:
    assert I.handoff_window(rel, now, pause_s=2.0) == want, rel


def _injector(tmp_path, fault: str):
    class View:
        emulated = False

        def state_dir(self, node):
            return tmp_path / node

    for node, cell, pid in (("n1", "c1", 111), ("n2", "w1-r1", 222)):
        d = tmp_path / node / "cells" / cell
        d.mkdir(parents=True)
        (d / "cell.json").write_text(json.dumps({"init_pid": pid}))
    inj = I.Injector(None, tmp_path, FAULTS[fault], {"id": "w1"}, View())
    return inj


@pytest.mark.parametrize("fault, pid", [("handoff-kill-target-warmup", 222), ("handoff-kill-source-warmup", 111)])
def test_a_warm_up_kill_waits_for_the_started_target_then_kills_its_side(tmp_path, monkeypatch, fault, pid) -> None:
    kills: list[int] = []
    monkeypatch.setattr(I, "_kill", lambda p, *a: kills.append(p) or True)
    inj = _injector(tmp_path, fault)
    base = {"id": "r1", "src": "n1", "src_cell": "c1", "dst": "n2", "dst_cell": "w1-r1", "result": "running",
            "phase": "RESTORE"}
    polls = iter([{**base, "dst_endpoint": ""}] * 3 + [{**base, "dst_endpoint": "http://n2/w1-r1"}])
    last = {}

    def still():
        last["rel"] = next(polls, last.get("rel"))
        return last["rel"]

    inj.act(base, still)
    assert kills == [pid] and inj.injected and inj.detail["window"] == "warm-up", (kills, inj.detail)


def test_a_warm_up_kill_that_comes_too_late_is_not_injected(tmp_path, monkeypatch) -> None:
    kills: list[int] = []
    monkeypatch.setattr(I, "_kill", lambda p, *a: kills.append(p) or True)
    inj = _injector(tmp_path, "handoff-kill-target-warmup")
    rel = {"id": "r1", "src": "n1", "src_cell": "c1", "dst": "n2", "dst_cell": "w1-r1", "result": "running",
           "phase": "RELEASE"}
    inj.act(rel, lambda: rel)
    assert kills == [] and not inj.injected  # the runner reports it as missed


def test_the_switch_kill_lands_after_the_pause(tmp_path, monkeypatch) -> None:
    kills: list[int] = []
    monkeypatch.setattr(I, "_kill", lambda p, *a: kills.append(p) or True)
    slept: list[float] = []
    monkeypatch.setattr(I.time, "sleep", lambda s: slept.append(s))
    inj = _injector(tmp_path, "handoff-kill-target-switch")
    now = I.time.time()
    rel = {"id": "r1", "src": "n1", "src_cell": "c1", "dst": "n2", "dst_cell": "w1-r1", "result": "running",
           "phase": "SWITCH", "phases": [{"name": "SWITCH", "started": now}]}
    inj.act(rel, lambda: rel)
    assert kills == [222] and inj.detail["window"] == "switch", inj.detail
    assert slept and 0.4 < slept[0] <= 0.55, slept  # the 0.5 s pause, and a little


def test_a_handoff_fault_that_rolled_back_with_failed_requests_is_a_problem() -> None:
    f = FAULTS["handoff-kill-target-warmup"]
    out = check_outcome(f, {"result": "rolled_back"}, injected=True, serving=True, serve_again_s=0.0,
                        failed_requests=2, leaked={})
    assert not out.ok and any("request(s) failed" in p for p in out.problems), out
    ok = check_outcome(f, {"result": "rolled_back"}, injected=True, serving=True, serve_again_s=0.0,
                       failed_requests=0, leaked={})
    assert ok.ok, ok


@pytest.mark.parametrize("states, killed", [
    # paced at 3e7 B/s: 1 s of memory still to come (3e7 B) after 10 MB of 100 MB: the kill lands
    ([{"state": "running", "page_bytes": 0, "lazy_bytes": 10 ** 8},
      {"state": "running", "page_bytes": 10 ** 7, "lazy_bytes": 10 ** 8}], True),
    # first seen with 80 of 100 MB arrived (under 1 s left; the state may be 0.2 s stale): no kill
    ([{"state": "running", "page_bytes": 8 * 10 ** 7, "lazy_bytes": 10 ** 8}], False),
    # a post-copy too short for the margin (under 2 s in all) is taken at its first sighting
    ([{"state": "running", "page_bytes": 4 * 10 ** 7, "lazy_bytes": 5 * 10 ** 7}], True),
    ([{"state": "done", "page_bytes": 10 ** 8, "lazy_bytes": 10 ** 8}], False),
])
def test_a_postcopy_kill_lands_only_while_memory_is_still_to_come(tmp_path, monkeypatch, states, killed) -> None:
    """CI's chaos smoke: postcopy-kill-target came out `done` with the worker lost, its kill
    landing as the last pages came while the keeper's state still read `running`."""
    from relocator.agent.postcopy import write_state

    kills: list[int] = []
    monkeypatch.setattr(I, "_kill", lambda p, *a: kills.append(p) or True)
    inj = _injector(tmp_path, "postcopy-kill-target")
    assert inj._throttle_bps() == 3e7
    cdir = tmp_path / "n2" / "cells" / "w1-r1"
    rel = {"id": "r1", "src": "n1", "src_cell": "c1", "dst": "n2", "dst_cell": "w1-r1", "result": "running",
           "phase": "RELEASE"}
    seq = iter(states)

    def still():
        st = next(seq, None)
        if st is not None:
            write_state(cdir, **st)
        return rel

    inj.act(rel, still)
    assert (kills == [222]) is killed and inj.injected is killed, (kills, inj.detail)


def _recorded_iptables(monkeypatch) -> list[list[str]]:
    ran: list[list[str]] = []

    class Done:
        returncode, stdout, stderr = 0, "", ""

    monkeypatch.setattr(I.subprocess, "run", lambda argv, **kw: ran.append(list(argv)) or Done())
    return ran


def test_the_switch_network_cut_drops_the_router_target_path_both_ways_until_cleanup(tmp_path, monkeypatch) -> None:
    ran = _recorded_iptables(monkeypatch)
    slept: list[float] = []
    monkeypatch.setattr(I.time, "sleep", lambda s: slept.append(s))
    inj = _injector(tmp_path, "handoff-network-cut-switch")
    now = I.time.time()
    rel = {"id": "r7", "src": "n1", "src_cell": "c1", "dst": "n2", "dst_cell": "w1-r1", "result": "running",
           "phase": "SWITCH", "phases": [{"name": "SWITCH", "started": now}], "dst_endpoint": "http://127.0.0.5:8123"}
    inj.act(rel, lambda: rel)
    assert slept and 0.2 < slept[0] <= 0.25, slept  # halfway through the 0.5 s pause: before the router's call
    assert inj.injected and inj.detail["cut"].startswith("router <-> target copy 127.0.0.5:8123"), inj.detail
    tag = ["-m", "comment", "--comment", "relocator-chaos-r7", "-j", "DROP"]
    assert ran == [["iptables", "-I", "OUTPUT", "-p", "tcp", "-d", "127.0.0.5", "--dport", "8123", *tag],
                   ["iptables", "-I", "INPUT", "-p", "tcp", "-s", "127.0.0.5", "--sport", "8123", *tag]], ran
    ran.clear()
    inj.cleanup()
    assert sorted(r[1:3] for r in ran) == [["-D", "INPUT"], ["-D", "OUTPUT"]] and all(r[-6:] == tag for r in ran), ran
    ran.clear()
    inj.cleanup()  # once only
    assert ran == []


@pytest.mark.parametrize("later", [{"phase": "RELEASE"}, {"result": "rolled_back"}, {"dst_endpoint": ""}])
def test_a_switch_network_cut_that_comes_too_late_or_has_no_target_is_not_injected(tmp_path, monkeypatch, later) -> None:
    ran = _recorded_iptables(monkeypatch)
    monkeypatch.setattr(I.time, "sleep", lambda s: None)
    inj = _injector(tmp_path, "handoff-network-cut-switch")
    rel = {"id": "r7", "dst": "n2", "dst_cell": "w1-r1", "result": "running", "phase": "SWITCH",
           "phases": [{"started": I.time.time()}], "dst_endpoint": "http://127.0.0.1:8123"}
    inj.act(rel, lambda: {**rel, **later})
    assert ran == [] and not inj.injected, ran


def test_leftover_chaos_rules_count_as_leaks(monkeypatch) -> None:
    from relocator.chaos import leaks

    class Out:
        stdout = ("-P INPUT ACCEPT\n-A INPUT -s 127.0.0.5/32 -p tcp -m tcp --sport 8123 "
                  '-m comment --comment relocator-chaos-r7 -j DROP\n-A INPUT -j CRIU\n')

    monkeypatch.setattr(leaks.subprocess, "run", lambda *a, **kw: Out())
    assert leaks.chaos_rules() == {"-A INPUT -s 127.0.0.5/32 -p tcp -m tcp --sport 8123 -m comment "
                                   "--comment relocator-chaos-r7 -j DROP"}
    assert "firewall" in leaks.KINDS
