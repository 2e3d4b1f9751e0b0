"""Policies (relocator.policies): validation, filters, triggers and actions on fake clocks, the
hysteresis and budget, the engine's rounds on fake ports, the agent's health reader on the
file-driven NVML stand-in. Pure logic: no Ray, no cells."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from relocator.agent.health import HealthReader, write_notice
from relocator.policies.actions import MoveAction, evacuation
from relocator.policies.base import Context, Firing
from relocator.policies.cron import Cron
from relocator.policies.engine import PolicyEngine
from relocator.policies.filters import WorkerFilter
from relocator.policies.runner import PolicyPorts, Runner
from relocator.policies.spec import load, load_file
from relocator.policies.triggers import GpuHealthTrigger, NodeNoticeTrigger, ScheduleTrigger, WindowTrigger

T0 = 1_800_000_000.0  # a fixed epoch


class Clock:
    def __init__(self, t: float = T0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.t += s


class MemStore:
    def __init__(self) -> None:
        self.docs: dict[tuple[str, str], dict] = {}

    def put(self, kind, key, body):
        self.docs[(kind, key)] = json.loads(json.dumps(body))

    def get(self, kind, key):
        return self.docs.get((kind, key))

    def all(self, kind):
        return [v for (k, _), v in list(self.docs.items()) if k == kind]

    def delete(self, kind, key):
        self.docs.pop((kind, key), None)


def worker(wid, node="n1", gpus=1, prio=0, gpu_ids=(0,), engine="vllm", model="tiny-llama", state="running"):
    return {"id": wid, "node": node, "gpus": gpus, "priority": prio, "gpu_ids": list(gpu_ids), "engine": engine,
            "model": model, "state": state}


class FakeCluster:
    """The controller's side as the policies see it: workers, nodes, agents' health, and the
    operations, which record what was asked and finish moves at once (or never, `stuck`)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.store = MemStore()
        self.workers = [worker("w1", gpu_ids=(2,)), worker("w2", gpu_ids=(0, 1), gpus=2)]
        self.nodes = {n: {"gpus_total": 4, "gpus_free": 4, "alive": True, "cordoned": False} for n in ("n2", "n3")}
        self.nodes["n1"] = {"gpus_total": 4, "gpus_free": 1, "alive": True, "cordoned": False}
        self.health = {n: {"gpus": [], "notice": None} for n in self.nodes}
        self.calls: list[tuple] = []
        self.events: list[tuple[str, dict]] = []
        self.rels: dict[str, dict] = {}
        self.move_takes_s = 0.0

    def relocate(self, wid, to=None, transfer=None, wait=False):
        rid = f"r{len(self.rels) + 1}"
        self.calls.append(("move", wid, to))
        self.rels[rid] = {"id": rid, "result": "running", "created_at": self.clock(),
                          "done_at": self.clock() + self.move_takes_s}
        return {"id": rid}

    def relocation(self, rid):
        r = self.rels[rid]
        if r["result"] == "running" and self.clock() >= r["done_at"]:
            r.update(result="done", finished_at=self.clock())
        return r

    def ports(self) -> PolicyPorts:
        return PolicyPorts(
            store=self.store, emit=lambda kind, **f: self.events.append((kind, f)),
            workers=lambda: [dict(w) for w in self.workers], nodes=lambda: self.nodes,
            health=lambda n: self.health[n], pending=lambda: [], relocations=lambda: [],
            relocate=self.relocate, relocation=self.relocation,
            suspend=lambda wid: self.calls.append(("suspend", wid)),
            replace=lambda wid: self.calls.append(("replace", wid)),
            consolidate=lambda k: self.calls.append(("consolidate", k)),
            cordon=lambda node, until: self.calls.append(("cordon", node, until)),
            uncordon=lambda node: self.calls.append(("uncordon", node)),
            hold_gpu=lambda node, gpu: self.calls.append(("hold", node, gpu)),
            release_gpu=lambda node, gpu: self.calls.append(("release", node, gpu)))

    def engine(self, doc) -> PolicyEngine:
        eng = PolicyEngine(self.ports(), None, clock=self.clock, spawn=lambda fn: fn(), sleep=self.clock.sleep)
        out = eng.apply(doc)
        assert not out["errors"], out["errors"]
        return eng

    def moves(self):
        return [c for c in self.calls if c[0] in ("move", "replace", "suspend")]


