"""Pure parts of the transfer modes (issue 14): hashing page files as they grow, the streamed
image's manifest completed on the target, CRIU's pagemap and stats images, the post-copy
keeper's protocol follower and its relay (kill the copy first, then let the daemon go), the
choice behind `transfer: auto`."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from relocator.agent.pagestream import TailHasher, complete_manifest, is_page_file, landed
from relocator.agent.postcopy import PSI, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE, PS_IOV_GET, Keeper, _Proxy, read_state
from relocator.agent.transfer import TransferError, iter_chunks, receive_chunks
from relocator.controller.transfers.postcopy import postcopy_problems
from relocator.snapshot import images
from relocator.snapshot.manifest import FileEntry, PagesMode, read_manifest


# ------------------------------------------------------------------------------ tail hashing
def test_tail_hasher_follows_a_growing_file(tmp_path: Path) -> None:
    h = TailHasher(tmp_path, idle_s=0.001)
    h.start()
    data = os.urandom(3 << 20)
    with open(tmp_path / "pages-1.img", "wb") as fh:
        for i in range(0, len(data), 100_000):  # the writer appends while the hasher reads
            fh.write(data[i:i + 100_000])
            fh.flush()
            time.sleep(0.001)
    (tmp_path / "pagemap-1.img").write_bytes(b"map")
    (tmp_path / "core-1.img").write_bytes(b"not a page file")
    out = h.result()
    assert set(out) == {"pages-1.img", "pagemap-1.img"}
    assert out["pages-1.img"] == FileEntry(sha256=hashlib.sha256(data).hexdigest(), size=len(data))
    assert out["pagemap-1.img"].sha256 == hashlib.sha256(b"map").hexdigest()
    assert is_page_file("pages-65538.img") and not is_page_file("pages.json") and landed("page-server.log")


def test_tail_hasher_refuses_a_file_changed_behind_it(tmp_path: Path) -> None:
    h = TailHasher(tmp_path)
    (tmp_path / "pages-1.img").write_bytes(b"x" * 1000)
    h.start()
    time.sleep(0.05)
    with open(tmp_path / "pages-1.img", "r+b") as fh:  # truncated: no longer what was hashed
        fh.truncate(10)
    with pytest.raises(OSError, match="changed while it was hashed"):
        h.result()


# ----------------------------------------------------------------- the streamed image's manifest
def _source_image(tmp_path: Path, pages: PagesMode) -> Path:
    """A minimal image whose manifest says where its pages are (no CRIU needed)."""
    from adapters.base import EngineFingerprint
    from relocator.snapshot.fingerprint import Fingerprint, HostFingerprint
    from relocator.snapshot.manifest import CellInfo, Manifest, hash_files, write_manifest

    src = tmp_path / "src"
    src.mkdir(parents=True)
    (src / "core-1.img").write_bytes(b"core" * 100)
    (src / "inventory.img").write_bytes(b"inv")
    fp = Fingerprint(host=HostFingerprint(arch="x86_64", cpu_model="cpu", kernel="k", criu_version="4.2.1"),
                     engine=EngineFingerprint(engine="vllm", engine_version="1", model_id="m", weight_sha256="w",
                                              dtype="bfloat16", max_model_len=2048, tensor_parallel_size=1))
    write_manifest(src, Manifest(files=hash_files(src), fingerprint=fp, pages=pages,
                                 cell=CellInfo(engine="vllm", port=8000, source_cell="c1")))
    return src


def test_stream_lands_small_files_beside_the_pages_and_completes_the_manifest(tmp_path: Path) -> None:
    src = _source_image(tmp_path, PagesMode.REMOTE)
    dst = tmp_path / "dst"
    dst.mkdir()
    page = os.urandom(8192)
    (dst / "pages-65537.img").write_bytes(page)  # what the page server wrote
    (dst / "page-server.log").write_text("log")
    h = TailHasher(dst)
    h.start()
    pages = h.result()
    out = receive_chunks(iter_chunks(src, chunk_bytes=64), dst, present=landed)
    assert out["verified"] and out["files"] == 2
    complete_manifest(dst, pages)
    m = read_manifest(dst)
    assert m.pages is PagesMode.LOCAL and set(m.files) == {"core-1.img", "inventory.img", "pages-65537.img"}
    assert m.files["pages-65537.img"].sha256 == hashlib.sha256(page).hexdigest()
    from relocator.snapshot.manifest import stamp_is_fresh, verify_files

    assert stamp_is_fresh(dst, m)  # hashed on arrival: the restore does not hash again
    verify_files(dst, m)
    with open(dst / "pages-65537.img", "r+b") as fh:  # a flipped byte afterwards is caught
        fh.write(b"\xff")
    assert not stamp_is_fresh(dst, m)
    from relocator.snapshot.manifest import ImageError

    with pytest.raises(ImageError, match="corrupt"):
        verify_files(dst, m)


def test_stream_refuses_unexpected_files_and_a_local_manifest(tmp_path: Path) -> None:
    src = _source_image(tmp_path, PagesMode.REMOTE)
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "core-1.img").write_bytes(b"left over")
    with pytest.raises(TransferError, match="not empty"):
        receive_chunks(iter_chunks(src), dst, present=landed)
    local = _source_image(tmp_path / "b", PagesMode.LOCAL)
    dst2 = tmp_path / "dst2"
    receive_chunks(iter_chunks(local), dst2)
    with pytest.raises(TransferError, match="not sent to a page server"):
        complete_manifest(dst2, {})


def test_manifest_digest_unchanged_for_local_pages(tmp_path: Path) -> None:
    """`pages` joined the manifest after images existed: a local image's digest is as before."""
    src = _source_image(tmp_path, PagesMode.LOCAL)
    raw = json.loads((src / "manifest.json").read_text())
    del raw["pages"], raw["digest"]
    body = json.dumps(raw, sort_keys=True, separators=(",", ":")).encode()
    from relocator.credentials import image_key

    assert read_manifest(src).digest == hmac.new(image_key(), body, hashlib.sha256).hexdigest()


