"""Issue 26: the TLS front of a move's page server (relocator.agent.front) and the per-move
credentials it admits (relocator.credentials.make_move). Pure Python on loopback: the test plays
CRIU on the other end of the socket pair (an echo of what the peer sends)."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from pathlib import Path

import pytest

from relocator import credentials
from relocator.agent.front import Front, move_credential, start_for


@pytest.fixture(autouse=True)
def _state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path / "state"))


@pytest.fixture(scope="module")
def move() -> dict:
    return credentials.make_move()


def _criu(end: socket.socket) -> threading.Thread:
    """CRIU's stand-in: answers every message with b'ack:' + it, ends at EOF."""
    def run() -> None:
        with end:
            while True:
                data = end.recv(65536)
                if not data:
                    return
                end.sendall(b"ack:" + data)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _front(move: dict, **kw) -> tuple[Front, threading.Thread]:
    ours, theirs = socket.socketpair()
    t = _criu(theirs)
    kw.setdefault("handshake_s", 1.0)
    kw.setdefault("accept_s", 20.0)
    return start_for("127.0.0.1", move["listener"], ours, peer_cert=move["peer"]["cert"], **kw), t


def _client(bundle: dict | None) -> ssl.SSLContext:
    if bundle is None:  # no certificate at all
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
        return ctx
    return credentials.move_context(bundle, server=False)


def _talk(port: int, ctx: ssl.SSLContext, msg: bytes = b"pages") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with ctx.wrap_socket(raw) as s:
            s.sendall(msg)
            got = b""
            while len(got) < len(msg) + 4:
                b = s.recv(65536)
                if not b:
                    break
                got += b
            return got


