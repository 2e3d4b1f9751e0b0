"""The scheduling benchmark's day runner against a fake controller (no cluster): every arm
queues a launch that does not fit and waits for it to be seated, a refused launch is a failure,
a stop retries while busy; the figures (idle GPU-seconds, work lost, the comparison) are pure."""

from __future__ import annotations

import time

import pytest

from relocator.bench.scheduling import ARMS, Day, Outcome, Step, compare, idle_while_waiting, starts, work_lost
from relocator.cluster.streams import RequestResult


class FakeCtl:
    def __init__(self, refusals: int = 0, pending: bool = False, busy: int = 0) -> None:
        self.refusals, self.pending, self.busy = refusals, pending, busy
        self.launches, self.stops, self.state, self.make_room = 0, 0, "pending", []

    def launch(self, model, gpus, make_room, **kw):
        self.launches += 1
        self.make_room.append(make_room)
        if self.launches <= self.refusals:
            raise RuntimeError("no node has 2 free GPUs")
        return {"state": "pending" if self.pending else "running"}

    def status(self):
        self.state = "running"  # seated on the first look
        return {"workers": [{"id": "a", "state": self.state}]}

    def stop_worker(self, wid):
        self.stops += 1
        if self.stops <= self.busy:
            raise RuntimeError("busy: a move")


def _day(ctl, rule="place-or-wait") -> Day:
    d = Day(ctl, rule, engine="vllm", scale=0.001, log=lambda _m: None)
    d.t0 = time.monotonic()
    return d


@pytest.mark.parametrize("rule", ARMS)
def test_every_arm_queues_and_serves_once_seated(rule):
    ctl = FakeCtl(pending=True)
    o = Outcome(Step("a", 0, 2, 1e9))
    _day(ctl, rule)._launch(o)
    assert o.served is not None and o.attempts == 1 and ctl.make_room == [True]  # queued, never polled


def test_a_refused_launch_is_a_failure_not_a_retry():
    ctl = FakeCtl(refusals=5)
    o = Outcome(Step("a", 0, 2, 1e9))
    _day(ctl)._launch(o)
    assert ctl.launches == 1 and o.served is None and "no node" in o.error and o.done.is_set()


def test_a_stop_while_busy_is_tried_again():
    ctl = FakeCtl(busy=1)
    o = Outcome(Step("a", 0, 2, 0))
    o.done.set()
    d = _day(ctl)
    d._stop_worker(o)
    assert ctl.stops == 2 and o.stopped and len(d.stops) == 1  # the stop that worked is recorded


def test_an_unknown_rule_is_refused():
    with pytest.raises(ValueError, match="valid: place-or-wait"):
        Day(FakeCtl(), "cancel", "vllm", 1.0, print)


def test_idle_gpu_seconds_count_only_while_something_waits():
    # 3 free for 2 s while waiting, then 1 free for 1 s not waiting, then 2 free for 1 s waiting
    assert idle_while_waiting([(0.0, 3, True), (2.0, 1, False), (3.0, 2, True), (4.0, 0, True)]) == 8.0
    assert idle_while_waiting([(0.0, 4, True)]) == 0.0


def test_work_lost_is_the_tokens_failed_requests_had_received_split_by_cause():
    ok = RequestResult(0, 0, tokens=[1, 2, 3], times=[0.0, 1.0])
    cut = RequestResult(1, 0, tokens=[4, 5], error="upstream broke", times=[9.0, 10.0, 10.1])
    at_stop = RequestResult(1, 0, tokens=[6, 7, 8], error="upstream broke", times=[19.0, 20.5])
    never = RequestResult(1, 1, error="HTTP 503")
    out = work_lost([ok, cut, at_stop, never], stops=[(20.0, 20.2)])
    assert out == {"failed_requests": 3, "tokens_of_work_lost": 5, "failed_requests_at_scripted_stops": 1,
                   "tokens_lost_at_scripted_stops": 3, "failed_requests_not_at_stops": 2,
                   "tokens_of_work_lost_not_at_stops": 2}
    assert work_lost([cut])["failed_requests_not_at_stops"] == 1  # no stops: all the rule's


def test_the_comparison_takes_the_best_stock_arm_and_checks_the_targets():
    arm = lambda p99, failed=0, lost=0: {"wait_s_p99": p99, "failed_requests": failed,  # noqa: E731
                                         "tokens_of_work_lost": lost}
    out = {"place-or-wait": arm(60.0), "evict-requeue": arm(30.0, 2, 40), "suspend-in-place": arm(45.0),
           "moves": arm(10.0)}
    c = compare(out)
    assert c["best_stock_arm"] == "evict-requeue" and c["p99_best_stock_over_moves"] == 3.0
    assert c["target_p99_moves_le_third_of_best_stock"] and c["target_moves_no_failed_requests_no_work_lost"]
    assert c["evict_requeue_loses_work"]
    out["moves"] = arm(12.0, 1, 5)
    c = compare(out)
    assert not c["target_p99_moves_le_third_of_best_stock"] and not c["target_moves_no_failed_requests_no_work_lost"]
    assert compare({"moves": arm(1.0)}) == {}
    assert c["p99_place_or_wait_over_moves"] == 5.0 and c["target_p99_moves_5x_shorter_than_place_or_wait"]