def test_restore_refuses_images_whose_pages_are_elsewhere(tmp_path: Path) -> None:
    from relocator.snapshot import ImageError, restore

    with pytest.raises(ImageError, match="sent to a page server"):
        restore(_source_image(tmp_path / "r", PagesMode.REMOTE))
    with pytest.raises(ImageError, match="post-copy image"):
        restore(_source_image(tmp_path / "l", PagesMode.LAZY))


# -------------------------------------------------------------------------------- CRIU images
def _img(path: Path, magic: int, entries: list[bytes], service: bool = False) -> None:
    head = struct.pack("<II", images.IMG_SERVICE_MAGIC if service else images.IMG_COMMON_MAGIC, magic)
    path.write_bytes(head + b"".join(struct.pack("<I", len(e)) + e for e in entries))


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b, n = n & 0x7F, n >> 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _field(num: int, val: int | bytes) -> bytes:
    if isinstance(val, bytes):
        return _varint(num << 3 | 2) + _varint(len(val)) + val
    return _varint(num << 3) + _varint(val)


def test_pagemap_counts_present_lazy_and_parent_pages(tmp_path: Path) -> None:
    pe = lambda vaddr, n, flags: _field(1, vaddr) + _field(2, n) + _field(4, flags)  # noqa: E731
    _img(tmp_path / "pagemap-7.img", 0x56084025, [
        _field(1, 3),  # head: pages_id 3
        pe(0x1000, 4, images.PE_PRESENT | images.PE_LAZY),  # in the image (lazily restorable)
        pe(0x9000, 10, images.PE_LAZY),  # left in the source
        pe(0x20000, 2, images.PE_PARENT),
        pe(0x30000, 1, images.PE_PRESENT),
    ])
    s = images.pagemap(tmp_path / "pagemap-7.img")
    assert (s.pages_id, s.present_pages, s.lazy_pages, s.parent_pages) == (3, 5, 10, 2)
    assert images.lazy_bytes(tmp_path) == 10 * 4096
    assert images.check_pages(tmp_path) == ["pagemap-7.img: pages-3.img is missing (20480 bytes expected)"]
    (tmp_path / "pages-3.img").write_bytes(b"\0" * 5 * 4096)
    assert images.check_pages(tmp_path) == []
    (tmp_path / "pages-3.img").write_bytes(b"\0" * 4096)
    assert "has 4096 bytes, its map says 20480" in images.check_pages(tmp_path)[0]
    (tmp_path / "bad.img").write_bytes(b"\0" * 3)
    with pytest.raises(images.ImageFormatError):
        images.pagemap(tmp_path / "bad.img")


