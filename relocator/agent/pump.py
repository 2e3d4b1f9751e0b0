"""Post-copy's push channel: the source sends the frozen worker's memory to the target's keeper
on a connection of its own, while CRIU's page server answers the page faults.

CRIU's lazy page server takes one connection, and answers in order on it: a page fault asked
behind megabytes of background copy waits for all of them (measured: health checks of 3-12 s
when the keeper fetched ahead on that connection, docs/benchmarks.md, issue 14). So the bulk of
the memory goes another way, as QEMU's post-copy does with its preempt channel: the **pump**
reads the lazy ranges of the stopped source tree (`/proc/<pid>/mem`; the tree is frozen from the
lazy dump until the post-copy ends, so these are the very bytes CRIU would serve) and streams
them to the keeper, which keeps them until the lazy-pages daemon asks. Faults the push has not
reached yet still go to CRIU's page server. The push carries no authority of its own: a page
the daemon already got from CRIU is dropped on arrival, and the source is released only when
the daemon has closed its session with CRIU's page server (relocator.agent.postcopy).

Frames: a header `<QQI` (the pagemap id CRIU and the daemon know the process by, vaddr, bytes)
then the bytes, over TLS: the keeper must present a certificate of the cluster's CA
(relocator.credentials); a connection that does not is closed after its failed handshake,
without a byte of memory, and the pump goes on waiting for the keeper. The pump exits once
everything is sent or the keeper goes away, when the lazy dump it belongs to ends, or when no
keeper connects in time.

Runs under `python -S` like the keeper: stdlib only, so its /proc readers (`ns_pids`, the
liveness of the dump) and its accept deadline are its own (relocator.agent.postcopy.base says why).
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import ssl
import sys
import time
from pathlib import Path

from relocator.agent.front import family_of, same_host
from relocator.agent.postcopy.base import FRAME, PAGE_SIZE, alive, is_ours, lazy_ranges, write_state
from relocator.agent.postcopy.base import read_state as _read_state

CHUNK = 1 << 20  # bytes per frame: big enough for throughput, small enough to interleave processes
STATE_FILE = "pump.json"


def ns_pids(init_pid: int) -> dict[int, int]:
    """The cell's processes, {pid inside the cell's PID namespace: host pid}; the pagemap ids of
    an image are the former."""
    ns = os.readlink(f"/proc/{init_pid}/ns/pid")
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{d}/ns/pid") != ns:
                continue
            for line in Path(f"/proc/{d}/status").read_text().splitlines():
                if line.startswith("NSpid:"):
                    out[int(line.split()[-1])] = int(d)
                    break
        except (OSError, ValueError):
            continue
    return out


def plan(image_dir: Path, pids: dict[int, int]) -> list[tuple[int, int, int, int]]:
    """(pagemap id, host pid, vaddr, bytes) frames, the processes interleaved a chunk at a
    time, each in address order: the order the daemon's background copy asks (one request in
    flight per process, each from its lowest address up)."""
    per: dict[int, list[tuple[int, int]]] = {}
    for pid, vaddr, n in lazy_ranges(image_dir):
        if pid not in pids:
            continue
        end = vaddr + n * PAGE_SIZE
        while vaddr < end:
            take = min(CHUNK, end - vaddr)
            per.setdefault(pid, []).append((vaddr, take))
            vaddr += take
    frames = []
    queues = [(pid, iter(chunks)) for pid, chunks in sorted(per.items())]
    while queues:
        going = []
        for pid, it in queues:
            nxt = next(it, None)
            if nxt is not None:
                frames.append((pid, pids[pid], *nxt))
                going.append((pid, it))
        queues = going
    return frames


class Pump:
    HANDSHAKE_S = 2.0

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.cell_dir = Path(a.cell_dir)
        self.refused = 0  # connections that failed the TLS handshake
        self.link = "tls"

    def state(self, **fields) -> None:
        write_state(self.cell_dir, STATE_FILE, pid=os.getpid(), **fields)

    def admit(self, lst: socket.socket, tls: ssl.SSLContext | None, port: int) -> socket.socket | None:
        """The connection waiting on `lst` once its peer proved itself (mutual TLS with the
        cluster's CA); None, having closed it, otherwise (and the pump keeps listening)."""
        raw, peer = lst.accept()
        expect = vars(self.a).get("peer_address", "")
        if expect and not same_host(peer[0], expect):  # not the keeper's host: closed before TLS
            raw.close()
            self.refused += 1
            self.state(state="listening", port=port, refused=self.refused,
                       last_refused=f"{peer[0]}: not the move's peer address {expect}"[:300])
            return None
        if tls is None:
            return raw
        raw.settimeout(self.HANDSHAKE_S)  # a client that says nothing holds the door this long only
        try:
            conn = tls.wrap_socket(raw, server_side=True)
        except (OSError, ValueError) as exc:
            raw.close()
            self.refused += 1
            self.state(state="listening", port=port, refused=self.refused, last_refused=f"{peer[0]}: {exc}"[:300])
            return None
        conn.settimeout(None)
        return conn

    def accept(self, lst: socket.socket, tls: ssl.SSLContext | None, port: int) -> socket.socket | None:
        """The keeper's connection: over TCP with TLS, or from a keeper of this host on the unix
        socket `--unix` (kernel-authenticated, relocator.agent.locallink: no crypto); None, with
        the state saying why, when none came while the lazy dump lasted."""
        from relocator.agent import locallink

        a = self.a
        unix = vars(a).get("unix", "")  # callers that build the arguments themselves may leave it out
        ulst = locallink.listen(unix) if unix else None
        deadline = time.monotonic() + a.accept_timeout  # stdlib only (python -S): not relocator.waits
        conn = None
        try:
            while conn is None:
                if not alive(a.dump_pid):
                    self.state(state="ended", why="the lazy dump ended before a keeper connected", port=port)
                    return None
                if time.monotonic() > deadline:
                    self.state(state="ended", why=f"no keeper connected in {a.accept_timeout:g}s", port=port)
                    return None
                r, _, _ = select.select([lst, *([ulst] if ulst else [])], [], [], 0.2)
                if ulst is not None and ulst in r:
                    conn = locallink.admit(ulst)
                    self.link = "unix" if conn else self.link
                elif r:
                    conn = self.admit(lst, tls, port)
        finally:
            lst.close()
            if ulst is not None:
                locallink.unlisten(ulst, unix)
        return conn

    def run(self) -> int:
        a = self.a
        try:  # CPU the node has to spare only: the restored worker's page faults come first
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except (OSError, AttributeError):
            pass
        pids = ns_pids(a.init_pid)
        frames = plan(Path(a.image_dir), pids)
        lst = socket.socket(family_of(a.address), socket.SOCK_STREAM)  # the address's own family
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind((a.address, 0))
        lst.listen(8)
        port = lst.getsockname()[1]
        from relocator.credentials import server_context

        tls = server_context()  # None only under the by-hand opt-out
        total = sum(f[3] for f in frames)
        self.state(state="listening", port=port, address=a.address, bytes=total, frames=len(frames))
        if a.status_fd >= 0:
            os.write(a.status_fd, b"\0")
            os.close(a.status_fd)
        conn = self.accept(lst, tls, port)
        if conn is None:
            return 0
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        self.state(state="sending", port=port, bytes=total, frames=len(frames), link=self.link)
        sent = skipped = 0
        buf = bytearray(CHUNK)
        fds: dict[int, int] = {}
        t0 = time.monotonic()
        last_check = t0
        try:
            for vpid, hpid, vaddr, size in frames:
                now = time.monotonic()
                if now - last_check > 0.25:
                    last_check = now
                    if not alive(a.dump_pid):  # the post-copy ended or was given up
                        break
                fd = fds.get(hpid)
                if fd is None:
                    fd = fds[hpid] = os.open(f"/proc/{hpid}/mem", os.O_RDONLY)
                view = memoryview(buf)[:size]
                try:
                    got = os.preadv(fd, [view], vaddr)
                except OSError:
                    got = 0  # not readable (gone, unmapped): the daemon asks CRIU for these
                got -= got % PAGE_SIZE
                if not got:
                    skipped += size
                    continue
                conn.sendall(FRAME.pack(vpid, vaddr, got))
                conn.sendall(view[:got])
                sent += got
        except OSError as exc:  # the keeper went away: it has what it needs, or it failed
            self.state(state="ended", why=f"keeper gone: {exc}", sent=sent, skipped=skipped,
                       seconds=round(time.monotonic() - t0, 3))
            return 0
        finally:
            for fd in fds.values():
                os.close(fd)
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        conn.close()
        self.state(state="done", sent=sent, skipped=skipped, seconds=round(time.monotonic() - t0, 3))
        return 0


def read_state(cell_dir: Path) -> dict | None:
    return _read_state(cell_dir, STATE_FILE)


def stop(cell_dir: Path) -> None:
    """Stop a cell's pump if it still runs (the post-copy ended or was given up)."""
    pid = (read_state(cell_dir) or {}).get("pid")
    if pid and alive(pid) and is_ours(pid, cell_dir, "relocator.agent.pump"):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def start(cell_dir: Path, image_dir: Path, init_pid: int, dump_pid: int, address: str,
          unix: str = "", tls_dir: str = "", peer_address: str = "") -> tuple[object, int]:
    """Start the pump for a lazy dump (`dump_pid`) of the cell; returns (process, port).
    `unix`: a socket path where a keeper of this host connects too (relocator.agent.locallink).
    `tls_dir`: the move's own credentials (it loads them as it starts; the keeper of this move
    is then the only client that passes its handshake). `peer_address`: the target's transfer
    address; a connection from any other is closed before its handshake ("": any)."""
    from relocator.credentials import ENV_MOVE, tls_files
    from relocator.snapshot import criu

    tls_files(tls_dir or None)  # the certificates, or a CredentialsError naming what is missing
    repo = str(Path(__file__).resolve().parents[2])
    argv = [sys.executable, "-S", "-m", "relocator.agent.pump", "--cell-dir", str(cell_dir), "--image-dir",
            str(image_dir), "--init-pid", str(init_pid), "--dump-pid", str(dump_pid), "--address", address,
            "--unix", unix, "--peer-address", peer_address]
    proc = criu.CriuProcess(argv, Path(cell_dir) / "pump.log", "post-copy pump", cwd=repo,
                            env={**os.environ, "PYTHONPATH": repo, **({ENV_MOVE: tls_dir} if tls_dir else {})})
    proc.start(timeout=30)
    st = read_state(cell_dir) or {}
    return proc, int(st["port"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relocator.agent.pump")
    p.add_argument("--cell-dir", required=True)
    p.add_argument("--image-dir", required=True)
    p.add_argument("--init-pid", type=int, required=True)
    p.add_argument("--dump-pid", type=int, required=True)
    p.add_argument("--address", required=True)
    p.add_argument("--unix", default="")  # a keeper of this host connects here: no TLS
    p.add_argument("--peer-address", default="")  # the keeper's host: anyone else is closed before TLS
    p.add_argument("--accept-timeout", type=float, default=120.0)
    p.add_argument("--status-fd", type=int, default=-1)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return Pump(args).run()


if __name__ == "__main__":
    sys.exit(main())
