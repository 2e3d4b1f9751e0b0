"""Chaos faults for the policy triggers (relocator.chaos.triggers, triggersteps): the catalogue,
the schedule, the controller's events told as lines, the checks, and each step driven against
a fake controller that does (or fails to do) what the policies should. No Ray."""

from __future__ import annotations

import copy
import time

import pytest

from relocator.chaos import triggers as T
from relocator.chaos import triggersteps as TS
from relocator.chaos.config import ChaosConfig
from relocator.chaos.faults import Step, StepKind, check_scheduling_outcome, make_schedule
from relocator.chaos.report import outcomes


class FakeCtl:
    """A controller whose policies act at once on what is marked (or not: `broken`)."""

    def __init__(self, broken: bool = False) -> None:
        self.broken = broken
        self.worker = {"id": "w1", "node": "n1", "state": "running", "gpu_ids": [2], "cell": "c1", "endpoint": "x"}
        self.nodes = {n: {"id": n, "alive": True, "gpus_total": 4, "gpus_free": 4} for n in ("n1", "n2", "n3")}
        self.nodes["n1"]["gpus_free"] = 3
        self.gpu_health: list[dict] = []
        self.ev: list[dict] = []
        self.applied: list[dict] = []
        self.calls: list[tuple] = []
        self.policy = ""

    # -- what the step reads
    def status(self) -> dict:
        return {"workers": [dict(self.worker)], "nodes": [dict(n) for n in self.nodes.values()],
                "gpu_health": copy.deepcopy(self.gpu_health), "relocations": [],
                "events": {"last": len(self.ev)}}

    def policies(self) -> dict:
        return {"policies": [{"name": "bad-gpu", "set": {"name": "bad-gpu", "trigger": {"kind": "gpu-health"},
                                                         "action": {"kind": "move"}}}]}

    def apply_policies(self, doc) -> dict:
        self.applied.append(doc)
        self.policy = doc["policies"][0]["name"] if doc["policies"] else ""
        return {}

    def events(self, since, kinds, idle_timeout):
        return [e for e in self.ev if e["seq"] > since and e["kind"] in kinds]

    # -- what it does
    def _emit(self, kind: str, **f) -> None:
        self.ev.append({"seq": len(self.ev) + 1, "ts": time.time(), "kind": kind, **f})

    def _gpu(self, node: str, gpu: int, state: str, held: bool) -> None:
        self.gpu_health = [g for g in self.gpu_health if (g["node"], g["gpu"]) != (node, gpu)]
        self.gpu_health.append({"node": node, "gpu": gpu, "state": state, "why": "x", "held": held})
        self._emit("gpu_health", node=node, gpu=gpu, **{"from": "healthy", "to": state}, why="x")
        if held:
            self.nodes[node]["gpus_free"] -= 1

    def mark_gpus(self, node, kind, gpus=None, count=0) -> dict:
        self.calls.append(("mark", node, kind, gpus, count))
        gpus = gpus or [3, 2][:count]
        w = self.worker
        if self.broken:
            if kind == "app":  # a policy that acts on the application's Xids
                self._emit("policy_planned", policy=self.policy, steps=[{"op": "move", "worker": "w1", "to": "n2"}],
                           firing={"reason": "Xid 13"})
            return {"gpus": gpus}
        if kind == "remap" and node == w["node"] and w["gpu_ids"][0] in gpus:
            self._emit("policy_planned", policy=self.policy, steps=[{"op": "move", "worker": "w1", "to": "n2"}],
                       firing={"reason": "row remap pending"})
            src = w["node"]
            w.update(node="n3" if src == "n2" else "n2", gpu_ids=[0], cell=w["cell"] + "m")
            self._emit("relocation_finished", relocation=f"r{len(self.ev)}", worker="w1", result="done")
            self._gpu(src, gpus[0], "ready_for_reset", True)
        elif kind == "xid79":
            self._emit("policy_planned", policy=self.policy, steps=[{"op": "replace", "worker": "w1"}],
                       firing={"reason": "Xid 79"})
            w.update(node="n2", gpu_ids=[0], cell="c2")
            self._emit("replacement_finished", worker="w1", to_node="n2", how="warm", ok=True)
            self._gpu(node, gpus[0], "failed", True)
        elif kind == "remap":  # idle GPUs: held by count
            for g in gpus:
                self._gpu(node, g, "ready_for_reset", True)
        return {"gpus": gpus}

    def clear_gpus(self, node, gpus=None) -> dict:
        self.calls.append(("clear", node, gpus))
        for g in list(self.gpu_health):
            if g["node"] == node and (gpus is None or g["gpu"] in gpus):
                self.gpu_health.remove(g)
                if g["held"]:
                    self.nodes[node]["gpus_free"] += 1
        return {"cleared": gpus}

    def notice(self, node, at, reason="") -> dict:
        self.calls.append(("notice", node, at))
        if at is not None and not self.broken:
            self._emit("policy_planned", policy=self.policy, steps=[{"op": "move", "worker": "w1", "to": "n3"}],
                       firing={"reason": f"{node} goes away"})
            self.worker.update(node="n3", cell="c3")
            self._emit("policy_outcome", policy=self.policy, ok=True, seconds=1.0, met_deadline=True,
                       results=[{"op": "move", "worker": "w1", "result": "ok"}])
        return {}

    def uncordon(self, node) -> dict:
        self.calls.append(("uncordon", node))
        return {}

    def resume(self, worker) -> dict:
        return {"state": "running"}


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    monkeypatch.setattr(TS, "_serving", lambda ctl, ids: [])
    monkeypatch.setattr(TS, "_settle", lambda ctl: 0.0)
    monkeypatch.setattr(T, "QUIET_S", 0.3)
    monkeypatch.setattr(T, "NOTICE_S", 0.5)
    monkeypatch.setattr(TS, "GPU_WAIT_S", 0.5)
    monkeypatch.setattr(TS, "OUTCOME_GRACE_S", 0.5)


