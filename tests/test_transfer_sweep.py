"""Issue 26: the stale transfer sockets and move credentials a crashed move left are removed at
agent start (relocator.agent.sweep): only ours by name, only old ones, never one something still
listens on, never through a symbolic link."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

import pytest

from relocator.agent.sweep import listening_paths, stale, sweep

HOUR = 3600.0


def _sock(path: Path, age_s: float = 2 * HOUR) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))
    s.close()  # bound, never listening: what a killed process leaves
    t = time.time() - age_s
    os.utime(path, (t, t), follow_symlinks=False)
    return path


def _old_dir(path: Path, age_s: float = 2 * HOUR) -> Path:
    path.mkdir(parents=True)
    (path / "node.key").write_text("k")
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


@pytest.fixture()
def state(tmp_path: Path) -> Path:
    # short: a unix socket's address holds 108 bytes
    d = Path(f"/tmp/rl-sweep-{os.getpid()}-{tmp_path.name[-12:]}")
    d.mkdir()
    yield d
    import shutil

    shutil.rmtree(d, ignore_errors=True)


def test_removes_only_our_old_dead_sockets_and_move_credentials(state: Path) -> None:
    gone = [_sock(state / "links" / "0123456789abcdef.sock"), _sock(state / "cells" / "c1" / "lazy-pages.socket"),
            _old_dir(state / "move-credentials" / "fedcba9876543210")]
    kept = [_sock(state / "links" / "0123456789abcde0.sock", age_s=5),  # young: maybe a move starting
            _sock(state / "links" / "not-ours.sock"),  # another name
            _sock(state / "cells" / "c2" / "other.socket"),
            _old_dir(state / "move-credentials" / "notamove")]
    (state / "links" / "notasocket0000000.sock").write_text("x")
    live = _sock(state / "links" / "aaaaaaaaaaaaaaaa.sock")
    removed = sweep(state, live={str(live)})
    assert sorted(removed) == sorted(str(p) for p in gone), removed
    for p in gone:
        assert not p.exists(), p
    for p in [*kept, live]:
        assert p.exists(), f"{p} was removed"


def test_a_listening_socket_is_live(state: Path) -> None:
    path = state / "links" / "bbbbbbbbbbbbbbbb.sock"
    path.parent.mkdir(parents=True)
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(str(path))
    lst.listen(1)
    try:
        t = time.time() - 2 * HOUR
        os.utime(path, (t, t))
        assert str(path) in listening_paths(), "a listening socket must show in /proc/net/unix"
        assert sweep(state) == [] and path.exists()
    finally:
        lst.close()
    assert sweep(state) == [str(path)]  # closed now: a dead socket


def test_never_follows_a_symbolic_link(state: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    target = _sock(outside / "links" / "cccccccccccccccc.sock")
    victim_dir = _old_dir(outside / "fedcba9876543210")
    state.mkdir(exist_ok=True)
    (state / "links").symlink_to(outside / "links")  # the links directory itself a link
    (state / "cells").mkdir()
    (state / "cells" / "c1").symlink_to(outside / "links")
    (state / "move-credentials").mkdir()
    (state / "move-credentials" / "fedcba9876543210").symlink_to(victim_dir)
    link_sock = state / "cells" / "c3" / "lazy-pages.socket"
    link_sock.parent.mkdir(parents=True)
    link_sock.symlink_to(target)
    assert stale(state) == [], stale(state)
    assert sweep(state) == []
    assert target.exists() and (victim_dir / "node.key").exists()


def test_an_agent_sweeps_at_start(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relocator.agent.agent import NodeAgent

    sock = _sock(state / "n1" / "state" / "links" / "dddddddddddddddd.sock")
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(state / "n1" / "state"))
    agent = NodeAgent("n1", str(state / "n1" / "state"), str(state / "n1" / "images"))
    assert agent.ping()["swept"] == [str(sock)] and not sock.exists()