def test_stats_images(tmp_path: Path) -> None:
    restore = _field(1, 7) + _field(2, 0) + _field(3, 1500) + _field(4, 250000) + _field(5, 123456)
    _img(tmp_path / "stats-restore", 0x57093306, [_field(2, restore)], service=True)
    assert images.stats(tmp_path / "stats-restore") == {
        "pages_compared": 7, "pages_skipped_cow": 0, "forking_time_us": 1500, "restore_time_us": 250000,
        "pages_restored": 123456}


# ------------------------------------------------------------------- the keeper's protocol
def _req(cmd: int, nr: int = 0) -> bytes:
    return PSI.pack(cmd, nr, 0x1000, 7)


def _answer(pid: int, vaddr: int, n: int, fill: bytes) -> bytes:
    return PSI.pack(6 | (4 << 16), n, vaddr, pid) + fill * (n * 4096)


def test_proxy_answers_the_daemon_in_the_order_it_asked() -> None:
    """Pages fetched ahead answer at once, but never before an earlier request still waiting
    on the source (the daemon matches answers to its requests by order)."""
    px = _Proxy([(10, 0x10000, 3)], depth=4, cache_bytes=1 << 30)
    px.xfer_pages = 1024
    assert px.next_prefetch() == [PSI.pack(PS_IOV_GET, 3, 0x10000, 10)]
    ahead = _answer(10, 0x10000, 2, b"a")  # the source clamps: 2 of 3 pages, the rest asked next
    more = px.from_source(memoryview(ahead[:50])) + px.from_source(memoryview(ahead[50:]))
    assert more == [PSI.pack(PS_IOV_GET, 1, 0x12000, 10)] and px.page_bytes == 2 * 4096
    # the daemon asks for a page not here (forwarded), then for one fetched ahead (a hit)
    fwd = px.from_daemon(_req(PS_IOV_GET, 1)[:5])
    fwd += px.from_daemon(_req(PS_IOV_GET, 1)[5:] + PSI.pack(PS_IOV_GET, 1, 0x11000, 10))
    assert fwd == [_req(PS_IOV_GET, 1)] and px.hits == 1

    class Sink:
        sent = b""

        def sendall(self, b: bytes) -> None:
            Sink.sent += b

    px.flush(Sink())
    assert Sink.sent == b""  # the hit waits behind the forwarded request
    px.from_source(memoryview(_answer(10, 0x12000, 1, b"z")))  # the rest of the run, ahead
    px.from_source(memoryview(_answer(7, 0x1000, 1, b"f")))  # the forwarded request's answer
    px.flush(Sink())
    assert Sink.sent == _answer(7, 0x1000, 1, b"f") + _answer(10, 0x11000, 1, b"a")
    assert px.served_bytes == 2 * 4096 and not px.up_q
    # the daemon on the keeper's socket pair (--ps-socket) closes with FORCE_CLOSE: the source
    # gets the CLOSE it always got
    assert px.from_daemon(_req(PS_IOV_FORCE_CLOSE)) == [_req(PS_IOV_CLOSE)]
    assert px.up_q and not px.closed and px.next_prefetch() == []
    px.from_source(memoryview(b"\0\0\0\0"))
    px.flush(Sink())
    assert px.closed and Sink.sent.endswith(b"\0\0\0\0")


def test_proxy_keeps_background_requests_small_while_faults_come() -> None:
    px = _Proxy([], depth=1, cache_bytes=0)
    big = PSI.pack(PS_IOV_GET, 1024, 0x40000, 10)
    assert px.from_daemon(big) == [big]  # no fault yet: as asked
    px.from_daemon(PSI.pack(PS_IOV_GET, 1, 0x1000, 10))  # a page fault
    assert px.from_daemon(big) == [PSI.pack(PS_IOV_GET, px.BUSY_PAGES, 0x40000, 10)]
    px.last_fault -= 1.0  # the faults stopped
    assert px.from_daemon(big) == [big]