def _refused(port: int, ctx: ssl.SSLContext) -> str:
    """Why the front would not take this client: its handshake's error, or the peer's close."""
    try:
        got = _talk(port, ctx)
    except (ssl.SSLError, ConnectionError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "" if got.startswith(b"ack:") else f"closed after {got!r}"


def test_a_move_credential_is_its_own_and_holds_no_ca_key(move: dict) -> None:
    other = credentials.make_move()
    assert move["id"] != other["id"] and move["listener"]["ca_cert"] != other["listener"]["ca_cert"]
    assert move["listener"]["cert"] != move["peer"]["cert"], "each end has a certificate of its own"
    for end in ("listener", "peer"):
        assert set(move[end]) == {"id", "ca_cert", "cert", "key"}, move[end].keys()  # no CA key anywhere
    d = credentials.install_move(move["peer"])
    assert credentials.tls_files(d) == (str(d / "ca.pem"), str(d / "node.pem"), str(d / "node.key"))
    assert oct(d.stat().st_mode & 0o777) == "0o700" and oct((d / "node.key").stat().st_mode & 0o777) == "0o600"
    credentials.remove_move(d)
    assert not d.exists()
    with pytest.raises(credentials.CredentialsError, match="malformed id"):
        credentials.install_move({**move["peer"], "id": "../x"})


def test_the_peer_gets_through_behind_an_idle_stranger(move: dict) -> None:
    """A connection that says nothing holds nothing back: the peer is admitted at once, the
    stranger dropped, and the relay carries both ways."""
    front, criu = _front(move, handshake_s=30.0)
    idle = socket.create_connection(("127.0.0.1", front.port))
    try:
        t = time.monotonic()
        got = _talk(front.port, _client(move["peer"]))
        took = time.monotonic() - t
    finally:
        idle.close()
    assert got == b"ack:pages", (got, front.why())
    assert took < 10.0, f"the peer waited {took:.1f}s behind an idle connection ({front.why()})"
    front.join(10)
    criu.join(10)
    assert front.state == "done" and front.peer, front.why()
    assert front.refused == 1 and "another peer was admitted" in front.last_refused, front.why()


@pytest.mark.parametrize("who", ["no-cert", "cluster-member", "earlier-move", "listener-cert"])
def test_a_wrong_peer_fails_fast_and_the_front_keeps_the_door(move: dict, who: str, tmp_path: Path) -> None:
    """No certificate, one of the cluster's CA (not this move's), a replayed credential of an
    earlier move, this move's listener certificate (its CA, not the peer's): each is refused at
    once with a TLS error and counted; the move's peer still gets in afterwards."""
    if who == "cluster-member":
        cluster = credentials.make_cluster()
        bundle = {**credentials.for_node(cluster, "n9"), "id": "0" * 16}  # type: ignore[dict-item]
        ctx = _client(bundle)
    elif who == "earlier-move":
        ctx = _client(credentials.make_move()["peer"])
    elif who == "listener-cert":
        ctx = _client(move["listener"])
    else:
        ctx = _client(None)
    front, _ = _front(move)
    t = time.monotonic()
    why = _refused(front.port, ctx)
    assert why, f"{who} was admitted ({front.why()})"
    assert time.monotonic() - t < 5.0, f"{who}: refusal took {time.monotonic() - t:.1f}s"
    deadline = time.monotonic() + 5
    while front.refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert front.refused == 1 and front.state == "listening", (who, why, front.why())
    assert _talk(front.port, _client(move["peer"])) == b"ack:pages", front.why()
    front.join(10)


def test_one_peer_only_and_a_handshake_is_bounded(move: dict) -> None:
    front, _ = _front(move, handshake_s=0.3)
    slow = socket.create_connection(("127.0.0.1", front.port))
    deadline = time.monotonic() + 5
    while front.refused < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert front.refused == 1 and "no TLS handshake within 0.3s" in front.last_refused, front.why()
    assert slow.recv(1) == b"", "a silent client is closed when its handshake time is up"
    slow.close()
    with socket.create_connection(("127.0.0.1", front.port), timeout=5) as raw:
        with _client(move["peer"]).wrap_socket(raw) as s:  # admitted: the front holds the link open
            s.sendall(b"x")
            assert s.recv(16) == b"ack:x"
            with pytest.raises(OSError):  # nobody else from now on: the port is closed
                _talk(front.port, _client(move["peer"]))
    front.join(10)
    assert front.state == "done", front.why()


def test_a_flood_evicts_the_oldest_waiter_not_the_newcomer(move: dict) -> None:
    front, _ = _front(move, handshake_s=30.0, max_pending=3)
    idle = [socket.create_connection(("127.0.0.1", front.port)) for _ in range(5)]
    try:
        assert _talk(front.port, _client(move["peer"])) == b"ack:pages", front.why()
    finally:
        for s in idle:
            s.close()
    front.join(10)
    assert front.refused == 5, front.why()


def _from(src: str, dst: tuple[str, int]) -> socket.socket:
    """A TCP connection to `dst` from the local address `src` (any 127/8 address is this host's)."""
    s = socket.socket(socket.AF_INET6 if ":" in src else socket.AF_INET, socket.SOCK_STREAM)
    s.bind((src, 0))
    s.settimeout(5)
    s.connect(dst)
    return s


def _until(cond, what: str, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_flood_from_another_address_takes_no_slot_from_the_peer(move: dict) -> None:
    """The front knows where the move's peer connects from (its agent's transfer address): a
    flood of idle connections from any other address is closed at once, before TLS, counted,
    and evicts nobody; the peer, connected before the flood (it still holds one of only two
    slots, 30 s to handshake), gets in afterwards."""
    front, _ = _front(move, handshake_s=30.0, max_pending=2, expect_addr="127.0.0.2")
    peer_raw = _from("127.0.0.2", ("127.0.0.1", front.port))  # the peer's host, not handshaking yet
    flood = []
    try:
        for _ in range(20):
            s = _from("127.0.0.1", ("127.0.0.1", front.port))
            flood.append(s)
        _until(lambda: front.refused_address == 20, f"the flood was not all refused at once: {front.why()}")
        for s in flood:
            assert s.recv(1) == b"", "a stranger's connection is closed without a byte"
        assert front.refused == 20 and "not the move's peer address 127.0.0.2" in front.last_refused, front.why()
        with _client(move["peer"]).wrap_socket(peer_raw) as tls:  # the slot it held is still there
            tls.sendall(b"pages")
            assert tls.recv(16) == b"ack:pages", front.why()
    finally:
        for s in flood:
            s.close()
        peer_raw.close()
    front.join(10)
    assert front.state == "done" and front.peer.startswith("127.0.0.2:"), front.why()
    assert front.info()["refused_address"] == 20, front.info()


def test_the_peers_address_is_not_enough_without_its_certificate(move: dict) -> None:
    """From the right address with the wrong credential: refused by TLS, the door kept."""
    front, _ = _front(move, expect_addr="127.0.0.2")
    with _from("127.0.0.2", ("127.0.0.1", front.port)) as raw:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            with _client(credentials.make_move()["peer"]).wrap_socket(raw) as s:
                s.sendall(b"x")
                s.recv(1)
    _until(lambda: front.refused == 1, front.why())
    assert front.refused_address == 0 and front.state == "listening", front.why()
    front.close()


@pytest.mark.parametrize("a, b, same", [("127.0.0.1", "::ffff:127.0.0.1", True), ("::1", "0:0::1", True),
                                        ("fe80::1%eth0", "fe80::1", True), ("10.0.0.1", "10.0.0.2", False)])
def test_peer_addresses_compare_by_host(a: str, b: str, same: bool) -> None:
    from relocator.agent.front import same_host

    assert same_host(a, b) is same and same_host(b, a) is same


def _has_ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1) to bind")
def test_the_front_listens_on_an_ipv6_address(move: dict) -> None:
    """Given an IPv6 transfer address, the front binds that family (it took IPv4 only)."""
    ours, theirs = socket.socketpair()
    _criu(theirs)
    front = start_for("::1", move["listener"], ours, peer_cert=move["peer"]["cert"], expect_addr="::1",
                      handshake_s=1.0, accept_s=20.0)
    assert front.lst.family == socket.AF_INET6, front.lst
    with socket.create_connection(("::1", front.port), timeout=5) as raw:
        with _client(move["peer"]).wrap_socket(raw) as s:
            s.sendall(b"v6")
            assert s.recv(16) == b"ack:v6", front.why()
    front.join(10)
    assert front.state == "done" and front.peer.startswith("[::1]:"), front.why()


def test_nobody_in_time_gives_up_and_closes_criu(move: dict) -> None:
    ours, theirs = socket.socketpair()
    front = start_for("127.0.0.1", move["listener"], ours, peer_cert=move["peer"]["cert"], accept_s=0.3)
    theirs.settimeout(5)
    assert theirs.recv(1) == b"", "CRIU's end must see EOF once the front gives up"
    front.join(5)
    assert front.state == "gave_up" and "no authenticated peer connected within 0.3s" in front.why(), front.why()


def test_close_stops_a_listening_front(move: dict) -> None:
    front, _ = _front(move)
    front.close()
    front.join(5)
    assert front.state in ("closed", "failed", "listening") and not front._thread.is_alive(), front.why()  # type: ignore[union-attr]
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", front.port), timeout=2).close()


def test_the_dumps_credential_lives_only_while_it_connects(move: dict) -> None:
    offer = {"address": "127.0.0.1", "port": 1, "credential": move["peer"]}
    with move_credential(offer, ("127.0.0.1", 1)) as d:
        assert d and (Path(d) / "node.key").is_file()
    assert not Path(d).exists(), "the move's key stays on disk after the dump"
    with move_credential(offer, 7) as d:  # a unix route: no TLS, nothing written
        assert d is None
    with move_credential({"address": "127.0.0.1", "port": 1}, ("127.0.0.1", 1)) as d:
        assert d is None


# -- with real CRIU: a dump through the front into a page server on a socket pair ----------------
def _criu_ok() -> bool:
    import os
    import shutil

    from relocator.snapshot import criu

    try:
        criu.criu_binary()
    except criu.CriuError:
        return False
    return os.geteuid() == 0 and bool(shutil.which("setsid"))


@pytest.mark.integration
@pytest.mark.skipif(not _criu_ok(), reason="CRIU dumps as root")
def test_a_real_dump_gets_through_behind_a_stranger_and_a_replay_does_not(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The stream's receiver (PageReceiver) with its front: a silent stranger connected first
    and a dump presenting an earlier move's credential (refused in well under a second, the
    dump failing with CRIU's TLS error) leave the page server waiting; the move's own dump
    then streams every page, and the receiver's account names the refusals."""
    import subprocess
    import sys

    from relocator.agent.pagestream import PageReceiver
    from relocator.snapshot import criu

    monkeypatch.setenv("RELOCATOR_LOCAL_LINKS", "0")  # the TCP route, as between two hosts
    monkeypatch.setenv(credentials.ENV_DIR, str(credentials.install(
        credentials.for_node(credentials.make_cluster(), "n1"), tmp_path / "creds", export=False)))
    worker = subprocess.Popen(["setsid", sys.executable, "-c",
                               "import time\nx = bytearray(16 << 20)\nx[::4096] = b'1' * (len(x) // 4096)\n"
                               "print('ready', flush=True)\ntime.sleep(600)"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    rx = PageReceiver(tmp_path / "dst", "127.0.0.1")
    try:
        assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
        rx.start()
        offer = rx.offer()
        assert offer["credential"]["id"] == rx.move["id"], offer.keys()  # type: ignore[index]
        stranger = socket.create_connection(("127.0.0.1", offer["port"]))

        def dump(bundle: dict, name: str) -> tuple[subprocess.CompletedProcess, float]:
            d = credentials.install_move(bundle)
            src = tmp_path / name
            src.mkdir()
            t = time.monotonic()
            try:
                return subprocess.run([criu.criu_binary(), "dump", "-t", str(worker.pid), "-D", str(src), "-o",
                                       "dump.log", "-v2", "--leave-running", "--page-server", "--address",
                                       "127.0.0.1", "--port", str(offer["port"]), *credentials.criu_tls_args(str(d))],
                                      capture_output=True, text=True, timeout=60), time.monotonic() - t
            finally:
                credentials.remove_move(d)

        replay, took = dump(credentials.make_move()["peer"], "replay")
        assert replay.returncode != 0 and took < 10, (replay.returncode, took, rx.front.why())  # type: ignore[union-attr]
        log = (tmp_path / "replay" / "dump.log").read_text()
        assert "not trusted" in log.lower(), f"CRIU's error should say why: {log[-600:]}"
        ok, took = dump(offer["credential"], "src")
        assert ok.returncode == 0, criu._log_tail(tmp_path / "src" / "dump.log")
        out = rx.finish(timeout=30)
        stranger.close()
        assert out["page_bytes"] >= 16 << 20 and out["link"] == "tls", out
        assert out["front_refused"] >= 2, out  # the stranger and the replay
    finally:
        rx.abort()
        worker.kill()


def test_the_controller_hands_the_keeper_its_credential_and_never_stores_it(tmp_path: Path) -> None:
    """The post-copy source's reply carries the keeper's end of the move's credential: the
    controller passes it to the target's restore and keeps it out of the stored record."""
    import json

    from relocator.controller.model import DONE, Relocation
    from relocator.controller.transfers import strategy
    from tests.test_transfer_units import _machine_env, _PostCopyBackend

    be = _PostCopyBackend({})
    cred = {"id": "ab" * 8, "ca_cert": "CA", "cert": "C", "key": "SECRET-KEY"}
    dump_lazy = be.dump_lazy
    be.dump_lazy = lambda node, cell, image_dir: {**dump_lazy(node, cell, image_dir), "credential": cred}
    store, m = _machine_env(tmp_path, be)
    rel = m.run(Relocation(id="r1", worker="w1", src="n1", transfer="postcopy"))
    assert rel.result == DONE, rel.error
    assert be.page_source["credential"] == cred, be.page_source
    saved = json.dumps([store.relocation("r1").__dict__, rel.__dict__, store.events_after(0)], default=str)
    assert "SECRET-KEY" not in saved, "the move's key went into the relocation record"
    assert "r1" not in strategy("postcopy")._credentials, "kept after the move"  # type: ignore[attr-defined]


@pytest.mark.integration
@pytest.mark.skipif(not _criu_ok(), reason="CRIU dumps as root")
@pytest.mark.parametrize("end", ["keeper", "given-up"])
def test_a_lazy_dump_behind_its_front_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, end: str) -> None:
    """`criu dump --lazy-pages --ps-socket` behind the post-copy's front process: a cluster
    member's certificate is refused, the move's keeper (its credential) gets a page and closes
    the session (the dump exits 0); or the move is given up: killing the front ends the dump
    at once (LazySource's way), with nobody connected."""
    import os
    import subprocess
    import sys

    from relocator.agent import front
    from relocator.agent.postcopy.base import PS_IOV_CLOSE, PS_IOV_GET, PSI, lazy_ranges
    from relocator.snapshot import criu

    monkeypatch.setenv(credentials.ENV_DIR, str(credentials.install(
        credentials.for_node(credentials.make_cluster(), "n1"), tmp_path / "creds", export=False)))
    worker = subprocess.Popen(["setsid", sys.executable, "-c",
                               "import time\nx = bytearray(8 << 20)\nx[::4096] = b'1' * (len(x) // 4096)\n"
                               "print('ready', flush=True)\ntime.sleep(600)"],
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    mv = credentials.make_move()
    img, cell = tmp_path / "img", tmp_path / "cell"
    img.mkdir()
    cell.mkdir()
    dump = fp = None
    try:
        assert worker.stdout is not None and worker.stdout.readline() == b"ready\n"
        ours, theirs = socket.socketpair()
        dump = criu.CriuProcess([criu.criu_binary(), "dump", "-t", str(worker.pid), "-D", str(img), "-o", "dump.log",
                                 "-v2", "--lazy-pages", "--ps-socket", str(theirs.fileno())], img / "dump.log",
                                "dump --lazy-pages", pass_fds=(theirs.fileno(),)).start()
        theirs.close()
        tls_dir = str(credentials.install_move(mv["listener"]))
        fp, port = front.start_process(cell, ours, "127.0.0.1", tls_dir, mv["peer"]["cert"])
        ours.close()
        credentials.remove_move(tls_dir)  # loaded as it started
        member = credentials.client_context()
        assert member is not None
        with pytest.raises(ssl.SSLError):
            with member.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5)) as s:
                s.sendall(b"x")
                s.recv(1)
        if end == "given-up":
            t = time.monotonic()
            os.kill(fp.pid, 9)
            assert dump.wait(10) is not None and time.monotonic() - t < 5, "the dump outlived its front"
            return
        with credentials.move_context(mv["peer"], server=False).wrap_socket(
                socket.create_connection(("127.0.0.1", port), timeout=5)) as s:
            pid, vaddr, _ = lazy_ranges(img)[0]
            s.sendall(PSI.pack(PS_IOV_GET, 1, vaddr, pid))
            got = b""
            while len(got) < PSI.size + 4096:
                b = s.recv(65536)
                assert b, f"the front closed after {len(got)} bytes: {front.read_state(cell)}"
                got += b
            assert PSI.unpack(got[:PSI.size])[2] == vaddr, got[:PSI.size]
            s.sendall(PSI.pack(PS_IOV_CLOSE, 0, 0, 0))
            assert s.recv(4) == b"\0\0\0\0", "CRIU acknowledges the CLOSE"
        assert dump.wait(10) == 0, criu._log_tail(img / "dump.log")
        assert fp.wait(10) == 0
        st = front.read_state(cell) or {}
        assert st.get("state") == "done" and st.get("refused") == 1, st
    finally:
        for p in (dump, fp):
            if p is not None:
                p.kill()
        worker.kill()


def test_giving_up_a_post_copy_ends_its_front_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """LazySource.abort of a dump behind a front kills the front (the dump's socket closes, it
    ends), not the old knock, which the front would refuse (a cluster member's certificate)."""
    from relocator.agent.postcopy import source as src_mod

    killed: list[int] = []
    dump_running = [True]
    monkeypatch.setattr(src_mod.procs, "alive", lambda pid: pid in (11, 22) and not (pid == 22 and 22 in killed))
    monkeypatch.setattr(src_mod.procs, "cmdline", lambda pid: ["python", "-S", "-m", "relocator.agent.front"]
                        if pid == 22 else ["criu", "dump", "--lazy-pages"])

    def kill(pid: int, sig: int) -> None:
        killed.append(pid)
        if pid == 22:
            dump_running[0] = False  # EOF on its socket: the dump ends

    monkeypatch.setattr(src_mod.os, "kill", kill)
    monkeypatch.setattr(src_mod.LazySource, "running", lambda self: dump_running[0])
    monkeypatch.setattr(src_mod, "knock", lambda *a: pytest.fail("knocked on a front"))
    ls = src_mod.LazySource(tmp_path)
    ls.record(11, "127.0.0.1", 4242, str(tmp_path / "img"), front_pid=22)
    monkeypatch.setattr(ls, "clear", lambda: None)
    assert ls.abort() == "front closed" and killed == [22], killed


@pytest.mark.parametrize("mode", ["stream", "postcopy"])
def test_the_listening_agent_is_told_its_peers_address(tmp_path: Path, mode: str) -> None:
    """The controller tells the listening agent (stream: the target's page server; post-copy:
    the source's lazy dump) the other node's transfer address, from its agent's transfer_info,
    so its front can close everyone else's connections before TLS."""
    from relocator.controller.model import DONE, Relocation
    from relocator.controller.transfers import peers
    from tests.test_transfer_units import _machine_env, _PostCopyBackend

    peers._cache.clear()
    be = _PostCopyBackend({})
    addresses = {"n1": "10.250.0.12", "n2": "10.250.0.13"}
    info = be.transfer_info
    be.transfer_info = lambda node: {**info(node), "address": addresses[node]}
    told: dict = {}
    ops, dump_lazy = be.open_page_server, be.dump_lazy
    be.open_page_server = lambda node, image_dir, peer_address="": (
        told.update(node=node, peer=peer_address), ops(node, image_dir))[1]
    be.dump_lazy = lambda node, cell, image_dir, peer_address="": (
        told.update(node=node, peer=peer_address), dump_lazy(node, cell, image_dir))[1]
    _, m = _machine_env(tmp_path, be)
    try:
        rel = m.run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer=mode))
    finally:
        peers._cache.clear()
    assert rel.result == DONE, rel.error
    want = {"node": "n2", "peer": "10.250.0.12"} if mode == "stream" else {"node": "n1", "peer": "10.250.0.13"}
    assert told == want, (mode, told)


