"""`relocator chaos --warm-faults` (relocator/chaos/warmsteps.py) against a fake controller and a
real store: the schedule, the step (the image damaged, the start after it checked) and its
outcome in the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from relocator.chaos import report as R
from relocator.chaos import warmsteps as WS
from relocator.chaos.config import ChaosConfig
from relocator.chaos.faults import Step, StepKind, make_schedule
from relocator.warm.store import ImageStore
from tests.test_warm_store import _fake_image, _key


def test_parse_names_the_live_faults_and_says_which_are_unit_tested_only() -> None:
    assert WS.parse_warm_faults("all") == ["corrupt", "truncate"] and WS.parse_warm_faults("none") == []
    assert WS.parse_warm_faults(None) == [] and WS.parse_warm_faults("truncate") == ["truncate"]
    with pytest.raises(ValueError, match="unit-tested only"):
        WS.parse_warm_faults("corrupt,full")
    with pytest.raises(ValueError, match="unknown warm fault"):
        WS.parse_warm_faults("bogus")


def test_each_warm_fault_is_one_step_of_its_kind() -> None:
    steps = make_schedule(2, [], {"w1": "n1"}, ["n1", "n2"], seed=3, warm=["corrupt", "truncate"])
    warm = [s for s in steps if s.kind is StepKind.WARM]
    assert sorted(s.warm for s in warm) == ["corrupt", "truncate"] and all(s.trigger is None for s in warm)
    assert len(steps) == 4


class FakeCtl:
    """The controller's calls a warm step makes; the launch's start answered by `how`/`reason`."""

    def __init__(self, how: str, reason: str) -> None:
        self.how, self.reason = how, reason
        self.evs = [{"seq": 1, "kind": "worker_started", "worker": "w1", "key": _key(), "how": "cold",
                     "capture": {"dumped": True}}]
        self.stopped: list[str] = []

    def events(self, since=None, kinds=None, idle_timeout=None):
        return [e for e in self.evs if e["seq"] > (since or 0)]

    def launch(self, model, gpus=1, node=None, engine=None, make_room=True):
        self.evs.append({"seq": 2, "kind": "worker_started", "worker": "w2", "key": _key(), "how": self.how,
                         "reason": self.reason, "seconds": 40.0})
        return {"id": "w2", "state": "running", "node": node, "cell_id": "w2-c1"}

    def stop_worker(self, wid):
        self.stopped.append(wid)


@pytest.fixture
def live(monkeypatch, tmp_path: Path):
    store = ImageStore(tmp_path / "store", max_bytes=10_000)
    store.put(_key(), _fake_image(tmp_path / "img", size=4000))
    monkeypatch.setattr(WS, "_store", lambda base, node: store)
    monkeypatch.setattr(WS, "_serving", lambda ctl, ids=None: [])
    return store


def _run(ctl: FakeCtl, fault: str) -> dict:
    step = Step(0, "w1", "n2", kind=StepKind.WARM, warm=fault)
    return WS.warm_step(ctl, Path("/x"), step, {"id": "w1", "node": "n1"}, ChaosConfig(), lambda m: None)


def test_a_step_damages_the_image_and_a_cold_start_that_names_it_is_ok(live: ImageStore) -> None:
    before = (live.path_of(_key()) / "pages-1.img").stat().st_size
    ctl = FakeCtl("cold", f"ImageError: warm image {_key()} removed: image file pages-1.img is truncated")
    rec = _run(ctl, "truncate")
    assert rec["injected"] and rec["result"] == "done" and not rec.get("error"), rec
    assert (live.path_of(_key()) / "pages-1.img").stat().st_size == before // 2
    assert ctl.stopped == ["w2"] and rec["cells"] == ["w2-c1"] and rec["start"]["how"] == "cold"
    outs, scheduling = R.outcomes([rec], {}, ChaosConfig())
    assert scheduling and scheduling[0]["ok"] and scheduling[0]["warm"] == "truncate", scheduling


def test_a_warm_start_from_a_damaged_image_fails_the_step(live: ImageStore) -> None:
    rec = _run(FakeCtl("warm", ""), "corrupt")
    assert rec["result"] == "failed" and any("not cold" in p for p in rec["problems"]), rec
    _outs, scheduling = R.outcomes([rec], {}, ChaosConfig())
    assert not scheduling[0]["ok"] and any("not cold" in p for p in scheduling[0]["problems"]), scheduling


def test_no_image_to_damage_is_an_error_not_a_hang(live: ImageStore, monkeypatch) -> None:
    monkeypatch.setattr(WS, "FILED_WAIT_S", 0.2)
    live.rm(_key())
    rec = _run(FakeCtl("cold", ""), "corrupt")
    assert rec["result"] == "failed" and "never held" in rec["error"] and not rec["injected"], rec