def test_lazy_runs(tmp_path: Path) -> None:
    pe = lambda vaddr, n, flags: _field(1, vaddr) + _field(2, n) + _field(4, flags)  # noqa: E731
    _img(tmp_path / "pagemap-7.img", 0x56084025, [_field(1, 3), pe(0x1000, 4, images.PE_PRESENT | images.PE_LAZY),
                                                  pe(0x9000, 10, images.PE_LAZY)])
    assert images.lazy_runs(tmp_path / "pagemap-7.img") == [(0x9000, 10)]
    from relocator.agent.postcopy import _lazy_ranges

    assert _lazy_ranges(tmp_path) == [(7, 0x9000, 10)]


class _FakeSource:
    """A page server answering GETs with `nr` pages each, until told to go silent or close."""

    def __init__(self, tls: bool = False) -> None:
        from relocator.credentials import server_context

        self.lst = socket.create_server(("127.0.0.1", 0))
        self.port = self.lst.getsockname()[1]
        self.mode = "answer"  # | "silent" | "close"
        self.tls = server_context() if tls else None  # as CRIU's --tls: the keeper must present its certificate
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        conn, _ = self.lst.accept()
        if self.tls is not None:
            conn = self.tls.wrap_socket(conn, server_side=True)
        buf = b""
        while True:
            data = conn.recv(4096)
            if not data:
                conn.close()
                return
            buf += data
            while len(buf) >= PSI.size:
                cmd, nr, vaddr, dst = PSI.unpack_from(buf)
                buf = buf[PSI.size:]
                if self.mode == "close":
                    conn.close()
                    return
                if self.mode == "silent":
                    continue
                if cmd & 0xFFFF == PS_IOV_CLOSE:
                    conn.sendall(b"\0\0\0\0")
                    if self.tls is not None:  # CRIU under --tls ends its session at once
                        conn.close()
                        return
                else:
                    conn.sendall(PSI.pack(6, nr, vaddr, dst) + b"m" * (nr * 4096))


def _keeper(tmp_path: Path, source: _FakeSource, stall_s: float = 1.0):
    """A Keeper relaying for a fake daemon (a socket here) and a fake tree (a sleep process);
    with a TLS source, as Keeper.run connects: TLS to the source, the daemon on a socket pair."""
    import argparse

    from relocator.agent.postcopy import _connect
    from relocator.credentials import client_context

    tree = subprocess.Popen(["sleep", "60"])
    (tmp_path / "init.pid").write_text(str(tree.pid))
    args = argparse.Namespace(cell_dir=str(tmp_path), image_dir=str(tmp_path), source="127.0.0.1",
                              source_port=source.port, stall_s=stall_s, throttle_bps=0.0, lazy_bytes=0,
                              connect_timeout=2.0, status_fd=-1, prefetch=1, prefetch_depth=4, cache_bytes=1 << 30)
    k = Keeper(args)
    k.daemon = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    out: dict = {}
    if source.tls is None:
        lst = socket.create_server(("127.0.0.1", 0))
        up = socket.create_connection(("127.0.0.1", source.port))
        t = threading.Thread(target=lambda: out.update(rc=k.relay(lst, up)), daemon=True)
        t.start()
        return k, tree, socket.create_connection(lst.getsockname()), t, out
    up = _connect("127.0.0.1", source.port, 2.0, client_context())
    up.settimeout(stall_s)
    down, daemon = socket.socketpair()
    t = threading.Thread(target=lambda: out.update(rc=k.relay(None, up, down=down)), daemon=True)
    t.start()
    return k, tree, daemon, t, out


@pytest.mark.parametrize("tls", [False, True])
def test_keeper_relays_and_counts_pages(tmp_path: Path, tls: bool) -> None:
    src = _FakeSource(tls)
    k, tree, daemon, t, out = _keeper(tmp_path, src)
    daemon.sendall(_req(PS_IOV_GET, 3))
    got = b""
    while len(got) < PSI.size + 3 * 4096:
        got += daemon.recv(65536)
    daemon.sendall(_req(PS_IOV_CLOSE))
    assert daemon.recv(4) == b"\0\0\0\0"
    k.daemon.kill()  # the daemon "exits" (rc -9 here: counted as a daemon failure, see below)
    daemon.close()
    t.join(10)
    st = read_state(tmp_path)
    assert st["page_bytes"] == 3 * 4096 and st["requests"] == 2
    # the daemon did not exit 0: its userfaultfds are gone, the tree must not run on
    assert st["state"] == "failed" and st["why"] == "daemon" and tree.wait(5) == -9


