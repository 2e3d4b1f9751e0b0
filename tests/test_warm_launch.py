"""The agent's warm-or-cold start (relocator.warm.launch) with fakes: which path a start takes,
why, the capture once per kind, and that neither a failed restore nor a failed capture fails it."""

from __future__ import annotations

import threading

import pytest

from relocator.warm import launch as L
from relocator.warm.config import WarmConfig
from relocator.warm.key import launch_digest
from relocator.warm.start import NoWarmImage


class FakeCell:
    def __init__(self, cid: str) -> None:
        self.id, self.killed = cid, False

    def kill(self) -> None:
        self.killed = True


@pytest.fixture
def fakes(monkeypatch, tmp_path):
    import relocator.warm.capture as C
    import relocator.warm.start as S
    import relocator.worker as W

    calls: dict[str, list] = {"launch": [], "restore": [], "dump": []}

    async def ready(cell, timeout=0, poll=0):
        return 0.01

    def launch_worker(spec, engine, cell_id, gpu_ids):
        calls["launch"].append(cell_id)
        return FakeCell(cell_id)

    monkeypatch.setattr(W, "launch_worker", launch_worker)
    monkeypatch.setattr(W, "wait_ready", ready)
    monkeypatch.setattr(S, "key_for_launch", lambda spec, engine, gpu_ids: "vllm-0.1-" + "a" * 32)
    monkeypatch.setattr(C, "key_of_cell", lambda cell: "vllm-0.1-" + "a" * 32)
    monkeypatch.setattr(L.WarmStarts, "store", lambda self, cfg: object())
    monkeypatch.delenv("RELOCATOR_WARM__ENABLED", raising=False)
    return calls


def _no_image(store, key, target):
    raise NoWarmImage(f"no warm image {key}")


def test_off_is_cold_and_captures_nothing(fakes, monkeypatch) -> None:
    import relocator.warm.capture as C

    monkeypatch.setenv("RELOCATOR_WARM__ENABLED", "0")
    monkeypatch.setattr(C, "dump_staged", lambda *a, **k: pytest.fail("captured with warm off"))
    cell, _, warm = L.WarmStarts("n1", "/nonexistent").start(None, "vllm", "c1", None, 10)
    assert fakes["launch"] == ["c1"] and warm["how"] == "cold"
    assert "warm.enabled" in warm["reason"] and warm["capture"]["dumped"] is False


def test_the_env_switch_reads_through_the_file(monkeypatch, tmp_path) -> None:
    cfg = tmp_path / "images.yaml"
    cfg.write_text("enabled: true\n")
    monkeypatch.setenv("RELOCATOR_WARM__ENABLED", "false")
    assert WarmConfig.load(cfg).enabled is False
    monkeypatch.delenv("RELOCATOR_WARM__ENABLED")
    assert WarmConfig.load(cfg).enabled is True


def test_no_image_starts_cold_with_the_reason_then_captures_once(fakes, monkeypatch) -> None:
    import relocator.warm.capture as C
    import relocator.warm.start as S

    monkeypatch.setattr(S, "restore_warm", _no_image)
    release = threading.Event()
    filed: list[str] = []

    class Staged(C.Staged):
        def __init__(self, key):
            self.key, self.cell, self.timings = key, FakeCell("x"), {"criu_dump_s": 1.5}

    def dump(cell, store, key=None):
        fakes["dump"].append(cell.id)
        return Staged(key)

    def file_staged(staged):
        release.wait(10)
        filed.append(staged.key)
        raise RuntimeError("store full")  # a failed filing: logged, never raised to the launch

    monkeypatch.setattr(C, "Staged", Staged)
    monkeypatch.setattr(C, "dump_staged", dump)
    monkeypatch.setattr(C, "file_staged", file_staged)
    ws = L.WarmStarts("n1", "/nonexistent")
    _, _, first = ws.start(None, "vllm", "c1", None, 10)
    assert first["how"] == "cold" and "NoWarmImage" in first["reason"]
    assert first["capture"] == {"dumped": True, "key": first["key"], "reason": "", "freeze_s": 1.5}
    # the same kind again while the first is being filed: no second dump
    second = ws.capture(WarmConfig.load(), FakeCell("c2"))
    assert second["dumped"] is False and "under way" in second["reason"] and fakes["dump"] == ["c1"]
    release.set()
    ws._wait_filing(first["key"])
    assert filed == [first["key"]]  # its failure was logged, not raised


