"""The receiving side of `transfer: stream`: a CRIU page server in the target's image directory.

The source's `criu dump --page-server` sends the worker's memory (pagemap and pages images)
straight into it while it reads it; nothing of the memory is written on the source or read
again there. The page files are hashed here as they grow (`TailHasher`), so their sha256 is
ready when the dump ends; the other, small images then travel with the chunked, checksummed
stream (relocator.agent.transfer) and the target writes the complete manifest: the source's
entries plus the page files it hashed on arrival, each page file checked against the map that
describes it (relocator.snapshot.images.check_pages).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
from pathlib import Path
from typing import Callable

from relocator.snapshot.manifest import FileEntry

CHUNK = 4 << 20
#: how long the TLS front waits for the move's dump to connect (the controller dumps right after
#: opening the page server; a move given up meanwhile aborts it sooner)
FRONT_ACCEPT_S = 300.0


def is_page_file(name: str) -> bool:
    return name.endswith(".img") and name.startswith(("pages-", "pagemap-"))


def landed(name: str) -> bool:
    """What the page server leaves in the image directory: page files and its own log."""
    return is_page_file(name) or name in ("page-server.log", "page-server.out")


class TailHasher(threading.Thread):
    """sha256 of every page file of `directory` while a writer appends to it: each file is read
    from where the last read stopped (the page cache still holds what was just written), so
    the hashes are ready moments after the writer ends. The writer only appends (CRIU's page
    server writes both images sequentially)."""

    def __init__(self, directory: Path, match: Callable[[str], bool] = is_page_file, idle_s: float = 0.005) -> None:
        super().__init__(name=f"tail-hash-{directory.name}", daemon=True)
        self.dir = Path(directory)
        self.match = match
        self.idle_s = idle_s
        self._files: dict[str, tuple[object, "hashlib._Hash", int]] = {}
        self._done = threading.Event()
        self.error: BaseException | None = None
        self.bytes = 0

    def _pass(self) -> int:
        got = 0
        try:
            names = [n for n in os.listdir(self.dir) if self.match(n)]
        except FileNotFoundError:
            return 0
        for name in names:
            if name not in self._files:
                self._files[name] = (open(self.dir / name, "rb"), hashlib.sha256(), 0)
            fh, h, size = self._files[name]
            while True:
                data = fh.read(CHUNK)  # type: ignore[attr-defined]
                if not data:
                    break
                h.update(data)
                size += len(data)
                got += len(data)
            self._files[name] = (fh, h, size)
        self.bytes += got
        return got

    def run(self) -> None:
        try:
            while not self._done.is_set():
                if not self._pass():
                    self._done.wait(self.idle_s)
            self._pass()  # whatever the writer wrote before it ended
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
        finally:
            for fh, _, _ in self._files.values():
                fh.close()  # type: ignore[attr-defined]

    def result(self, timeout: float = 600.0) -> dict[str, FileEntry]:
        """Stop following (the writer has ended) and return {name: sha256 and size}."""
        self._done.set()
        self.join(timeout)
        if self.error is not None:
            raise self.error
        out = {name: FileEntry(sha256=h.hexdigest(), size=size) for name, (_, h, size) in self._files.items()}
        for name, entry in out.items():  # the bytes hashed are the file: it must not have changed
            if (self.dir / name).stat().st_size != entry.size:
                raise OSError(f"{name} changed while it was hashed")
        return out


class PageReceiver:
    """One streamed dump's landing place on the target: `criu page-server` into `image_dir`,
    hashed as it arrives."""

    def __init__(self, image_dir: Path, address: str, peer_address: str = "") -> None:
        self.image_dir, self.address = Path(image_dir), address
        self.peer_address = peer_address  # the source's transfer address: the front admits only it ("": any)
        self.proc = None
        self.port = 0
        self.hasher: TailHasher | None = None
        self.started_at = 0.0
        self.unix = None  # locallink.UnixOffer: the same-host route, when the dump takes it
        self.link = "tls"
        self.front = None  # relocator.agent.front.Front: the TLS route's port, before CRIU
        self.move: dict | None = None  # this move's credentials (make_move): the peer's goes in the offer
        self._swap = threading.Lock()  # the offer's thread swaps page servers; abort() must not miss one
        self._aborted = False

    def start(self, hash_on_arrival: bool = True) -> "PageReceiver":
        from relocator.snapshot import criu

        if self.image_dir.exists() and any(self.image_dir.iterdir()):
            raise FileExistsError(f"{self.image_dir} is not empty")
        self._open_network_route()
        self.started_at = time.monotonic()
        from relocator.agent import locallink

        if locallink.enabled():  # a dump on this host takes it and the TLS page server goes
            try:
                self.unix = locallink.UnixOffer(self._take_unix)
            except OSError:  # no room for the socket: TLS only, as between hosts
                self.unix = None
            else:
                self.unix.start()
        if hash_on_arrival:
            self.hasher = TailHasher(self.image_dir)
            self.hasher.start()
        return self

    def _open_network_route(self) -> None:
        """The page server for a dump of another host: CRIU on a socket pair behind a TLS front
        (relocator.agent.front) that admits only the holder of this move's peer credential,
        each connection's handshake bounded; plaintext CRIU on the port under the by-hand
        opt-out only (no credentials: RELOCATOR_INSECURE_TRANSFERS=1)."""
        import socket

        from relocator import credentials
        from relocator.snapshot import criu

        if credentials.tls_files() is None:  # CredentialsError without any
            self.proc, self.port = criu.page_server(self.image_dir, self.address)
            self.link = "tcp"  # plaintext (the by-hand opt-out, the bench's switch): said in TRANSFER's info
            return
        self.move = credentials.make_move()
        ours, criu_end = socket.socketpair()
        try:
            self.proc = criu.page_server_on(self.image_dir, criu_end.fileno())
        except BaseException:
            ours.close()
            raise
        finally:
            criu_end.close()  # CRIU has its copy
        from relocator.agent.front import start_for

        try:
            self.front = start_for(self.address, self.move["listener"], ours, peer_cert=self.move["peer"]["cert"],
                                   expect_addr=self.peer_address, accept_s=FRONT_ACCEPT_S)
        except BaseException:
            ours.close()
            self.proc.kill()
            raise
        self.port = self.front.port

    def offer(self) -> dict:
        """What the source's dump needs: the TLS page server's address and port, and the unix
        socket a dump of this host uses instead (relocator.agent.locallink)."""
        out = {"address": self.address, "port": self.port, **(self.unix.offer() if self.unix else {})}
        if self.move:  # the dump's end of this move's credential (relocator.credentials.make_move)
            out["credential"] = self.move["peer"]
        return out

    def _take_unix(self, conn) -> None:
        from relocator.snapshot import criu

        with self._swap:
            if self._aborted:
                return
            tls, self.proc = self.proc, criu.page_server_on(self.image_dir, conn.fileno())
            self.link = "unix"
        if self.front is not None:
            self.front.close()
        tls.kill()

    def finish(self, timeout: float = 120.0) -> dict:
        """After the dump: the page server's exit (0: every page flushed) and the page files'
        hashes. Raises TransferError if the pages did not all arrive."""
        from relocator.agent.transfer import TransferError
        from relocator.snapshot import criu
        from relocator.snapshot.images import check_pages

        assert self.proc is not None
        if self.unix is not None:
            self.unix.close()  # the dump has ended: nobody else may take the route
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise TransferError(f"the page server in {self.image_dir} did not end within {timeout:.0f}s "
                                "(the dump never finished sending)") from None
        front = self._front_info()
        if rc != 0:
            why = f" ({self.front.why()})" if self.front is not None and self.link == "tls" else ""
            raise TransferError(f"the page server in {self.image_dir} failed (exit {rc}){why}: the memory did not "
                                f"all arrive\n{criu._log_tail(self.image_dir / 'page-server.log')}")
        t = time.monotonic()
        files = self.hasher.result() if self.hasher else _hash_now(self.image_dir)
        hash_tail_s = time.monotonic() - t
        problems = check_pages(self.image_dir)
        if problems:
            raise TransferError("streamed memory incomplete: " + "; ".join(problems[:3]))
        return {"files": files, "page_bytes": sum(f.size for f in files.values()),
                "page_server_s": round(t - self.started_at, 3), "hash_tail_s": round(hash_tail_s, 3),
                "link": self.link, **front}

    def _front_info(self) -> dict:
        """The TLS front's account once the dump ended: who got in, how many were refused."""
        if self.front is None or self.link != "tls":
            return {}
        self.front.join(10.0)
        return {"front_refused": self.front.refused, "front_last_refused": self.front.last_refused}

    def abort(self) -> None:
        if self.unix is not None:
            self.unix.close()
        with self._swap:
            self._aborted = True
            if self.proc is not None:
                self.proc.kill()
        if self.front is not None:
            self.front.close()
        if self.hasher is not None:
            self.hasher._done.set()