def test_an_unknown_peer_address_leaves_the_call_as_it_was() -> None:
    from relocator.controller.transfers import peers

    peers._cache.clear()

    class NoInfo:
        pass

    class Broken:
        def transfer_info(self, node: str) -> dict:
            raise RuntimeError("agent lost")

    assert peers.address_kw(NoInfo(), "n1") == {} and peers.address_kw(Broken(), "n1") == {}
    assert "n1" not in peers._cache, "a failure is not cached"


def test_the_pump_closes_a_connection_from_another_address_before_tls(tmp_path: Path) -> None:
    """The post-copy push (relocator.agent.pump) takes the same pin: a stranger's connection is
    closed without a handshake (which would hold the pump for up to 2 s), the keeper's passes."""
    import argparse

    from relocator.agent import pump

    p = pump.Pump(argparse.Namespace(cell_dir=str(tmp_path), peer_address="127.0.0.2"))
    with socket.create_server(("127.0.0.1", 0)) as lst:
        port = lst.getsockname()[1]
        with _from("127.0.0.1", ("127.0.0.1", port)) as stranger:
            assert p.admit(lst, None, port) is None and p.refused == 1
            assert stranger.recv(1) == b"", "closed at once"
        assert "not the move's peer address 127.0.0.2" in (pump.read_state(tmp_path) or {}).get("last_refused", "")
        with _from("127.0.0.2", ("127.0.0.1", port)):
            conn = p.admit(lst, None, port)
            assert conn is not None and conn.getpeername()[0] == "127.0.0.2", p.refused
            conn.close()


