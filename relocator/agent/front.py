"""The TLS front of a CRIU page server: one listening port that admits one authenticated peer.

CRIU's own page servers (`criu page-server`, `criu dump --lazy-pages`) serve the first
connection they accept: a stranger that connects first, or just sits idle, takes the move's
only door (the move hung or rolled back). Here CRIU speaks plaintext on one end of a socket
pair (`--ps-socket`) and the front holds the TCP port in its place:

- with `expect_addr` (the other agent's transfer address, which its dump or keeper connects
  from), a connection from any other address is closed at once, before TLS, and takes no
  pending slot (counted in `refused` and `refused_address`): only the peer's own host can
  compete for the slots below;
- every connection gets at most `handshake_s` to finish its TLS handshake, several at once (a
  silent or slow client holds nothing back), at most `max_pending` in flight (the oldest goes);
- the handshake requires a certificate of this move's CA (relocator.credentials.make_move) and,
  with `expect_peer`, that very certificate: a cluster member, a replayed credential of an
  earlier move or anyone else fails it, gets a TLS alert at once and is counted in `refused`;
- the first peer that passes is the only one: the listener closes and every other pending
  connection is dropped; the front then relays between it and CRIU until both ends close;
- nobody within `accept_s`: the front gives up and closes CRIU's end (the page server ends
  with an error the caller reports with `why()`).

Stdlib only at import (the post-copy's front may run under `python -S`, like the pump).
"""

from __future__ import annotations

import hashlib
import select
import socket
import ssl
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator

BUF = 1 << 20


def family_of(address: str) -> socket.AddressFamily:
    """AF_INET6 for an IPv6 literal (`::1`, `fd00::5`), AF_INET otherwise."""
    return socket.AF_INET6 if ":" in address else socket.AF_INET


def same_host(a: str, b: str) -> bool:
    """Two literal addresses of one host: equal once an IPv4-mapped IPv6 form (`::ffff:1.2.3.4`)
    and an IPv6 zone (`fe80::1%eth0`) are taken off, and IPv6 written in canonical form."""
    import ipaddress

    def norm(x: str) -> str:
        x = x.split("%", 1)[0]
        try:
            ip = ipaddress.ip_address(x)
        except ValueError:
            return x
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ip)

    return norm(a) == norm(b)


