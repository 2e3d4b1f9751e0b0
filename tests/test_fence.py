"""Fencing a lost node's cells from its state dir, without its agent (relocator.cell.fence)."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

import relocator.cell.netns as netns
from relocator.cell.cell import Cell, boot_id, list_cells, using_state_dir
from relocator.cell.fence import fence_cells


@pytest.fixture
def sleeper():
    procs = []

    def start() -> subprocess.Popen:
        p = subprocess.Popen(["sleep", "300"])
        procs.append(p)
        return p

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _alive(p: subprocess.Popen) -> bool:
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return False
        time.sleep(0.05)
    return True


def test_fence_kills_this_boots_cells_and_skips_foreign_ones(tmp_path: Path, sleeper, monkeypatch) -> None:
    monkeypatch.setattr(netns, "delete", lambda name: None)
    state = tmp_path / "nodes" / "n3" / "state"
    here, foreign, other = sleeper(), sleeper(), sleeper()
    with using_state_dir(state):
        Cell(id="w1-c0", netns="rl-x1", ip="10.0.0.2", port=8000, init_pid=here.pid).save()
        Cell(id="w2-c0", netns="rl-x2", ip="10.0.0.6", port=8000, init_pid=foreign.pid, boot_id="another-host").save()
        Cell(id="w3-c0", netns="rl-x3", ip="10.0.0.10", port=8000, init_pid=other.pid).save()
    out = fence_cells(state, ["w1-c0", "w2-c0"])
    assert out == {"killed": ["w1-c0"], "unreachable": ["w2-c0"]}
    here.wait(5)
    assert here.returncode is not None
    # a record from another boot is never acted on: its PID is someone else's here
    assert _alive(foreign) and _alive(other)
    with using_state_dir(state):
        ids = {c.id: c for c in list_cells()}
    assert set(ids) == {"w2-c0", "w3-c0"}
    assert not ids["w2-c0"].is_alive() and ids["w3-c0"].is_alive()
    assert fence_cells(state)["killed"] == ["w3-c0"]  # all of the node's cells


def test_fence_of_a_missing_node_dir_is_empty(tmp_path: Path) -> None:
    assert fence_cells(tmp_path / "nope") == {"killed": [], "unreachable": []}


def test_cells_record_their_boot() -> None:
    c = Cell(id="c", netns="n", ip="1.2.3.4", port=1, init_pid=1)
    assert c.boot_id == boot_id() != ""