def _hash_now(image_dir: Path) -> dict[str, FileEntry]:
    from relocator.snapshot.manifest import _sha256

    out = {}
    for p in sorted(image_dir.iterdir()):
        if p.is_file() and is_page_file(p.name):
            out[p.name] = FileEntry(sha256=_sha256(p), size=p.stat().st_size)
    return out


def complete_manifest(image_dir: Path, pages: dict[str, FileEntry]) -> dict:
    """Turn the source's manifest (`pages: remote`) into the image's: its entries plus the page
    files hashed here; stamp it (every byte was hashed on this host)."""
    from relocator.agent.transfer import TransferError
    from relocator.snapshot.manifest import PagesMode, read_manifest, write_manifest, write_stamp

    manifest = read_manifest(image_dir)
    if manifest.pages != PagesMode.REMOTE:
        raise TransferError(f"{image_dir}: the source's manifest says its pages are {manifest.pages}, "
                            "not sent to a page server")
    clash = sorted(set(pages) & set(manifest.files))
    if clash:
        raise TransferError(f"page files also in the source's image: {', '.join(clash[:3])}")
    manifest.files.update(pages)
    manifest.pages = PagesMode.LOCAL
    write_manifest(image_dir, manifest)
    write_stamp(image_dir, manifest)
    return {"files": len(manifest.files), "bytes": manifest.total_bytes}