def _run(name: str, ctl: FakeCtl) -> dict:
    cfg = ChaosConfig(move_timeout_s=1.0, flap_s=2)
    step = Step(4, "w1", "n2", kind=StepKind.TRIGGER, trigger=name)
    rec = TS.trigger_step(ctl, None, step, ctl.status()["workers"][0], cfg, lambda m: None)
    return rec


@pytest.mark.parametrize("name", list(T.TRIGGER_FAULTS))
def test_each_trigger_fault_passes_when_the_controller_does_its_part(name):
    ctl = FakeCtl()
    rec = _run(name, ctl)
    problems = T.check(rec, T.TRIGGER_FAULTS[name])
    assert not problems and rec["result"] == "done", (problems, rec)
    o = check_scheduling_outcome(rec, None)
    assert o.ok, o.problems
    # the step's own policies, then the cluster's again; every GPU it marked cleared, notices withdrawn
    assert [d["policies"][0]["name"] if d["policies"] else None for d in ctl.applied] == [
        T.policies(4, T.TRIGGER_FAULTS[name])["policies"][0]["name"], "bad-gpu"]
    assert ctl.gpu_health == [], ctl.gpu_health
    if name == "node-notice":
        assert ("uncordon", "n1") in ctl.calls and ctl.calls[-2][2] is None
    if name not in ("gpu-app-xid", "gpu-hold-count"):
        assert rec["controller"], rec  # what the controller did, told


def test_hold_count_uses_a_node_without_the_worker_and_records_the_free_gpus():
    ctl = FakeCtl()
    rec = _run("gpu-hold-count", ctl)
    o = rec["observed"]
    assert o["node"] != "n1" and (o["free_before"], o["free_held"], o["free_after"], o["held"]) == (4, 2, 4, 2), o


def test_a_controller_that_does_the_wrong_thing_is_named():
    ctl = FakeCtl(broken=True)
    rec = _run("gpu-app-xid", ctl)
    assert any("acted on the application's Xids" in p for p in T.check(rec, T.TRIGGER_FAULTS["gpu-app-xid"])), rec
    rec = _run("gpu-remap", FakeCtl(broken=True))
    problems = T.check(rec, T.TRIGGER_FAULTS["gpu-remap"])
    assert any("not moved" in p for p in problems) and any("not ready_for_reset" in p for p in problems), problems
    rec = _run("node-notice", FakeCtl(broken=True))
    problems = T.check(rec, T.TRIGGER_FAULTS["node-notice"])
    assert any("still on n1" in p for p in problems), problems


