"""GPU health operations (issue 33): fake GPUs marked bad by index or by count
(relocator.agent.fakenvml), held by count in the controller's GPU book (relocator.policies.gpustate),
the controller's mark/clear (relocator.controller.gpuops) and `relocator gpus`. Pure logic
with fakes: no Ray."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

from relocator.agent import fakenvml
from relocator.agent.health import HealthReader
from relocator.policies.base import Context
from relocator.policies.engine import PolicyEngine
from relocator.policies.gpustate import GpuBook
from relocator.policies.runner import PolicyPorts
from relocator.policies.triggers import GpuHealthTrigger
from tests.test_policies_units import T0, Clock, MemStore, worker

RULES = GpuHealthTrigger(kind="gpu-health")


# -- the NVML stand-in's file ------------------------------------------------------------------
def test_mark_by_count_picks_idle_unlisted_gpus_highest_first(tmp_path):
    f = tmp_path / "fake-nvml.json"
    assert fakenvml.mark(f, 4, "remap", count=2, avoid=[3]) == [1, 2]
    assert fakenvml.mark(f, 4, "xid79", count=1, avoid=[3]) == [0]  # 1 and 2 are listed already
    doc = json.loads(f.read_text())
    assert doc["count"] == 4 and [g["index"] for g in doc["gpus"]] == [0, 1, 2]
    assert doc["gpus"][0] == {"index": 0, "xids": [79]} and doc["gpus"][1]["remapped_rows_pending"] is True
    with pytest.raises(ValueError, match="only 0 GPU"):
        fakenvml.mark(f, 4, "remap", count=1, avoid=[3])
    with pytest.raises(ValueError, match="no GPU 4"):
        fakenvml.mark(f, 4, "remap", gpus=[4])
    with pytest.raises(ValueError, match="unknown GPU fault 'xid99'"):
        fakenvml.mark(f, 4, "xid99", gpus=[1])
    assert fakenvml.mark(f, 4, "app", gpus=[1]) == [1]  # marked again: the new fault replaces the old
    assert json.loads(f.read_text())["gpus"][1] == {"index": 1, "xids": [13, 31, 43]}
    assert fakenvml.reset(f, [1, 3]) == [1]
    assert fakenvml.listed(f) == [0, 2]
    assert fakenvml.reset(f) == [0, 2] and fakenvml.listed(f) == []


def test_reader_clear_resets_the_fake_gpu_and_a_new_xid_is_delivered_again(tmp_path):
    r = HealthReader("n1", tmp_path, env={})
    fakenvml.mark(tmp_path / "fake-nvml.json", 4, "xid79", gpus=[2])
    assert r.read()["gpus"][2]["xids"] == [79]
    r.clear(2)
    g = r.read()["gpus"][2]
    assert g["xids"] == [] and not g.get("remapped_rows_pending"), g
    r.mark(4, "xid79", [2], 0, [])  # the same Xid on the same GPU after its reset: a new event
    assert r.read()["gpus"][2]["xids"] == [79]


def test_reader_refuses_to_mark_real_gpus(tmp_path, monkeypatch):
    r = HealthReader("n1", tmp_path, env={})
    monkeypatch.setattr(r, "_module", lambda: (object(), "real"))
    with pytest.raises(ValueError, match="real GPUs"):
        r.mark(4, "remap", [0], 0, [])


# -- the GPU book: holds by count on fake GPUs --------------------------------------------------
class Holds:
    """hold/release ports: Ray hands out the node's free fake GPU ids lowest first."""

    def __init__(self, free: dict[str, list[int]]) -> None:
        self.free, self.calls = free, []

    def hold(self, node, gpu):
        if not self.free[node]:
            raise RuntimeError("no free GPU")
        got = self.free[node].pop(0)
        self.calls.append(("hold", node, gpu, got))
        return [got]

    def release(self, node, gpu):
        self.calls.append(("release", node, gpu))


def _ctx(workers, gpus_free, unhealthy, nvml="fake"):
    gpus = [{"index": i, "remapped_rows_pending": i in unhealthy, "xids": []} for i in range(4)]
    return Context(now=T0, workers=workers, nodes={"n1": {"gpus_total": 4, "gpus_free": gpus_free, "alive": True}},
                   health={"n1": {"nvml": nvml, "gpus": gpus}})


def test_n_unhealthy_idle_fake_gpus_take_n_holds_and_no_more_than_are_free():
    h = Holds({"n1": [0, 1]})
    events = []
    book = GpuBook(MemStore(), lambda k, **f: events.append((k, f)), h.hold, h.release)
    book.update(_ctx([worker("w1", gpu_ids=(3,))], 2, {1, 2}), RULES)
    states = {d["gpu"]: d for d in book.states()}
    assert {g: (d["state"], d["held"], d["held_as"]) for g, d in states.items()} == {
        1: ("ready_for_reset", True, [0]), 2: ("ready_for_reset", True, [1])}, states
    h2 = Holds({"n1": [0]})  # three unhealthy, one free: one hold tried, not three
    book2 = GpuBook(MemStore(), lambda k, **f: None, h2.hold, h2.release)
    book2.update(_ctx([worker("w1", gpu_ids=(3,))], 1, {0, 1, 2}), RULES)
    assert [c[0] for c in h2.calls] == ["hold"] and sum(d["held"] for d in book2.states()) == 1