# ------------------------------------------------------------------ --warm on|off (issue 28)
def _fake_arms(monkeypatch):
    """bench.scheduling.run with each arm's subprocess faked: the environments it was given."""
    import json
    import subprocess

    import relocator.bench.scheduling as mod

    envs: dict[str, dict] = {}

    def fake(cmd, stdout, text, env):
        rule = cmd[3]
        envs[rule] = env
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"rule": rule, "wait_s_p99": 1.0,
                                                               "failed_requests": 0, "tokens_of_work_lost": 0}))

    monkeypatch.setattr(mod.subprocess, "run", fake)
    return mod, envs


@pytest.mark.parametrize("warm", [True, False])
def test_warm_reaches_every_arm_and_the_json_says_which(monkeypatch, warm):
    from relocator.warm.config import WarmConfig

    mod, envs = _fake_arms(monkeypatch)
    monkeypatch.setenv("RELOCATOR_WARM__ENABLED", "1" if not warm else "0")  # the flag wins over the caller's
    res = mod.run("/nonexistent", log=lambda m: None, warm=warm)
    assert set(envs) == set(ARMS), envs.keys()
    want = "on" if warm else "off"
    assert res["day"]["warm_images"] == want and all(res[a]["warm_images"] == want for a in ARMS), res
    for rule, env in envs.items():
        for k, v in env.items():  # what each arm's cluster (daemon, agents, controller) will read
            monkeypatch.setenv(k, v)
        assert WarmConfig.load().enabled is warm, (rule, env.get("RELOCATOR_WARM__ENABLED"))


def test_the_cli_passes_warm_on_by_default_and_refuses_other_values(monkeypatch):
    from typer.testing import CliRunner

    import relocator.bench.scheduling as mod
    from relocator.cli import _register, app

    _register()
    seen: list[bool] = []
    monkeypatch.setattr(mod, "run", lambda *a, **k: seen.append(k["warm"]) or {"day": {}})
    runner = CliRunner()
    for args, want in (([], True), (["--warm", "on"], True), (["--warm", "off"], False)):
        res = runner.invoke(app, ["bench", "scheduling", "--json", *args])
        assert res.exit_code == 0 and seen[-1] is want, (args, seen, res.output)
    n = len(seen)
    for bad in ("maybe", "ON", "0", ""):
        res = runner.invoke(app, ["bench", "scheduling", "--warm", bad, "--json"])
        lines = res.output.strip().splitlines()
        assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (bad, res.output)
        assert "--warm" in lines[0] and "on, off" in lines[0], lines[0]
    assert len(seen) == n, "a refused --warm ran the benchmark"


def test_starts_count_warm_and_cold_and_say_why_cold():
    ev = [{"kind": "worker_started", "worker": "b1", "how": "cold", "seconds": 9.0, "reason": "no image"},
          {"kind": "worker_started", "worker": "a", "how": "cold", "seconds": 6.0, "reason": "no image of its kind"},
          {"kind": "worker_started", "worker": "b", "how": "warm", "seconds": 1.0},
          {"kind": "worker_started", "worker": "d", "how": "warm", "seconds": 2.0},
          {"kind": "relocation_finished", "worker": "a", "result": "done"}]
    s = starts(ev, {"b1"})
    assert s["warm"] == 2 and s["cold"] == 1 and s["warm_s_max"] == 2.0 and s["cold_s_p50"] == 6.0, s
    assert s["cold_reasons"] == {"no image of its kind": 1}, s


def test_the_timeline_places_a_launchs_events_on_the_days_clock():
    day = Day(FakeCtl(), "moves", "reference", 2.0, lambda m: None, (Step("a", 0, 2, 10), Step("c", 0, 1, 10)), 10.0)
    day.t0, day.t0_wall = 100.0, 5000.0
    o = day.out["a"]
    o.requested, o.served = 102.0, 110.0
    day.stopped["b1"] = 104.0  # a scripted stop gives capacity back: on the timeline too
    ev = [{"kind": "worker_started", "worker": "a", "how": "warm", "seconds": 1.5, "ts": 5009.0, "capture": {}},
          {"kind": "worker_started", "worker": "c", "how": "cold", "ts": 5003.0},
          {"kind": "relocation_finished", "worker": "b1", "result": "done", "ts": 5006.0,
           "phases": {"dump": 1.0, "restore": 0.5}}]
    tl = day.timeline(ev)
    assert [(e["t"], e["kind"], e["worker"]) for e in tl] == [
        (1.0, "requested", "a"), (2.0, "stopped", "b1"), (3.0, "relocation_finished", "b1"),
        (4.5, "worker_started", "a"),
        (5.0, "serving", "a")], tl
    assert tl[2]["phases"] == {"dump": 1.0, "restore": 0.5} and "capture" not in tl[3], tl