def test_a_restore_is_warm_and_launches_nothing(fakes, monkeypatch) -> None:
    import relocator.warm.start as S

    seen = {}

    def restore(store, key, target):
        seen["target"] = target
        return FakeCell(target.cell_id)

    monkeypatch.setattr(S, "restore_warm", restore)
    cell, ready_s, warm = L.WarmStarts("n1", "/nonexistent").start(None, "vllm", "w7-cabc", [2], 10)
    assert warm["how"] == "warm" and cell.id == "w7-cabc" and fakes["launch"] == []
    assert seen["target"].cell_id == "w7-cabc" and seen["target"].gpu_ids == [2]  # its identity
    assert ready_s >= 0


def test_a_restored_copy_that_never_serves_is_killed_and_started_cold(fakes, monkeypatch) -> None:
    import relocator.warm.start as S
    import relocator.worker as W

    restored = FakeCell("c1")
    monkeypatch.setattr(S, "restore_warm", lambda store, key, target: restored)
    state = {"n": 0}

    async def ready(cell, timeout=0, poll=0):
        state["n"] += 1
        if cell is restored:
            raise TimeoutError("not ready")
        return 0.01

    monkeypatch.setattr(W, "wait_ready", ready)
    monkeypatch.setenv("RELOCATOR_WARM__CAPTURE__ENABLED", "0")
    _, _, warm = L.WarmStarts("n1", "/nonexistent").start(None, "vllm", "c1", None, 10)
    assert restored.killed and fakes["launch"] == ["c1"]
    assert warm["how"] == "cold" and "did not get ready" in warm["reason"]


def test_a_fenced_start_does_not_fall_back_to_a_cold_one(fakes, monkeypatch) -> None:
    # the node was declared lost mid-start (its agent outlived its raylet): no copy of any kind
    import relocator.warm.start as S
    from relocator.cell.cell import CellFenced

    def restore(store, key, target):
        raise CellFenced(f"cell {target.cell_id} was fenced")

    monkeypatch.setattr(S, "restore_warm", restore)
    with pytest.raises(CellFenced):
        L.WarmStarts("n1", "/nonexistent").start(None, "vllm", "w1-r1", None, 10)
    assert fakes["launch"] == []


def test_fake_gpu_ids_are_not_part_of_the_kind() -> None:
    a = {"served_model_name": "m", "env": {"CUDA_VISIBLE_DEVICES": "0", "X": "1"}}
    b = {"served_model_name": "m", "env": {"CUDA_VISIBLE_DEVICES": "3", "X": "1"}}
    c = {"served_model_name": "m", "env": {"CUDA_VISIBLE_DEVICES": "3", "X": "2"}}
    assert launch_digest(a) == launch_digest(b) != launch_digest(c)


def test_the_controller_says_how_a_replacement_started(tmp_path) -> None:
    from relocator.controller.store import Store
    from tests.test_controller_managers import Agents, Events, _workers, worker

    class WarmAgents(Agents):
        def call(self, node, method, *args, **kw):
            out = super().call(node, method, *args, **kw)
            if method == "launch":
                return {**out, "warm": {"how": "warm", "key": "k", "reason": ""}}
            return out

    store = Store(tmp_path / "controller.db")
    store.save_worker(worker(state="lost"))
    ev = Events()
    m, _ = _workers(store, WarmAgents(), ev)
    m.claims.busy.add("w1")
    m.replace(store.worker("w1"))
    started = [f for k, f in ev if k == "worker_started"]
    assert [(f["worker"], f["node"], f["how"], f["key"]) for f in started] == [("w1", "n2", "warm", "k")]
    assert ev[-1][1]["how"] == "restored from a warm image" and store.worker("w1").state.value == "running"