def test_a_worker_ray_puts_on_a_held_fake_gpus_index_is_covered_not_moved():
    h = Holds({"n1": [0]})  # Ray gives the hold GPU 0 although GPU 2 is the bad one
    book = GpuBook(MemStore(), lambda k, **f: None, h.hold, h.release)
    book.update(_ctx([], 4, {2}), RULES)
    assert book.states()[0]["held_as"] == [0]
    ctx = _ctx([worker("w9", gpu_ids=(2,))], 3, {2})  # a new worker got index 2
    book.update(ctx, RULES)
    (d,) = book.states()
    assert (d["state"], d["held"]) == ("ready_for_reset", True), d
    assert book.covered() == {("n1", 2)}
    assert [g["index"] for g in book.visible(ctx.health)["n1"]["gpus"]] == [0, 1, 3]
    # on real GPUs the same worker is on the bad GPU: it drains (the policy moves it)
    real = GpuBook(MemStore(), lambda k, **f: None, Holds({"n1": []}).hold, h.release)
    real.update(_ctx([worker("w9", gpu_ids=(2,))], 3, {2}, nvml="real"), RULES)
    assert real.states()[0]["state"] == "draining"
    assert real.visible(_ctx([], 3, {2}, nvml="real").health)["n1"]["gpus"][2]["index"] == 2


def test_the_engine_does_not_move_a_worker_off_a_covered_fake_gpu():
    clock = Clock()
    store = MemStore()
    h = Holds({"n1": [0]})
    health = {"nvml": "fake", "gpus": [{"index": 2, "xids": [79]}]}
    workers: list[dict] = []
    calls: list[tuple] = []
    ports = PolicyPorts(
        store=store, emit=lambda k, **f: None, workers=lambda: [dict(w) for w in workers],
        nodes=lambda: {"n1": {"gpus_total": 4, "gpus_free": 4 - len(workers), "alive": True, "cordoned": False},
                       "n2": {"gpus_total": 4, "gpus_free": 4, "alive": True, "cordoned": False}},
        health=lambda n: health if n == "n1" else {"nvml": "fake", "gpus": []}, pending=lambda: [],
        relocations=lambda: [], relocate=lambda *a, **k: calls.append(("move", a)) or {"id": "r1"},
        relocation=lambda rid: {"result": "done"}, suspend=lambda w: calls.append(("suspend", w)),
        replace=lambda w: calls.append(("replace", w)), consolidate=lambda k: None,
        cordon=lambda n, u: None, uncordon=lambda n: None, hold_gpu=h.hold, release_gpu=h.release)
    eng = PolicyEngine(ports, None, clock=clock, spawn=lambda fn: fn(), sleep=clock.sleep)
    eng.apply({"policies": [{"name": "g", "trigger": {"kind": "gpu-health"}, "action": {"kind": "move"},
                             "limits": {"cooldown_s": 0}}]})
    eng.update()  # GPU 2 failed, idle: held (Ray gave the hold GPU 0)
    workers.append(worker("w9", gpu_ids=(2,)))  # then a launch got index 2
    for _ in range(3):
        clock.sleep(2.0)
        eng.update()
    assert calls == [], calls
    assert eng.dry_run()["policies"][0]["firings"] == []


# -- the controller's mark / clear --------------------------------------------------------------
class FakeAgents:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def mark_gpus(self, node, total, kind, gpus, count, avoid):
        self.calls.append(("mark", node, total, kind, gpus, count, avoid))
        return gpus or list(range(total - count, total))

    def clear_gpu(self, node, index):
        self.calls.append(("clear", node, index))


def _ctl(states=()):
    from relocator.controller.model import WorkerState

    agents = FakeAgents()
    ws = [SimpleNamespace(node="n1", state=WorkerState.RUNNING, gpu_ids=[0]),
          SimpleNamespace(node="n1", state=WorkerState.SUSPENDED, gpu_ids=[1]),  # holds no GPU
          SimpleNamespace(node="n2", state=WorkerState.RUNNING, gpu_ids=[2])]
    return SimpleNamespace(
        inventory=lambda: {"n1": SimpleNamespace(alive=True, gpus_total=4), "n2": SimpleNamespace(alive=False, gpus_total=4)},
        store=SimpleNamespace(workers=lambda: ws), backend=SimpleNamespace(agents=agents),
        claims=SimpleNamespace(wake=SimpleNamespace(set=lambda: None)),
        policies=SimpleNamespace(gpus=SimpleNamespace(states=lambda: list(states)))), agents