class Front:
    def __init__(self, address: str, ctx: ssl.SSLContext, backend: socket.socket, *, port: int = 0,
                 expect_peer: str = "", expect_addr: str = "", handshake_s: float = 2.0, accept_s: float = 120.0,
                 max_pending: int = 16, io_s: float = 60.0, on_change: Callable[["Front"], None] | None = None) -> None:
        self.ctx, self.backend, self.expect_peer, self.expect_addr = ctx, backend, expect_peer, expect_addr
        self.handshake_s, self.accept_s, self.max_pending, self.io_s = handshake_s, accept_s, max_pending, io_s
        self.on_change = on_change
        self.lst = socket.socket(family_of(address), socket.SOCK_STREAM)  # the address's own family
        self.lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.lst.bind((address, port))
        except OSError:
            self.lst.close()
            raise
        self.lst.listen(64)
        self.address, self.port = address, self.lst.getsockname()[1]
        self.refused = 0
        self.refused_address = 0  # of them, from another address than expect_addr (no slot taken)
        self.last_refused = ""
        self.peer = ""  # who was admitted
        self.state = "listening"  # listening, relaying, done, gave_up, closed, failed
        self.error = ""
        self.bytes_in = self.bytes_out = 0
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    # -- running ----------------------------------------------------------------------------
    def start(self) -> "Front":
        self._thread = threading.Thread(target=self.run, name=f"tls-front-{self.port}", daemon=True)
        self._thread.start()
        return self

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)

    def run(self) -> None:
        try:
            conn = self.admit()
            if conn is not None:
                self._set("relaying")
                self.relay(conn)
                self._set("done")
        except Exception as exc:  # noqa: BLE001 - said by why(); CRIU's end closes below
            self.error = f"{type(exc).__name__}: {exc}"[:500]
            self._set("failed")
        finally:
            self._close_listener()
            try:
                self.backend.close()
            except OSError:
                pass

    def close(self) -> None:
        """Stop (the move took another route, or was aborted): no more admissions or relaying."""
        self._closed.set()
        self._close_listener()
        try:
            self.backend.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def why(self) -> str:
        """What the front saw, for a failed page server's error: one line."""
        parts = [f"TLS front {self.address}:{self.port} {self.state}"]
        if self.peer:
            parts.append(f"peer {self.peer}")
        if self.refused:
            parts.append(f"{self.refused} connection(s) refused, last: {self.last_refused}")
        if self.refused_address:
            parts.append(f"{self.refused_address} of them from another address than the peer's {self.expect_addr}")
        if self.error:
            parts.append(self.error)
        return "; ".join(parts)

    def info(self) -> dict:
        return {"state": self.state, "port": self.port, "peer": self.peer, "refused": self.refused,
                "refused_address": self.refused_address, "last_refused": self.last_refused, "error": self.error, "bytes_in": self.bytes_in,
                "bytes_out": self.bytes_out}

    def _set(self, state: str) -> None:
        self.state = state
        if self.on_change is not None:
            try:
                self.on_change(self)
            except Exception:  # noqa: BLE001 - a report only
                pass

    def _close_listener(self) -> None:
        try:
            self.lst.close()
        except OSError:
            pass

    def _refuse(self, sock: socket.socket, peer: str, why: str) -> None:
        try:
            sock.close()
        except OSError:
            pass
        self.refused += 1
        self.last_refused = f"{peer}: {why}"[:300]
        self._set(self.state)

    # -- admission --------------------------------------------------------------------------
    def _verified(self, conn: ssl.SSLSocket) -> str:
        """Why an admitted handshake's peer is not the one expected; "" when it is."""
        if not self.expect_peer:
            return ""
        der = conn.getpeercert(binary_form=True) or b""
        if hashlib.sha256(der).hexdigest() != self.expect_peer:
            return "a certificate of this move's CA, but not the peer's"
        return ""

    def admit(self) -> ssl.SSLSocket | None:
        """Handshakes in parallel, each bounded; the first authenticated peer, or None (closed,
        or nobody passed within accept_s)."""
        pending: dict[ssl.SSLSocket, tuple[float, str, bool]] = {}  # sock: (deadline, peer, wants write)
        deadline = time.monotonic() + self.accept_s
        try:
            while not self._closed.is_set():
                now = time.monotonic()
                if now >= deadline:
                    self.error = f"no authenticated peer connected within {self.accept_s:g}s"
                    self._set("gave_up")
                    return None
                for s, (dl, peer, _) in list(pending.items()):
                    if now >= dl:
                        del pending[s]
                        self._refuse(s, peer, f"no TLS handshake within {self.handshake_s:g}s")
                wait = min([deadline, *(dl for dl, _, _ in pending.values())]) - now
                rs = [self.lst, self.backend, *(s for s, (_, _, w) in pending.items() if not w)]
                ws = [s for s, (_, _, w) in pending.items() if w]
                try:
                    r, w, _ = select.select(rs, ws, [], max(0.0, min(wait, 0.5)))
                except (OSError, ValueError):  # the listener was closed under us
                    return None
                if self.backend in r and self._criu_gone():
                    self.error = "the page server ended before a peer connected"
                    self._set("closed")
                    return None
                if self.lst in r:
                    self._accept(pending)
                for s in [x for x in (*r, *w) if x is not self.lst and x is not self.backend]:
                    if s not in pending:
                        continue
                    dl, peer, _ = pending[s]
                    try:
                        s.do_handshake()
                    except ssl.SSLWantReadError:
                        pending[s] = (dl, peer, False)
                        continue
                    except ssl.SSLWantWriteError:
                        pending[s] = (dl, peer, True)
                        continue
                    except (ssl.SSLError, OSError, ValueError) as exc:
                        del pending[s]
                        self._refuse(s, peer, getattr(exc, "reason", None) or str(exc) or type(exc).__name__)
                        continue
                    del pending[s]
                    bad = self._verified(s)
                    if bad:
                        self._refuse(s, peer, bad)
                        continue
                    self.peer = peer
                    return s
            self._set("closed")
            return None
        finally:
            self._close_listener()  # one peer only: nobody else reaches CRIU from now on
            for s, (_, peer, _) in pending.items():
                self._refuse(s, peer, "another peer was admitted" if self.peer else "the front closed")

    def _criu_gone(self) -> bool:
        try:
            return self.backend.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True

    def _accept(self, pending: dict) -> None:
        try:
            raw, addr = self.lst.accept()
        except OSError:
            return
        peer = f"[{addr[0]}]:{addr[1]}" if ":" in addr[0] else f"{addr[0]}:{addr[1]}"
        if self.expect_addr and not same_host(addr[0], self.expect_addr):  # not the peer's host: no slot
            self.refused_address += 1
            self._refuse(raw, peer, f"not the move's peer address {self.expect_addr}")
            return
        if len(pending) >= self.max_pending:  # a flood: the oldest waiter goes, not the newcomer
            oldest = min(pending, key=lambda s: pending[s][0])
            _, opeer, _ = pending.pop(oldest)
            self._refuse(oldest, opeer, f"more than {self.max_pending} handshakes at once")
        raw.setblocking(False)
        try:
            s = self.ctx.wrap_socket(raw, server_side=True, do_handshake_on_connect=False)
        except (ssl.SSLError, OSError) as exc:
            self._refuse(raw, peer, str(exc))
            return
        pending[s] = (time.monotonic() + self.handshake_s, peer, False)

    # -- relaying ---------------------------------------------------------------------------
    def relay(self, conn: ssl.SSLSocket) -> None:
        """Bytes both ways between the admitted peer and CRIU until one side closes; then the
        other is closed too (the peer with a TLS close_notify, as CRIU's GnuTLS ends a session).
        Reads of the TLS side never block (a part of a record waits for the rest in OpenSSL,
        not here); writes block, bounded by io_s (CRIU's answers are small, its reads keep up)."""
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setblocking(False)
        self.backend.settimeout(self.io_s)
        view = memoryview(bytearray(BUF))
        try:
            while not self._closed.is_set():
                r = [conn] if conn.pending() else select.select([conn, self.backend], [], [], 0.5)[0]
                if conn in r:
                    n = self._read_tls(conn, view)
                    if n == 0:  # the peer closed: CRIU gets EOF
                        break
                    if n:
                        self.backend.sendall(view[:n])
                        self.bytes_in += n
                if self.backend in r:
                    data = self.backend.recv(BUF)
                    if not data:  # CRIU ended its session
                        break
                    self._send_tls(conn, data)
                    self.bytes_out += len(data)
        finally:
            try:
                self.backend.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            try:  # our close_notify (and the peer's, 2 s at most): CRIU's GnuTLS waits for it
                conn.setblocking(True)
                conn.settimeout(2.0)
                conn.unwrap()
            except (ssl.SSLError, OSError, ValueError):
                pass
            conn.close()

    @staticmethod
    def _read_tls(conn: ssl.SSLSocket, view: memoryview) -> int | None:
        """Decrypted bytes now (as many as have arrived, up to the buffer); 0 when the peer
        closed; None: none yet."""
        got = 0
        while got < len(view) - (16 << 10):
            try:
                n = conn.recv_into(view[got:])
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
                break
            except ssl.SSLZeroReturnError:
                n = 0
            except (ConnectionResetError, BrokenPipeError, ssl.SSLEOFError):
                n = 0
            if n == 0:
                return got or 0
            got += n  # on until the socket has nothing more (WantRead): one record is 16 KiB, and a
            # select plus a send to CRIU per record cost more CPU than the decryption (0.2 GB/s)
        return got or None

    def _send_tls(self, conn: ssl.SSLSocket, data: bytes) -> None:
        view = memoryview(data)
        deadline = time.monotonic() + self.io_s
        while view:
            try:
                n = conn.send(view)
                view = view[n:]
            except ssl.SSLWantWriteError:
                pass
            except ssl.SSLWantReadError:
                pass
            if view:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the peer took no data for {self.io_s:g}s")
                select.select([], [conn], [], 0.1)


