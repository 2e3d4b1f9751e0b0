"""The scheduling benchmark's day runner against a fake controller (no cluster): a launch the
stock scheduler refuses is tried again, a queued one waits to be seated, a stop retries while busy."""

from __future__ import annotations

import time

from relocator.bench.scheduling import Day, Outcome, Step


class FakeCtl:
    def __init__(self, refusals: int = 0, pending: bool = False, busy: int = 0) -> None:
        self.refusals, self.pending, self.busy = refusals, pending, busy
        self.launches, self.stops, self.state = 0, 0, "pending"

    def launch(self, model, gpus, make_room, **kw):
        self.launches += 1
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


def _day(ctl, moves=False) -> Day:
    d = Day(ctl, moves=moves, engine="vllm", scale=0.001, log=lambda _m: None)
    d.t0 = time.monotonic()
    return d


def test_a_refused_stock_launch_is_tried_again_until_it_serves():
    ctl = FakeCtl(refusals=1)
    o = Outcome(Step("a", 0, 2, 1e9))
    _day(ctl)._launch(o)
    assert ctl.launches == 2 and o.attempts == 2 and o.served is not None and o.error == "" and o.done.is_set()


def test_a_queued_launch_serves_once_seated():
    o = Outcome(Step("a", 0, 2, 1e9))
    _day(FakeCtl(pending=True))._launch(o)
    assert o.served is not None and o.attempts == 1


def test_a_refusal_with_moves_is_a_failure_not_a_retry():
    ctl = FakeCtl(refusals=5)
    o = Outcome(Step("a", 0, 2, 1e9))
    _day(ctl, moves=True)._launch(o)
    assert ctl.launches == 1 and o.served is None and "no node" in o.error


def test_a_stop_while_busy_is_tried_again():
    ctl = FakeCtl(busy=1)
    o = Outcome(Step("a", 0, 2, 0))
    o.done.set()
    _day(ctl)._stop_worker(o)
    assert ctl.stops == 2 and o.stopped
