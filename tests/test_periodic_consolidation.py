"""Periodic consolidation in the reconcile loop (relocator.controller.periodic) with fakes:
off by default, config validated, minimum gain, hourly move cap, a busy cluster skipped, and a
failing run that never stops the next round."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from relocator.cluster.config import ConsolidateSection, LocalConfig
from relocator.controller.periodic import PeriodicConsolidation


class Fake:
    def __init__(self, freed=("n3",), moves=1, fail=False):
        self.freed, self.moves, self.fail = list(freed), moves, fail
        self.runs: list[int] = []
        self.plans: list[int] = []
        self.busy = False
        self.now = 1000.0

    def plan(self, k: int) -> dict:
        self.plans.append(k)
        return {"nodes_freed": self.freed, "moves": [{"worker": f"w{i}"} for i in range(min(k, self.moves))]}

    def run(self, k: int) -> dict:
        self.runs.append(k)
        if self.fail:
            raise RuntimeError("move of w0 failed")
        return {"nodes_freed": self.freed, "moves": [{"worker": "w0", "result": "done"}]}


def make(fake: Fake, **cfg) -> PeriodicConsolidation:
    return PeriodicConsolidation(cfg, plan=fake.plan, run=fake.run, busy=lambda: fake.busy,
                                 clock=lambda: fake.now, spawn=lambda fn: fn())


def test_off_by_default_and_validated() -> None:
    assert LocalConfig.load(None).controller.consolidate == ConsolidateSection(
        enabled=False, min_gain_nodes=1, max_moves_per_hour=6)
    cfg = LocalConfig.load(None, controller={"consolidate": {"enabled": True, "max_moves_per_hour": 2}})
    assert cfg.controller.consolidate.enabled and cfg.controller.consolidate.max_moves_per_hour == 2
    for bad in ({"min_gain_nodes": 0}, {"max_moves_per_hour": 0}, {"enabeld": True}):
        with pytest.raises(ValidationError):
            ConsolidateSection(**bad)
    fake = Fake()
    p = make(fake)
    p.update()
    assert fake.plans == [] and fake.runs == [] and p.last["why"] == "disabled"


def test_runs_when_worth_it_within_the_hourly_cap() -> None:
    fake = Fake(moves=2)
    p = make(fake, enabled=True, max_moves_per_hour=3)
    p.update()
    assert fake.runs == [3] and p.last["ran"] and p.budget() == 1
    p.update()  # one move left this hour: planned with that budget
    assert fake.plans[-1] == 1 and fake.runs == [3, 1] and p.budget() == 0
    p.update()
    assert p.last["why"].startswith("max_moves_per_hour") and len(fake.runs) == 2
    fake.now += 3600  # an hour later the cap is free again
    p.update()
    assert len(fake.runs) == 3


def test_minimum_gain_and_busy_cluster() -> None:
    fake = Fake(freed=("n3",))
    p = make(fake, enabled=True, min_gain_nodes=2)
    p.update()
    assert fake.runs == [] and "below min_gain_nodes=2" in p.last["why"]
    fake.freed = []
    p = make(fake, enabled=True)
    p.update()
    assert fake.runs == []
    fake.freed, fake.busy = ["n3"], True
    p.update()
    assert fake.runs == [] and p.last["why"] == "demands, relocations or a drain in progress"


def test_a_failing_run_never_stops_the_next_round() -> None:
    fake = Fake(fail=True)
    p = make(fake, enabled=True)
    p.update()
    assert p.last["error"] == "move of w0 failed" and not p._running.is_set()
    fake.fail = False
    p.update()
    assert p.last["ran"] and "result" in p.last and len(fake.runs) == 2
