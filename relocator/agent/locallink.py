"""Same-host transfers without crypto: an AF_UNIX socket that the kernel authenticates.

When a move's two agents run on one host (the loopback cluster: same kernel, network and mount
namespaces), the stream's pages need not cross any network. The target offers a unix socket in
a directory only root reaches (0700, the socket 0600) and admits a peer only if the kernel says
it runs as the agent's own user (SO_PEERCRED); everyone else is closed and it keeps accepting.
The connected socket goes to CRIU with `--ps-socket`, so the pages go through it with CRIU's
splice and no TLS. The post-copy pump listens the same way (`listen`, `admit`) beside its TLS
port, for a keeper of its host. Agents on different hosts, or in different network namespaces
(emulated hosts), never match `identity()` and keep TLS (docs/security.md). Stdlib only at
import: the pump imports this under `python -S`.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

from relocator.paths import state_dir

ENV_OFF = "RELOCATOR_LOCAL_LINKS"  # "0": always TLS over TCP, also between agents of one host


def identity() -> str:
    """This host and namespaces: equal for two agents iff a unix socket of one reaches the other
    and both see the same network (boot id, network and mount namespace)."""
    from relocator import procs  # here: the pump imports this module under `python -S` (no psutil)

    return "|".join([procs.boot_id(), procs.namespace("net") or "", procs.namespace("mnt") or ""])


def enabled() -> bool:
    return os.environ.get(ENV_OFF, "1") != "0"


def links_dir() -> Path:
    d = state_dir() / "links"
    d.mkdir(parents=True, exist_ok=True)
    os.chmod(d, 0o700)  # the socket's first guard: only root gets to connect at all
    return d


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


MAX_PATH = 100  # sun_path holds 108 bytes


def new_path() -> str:
    """Where a new listening socket goes (links_dir: only root reaches it); "" where that path
    would not fit a unix socket's address (a deep state directory): then TLS only."""
    path = str(links_dir() / f"{uuid.uuid4().hex[:16]}.sock")
    return path if len(path.encode()) <= MAX_PATH else ""


def listen(path: str) -> socket.socket:
    """A unix socket listening at `path` (0600: made under umask 0177, no window)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    sock.listen(8)
    return sock


def admit(lst: socket.socket) -> socket.socket | None:
    """The connection waiting on `lst` if the kernel says its peer runs as this user; None,
    having closed it, otherwise (the caller goes on listening)."""
    conn, _ = lst.accept()
    if peer_uid(conn) == os.geteuid():
        return conn
    conn.close()
    return None


def unlisten(lst: socket.socket, path: str) -> None:
    try:  # shutdown first: a bare close() does not wake an accept() of another thread
        lst.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    lst.close()
    Path(path).unlink(missing_ok=True)


class UnixOffer(threading.Thread):
    """A listening unix socket that hands its first peer of this user to `on_peer` (then closes);
    peers of any other user are closed without a byte and it goes on listening."""

    def __init__(self, on_peer: Callable[[socket.socket], None]) -> None:
        super().__init__(name="unix-offer", daemon=True)
        self.on_peer = on_peer
        path = new_path()
        if not path:
            raise OSError(f"{links_dir()} is too deep for a unix socket's address")
        self.path = Path(path)
        self.sock = listen(path)
        self.error: BaseException | None = None
        self.refused = 0

    def run(self) -> None:
        try:
            while True:
                try:
                    conn = admit(self.sock)
                except OSError:
                    return  # closed: the move took the network path, or was aborted
                if conn is None:
                    self.refused += 1
                    continue
                try:
                    self.on_peer(conn)
                finally:
                    conn.close()
                return
        except BaseException as exc:  # noqa: BLE001 - the page server then never starts
            self.error = exc
        finally:
            self.close()

    def close(self) -> None:
        unlisten(self.sock, str(self.path))

    def offer(self) -> dict[str, str]:
        return {"unix": str(self.path), "host": identity()}


def same_host(offer: dict, key: str) -> str:
    """`offer[key]` (a unix socket path of the other agent) when that agent is on this host
    and namespaces and local links are on; "" otherwise (then TLS over TCP)."""
    if enabled() and offer.get("host") == identity():
        return str(offer.get(key) or "")
    return ""


def connect(offer: dict) -> socket.socket | None:
    """A connected unix socket to the target's offer when it is on this host and namespaces;
    None otherwise (then TLS over TCP)."""
    path = same_host(offer, "unix")
    if not path:
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        return None
    return sock


@contextmanager
def route(offer: dict | None) -> Iterator[tuple[str, int] | int | None]:
    """How a dump reaches the target's page server (`offer`: open_page_server's answer): the
    fd of a unix socket on one host, else (address, port) for TLS over TCP; None: no page
    server (the pages stay in the image). The socket is closed afterwards."""
    sock = connect(offer) if offer else None
    try:
        yield sock.fileno() if sock else (offer["address"], int(offer["port"])) if offer else None
    finally:
        if sock:
            sock.close()