# -- validation --------------------------------------------------------------------------------
def test_one_invalid_policy_is_reported_and_the_others_load():
    specs, errors = load({"policies": [
        {"name": "ok", "trigger": {"kind": "gpu-health"}, "action": {"kind": "move"}},
        {"name": "bad-cron", "trigger": {"kind": "schedule", "cron": "61 * * * *"}, "action": {"kind": "move"}},
        {"name": "no-such", "trigger": {"kind": "weather"}, "action": {"kind": "move"}},
        {"name": "late", "trigger": {"kind": "window", "node": "n1", "start": "2030-01-01T01:00:00Z",
                                     "end": "2030-01-01T00:00:00Z"}, "action": {"kind": "cordon"}},
        {"name": "xid-twice", "trigger": {"kind": "gpu-health", "fail_xids": [63]}, "action": {"kind": "move"}},
        {"name": "prio", "trigger": {"kind": "node-notice"}, "filter": {"priority_min": 5, "priority_max": 1},
         "action": {"kind": "move"}},
        {"name": "typo", "trigger": {"kind": "node-notice"}, "action": {"kind": "move", "paralel": 2}},
        {"name": "ok", "trigger": {"kind": "node-notice"}, "action": {"kind": "suspend"}},
    ]})
    assert [s.name for s in specs] == ["ok"]
    why = {e["name"]: e["error"] for e in errors}
    assert "outside 0-59" in why["bad-cron"]
    assert "weather" in why["no-such"]
    assert "end must be after its start" in why["late"]
    assert "[63]" in why["xid-twice"]
    assert "priority_min 5 > priority_max 1" in why["prio"]
    assert "paralel" in why["typo"]
    assert any(e == {"name": "ok", "error": "duplicate policy name"} for e in errors)


def test_shipped_policies_file_is_valid():
    specs, errors = load_file(Path(__file__).resolve().parents[1] / "configs" / "policies.yaml")
    assert errors == []
    kinds = {s.trigger.kind for s in specs}
    assert kinds == {"gpu-health", "node-notice", "window", "schedule", "metric"}


def test_a_file_that_is_not_yaml_is_one_error(tmp_path):
    p = tmp_path / "p.yaml"
    p.write_text("policies: [unclosed")
    specs, errors = load_file(p)
    assert specs == [] and len(errors) == 1 and str(p) in errors[0]["error"]


# -- cron --------------------------------------------------------------------------------------
def test_cron_fields_steps_and_days():
    c = Cron.parse("*/15 9-17 * * 1-5")
    monday_0930 = time.mktime((2026, 3, 2, 9, 30, 0, 0, 0, 0)) - time.timezone  # UTC
    assert c.matches(monday_0930)
    assert not c.matches(monday_0930 + 60)  # 09:31
    assert not c.matches(monday_0930 + 5 * 86400)  # Saturday
    sunday = Cron.parse("0 0 * * 7")
    assert sunday.matches(time.mktime((2026, 3, 1, 0, 0, 0, 0, 0, 0)) - time.timezone)
    either = Cron.parse("0 0 1 * 1")  # the 1st, or a Monday
    assert either.matches(time.mktime((2026, 3, 2, 0, 0, 0, 0, 0, 0)) - time.timezone)
    for bad in ("* * * *", "a * * * *", "*/0 * * * *", "5-1 * * * *", "0 24 * * *"):
        with pytest.raises(ValueError):
            Cron.parse(bad)


# -- filters -----------------------------------------------------------------------------------
def test_filter_by_engine_model_priority_labels_and_share():
    ws = [worker("a", prio=0, engine="vllm"), worker("b", prio=5, engine="sglang", gpus=2),
          {**worker("c", prio=3, gpus=0.5), "labels": {"tier": "batch"}}]
    pick = lambda **kw: [w["id"] for w in WorkerFilter(**kw).select(ws)]  # noqa: E731
    assert pick() == ["a", "b", "c"]
    assert pick(engines=["sglang"]) == ["b"]
    assert pick(priority_min=1, priority_max=4) == ["c"]
    assert pick(labels={"tier": "batch"}) == ["c"]
    assert pick(gpus_max=1) == ["a", "c"]
    assert pick(gpus_min=1, models=["tiny-llama"]) == ["a", "b"]


# -- triggers ----------------------------------------------------------------------------------
@pytest.mark.parametrize("report,state", [
    ({"xids": [63]}, "draining"), ({"remapped_rows_pending": True}, "draining"), ({"xids": [92]}, "draining"),
    ({"xids": [79]}, "failed"), ({"xids": [63, 48]}, "failed"), ({"remapped_rows_failure": True}, "failed"),
    ({"xids": [13, 31, 43]}, "healthy"), ({"xids": [999]}, "healthy"), ({}, "healthy"),
])
def test_gpu_health_classification(report, state):
    assert GpuHealthTrigger(kind="gpu-health").classify({"index": 0, **report})[0] == state