def test_keeper_done_when_a_tls_source_ends_its_session_after_the_close(tmp_path: Path) -> None:
    """CRIU's page server under --tls closes its side right after acknowledging the CLOSE, before
    the daemon has closed the keeper's: every page is there, so that is not a lost source."""
    src = _FakeSource(tls=True)
    k, tree, daemon, t, out = _keeper(tmp_path, src)
    try:
        k.daemon = subprocess.Popen(["true"])  # the daemon exits 0 once it has every page
        daemon.sendall(_req(PS_IOV_GET, 2))
        got = b""
        while len(got) < PSI.size + 2 * 4096:
            got += daemon.recv(65536)
        daemon.sendall(_req(PS_IOV_FORCE_CLOSE))  # as on the keeper's socket pair
        assert daemon.recv(4) == b"\0\0\0\0"
        time.sleep(0.5)  # the source's end of the session reaches the keeper first
        daemon.close()
        t.join(10)
        st = read_state(tmp_path)
        assert st["state"] == "done" and out["rc"] == 0, st
    finally:
        tree.kill()


@pytest.mark.parametrize("tls", [False, True])
@pytest.mark.parametrize("mode, why", [("close", "source"), ("silent", "stall")])
def test_keeper_kills_the_copy_before_the_daemon_hears_of_a_lost_source(tmp_path: Path, mode: str, why: str,
                                                                        tls: bool) -> None:
    src = _FakeSource(tls)
    k, tree, daemon, t, out = _keeper(tmp_path, src, stall_s=0.5)
    src.mode = mode
    daemon.sendall(_req(PS_IOV_GET, 1))
    data = daemon.recv(65536)  # the daemon's link ends only after the tree is dead
    assert data == b"" and tree.poll() == -9
    t.join(10)
    st = read_state(tmp_path)
    assert st["state"] == "failed" and st["why"] == why and st["killed_pid"] == tree.pid, st
    assert k.daemon.poll() is not None and out["rc"] == 6


# ------------------------------------------------------------------------------ auto choice
def test_postcopy_problems() -> None:
    ok = {"uffd_noncoop": [True, "uffd-noncoop is supported"], "lazy_dump_pipes": [True, "fs.pipe-max-size is 4194304"]}
    assert postcopy_problems(ok, ok) == []
    no_uffd = {**ok, "uffd_noncoop": [False, "UFFD is not supported"]}
    small = {**ok, "lazy_dump_pipes": [False, "fs.pipe-max-size is 1048576 (>= 4194304 needed)"]}
    assert postcopy_problems(ok, no_uffd) == ["target: no non-cooperative userfaultfd (UFFD is not supported)"]
    assert postcopy_problems(small, ok) == ["source: fs.pipe-max-size is 1048576 (>= 4194304 needed)"]


# ------------------------------------------------------- the state machine with a post-copy
class _PostCopyBackend:
    """tests/test_controller_machine.py's fake backend plus a post-copy that ends as told."""

    def __new__(cls, outcome: dict):
        from tests.test_controller_machine import FakeBackend

        be = FakeBackend()
        be.outcome, be.lazy_waits = outcome, 0

        def shared_storage(src, dst):  # `auto`: no shared image store ...
            be._call("shared_storage", src, dst)
            return False

        def transfer_info(node):  # ... and both nodes can post-copy
            return {"uffd_noncoop": [True, "ok"], "lazy_dump_pipes": [True, "ok"]}

        def dump_lazy(node, cell, image_dir):
            be.cells[(node, cell)] = "stopped"  # frozen, serving its memory
            be._call("dump_lazy", node, cell)
            be.images.add((node, image_dir))
            return {"bytes": 33, "lazy_bytes": 1000, "address": "127.0.0.1", "port": 4242, "pump_port": 4343}

        restore = be.restore

        def restore_pc(node, image_dir, cell, verified=False, gpu_ids=None, page_source=None):
            be.page_source = page_source
            return restore(node, image_dir, cell, verified, gpu_ids)

        def postcopy_status(node, cell):
            return {"state": "running", "page_bytes": 400}

        def postcopy_wait(node, cell, timeout=1.0):
            if be.outcome.get("state") == "failed":
                be.cells[(node, cell)] = "absent"  # the keeper killed the copy
            return {"state": "done", "page_bytes": 1000, "started_at": 10.0, "ended_at": 14.5, **be.outcome}

        def lazy_dump_wait(node, cell, timeout=1.0):
            be.lazy_waits += 1
            return {"done": True, "rc": 0}

        be.shared_storage, be.transfer_info, be.dump_lazy, be.restore = shared_storage, transfer_info, dump_lazy, restore_pc
        be.postcopy_status, be.postcopy_wait, be.lazy_dump_wait = postcopy_status, postcopy_wait, lazy_dump_wait
        return be