def start_for(address: str, bundle: dict, backend: socket.socket, **kw) -> Front:
    """A running front for one move: `bundle` is the listener's end of make_move (its own
    certificate and the move's CA); `peer_cert`, the other end's certificate (kw) to pin."""
    from relocator.credentials import cert_sha256, move_context

    peer_cert = kw.pop("peer_cert", "")  # expect_addr (kw): the peer's transfer address, "" for any
    return Front(address, move_context(bundle, server=True), backend,
                 expect_peer=cert_sha256(peer_cert) if peer_cert else "", **kw).start()


@contextmanager
def move_credential(offer: dict | None, route: object) -> Iterator[str | None]:
    """The directory of the move's credential an offer carries, for CRIU's TLS options while a
    dump connects over TCP; None for a unix route (no TLS) or an offer without one (the node's
    own credentials then). Removed afterwards: the credential is this move's only."""
    bundle = (offer or {}).get("credential")
    if not bundle or not isinstance(route, tuple):
        yield None
        return
    from relocator.credentials import install_move, remove_move

    d = install_move(bundle)
    try:
        yield str(d)
    finally:
        remove_move(d)


# -- as a process of its own: the post-copy source's lazy dump outlives its agent ----------------
def main(argv: list[str] | None = None) -> int:
    """`python -S -m relocator.agent.front`: a front for the lazy dump whose socket-pair end is
    `--backend-fd`, with this move's listener credentials (RELOCATOR_MOVE_CREDENTIALS); its port
    and account go to `--state` (JSON). Ends when the relay ends, the dump ends, or nobody came."""
    import argparse
    import json
    import os
    import signal
    import sys

    from relocator.credentials import server_context

    p = argparse.ArgumentParser(prog="python -m relocator.agent.front")
    p.add_argument("--backend-fd", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--peer-sha256", default="")
    p.add_argument("--peer-address", default="", help="only connections from this address compete for a slot")
    p.add_argument("--state", required=True)
    p.add_argument("--accept-s", type=float, default=300.0)
    p.add_argument("--handshake-s", type=float, default=2.0)
    p.add_argument("--status-fd", type=int, default=-1)
    a = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    backend = socket.socket(fileno=a.backend_fd)

    def save(f: Front) -> None:
        tmp = a.state + ".tmp"
        with open(tmp, "w") as fh:
            json.dump({**f.info(), "pid": os.getpid(), "address": f.address, "why": f.why()}, fh)
        os.replace(tmp, a.state)

    ctx = server_context()
    if ctx is None:
        raise SystemExit("the front needs credentials (RELOCATOR_MOVE_CREDENTIALS)")
    front = Front(a.address, ctx, backend, expect_peer=a.peer_sha256, expect_addr=a.peer_address, accept_s=a.accept_s,
                  handshake_s=a.handshake_s, on_change=save)
    save(front)
    if a.status_fd >= 0:
        os.write(a.status_fd, b"\0")
        os.close(a.status_fd)
    front.run()
    save(front)
    return 0 if front.state == "done" else 1


if __name__ == "__main__":
    raise SystemExit(main())


STATE_FILE = "front.json"


def start_process(cell_dir, backend: socket.socket, address: str, tls_dir: str, peer_cert: str,
                  accept_s: float = 300.0, peer_address: str = ""):
    """The post-copy source's front as a process of its own (it outlives the agent, as the lazy
    dump does), in the cell's directory; it loads the move's credentials from `tls_dir` as it
    starts (the caller may remove them then). `peer_address`: the target's transfer address
    (its keeper's connections come from there; "": any). Returns (process, port)."""
    import json
    import os
    import sys
    from pathlib import Path

    from relocator.credentials import ENV_MOVE, cert_sha256
    from relocator.snapshot import criu

    cell_dir = Path(cell_dir)
    state = cell_dir / STATE_FILE
    state.unlink(missing_ok=True)
    repo = str(Path(__file__).resolve().parents[2])
    argv = [sys.executable, "-S", "-m", "relocator.agent.front", "--backend-fd", str(backend.fileno()),
            "--address", address, "--peer-sha256", cert_sha256(peer_cert), "--state", str(state),
            "--accept-s", str(accept_s), "--peer-address", peer_address]
    proc = criu.CriuProcess(argv, cell_dir / "front.log", "post-copy TLS front", cwd=repo,
                            env={**os.environ, "PYTHONPATH": repo, ENV_MOVE: tls_dir}, pass_fds=(backend.fileno(),))
    proc.start(timeout=30)
    return proc, int(json.loads(state.read_text())["port"])


def read_state(cell_dir) -> dict | None:
    import json
    from pathlib import Path

    try:
        return json.loads((Path(cell_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