def test_gpu_health_thresholds_are_the_policys():
    t = GpuHealthTrigger(kind="gpu-health", sbe_max=100, temperature_c_max=90, remapped_rows_pending=False)
    assert t.classify({"index": 0, "sbe": 101})[0] == "draining"
    assert t.classify({"index": 0, "temperature_c": 95})[0] == "draining"
    assert t.classify({"index": 0, "remapped_rows_pending": True})[0] == "healthy"


def test_notice_window_and_schedule_fire_on_the_clock():
    ctx = Context(now=T0, health={"n1": {"notice": {"at": T0 + 60}}, "n2": {"notice": {"at": T0 + 7200}}})
    fired = NodeNoticeTrigger(kind="node-notice", max_lead_s=3600).fire(ctx)
    assert [(f.node, f.deadline) for f in fired] == [("n1", T0 + 60)]
    w = WindowTrigger(kind="window", node="n3", start=T0 + 600, end=T0 + 1200, lead_s=300)
    assert w.fire(Context(now=T0)) == []
    assert w.fire(Context(now=T0 + 301))[0].until == T0 + 1200
    assert w.fire(Context(now=T0 + 1200)) == []
    s = ScheduleTrigger(kind="schedule", cron="* * * * *")
    assert s.fire(Context(now=T0))[0].key == s.fire(Context(now=T0 + 1))[0].key  # one firing a minute
    assert s.fire(Context(now=T0))[0].key != s.fire(Context(now=T0 + 60))[0].key


# -- the node-notice plan ----------------------------------------------------------------------
def test_evacuation_moves_highest_priority_first_and_suspends_what_fits_nowhere():
    ws = [worker(f"w{i}", prio=p, gpus=g) for i, (p, g) in enumerate([(0, 2), (9, 2), (5, 4), (1, 1)])]
    nodes = {"n1": {"gpus_free": 0}, "n2": {"gpus_free": 4}, "n3": {"gpus_free": 3, "cordoned": False},
             "n4": {"gpus_free": 8, "cordoned": True}}
    ctx = Context(now=T0, workers=ws, nodes=nodes, move_s=30)
    steps = evacuation(Firing("k", "r", node="n1", deadline=T0 + 45), ws, ctx, parallel=1, suspend_if_no_room=True)
    assert [(s.op, s.worker) for s in steps] == [("move", "w1"), ("move", "w2"), ("move", "w3"), ("suspend", "w0")]
    assert [s.to for s in steps[:3]] == ["n3", "n2", "n3"]  # best fit; the cordoned n4 is never a target
    assert [s.fits_deadline for s in steps[:3]] == [True, False, False]  # one at a time, 30 s each


def test_a_short_notice_says_so_at_once_and_moves_the_highest_priority_first():
    c = Clock()
    fc = FakeCluster(c)
    fc.workers = [worker(f"w{i}", prio=i, gpus=1, gpu_ids=(i,)) for i in range(4)]
    fc.health["n1"]["notice"] = {"at": T0 + 40}
    fc.move_takes_s = 30.0
    eng = fc.engine({"policies": [{"name": "notice", "trigger": {"kind": "node-notice"},
                                   "action": {"kind": "move", "parallel": 2}}]})
    eng.update()
    planned = [f for k, f in fc.events if k == "policy_planned"][0]
    assert planned["short_by_s"] == pytest.approx(20.0)  # 2 waves x 30 s against 40 s
    assert ("cordon", "n1", T0 + 40) in fc.calls
    moved = [c_[1] for c_ in fc.calls if c_[0] == "move"]
    assert moved == ["w3", "w2"]  # the second wave would start at the deadline: set aside instead
    assert [c_[1] for c_ in fc.calls if c_[0] == "suspend"] == ["w1", "w0"]
    outcome = [f for k, f in fc.events if k == "policy_outcome"][0]
    assert outcome["met_deadline"] is True
    counts = {(r["action"], r["result"]): r["n"] for r in fc.store.all("policy_actions")}
    assert counts[("move", "ok")] == 2 and counts[("suspend", "ok")] == 2


# -- hysteresis and budget ---------------------------------------------------------------------
def _flap(hold_s: float, budget: int, cooldown_s: float = 0.0) -> FakeCluster:
    c = Clock()
    fc = FakeCluster(c)
    eng = fc.engine({"policies": [{"name": "bad-gpu", "trigger": {"kind": "gpu-health"}, "action": {"kind": "move"},
                                   "limits": {"hold_s": hold_s, "cooldown_s": cooldown_s,
                                              "max_moves_per_hour": budget}}]})
    for second in range(300):  # the health signal flips every second for five minutes
        fc.health["n1"]["gpus"] = [{"index": 2, "remapped_rows_pending": second % 2 == 0}]
        eng.update()
        c.t += 1.0
    return fc


