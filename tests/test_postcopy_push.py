"""Post-copy's push channel (relocator.agent.pump) and the keeper's use of it: pure logic of the
keeper's proxy, and the pump reading a real stopped process's memory. The whole path (a real
lazy dump, CRIU's lazy-pages daemon, vLLM) runs in tests/test_transfer_e2e.py."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from relocator import procs, waits
from relocator.agent import pump
from relocator.agent.postcopy import PSI, PS_IOV_GET, _Proxy

PAGE = 4096


def _frame(pid: int, vaddr: int, data: bytes) -> bytes:
    return pump.FRAME.pack(pid, vaddr, len(data)) + data


def _push(px: _Proxy, data: bytes, bite: int = 5000) -> None:
    """Feed push-channel bytes to the proxy through a real socket, in bites."""
    a, b = socket.socketpair()
    with a, b:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        while px.pump_recv(b, bite):
            pass


class Sink:
    def __init__(self) -> None:
        self.sent = b""

    def sendall(self, b) -> None:
        self.sent += bytes(b)


def _answer(pid: int, vaddr: int, data: bytes) -> bytes:
    return PSI.pack(6 | (4 << 16), len(data) // PAGE, vaddr, pid) + data


def test_pushed_pages_answer_the_daemon_without_asking_the_source() -> None:
    px = _Proxy([], depth=1, cache_bytes=1 << 30, pushed=True)
    pages = b"".join(bytes([i]) * PAGE for i in range(4))
    frame = _frame(7, 0x10000, pages)
    _push(px, frame)  # in pieces
    assert px.pushed_bytes == 4 * PAGE and px.cached == 4 * PAGE
    # a fault in the middle of the pushed run, then the daemon's background copy of the rest
    # (it never asks a page twice: its ranges are split around the faulted one)
    assert px.from_daemon(PSI.pack(PS_IOV_GET, 1, 0x12000, 7)) == []
    assert px.from_daemon(PSI.pack(PS_IOV_GET, 2, 0x10000, 7)) == []
    assert px.from_daemon(PSI.pack(PS_IOV_GET, 1024, 0x13000, 7)) == []  # the answer stops at the run's end
    sink = Sink()
    px.flush(sink)
    assert sink.sent == (_answer(7, 0x12000, pages[2 * PAGE:3 * PAGE]) + _answer(7, 0x10000, pages[:2 * PAGE])
                         + _answer(7, 0x13000, pages[3 * PAGE:]))
    assert px.hits == 3 and px.page_bytes == 0 and px.cached == 0  # nothing by request, nothing left


def test_a_request_stops_where_pushed_pages_begin_and_pushed_copies_of_requested_pages_are_dropped() -> None:
    px = _Proxy([], depth=1, cache_bytes=1 << 30, pushed=True)
    _push(px, _frame(7, 0x20000, b"p" * (2 * PAGE)))
    # background copy from 0x10000: the source is asked up to the pushed run only
    assert px.from_daemon(PSI.pack(PS_IOV_GET, 1024, 0x10000, 7)) == [PSI.pack(PS_IOV_GET, 16, 0x10000, 7)]
    # a fault on 0x31000, then the pump pushes 0x30000-0x32fff: the requested page is dropped
    assert px.from_daemon(PSI.pack(PS_IOV_GET, 1, 0x31000, 7)) == [PSI.pack(PS_IOV_GET, 1, 0x31000, 7)]
    _push(px, _frame(7, 0x30000, b"a" * PAGE + b"b" * PAGE + b"c" * PAGE))
    assert px.pushed_dropped == PAGE and px.cached == 4 * PAGE
    px.from_daemon(PSI.pack(PS_IOV_GET, 1, 0x32000, 7))
    px.from_source(memoryview(_answer(7, 0x10000, b"s" * (16 * PAGE))))
    px.from_source(memoryview(_answer(7, 0x31000, b"S" * PAGE)))
    sink = Sink()
    px.flush(sink)
    assert sink.sent == (_answer(7, 0x10000, b"s" * (16 * PAGE)) + _answer(7, 0x31000, b"S" * PAGE)
                         + _answer(7, 0x32000, b"c" * PAGE))


def test_plan_interleaves_processes_in_address_order(monkeypatch) -> None:
    monkeypatch.setattr(pump, "lazy_ranges", lambda _d: [(1, 0x100000, 512), (1, 0x900000, 1), (2, 0x5000, 3),
                                                            (9, 0x1000, 1)])
    frames = pump.plan(Path("/nonexistent"), {1: 101, 2: 102})  # 9: not a process of the cell
    assert frames == [(1, 101, 0x100000, pump.CHUNK), (2, 102, 0x5000, 3 * PAGE),
                      (1, 101, 0x200000, pump.CHUNK), (1, 101, 0x900000, PAGE)]


_CHILD = """
import mmap, os, sys
m = mmap.mmap(-1, 8 * 4096)
for i in range(8):
    m[i * 4096:(i + 1) * 4096] = bytes([65 + i]) * 4096
