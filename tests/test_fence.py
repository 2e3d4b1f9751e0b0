"""Fencing a lost node's cells from its state dir, without its agent (relocator.cell.fence)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

import relocator.cell.netns as netns
from adapters.base import EngineFingerprint
from relocator import procs, waits
from relocator.cell.cell import Cell, CellFenced, boot_id, launch_cell, list_cells, record_built, using_state_dir
from relocator.cell.fence import fence_cells
from relocator.snapshot.criu import CriuError
from relocator.snapshot.fingerprint import Fingerprint, HostFingerprint
from relocator.snapshot.manifest import CellInfo, Manifest, write_manifest
from relocator.snapshot.snapshot import RestoreTarget, restore


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


# -- a start still under way on the lost node (its agent outlived its raylet) -------------------
#: a stand-in for `criu restore`: says it ran, waits $FAKE_CRIU_WAIT s, then leaves a detached
#: process (the restored tree) whose pid goes to --pidfile, as `criu restore -d` does
FAKE_CRIU = """#!/bin/sh
while [ $# -gt 0 ]; do [ "$1" = --pidfile ] && pidfile=$2; shift; done
echo $$ >> "$FAKE_CRIU_RAN"
sleep "${FAKE_CRIU_WAIT:-0}"
sleep 300 </dev/null >/dev/null 2>&1 &
echo $! >> "$FAKE_CRIU_RAN"
echo $! > "$pidfile"
"""


@pytest.fixture
def fake_criu(tmp_path: Path, monkeypatch):
    """RELOCATOR_CRIU is the script above; yields the file each run appends its pids to; every
    process a run left is killed afterwards."""
    criu = tmp_path / "bin" / "criu"
    criu.parent.mkdir()
    criu.write_text(FAKE_CRIU)
    criu.chmod(0o755)
    ran = tmp_path / "criu-ran"
    monkeypatch.setenv("RELOCATOR_CRIU", str(criu))
    monkeypatch.setenv("FAKE_CRIU_RAN", str(ran))
    yield ran
    for pid in (ran.read_text().split() if ran.exists() else []):
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _image(path: Path) -> Fingerprint:
    """A (tiny) warm image's directory: a manifest and no files; its fingerprint."""
    fp = Fingerprint(host=HostFingerprint(arch="x86_64", cpu_model="cpu", kernel="k", criu_version="4.2"),
                     engine=EngineFingerprint(engine="vllm", engine_version="0", model_id="m", weight_sha256="ab",
                                              dtype="float32", max_model_len=64))
    path.mkdir(parents=True)
    write_manifest(path, Manifest(files={}, fingerprint=fp, cell=CellInfo(engine="vllm", port=8000, source_cell="c0")))
    return fp


def _no_netns(monkeypatch, tmp_path: Path) -> list[str]:
    """netns.create/delete without touching the host's namespaces: the cell's 'namespace' is a
    file (CRIU's wrapper only opens it); the names deleted are returned."""
    deleted: list[str] = []
    ns_file = tmp_path / "netns"
    ns_file.touch()

    class Link(netns.NetLink):
        @property
        def path(self) -> str:
            return str(ns_file)

    monkeypatch.setattr(netns, "create", lambda name: Link(name, 1, "10.0.0.1", "10.0.0.2", "rlh1"))
    monkeypatch.setattr(netns, "delete", deleted.append)
    return deleted


needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="CRIU's restore wrapper needs root and util-linux unshare")


