"""The same-host route of a streamed dump (relocator.agent.locallink): a unix socket that only
the agent's own user reaches, taken only when both agents share host and namespaces."""

from __future__ import annotations

import os
import socket
import stat
import threading
from pathlib import Path

import pytest

from relocator.agent import locallink


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.delenv(locallink.ENV_OFF, raising=False)


def _offer(got: list[bytes]) -> locallink.UnixOffer:
    done = threading.Event()

    def take(conn: socket.socket) -> None:
        got.append(conn.recv(5))
        done.set()

    offer = locallink.UnixOffer(take)
    offer.done = done  # type: ignore[attr-defined]
    offer.start()
    return offer


def test_the_socket_is_private_and_its_first_peer_of_this_user_gets_it() -> None:
    got: list[bytes] = []
    offer = _offer(got)
    assert stat.S_IMODE(offer.path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(offer.path.stat().st_mode) == 0o600
    sock = locallink.connect(offer.offer())
    assert sock is not None
    sock.sendall(b"pages")
    assert offer.done.wait(10)  # type: ignore[attr-defined]
    offer.join(10)
    sock.close()
    assert got == [b"pages"]
    assert not offer.path.exists()  # one dump only: the route is gone once taken


def test_a_peer_of_another_user_is_closed_and_the_offer_keeps_listening(monkeypatch: pytest.MonkeyPatch) -> None:
    got: list[bytes] = []
    uids = iter([os.geteuid() + 1, os.geteuid()])
    monkeypatch.setattr(locallink, "peer_uid", lambda _sock: next(uids))
    offer = _offer(got)
    stranger = locallink.connect(offer.offer())
    assert stranger is not None
    assert stranger.recv(1) == b""  # closed without a byte
    friend = locallink.connect(offer.offer())
    assert friend is not None
    friend.sendall(b"pages")
    assert offer.done.wait(10)  # type: ignore[attr-defined]
    assert got == [b"pages"] and offer.refused == 1
    stranger.close()
    friend.close()


def test_another_host_or_namespace_takes_tls(monkeypatch: pytest.MonkeyPatch) -> None:
    offer = locallink.UnixOffer(lambda _conn: None)
    try:
        theirs = {**offer.offer(), "host": "another-boot|net:[1]|mnt:[2]", "address": "10.0.0.2", "port": 7}
        assert locallink.connect(theirs) is None
        with locallink.route(theirs) as ps:
            assert ps == ("10.0.0.2", 7)
        mine = {**offer.offer(), "address": "127.0.0.1", "port": 7}
        monkeypatch.setenv(locallink.ENV_OFF, "0")  # the operator's switch: always TLS
        with locallink.route(mine) as ps:
            assert ps == ("127.0.0.1", 7)
        monkeypatch.delenv(locallink.ENV_OFF)
        with locallink.route(mine) as ps:
            assert isinstance(ps, int)
        with locallink.route(None) as ps:
            assert ps is None
    finally:
        offer.close()


def test_identity_names_boot_network_and_mounts() -> None:
    boot, net, mnt = locallink.identity().split("|")
    assert boot and net.startswith("net:[") and mnt.startswith("mnt:[")


def test_closing_an_untaken_offer_ends_its_thread_and_removes_the_socket() -> None:
    offer = locallink.UnixOffer(lambda _conn: None)
    offer.start()
    offer.close()
    offer.join(10)
    assert not offer.is_alive() and not offer.path.exists()
    assert locallink.connect(offer.offer()) is None  # nothing to connect to: the dump takes TLS


def test_the_pump_sends_a_keeper_of_this_host_the_memory_on_its_unix_socket(tmp_path: Path, monkeypatch) -> None:
    """The post-copy pump with `--unix`: a keeper of this host connects there (no TLS) and gets
    every frame; its TCP port still refuses a client without the cluster's certificate."""
    import argparse
    import subprocess
    import sys

    from relocator import procs, waits
    from relocator.agent import pump
    from tests.test_postcopy_push import _CHILD, _read_all

    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        addr = int(child.stdout.readline())
        waits.until(lambda: procs.stopped(child.pid), 10, every=0.02, what="the child's SIGSTOP")
        monkeypatch.setattr(pump, "ns_pids", lambda _init: {5: child.pid})
        monkeypatch.setattr(pump, "lazy_ranges", lambda _d: [(5, addr, 8)])
        path = locallink.new_path()
        args = argparse.Namespace(cell_dir=str(tmp_path), image_dir=str(tmp_path), init_pid=child.pid, unix=path,
                                  dump_pid=os.getpid(), address="127.0.0.1", accept_timeout=10.0, status_fd=-1)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(rc=pump.Pump(args).run()), daemon=True)
        t.start()
        waits.until(lambda: os.path.exists(path) and (pump.read_state(tmp_path) or {}).get("port"), 10,
                    every=0.02, what="the pump's sockets")
        port = pump.read_state(tmp_path)["port"]
        assert b"A" * 64 not in _read_all(port)  # plaintext over TCP: refused, as before
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        got = b""
        while chunk := sock.recv(1 << 16):
            got += chunk
        sock.close()
        t.join(10)
        assert out["rc"] == 0 and pump.read_state(tmp_path)["state"] == "done"
        assert pump.FRAME.unpack(got[:pump.FRAME.size]) == (5, addr, 8 * 4096)
        assert got[pump.FRAME.size:] == b"".join(bytes([65 + i]) * 4096 for i in range(8))
        assert not os.path.exists(path)  # the route is gone with the connection taken
    finally:
        child.kill()
        child.wait()


def test_the_controller_hands_the_pumps_unix_socket_to_the_target_only_when_offered() -> None:
    from relocator.controller.transfers.postcopy import _local_route

    assert _local_route({"pump_unix": "/run/relocator/links/a.sock", "host": "b|n|m", "port": 1}) == {
        "pump_unix": "/run/relocator/links/a.sock", "host": "b|n|m"}
    assert _local_route({"pump_unix": "", "host": "b|n|m"}) == {}  # no pump: nothing to take
    # and the target's agent takes it only from its own host
    assert locallink.same_host({"pump_unix": "/x.sock", "host": locallink.identity()}, "pump_unix") == "/x.sock"
    assert locallink.same_host({"pump_unix": "/x.sock", "host": "elsewhere"}, "pump_unix") == ""


def test_a_state_dir_too_deep_for_a_socket_address_means_tls_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path / ("d" * 120)))
    assert locallink.new_path() == ""  # the pump then listens on TCP only
    with pytest.raises(OSError, match="too deep"):
        locallink.UnixOffer(lambda _conn: None)  # the page receiver then offers TLS only


def test_a_receiver_aborted_before_the_dump_connects_starts_no_page_server(tmp_path: Path, monkeypatch) -> None:
    from relocator.agent import pagestream
    from relocator.snapshot import criu

    started: list[int] = []
    monkeypatch.setattr(criu, "page_server_on", lambda _d, fd: started.append(fd))
    rx = pagestream.PageReceiver(tmp_path / "img", "127.0.0.1")
    rx.abort()
    rx._take_unix(socket.socket(socket.AF_UNIX))  # the offer's thread, a moment too late
    assert started == [] and rx.link == "tls"