import ctypes
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
print(addr, flush=True)
os.kill(os.getpid(), 19)  # SIGSTOP: frozen, as a lazy dump leaves the tree
"""


def test_pump_streams_a_stopped_process_memory(tmp_path: Path, monkeypatch) -> None:
    """The pump's own process against a real stopped process: the frames carry its memory."""
    child = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        addr = int(child.stdout.readline())
        waits.until(lambda: procs.stopped(child.pid), 10, every=0.02, what="the child's SIGSTOP")
        monkeypatch.setattr(pump, "ns_pids", lambda _init: {5: child.pid})
        monkeypatch.setattr(pump, "lazy_ranges", lambda _d: [(5, addr, 8)])
        args = argparse.Namespace(cell_dir=str(tmp_path), image_dir=str(tmp_path), init_pid=child.pid,
                                  dump_pid=os.getpid(), address="127.0.0.1", accept_timeout=10.0, status_fd=-1)
        p = pump.Pump(args)
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(rc=p.run()), daemon=True)
        t.start()
        waits.until(lambda: (pump.read_state(tmp_path) or {}).get("port"), 10, every=0.02, what="the pump's port")
        port = pump.read_state(tmp_path)["port"]
        # clients without this cluster's certificate get no byte of memory (issue 26) ...
        for client in (None, _tls_client(None), _tls_client(tmp_path / "other")):
            leaked = _read_all(port, client)
            assert b"A" * 64 not in leaked and not leaked.startswith(pump.FRAME.pack(5, addr, 8 * PAGE)[:16])
        # counted once the pump has closed the connection
        waits.until(lambda: pump.read_state(tmp_path).get("refused") == 3, 10, every=0.02, what="3 refusals")
        # ... and the pump kept listening for the keeper, which gets it all
        from relocator.credentials import client_context

        got = _read_all(port, client_context())
        t.join(10)
        px = _Proxy([], depth=1, cache_bytes=1 << 30, pushed=True)
        _push(px, got)
        assert px.pushed_bytes == 8 * PAGE and out["rc"] == 0
        assert pump.read_state(tmp_path)["state"] == "done"
        px.from_daemon(PSI.pack(PS_IOV_GET, 8, addr, 5))
        sink = Sink()
        px.flush(sink)
        assert sink.sent == _answer(5, addr, b"".join(bytes([65 + i]) * PAGE for i in range(8)))
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()


def _tls_client(other_cluster: Path | None):
    """A TLS client that presents no certificate (None) or one of another cluster."""
    import ssl

    from relocator import credentials

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname, ctx.verify_mode = False, ssl.CERT_NONE
    if other_cluster is not None:
        d = credentials.install(credentials.for_node(credentials.make_cluster("other"), "x"), other_cluster,
                                export=False)
        ctx.load_cert_chain(str(d / credentials.CERT), str(d / credentials.KEY))
    return ctx


def _read_all(port: int, tls=None) -> bytes:
    """Everything a connection to `port` gets until it is closed (or nothing comes for 5 s)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    got = b""
    try:
        if tls is not None:
            sock = tls.wrap_socket(sock)
        while True:
            b = sock.recv(1 << 16)
            if not b:
                break
            got += b
    except OSError:  # the handshake refused, the connection reset: what came is what leaked
        pass
    finally:
        sock.close()
    return got


def _keeper_for_prefill(tmp_path: Path, prefill_bytes: int, prefill_s: float = 5.0, stall_s: float = 0.5):
    from relocator.agent.postcopy import Keeper

    args = argparse.Namespace(cell_dir=str(tmp_path), prefill_bytes=prefill_bytes, prefill_s=prefill_s,
                              stall_s=stall_s, throttle_bps=0.0)
    k = Keeper(args)
    k.px = _Proxy([], depth=1, cache_bytes=1 << 30, pushed=True)
    return k


def test_prefill_takes_the_push_up_to_its_budget_before_the_tree_starts(tmp_path: Path) -> None:
    from relocator.agent.postcopy import read_state

    a, b = socket.socketpair()
    with a:
        a.sendall(b"".join(_frame(7, 0x10000 + i * 4 * PAGE, bytes([i]) * (4 * PAGE)) for i in range(4)))
        k = _keeper_for_prefill(tmp_path, prefill_bytes=8 * PAGE)
        left = k.prefill(b)
        assert left is b and k.px.pushed_bytes == 8 * PAGE and k.px.cached == 8 * PAGE  # two frames, then stop
        assert read_state(tmp_path)["prefill_bytes"] == 8 * PAGE
        # the push ends: the prefill ends with it and says so (None: no push connection left)
        a.shutdown(socket.SHUT_WR)
        k2 = _keeper_for_prefill(tmp_path, prefill_bytes=1 << 30)
        k2.px = k.px
        assert k2.prefill(b) is None and k.px.pushed_bytes == 16 * PAGE


def test_a_stalled_push_only_ends_the_prefill(tmp_path: Path) -> None:
    a, b = socket.socketpair()
    with a:
        a.sendall(_frame(7, 0x10000, b"x" * PAGE) + pump.FRAME.pack(7, 0x20000, 4 * PAGE) + b"y" * 100)
        k = _keeper_for_prefill(tmp_path, prefill_bytes=1 << 30, stall_s=0.3)
        t = time.monotonic()
        assert k.prefill(b) is None  # nothing more comes: given up after stall_s, not hung
        assert time.monotonic() - t < 5 and k.px.cached == PAGE