@needs_root
def test_a_warm_start_that_reaches_criu_after_the_fence_builds_nothing(tmp_path: Path, fake_criu, monkeypatch) -> None:
    # node-loss 0.44 s into a handoff's RESTORE: the rollback fenced the target cell while the
    # (orphaned) agent was still copying/checking the warm image; its CRIU came after the fence
    state = tmp_path / "nodes" / "n3" / "state"
    state.mkdir(parents=True)
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(state))  # as in the agent's process
    _no_netns(monkeypatch, tmp_path)
    fp = _image(tmp_path / "warm" / "k1")
    assert fence_cells(state, ["w1-rcc3fde48"]) == {"killed": [], "unreachable": []}  # nothing yet
    with pytest.raises(CellFenced):
        restore(tmp_path / "warm" / "k1", RestoreTarget(cell_id="w1-rcc3fde48", fingerprint=fp, verify="none"))
    assert not fake_criu.exists()  # CRIU never ran
    assert list_cells() == [] and not (state / "cells" / "w1-rcc3fde48").exists()


@needs_root
def test_a_fence_kills_a_restore_in_progress_and_its_tree(tmp_path: Path, fake_criu, monkeypatch) -> None:
    state = tmp_path / "nodes" / "n3" / "state"
    state.mkdir(parents=True)
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(state))
    monkeypatch.setenv("FAKE_CRIU_WAIT", "30")
    deleted = _no_netns(monkeypatch, tmp_path)
    fp = _image(tmp_path / "warm" / "k1")
    errors: list[BaseException] = []

    def start() -> None:
        try:
            restore(tmp_path / "warm" / "k1", RestoreTarget(cell_id="w1-r2", fingerprint=fp, verify="none"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=start)
    t.start()
    waits.until(fake_criu.exists, 10, every=0.02, what="the fake CRIU")
    fence_cells(state, ["w1-r2"])
    t.join(10)
    assert not t.is_alive() and isinstance(errors[0], CriuError)  # killed: the start fails
    pid = int(fake_criu.read_text().split()[0])
    assert not procs.alive(pid) and len(fake_criu.read_text().split()) == 1  # it built no tree
    assert "rl-w1-r2" in deleted and not (state / "cells" / "w1-r2").exists()
    with pytest.raises(CellFenced):  # and the cold start it falls back to refuses too
        launch_cell(["sleep", "300"], {}, 8000, cell_id="w1-r2")


def test_a_cell_recorded_after_its_fence_is_killed_by_its_builder(tmp_path: Path, sleeper, monkeypatch) -> None:
    # the start checked for a fence, then the fence came, then the start recorded its cell
    monkeypatch.setattr(netns, "delete", lambda name: None)
    state = tmp_path / "nodes" / "n3" / "state"
    state.mkdir(parents=True)
    fence_cells(state, ["w1-r3"])
    p = sleeper()
    with using_state_dir(state):
        with pytest.raises(CellFenced):
            record_built(Cell(id="w1-r3", netns="rl-w1-r3", ip="10.0.0.2", port=8000, init_pid=p.pid))
        assert list_cells() == []
    assert p.wait(5) is not None


def test_a_fence_kills_criu_still_in_its_wrapper(tmp_path: Path, monkeypatch) -> None:
    # `unshare … sh -c SCRIPT ROOT NETNS /usr/local/sbin/criu restore -W <cell dir> …` before its
    # exec of CRIU (snapshot.criu.restore): argv[0] is not criu yet, the cell dir is there already
    monkeypatch.setattr(netns, "delete", lambda name: None)
    state = tmp_path / "nodes" / "n3" / "state"
    cdir = state / "cells" / "w1-r4"
    cdir.mkdir(parents=True)
    wrapper = subprocess.Popen(["sh", "-c", "sleep 300; exit", "/run/root", "/run/netns/rl-w1-r4", "/usr/local/sbin/criu",
                                "restore", "-W", str(cdir), "--pidfile", str(cdir / "init.pid")])
    child = waits.until(lambda: procs.children(wrapper.pid), 5, every=0.02, what="the wrapper's child")[0]
    try:
        fence_cells(state, ["w1-r4"])
        assert wrapper.wait(5) == -signal.SIGKILL
        assert waits.settle(lambda: not procs.alive(child), 5, every=0.05)
    finally:
        for pid in (child, wrapper.pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wrapper.wait()