def test_a_flapping_health_signal_causes_at_most_the_budget_of_moves():
    fc = _flap(hold_s=0, budget=3)
    assert len(fc.moves()) == 3  # without the budget: one move per flap (150)
    assert fc.moves()[0] == ("move", "w1", "n2")  # the worker on GPU 2, nothing else


def test_hold_s_ignores_a_signal_that_never_holds():
    assert _flap(hold_s=5, budget=100).moves() == []


def test_cooldown_spaces_the_moves_of_one_condition():
    assert len(_flap(hold_s=0, budget=100, cooldown_s=100).moves()) == 3  # at 0, 100 (even s), 200


# -- GPU states, failing policies, dry run -----------------------------------------------------
def test_draining_gpu_is_moved_off_then_ready_for_reset_and_held():
    c = Clock()
    fc = FakeCluster(c)
    eng = fc.engine({"policies": [{"name": "bad-gpu", "trigger": {"kind": "gpu-health"}, "action": {"kind": "move"}}]})
    fc.health["n1"]["gpus"] = [{"index": 2, "remapped_rows_pending": True}, {"index": 3, "xids": [43]}]
    eng.update()
    assert [g["state"] for g in eng.gpus.states()] == ["draining"]
    assert fc.moves() == [("move", "w1", "n2")]
    fc.workers = [w for w in fc.workers if w["id"] != "w1"]  # the move done: nothing on GPU 2
    eng.update()
    assert [(g["gpu"], g["state"], g["held"]) for g in eng.gpus.states()] == [(2, "ready_for_reset", True)]
    assert ("hold", "n1", 2) in fc.calls
    fc.health["n1"]["gpus"] = [{"index": 2}]  # reset: healthy again
    eng.update()
    assert eng.gpus.states() == [] and ("release", "n1", 2) in fc.calls
    moves = [f for k, f in fc.events if k == "gpu_health"]
    assert [(e["from"], e["to"]) for e in moves] == [("healthy", "draining"), ("draining", "ready_for_reset"),
                                                     ("ready_for_reset", "healthy")]


def test_a_failed_gpu_replaces_its_worker_and_application_xids_do_nothing():
    c = Clock()
    fc = FakeCluster(c)
    eng = fc.engine({"policies": [{"name": "bad-gpu", "trigger": {"kind": "gpu-health"}, "action": {"kind": "move"}}]})
    fc.health["n1"]["gpus"] = [{"index": 0, "xids": [13, 31, 43]}, {"index": 2, "xids": [79]}]
    eng.update()
    assert fc.moves() == [("replace", "w1")]
    assert [(g["gpu"], g["state"]) for g in eng.gpus.states()] == [(2, "failed")]


def test_one_failing_policy_never_stops_the_others():
    c = Clock()
    fc = FakeCluster(c)
    eng = fc.engine({"policies": [
        {"name": "broken", "trigger": {"kind": "node-notice"}, "action": {"kind": "move"}},
        {"name": "bad-gpu", "trigger": {"kind": "gpu-health"}, "action": {"kind": "move"}}]})
    fc.health["n1"] = {"notice": {"at": "not a time"}, "gpus": [{"index": 2, "xids": [63]}]}
    eng.update()
    assert "error" in eng.last["broken"]
    assert fc.moves() == [("move", "w1", "n2")]


def test_dry_run_changes_nothing_and_says_why_it_would_wait():
    c = Clock()
    fc = FakeCluster(c)
    eng = fc.engine({"policies": [{"name": "bad-gpu", "trigger": {"kind": "gpu-health"}, "action": {"kind": "move"},
                                   "limits": {"hold_s": 10}}]})
    fc.health["n1"]["gpus"] = [{"index": 2, "xids": [63]}]
    out = eng.dry_run()
    (p,) = out["policies"]
    assert p["firings"][0]["would"].startswith("holding")
    assert p["firings"][0]["steps"] == [{"op": "move", "worker": "w1", "node": "n1", "to": "n2", "priority": 0,
                                         "fits_deadline": True}]
    assert fc.calls == [] and fc.events == []