def _machine_env(tmp_path: Path, be):
    from relocator.controller.machine import Machine
    from relocator.controller.model import WorkerRecord
    from relocator.controller.store import Store

    store = Store(tmp_path / "c.db")
    store.save_worker(WorkerRecord(id="w1", model="m", node="n1", gpus=2, cell_id="c1", endpoint="http://a",
                                   state="running", reservation="pg-w1", gpu_ids=[0, 1]))
    be.gpu_ids = {"n2": [2, 3]}
    return store, Machine(store, be)


def test_postcopy_releases_the_source_only_after_every_page(tmp_path: Path) -> None:
    from relocator.controller.model import DONE, Relocation

    be = _PostCopyBackend({})
    store, m = _machine_env(tmp_path, be)
    rel = m.run(Relocation(id="r1", worker="w1", src="n1", transfer="auto", faults={"postcopy": {"stall_s": 2}}))
    assert rel.result == DONE and rel.transfer == "postcopy"
    # the page server, the push channel beside it, and the fault's settings for the keeper
    assert be.page_source == {"address": "127.0.0.1", "port": 4242, "pump_port": 4343, "stall_s": 2}
    assert rel.postcopy["pages_after_switch_bytes"] == 600 and rel.postcopy["postcopy_s"] == 4.5
    names = [c[0] for c in be.calls]
    assert names.index("switch") < names.index("kill") and be.lazy_waits == 1  # source killed last
    assert store.worker("w1").node == "n2" and store.worker("w1").gpu_ids == [2, 3]


@pytest.mark.parametrize("why, source_state, result, worker_state", [
    ("target", "stopped", "rolled_back", "running"),  # the copy died: back to the frozen source
    ("stall", "stopped", "rolled_back", "running"),  # network cut
    ("source", "lost", "failed", "lost"),  # the source node died: the worker is lost, replaced
])
def test_postcopy_failure_after_the_switch(tmp_path: Path, why, source_state, result, worker_state) -> None:
    from relocator.controller.model import Relocation

    be = _PostCopyBackend({"state": "failed", "why": why, "error": "x"})
    store, m = _machine_env(tmp_path, be)
    if source_state == "lost":
        real = be.cell_state
        be.cell_state = lambda node, cell: "lost" if node == "n1" else real(node, cell)
    rel = m.run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="postcopy"))
    assert rel.result == result and rel.postcopy["failed"] == why, rel.error
    w = store.worker("w1")
    assert (w.node, w.state, w.gpu_ids, w.reservation) == ("n1", worker_state, [0, 1], "pg-w1")
    assert ("n2", f"w1-r1") not in be.cells  # the copy is gone
    if result == "rolled_back":
        assert be.cells[("n1", "c1")] == "running" and be.router["w1"]["endpoint"] == "http://a"


def test_postcopy_whose_copy_dies_as_its_last_pages_come_rolls_back(tmp_path: Path) -> None:
    """The keeper says done (its daemon ends as for a copy that has every page) but the copy is
    gone: the frozen source is still whole, so the move rolls back to it (CI: it came out done
    and the worker was lost)."""
    from relocator.controller.model import Relocation

    be = _PostCopyBackend({})
    store, m = _machine_env(tmp_path, be)
    real = be.lazy_dump_wait

    def lazy_dump_wait(node, cell, timeout=1.0):  # the copy dies once its memory is there
        be.cells.pop(("n2", "w1-r1"), None)
        return real(node, cell, timeout)

    be.lazy_dump_wait = lazy_dump_wait
    rel = m.run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="postcopy"))
    assert rel.result == "rolled_back" and rel.postcopy["failed"] == "target", rel.error
    w = store.worker("w1")
    assert (w.node, w.state) == ("n1", "running") and be.cells[("n1", "c1")] == "running"