@pytest.mark.parametrize("phase, result", [("TRANSFER", "rolled_back"), ("RESTORE", "rolled_back"),
                                           ("SWITCH", "done"), ("RELEASE", "done")])
def test_a_controller_restart_mid_post_copy_needs_no_credential(tmp_path: Path, phase: str, result: str) -> None:
    """The keeper's credential lives in the controller's memory only, from DUMP's reply to
    RESTORE's call. A controller that restarts in between has lost it, and does not need it:
    before SWITCH a recovery rolls back (to the frozen source, which runs again; no restore is
    tried), from SWITCH on the keeper has long connected and the move completes."""
    from relocator.controller.machine import Machine, SimulatedCrash
    from relocator.controller.model import Relocation
    from relocator.controller.transfers import strategy
    from tests.test_controller_machine import _crash
    from tests.test_transfer_units import _machine_env, _PostCopyBackend

    be = _PostCopyBackend({})
    cred = {"id": "cd" * 8, "ca_cert": "CA", "cert": "C", "key": "K"}
    dump_lazy = be.dump_lazy
    be.dump_lazy = lambda node, cell, image_dir, **kw: {**dump_lazy(node, cell, image_dir), "credential": cred}
    store, _ = _machine_env(tmp_path, be)
    with pytest.raises(SimulatedCrash):
        Machine(store, be, on_crash=_crash).run(Relocation(id="r1", worker="w1", src="n1", dst="n2",
                                                           transfer="postcopy", faults={"crash": {"phase": phase}}))
    strategy("postcopy")._credentials.clear()  # type: ignore[attr-defined]  # the new controller's memory
    restores = len([c for c in be.calls if c[0] == "restore"])
    (open_rel,) = store.open_relocations()
    rel = Machine(store, be).recover(open_rel)
    assert rel.result == result, (phase, rel.result, rel.error)
    assert len(be.live()) == 1, f"one live copy after the recovery: {be.live()} ({rel.error})"
    assert len([c for c in be.calls if c[0] == "restore"]) == restores, "the recovery restored again"
    want = ("n1", "c1") if result == "rolled_back" else ("n2", "w1-r1")
    assert be.live() == [want] and store.worker("w1").state == "running", (be.live(), store.worker("w1"))