def test_mark_gpus_passes_the_gpus_in_use_and_refuses_bad_input():
    from relocator.controller.gpuops import clear_gpus, mark_gpus

    ctl, agents = _ctl()
    out = mark_gpus(ctl, "n1", "remap", count=2)
    assert agents.calls == [("mark", "n1", 4, "remap", [], 2, [0])] and out["gpus"] == [2, 3]
    for args, msg in ((("n9", "remap"), "unknown node 'n9'"), (("n2", "remap", [1]), "n2 is lost"),
                      (("n1", "xid7", [1]), "unknown GPU fault"), (("n1", "remap"), "GPU indexes or a count"),
                      (("n1", "remap", [1], 2), "not both")):
        with pytest.raises(ValueError, match=msg):
            mark_gpus(ctl, *args)
    ctl, agents = _ctl([{"node": "n1", "gpu": 3, "state": "failed"}, {"node": "n2", "gpu": 0, "state": "failed"}])
    assert clear_gpus(ctl, "n1") == {"node": "n1", "cleared": [3], "were_unhealthy": [3]}
    assert clear_gpus(ctl, "n1", [1])["were_unhealthy"] == []
    assert agents.calls == [("clear", "n1", 3), ("clear", "n1", 1)]
    with pytest.raises(ValueError, match="no GPU 7 on n1"):
        clear_gpus(ctl, "n1", [7])


# -- `relocator gpus` ---------------------------------------------------------------------------
class FakeClient:
    def __init__(self, states, clears_to=None) -> None:
        self.states, self.clears_to, self.calls = list(states), clears_to, []

    def status(self):
        return {"gpu_health": self.states}

    def mark_gpus(self, node, kind, gpus, count):
        self.calls.append(("mark", node, kind, gpus, count))
        if node == "n9":
            raise ValueError("unknown node 'n9'; known: n1, n2")
        return {"node": node, "kind": kind, "gpus": gpus or [3], "in_use": []}

    def clear_gpus(self, node, gpus):
        self.calls.append(("clear", node, gpus))
        cleared = gpus or [g["gpu"] for g in self.states if g["node"] == node]
        if self.clears_to is not None:
            self.states = self.clears_to
        return {"node": node, "cleared": cleared, "were_unhealthy": cleared}


def _cli(monkeypatch, client, args):
    import relocator.cli.gpus as mod
    from relocator.cli import _register, app

    _register()
    monkeypatch.setattr(mod, "_connect", lambda d: client)
    monkeypatch.setattr(mod, "WAIT_S", 1.0)
    return CliRunner().invoke(app, ["gpus", *args])


HELD = {"node": "n1", "gpu": 2, "state": "ready_for_reset", "why": "remap", "since": time.time(), "held": True,
        "held_as": [0]}


def test_cli_list_table_and_json(monkeypatch):
    res = _cli(monkeypatch, FakeClient([HELD]), ["list"])
    assert res.exit_code == 0 and "ready_for_reset" in res.output and "yes (Ray GPU" in res.output, res.output
    res = _cli(monkeypatch, FakeClient([HELD]), ["list", "--json"])
    assert json.loads(res.output) == {"gpus": [HELD]}
    res = _cli(monkeypatch, FakeClient([HELD]), ["list", "--node", "n2"])
    assert "every GPU reads healthy on n2" in res.output


def test_cli_mark_by_count_and_bad_input_exit_2(monkeypatch):
    c = FakeClient([])
    res = _cli(monkeypatch, c, ["mark", "n1", "--count", "1", "--fault", "xid79", "--json"])
    assert res.exit_code == 0 and json.loads(res.output)["gpus"] == [3] and c.calls == [("mark", "n1", "xid79", None, 1)]
    for args, msg in ((["mark", "n1"], "give --gpu"), (["mark", "n1", "--gpu", "1", "--count", "2"], "give --gpu"),
                      (["mark", "n1", "--gpu", "1", "--fault", "xid99"], "unknown GPU fault 'xid99'"),
                      (["mark", "n9", "--gpu", "1"], "unknown node 'n9'")):
        res = _cli(monkeypatch, FakeClient([]), args)
        assert res.exit_code == 2, (args, res.output)
        lines = res.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], (args, res.output)


def test_cli_clear_waits_for_the_release_and_says_what_stays(monkeypatch):
    c = FakeClient([HELD], clears_to=[])
    res = _cli(monkeypatch, c, ["clear", "n1", "--json"])
    out = json.loads(res.output)
    assert res.exit_code == 0 and out["cleared"] == [2] and out["still_unhealthy"] == [], res.output
    stuck = FakeClient([HELD])  # NVML still reports the remap: not really reset
    res = _cli(monkeypatch, stuck, ["clear", "n1", "2"])
    assert res.exit_code == 1 and "still not healthy" in res.output, res.output
    assert stuck.calls == [("clear", "n1", [2])]
    res = _cli(monkeypatch, FakeClient([]), ["clear", "n1"])
    assert res.exit_code == 0 and "no unhealthy GPU" in res.output