def test_checks_of_records():
    f = T.TRIGGER_FAULTS
    assert T.check({"injected": False, "error": "no live node with 2 free GPUs"}, f["gpu-hold-count"]) == [
        "not injected: no live node with 2 free GPUs"]
    flap = {"injected": True, "observed": {"moves": 3, "budget": 2, "flips": 12}}
    assert T.check(flap, f["gpu-flap"]) == ["3 moves > the budget of 2 (12 flips)"]
    late = {"injected": True, "observed": {"off_node": True, "met_deadline": False, "released": True}}
    assert T.check(late, f["node-notice"]) == ["deadline not met (policy outcome: False)"]
    held = {"injected": True, "observed": {"count": 2, "held": 1, "free_before": 4, "free_held": 3,
                                           "released": False, "left": ["n2/3 ready_for_reset"]}}
    assert T.check(held, f["gpu-hold-count"]) == [
        "1 GPU(s) held of 2 marked", "free GPUs 4 → 3 while held, not 2",
        "not released after the clear: ['n2/3 ready_for_reset']"]


def test_parse_schedule_policies_and_told_lines():
    assert T.parse_triggers("all") == list(T.TRIGGER_FAULTS) and T.parse_triggers("none") == []
    assert T.parse_triggers("gpu-remap, node-notice") == ["gpu-remap", "node-notice"]
    with pytest.raises(ValueError, match="unknown trigger fault"):
        T.parse_triggers("gpu-melt")
    workers = {"w1": "n1"}
    plain = make_schedule(3, [], workers, ["n1", "n2"], seed=5)
    with_t = make_schedule(3, [], workers, ["n1", "n2"], seed=5, triggers=["gpu-remap", "gpu-flap"])
    assert [s.kind for s in plain] == [StepKind.MOVE] * 3
    assert sorted(s.trigger for s in with_t if s.kind is StepKind.TRIGGER) == ["gpu-flap", "gpu-remap"]
    assert len(with_t) == 5
    flap = T.policies(7, T.TRIGGER_FAULTS["gpu-flap"])["policies"][0]
    assert flap["name"] == "chaos-gpu-7" and flap["limits"]["max_moves_per_hour"] == T.FLAP_BUDGET
    lines = T.told([
        {"ts": 101.0, "kind": "gpu_health", "node": "n1", "gpu": 2, "from": "healthy", "to": "draining",
         "why": "row remap pending"},
        {"ts": 101.5, "kind": "policy_planned", "policy": "p", "steps": [{"op": "move", "worker": "w1", "to": "n2"}],
         "firing": {"reason": "GPU 2 on n1: row remap pending"}},
        {"ts": 104.0, "kind": "policy_outcome", "policy": "p", "ok": True, "seconds": 2.5, "met_deadline": None,
         "results": [{"op": "move", "worker": "w1", "result": "ok"}]},
        {"ts": 104.0, "kind": "phase_started"}], t0=100.0)
    assert lines == ["+1.0s GPU 2 on n1: healthy → draining (row remap pending)",
                     "+1.5s p planned move w1→n2 (GPU 2 on n1: row remap pending)",
                     "+4.0s p ok in 2.5 s (move w1: ok)"]
    assert T.budgeted_moves([{"kind": "policy_planned", "policy": "p", "steps": [{"op": "move"}, {"op": "cordon"}]},
                             {"kind": "policy_planned", "policy": "q", "steps": [{"op": "move"}]}], "p") == 1


def test_the_report_lists_trigger_outcomes_with_what_the_controller_did():
    ctl = FakeCtl()
    rec = _run("gpu-remap", ctl)
    skipped = {"step": 5, "kind": "trigger", "trigger": "gpu-flap", "fault": None, "result": "skipped",
               "error": "worker w1 is relocating"}
    outs, scheduling = outcomes([rec, skipped], {}, ChaosConfig())
    assert outs[0]["ok"] and outs[0]["trigger"] == "gpu-remap" and outs[0]["controller"] == rec["controller"]
    assert scheduling[1]["trigger"] == "gpu-flap" and not scheduling[1]["ok"]


def test_the_text_report_prints_each_trigger_fault_with_the_controllers_lines(capsys):
    from relocator.cli.chaos import _print_report

    rep = {"relocations": 1, "faults_injected": 0, "triggers_injected": 2, "faults": {}, "ok": False,
           "triggers": {"gpu-remap": {"step": 0, "ok": True, "problems": [], "controller": ["+0.1s GPU 2: a → b"]},
                        "gpu-flap": {"step": 1, "ok": False, "problems": ["3 moves > the budget of 2"],
                                     "controller": []}}}
    _print_report(rep)
    out = capsys.readouterr().out
    assert "chaos: 1 relocations, 0 faults, 2 trigger faults" in out and "┏" not in out, out  # no empty table
    assert "trigger gpu-remap (step 0): ok" in out and "+0.1s GPU 2: a → b" in out, out
    assert "3 moves > the budget of 2" in out and "the controller did nothing" in out and "FAILED" in out, out