def test_a_window_cordons_then_uncordons_after_its_end():
    c = Clock()
    fc = FakeCluster(c)
    fc.workers = []
    eng = fc.engine({"policies": [{"name": "mw", "trigger": {"kind": "window", "node": "n1", "start": T0 + 100,
                                                             "end": T0 + 200, "lead_s": 100},
                                   "action": {"kind": "move"}}]})
    eng.update()
    assert ("cordon", "n1", T0 + 200) in fc.calls
    c.t = T0 + 200
    eng.update()
    assert ("uncordon", "n1") in fc.calls


def test_runner_counts_a_refused_move_and_goes_on():
    c = Clock()
    fc = FakeCluster(c)

    def refuse(wid, to=None, transfer=None, wait=False):
        raise RuntimeError("busy")

    ports = fc.ports()
    ports = PolicyPorts(**{**ports.__dict__, "relocate": refuse})
    plan = MoveAction(kind="move").plan(Firing("k", "r", node="n1"), fc.workers, Context(now=T0, nodes=fc.nodes))
    out = Runner(ports, c, c.sleep).run("p", Firing("k", "r", node="n1"), plan)
    assert [r["result"] for r in out] == ["ok", "failed", "failed"]  # the cordon, two refused moves


# -- the agent's health reader -----------------------------------------------------------------
def test_health_reader_on_the_fake_nvml_file(tmp_path):
    (tmp_path / "fake-nvml.json").write_text(json.dumps(
        {"count": 4, "gpus": [{"index": 2, "remapped_rows_pending": True, "xids": [63]}]}))
    r = HealthReader("n1", tmp_path, env={})
    first = r.read()
    assert first["nvml"] == "fake" and len(first["gpus"]) == 4 and first["notice"] is None
    g2 = first["gpus"][2]
    assert g2["remapped_rows_pending"] is True and g2["xids"] == [63]
    assert r.read()["gpus"][2]["xids"] == [63]  # sticky: delivered once, kept
    r.clear(2)
    assert r.read()["gpus"][2]["xids"] == []
    write_notice(tmp_path, T0 + 60, "spot")
    assert r.read()["notice"] == {"at": T0 + 60, "reason": "spot"}


def test_health_reader_without_nvml_reports_no_gpus(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    out = HealthReader("n1", tmp_path, env={}).read()
    assert out["gpus"] == [] and out["nvml"] == "none"


# -- CLI and metrics ---------------------------------------------------------------------------
def test_cli_validates_a_file_offline_and_refuses_bad_labels(tmp_path):
    from typer.testing import CliRunner

    from relocator.cli import _register, app

    _register()
    bad = tmp_path / "p.yaml"
    bad.write_text("policies:\n - name: x\n   trigger: {kind: schedule, cron: '* * *'}\n   action: {kind: move}\n"
                   " - name: y\n   trigger: {kind: node-notice}\n   action: {kind: cordon}\n")
    r = CliRunner().invoke(app, ["policies", "--file", str(bad), "--json"])
    assert r.exit_code == 2
    out = json.loads(r.stdout)
    assert [p["name"] for p in out["policies"]] == ["y"] and out["errors"][0]["name"] == "x"
    r = CliRunner().invoke(app, ["launch", "--label", "nokey", "--cluster-dir", str(tmp_path)])
    assert r.exit_code == 2 and "--label wants k=v" in r.output
    r = CliRunner().invoke(app, ["notice", "n1", "--cluster-dir", str(tmp_path)])
    assert r.exit_code == 2 and "exactly one of" in r.output


def test_policy_counts_and_gpu_states_are_metrics():
    from relocator.controller.metrics import ControllerCollector

    store = MemStore()
    store.put("policy_actions", "p|move|ok", {"policy": "p", "action": "move", "result": "ok", "n": 2})
    store.put("gpu_health", "n1/2", {"node": "n1", "gpu": 2, "state": "draining", "why": "x"})
    fams = {f.name: f for f in ControllerCollector.policy_metrics(store)}
    (s,) = [s for s in fams["relocator_policy_actions"].samples if s.name.endswith("_total")]
    assert s.labels == {"policy": "p", "action": "move", "result": "ok"} and s.value == 2
    (g,) = fams["relocator_gpu_health"].samples
    assert g.labels == {"node": "n1", "gpu": "2", "state": "draining"}


def test_shutdown_releases_every_withheld_gpu():
    c = Clock()
    fc = FakeCluster(c)
    fc.workers = []
    eng = fc.engine({"policies": []})
    fc.health["n1"]["gpus"] = [{"index": 1, "xids": [79]}]
    eng.update()
    assert ("hold", "n1", 1) in fc.calls
    eng.gpus.release_all()
    assert ("release", "n1", 1) in fc.calls and eng.gpus.states()[0]["held"] is False
