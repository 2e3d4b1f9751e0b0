"""A start at low CPU priority (relocator.warm.lowstart; a handoff's target copy, issue 29), with
fakes: the start runs niced, a restored tree is niced again (CRIU put back the image's nice), a
cold copy is captured at normal priority (an image never carries the low one), and a priority
that cannot be set never fails a start."""

from __future__ import annotations

from contextlib import contextmanager

import pytest

from relocator.warm import launch as L
from relocator.warm import lowstart
from tests.test_warm_launch import FakeCell, _no_image, fakes  # noqa: F401 - the fixture


@pytest.fixture
def niced(monkeypatch):
    """What the start asked of priorities, in order: ("start", n) / ("end", n) around the niced
    block, ("cell", id, n) for each renice of a tree."""
    seen: list[tuple] = []

    @contextmanager
    def niced_start(nice):
        seen.append(("start", nice))
        yield
        seen.append(("end", nice))

    monkeypatch.setattr(L, "this_thread_niced", niced_start)
    def renice(cell, nice):
        if nice is not None:
            seen.append(("cell", cell.id, nice))
        return 0

    monkeypatch.setattr(L, "renice", renice)
    monkeypatch.setattr(lowstart, "renice", renice)  # captured_at_normal's
    monkeypatch.setattr(lowstart, "normal_nice", lambda: 15)  # the agent's (Ray's workers: 15)
    return seen


def test_a_warm_start_at_low_priority_renices_the_restored_tree(fakes, niced, monkeypatch) -> None:
    import relocator.warm.start as S

    def restore(store, key, target):
        niced.append(("restore",))
        return FakeCell(target.cell_id)

    monkeypatch.setattr(S, "restore_warm", restore)
    cell, _, warm = L.WarmStarts("n1", "/nonexistent").start(None, "vllm", "w1-r1", None, 10, nice=19)
    assert warm["how"] == "warm" and warm["nice"] == 19, warm
    # CRIU ran inside the niced block, and the tree it restored was niced once it existed
    assert niced == [("start", 19), ("restore",), ("cell", "w1-r1", 19), ("end", 19)], niced


def test_a_cold_start_at_low_priority_is_captured_at_normal_priority(fakes, niced, monkeypatch) -> None:
    import relocator.warm.start as S

    monkeypatch.setattr(S, "restore_warm", _no_image)
    monkeypatch.setattr(L.WarmStarts, "capture", lambda self, cfg, cell: niced.append(("capture",)) or {"dumped": True})
    _, _, warm = L.WarmStarts("n1", "/nonexistent").start(None, "vllm", "w1-r1", None, 10, nice=19)
    assert warm["how"] == "cold" and warm["capture"] == {"dumped": True}, warm
    # the engine niced from its launch; the image dumped at the agent's nice (CRIU keeps each
    # thread's nice in the image)
    assert niced == [("start", 19), ("cell", "w1-r1", 19), ("cell", "w1-r1", 15), ("capture",),
                     ("cell", "w1-r1", 19), ("end", 19)], niced


def test_a_start_without_a_nice_changes_no_priority(fakes, niced, monkeypatch) -> None:
    import relocator.warm.start as S

    monkeypatch.setattr(S, "restore_warm", lambda store, key, target: FakeCell(target.cell_id))
    _, _, warm = L.WarmStarts("n1", "/nonexistent").start(None, "vllm", "c1", None, 10)
    assert "nice" not in warm and niced == [("start", None), ("end", None)], niced


def test_renice_sets_every_thread_of_the_tree_and_never_raises(monkeypatch) -> None:
    class Cell:
        id = "c1"

        def pids(self):
            return [10, 11]

    got: list = []
    monkeypatch.setattr(lowstart.procs, "set_nice", lambda pids, nice, group=None: got.append((pids, nice, group)) or 7)
    assert lowstart.renice(Cell(), 19) == 7 and got == [([10, 11], 19, 19)]  # the session too
    assert lowstart.renice(Cell(), None) == 0 and len(got) == 1  # None: nothing asked
    normal = lowstart.normal_nice()
    assert lowstart.renice(Cell(), normal) == 7 and got[-1] == ([10, 11], normal, 0)  # every session's 0
    assert lowstart.set_priority(Cell(), None) == 7 and got[-1] == ([10, 11], normal, 0)
    assert lowstart.set_priority(Cell(), -10) == 7 and got[-1] == ([10, 11], -10, -10)

    def broken(pids, nice, group=None):
        raise OSError("gone")

    monkeypatch.setattr(lowstart.procs, "set_nice", broken)
    assert lowstart.renice(Cell(), 0) == 0  # logged, not raised


def test_the_capture_puts_the_low_priority_back_even_when_it_fails(monkeypatch) -> None:
    got: list = []
    monkeypatch.setattr(lowstart, "renice", lambda cell, nice: got.append(nice))
    monkeypatch.setattr(lowstart, "normal_nice", lambda: 15)

    def capture():
        got.append("dump")
        raise RuntimeError("criu failed")

    with pytest.raises(RuntimeError):
        lowstart.captured_at_normal(FakeCell("c1"), 19, capture)
    assert got == [15, "dump", 19], got
    got.clear()
    assert lowstart.captured_at_normal(FakeCell("c1"), None, lambda: "ok") == "ok" and got == []


def test_the_peer_sends_at_nice_19_where_the_copy_is_ahead_of_need_or_the_start_is_niced(monkeypatch) -> None:
    from relocator.agent import warmcopy

    nice = {"v": 0}
    monkeypatch.setattr(warmcopy.os, "getpriority", lambda which, who: nice["v"])
    assert warmcopy.sender_niced(True) is True  # ahead of need: both ends at 19, as before
    assert warmcopy.sender_niced(False) is False  # a start at normal priority waits for it: full speed
    nice["v"] = 19  # a start at low priority (a handoff's target) waits for it
    assert warmcopy.sender_niced(False) is True


def test_normal_is_this_processs_own_nice_not_0() -> None:
    import os

    assert lowstart.normal_nice() == os.getpriority(os.PRIO_PROCESS, os.getpid())
