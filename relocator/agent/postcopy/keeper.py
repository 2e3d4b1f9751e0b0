"""The post-copy keeper: a process of its own on the target (it outlives the agent that started
it) between the `criu lazy-pages` daemon and the source. It relays the page-server protocol
(through relocator.agent.postcopy.proxy), counts what arrives, and owns the one dangerous
moment of post-copy: when the source stops answering, it kills the target's tree before it
lets the daemon go (see relocator.agent.postcopy).

Runs under `python -S`, stdlib only (relocator.agent.postcopy.base says why): its deadline
loops are its own, not relocator.waits.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from relocator.agent.postcopy.base import (alive, connect, lazy_ranges, pending, raise_priority, recv_some,
                                           write_state)
from relocator.agent.postcopy.proxy import Proxy

_DONE = True  # a relay step's answer when the daemon closed its side


@dataclass
class Links:
    """The relay's connections and pacing: the daemon (`down`, or the first connection on
    `lst`), the source's page server (`up`) and its push channel (`pump`)."""

    up: socket.socket
    lst: socket.socket | None = None
    pump: socket.socket | None = None
    down: socket.socket | None = None
    last_up: float = field(default_factory=time.monotonic)
    up_ended: bool = False  # the source ended its session after acknowledging the CLOSE (TLS does)
    throttle_until: float = 0.0
    buf: bytearray = field(default_factory=lambda: bytearray(1 << 20))


class Keeper:
    PUMP_BITE = 64 << 10  # push-channel bytes read between two looks at the daemon and the source
    PUMP_QUIET_S = 0.005  # ... and only once no page fault came for this long

    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.cell_dir = Path(args.cell_dir)
        self.daemon: subprocess.Popen | None = None
        self.t0 = time.monotonic()
        self.last_flush = 0.0
        self.px: Proxy | None = None  # made in run() (before the daemon: pre-paging fills it)

    def state(self, **fields: Any) -> None:
        write_state(self.cell_dir, **fields)

    def kill_tree(self) -> int | None:
        """SIGKILL the restored tree (its init: the whole PID namespace goes) and wait for it."""
        try:
            pid = int((self.cell_dir / "init.pid").read_text().strip())
        except (OSError, ValueError):
            return None  # not restored yet: the daemon's failure makes the restore fail instead
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return pid
        deadline = time.monotonic() + 10  # stdlib only (python -S): not relocator.waits
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        return pid

    def stop_daemon(self) -> int | None:
        if self.daemon is None:
            return None
        if self.daemon.poll() is None:
            self.daemon.kill()
        return self.daemon.wait()

    def run(self) -> int:
        a = self.a
        # every page fault of the restored copy waits on this process and the daemon (its child,
        # it inherits this): ahead of the crowd on a busy node, as the frozen source's page server
        raise_priority(0)
        self.state(state="starting", keeper_pid=os.getpid(), upstream=f"{a.source}:{a.source_port}",
                   page_bytes=0, lazy_bytes=a.lazy_bytes, started_at=time.time())
        # the daemon's end of its page-server connection is one of a socket pair (--ps-socket):
        # no listening port that another local process could reach first and be served from
        down, daemon_end = socket.socketpair()
        from relocator.credentials import client_context

        tls = client_context()  # the cluster's CA and this node's certificate (None: opted out by hand)
        try:
            up = connect(a.source, a.source_port, a.connect_timeout, tls)
        except OSError as exc:
            self.state(state="failed", why="source", error=f"cannot reach the source's page server: {exc}")
            return 3
        # a TLS record read in part blocks until its rest comes: a cut link then ends in a
        # timeout (a stall) instead of a relay stuck for ever
        up.settimeout(a.stall_s)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pump = self.open_pump(tls)
        self.px = self.proxy(pushed=pump is not None)
        if pump is not None and a.prefill_bytes > 0:
            pump = self.prefill(pump)
        rc = self.start_daemon(daemon_end)
        if rc:
            up.close()
            return rc
        try:
            return self.relay(None, up, pump, down=down)
        finally:
            if pump is not None:
                pump.close()

    def open_pump(self, tls: ssl.SSLContext | None) -> socket.socket | None:
        """The source's push channel, if it has one; None: every page comes by request."""
        a = self.a
        if not a.pump_port:
            return None
        try:  # the push channel is an accelerator only
            pump = self.pump_on_this_host() or connect(a.source, a.pump_port, a.connect_timeout, tls, rcvbuf=4 << 20)
        except OSError as exc:
            self.state(pump_error=f"cannot reach the source's pump: {exc}")
            return None
        pump.settimeout(None)
        return pump

    def pump_on_this_host(self) -> socket.socket | None:
        """The pump's unix socket when the source is on this host (`--pump-unix`, given by the
        agent only then): the kernel authenticates both ends, no TLS (relocator.agent.locallink)."""
        if not self.a.pump_unix:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self.a.connect_timeout)
            sock.connect(self.a.pump_unix)
        except OSError:
            sock.close()
            return None  # then over TCP and TLS
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
        self.state(pump_link="unix")
        return sock

    def start_daemon(self, daemon_end: socket.socket) -> int:
        """Start `criu lazy-pages` on its end of the socket pair and tell the agent we are
        ready; 0, or the keeper's exit code when the daemon would not start."""
        from relocator.snapshot import criu

        a = self.a
        try:
            d = criu.lazy_pages(Path(a.image_dir), self.cell_dir, ps_socket=daemon_end.fileno())
        except criu.CriuError as exc:
            self.state(state="failed", why="daemon", error=str(exc)[:2000])
            return 4
        finally:
            daemon_end.close()  # the daemon has its copy
        self.daemon = d.proc
        self.state(state="ready", daemon_pid=d.pid)
        if a.status_fd >= 0:
            os.write(a.status_fd, b"\0")
            os.close(a.status_fd)
        return 0

    def proxy(self, pushed: bool) -> Proxy:
        """The proxy between the daemon and the source; it fetches ahead itself only when asked
        to and nothing is pushed (the push brings every page already)."""
        a = self.a
        ranges = lazy_ranges(Path(a.image_dir)) if a.prefetch and not pushed else []
        return Proxy(ranges, a.prefetch_depth, a.cache_bytes, pushed=pushed)

    def prefill(self, pump: socket.socket) -> socket.socket | None:
        """Pre-paging: before the tree starts, take what the push brings, up to `prefill_bytes`
        or `prefill_s`. The restored worker's first requests then find their pages here instead
        of faulting each one through the source (measured: the faults after the switch went from
        ~1 s to ~0.06 s, docs/benchmarks.md); the bound keeps the blackout flat in image size.
        Returns the push connection, or None once it ended."""
        a, px = self.a, self.px
        t0 = time.monotonic()
        deadline = t0 + a.prefill_s  # stdlib only (python -S): not relocator.waits
        pump.settimeout(a.stall_s)  # a push that stalls (a cut link) only ends the prefill
        try:
            while px.pushed_bytes < a.prefill_bytes and px.cached < px.cache_cap and time.monotonic() < deadline:
                if not px.pump_recv(pump, 1 << 20):
                    pump.close()
                    pump = None
                    break
                if a.throttle_bps:  # paced like the rest (chaos: faults land while memory moves)
                    time.sleep(max(0.0, t0 + px.pushed_bytes / a.throttle_bps - time.monotonic()))
        except OSError:  # the push broke: the rest comes by request (or the source is gone: see relay)
            pump.close()
            pump = None
        if pump is not None:  # the relay reads it in the gaps only: never blocked on part of a record
            pump.setblocking(False)
        self.state(prefill_s=round(time.monotonic() - t0, 3), prefill_bytes=px.pushed_kept)
        return pump

    # -- the relay ----------------------------------------------------------------------------
    def relay(self, lst: socket.socket | None, up: socket.socket, pump: socket.socket | None = None,
              down: socket.socket | None = None) -> int:
        """Serve the daemon's requests in order, from pages pushed (or fetched ahead) when they
        are here, through the source's page server otherwise. The daemon is `down` (connected
        already) or the first connection on `lst`."""
        self.px = self.px or self.proxy(pushed=pump is not None)
        k = Links(up=up, lst=lst, pump=pump, down=down)
        self.state(state="running")
        out = self.send_up(k, self.px.next_prefetch)
        while out is None:
            out = self.step(k)
        if self.px.trace is not None:
            Path(os.environ["RELOCATOR_POSTCOPY_TRACE"], f"{self.cell_dir.name}.json").write_text(
                json.dumps(self.px.trace))
        if out is not _DONE:
            return self.failed(k, *out)
        return self.finish(k)

    def send_up(self, k: Links, requests) -> tuple[str, str] | None:
        """Forward what `requests()` makes to the source; (why, error) when it went away."""
        try:
            for req in requests():
                k.up.sendall(req)
        except OSError as exc:
            return "source", f"the source's page server went away: {exc}"
        return None

    def watched(self, k: Links, now: float) -> tuple[list[socket.socket], float]:
        """The sockets to wait on now, and for how long at most."""
        px, wait = self.px, 0.2
        socks = [k.down if k.down is not None else k.lst]
        if now < k.throttle_until:
            return socks, min(wait, k.throttle_until - now)
        if not k.up_ended:
            socks.append(k.up)
        if k.pump is not None and px.cached < px.cache_cap:
            quiet = px.last_fault + self.PUMP_QUIET_S - now
            if quiet <= 0:
                socks.append(k.pump)
            else:  # not even looked at while faults come (a readable socket would spin)
                wait = min(wait, quiet)
        return socks, wait

    def step(self, k: Links) -> tuple[str, str] | bool | None:
        """One turn of the relay: None to go on, _DONE when the daemon closed its side,
        (why, error) when the post-copy failed."""
        socks, wait = self.watched(k, time.monotonic())
        buffered = [s for s in socks if pending(s)]  # TLS: decrypted already, select cannot see it
        r, _, _ = select.select(socks, [], [], 0 if buffered else wait)
        r = set(r) | set(buffered)
        now = time.monotonic()
        if k.down is None and k.lst in r:
            k.down, _ = k.lst.accept()
            if k.down.family != socket.AF_UNIX:
                k.down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.state(connected_at=time.time())
            return None
        if k.down is None and self.daemon is not None and self.daemon.poll() is not None:
            return "daemon", f"lazy-pages exited ({self.daemon.returncode}) before it connected"
        if k.down is not None and k.down in r:
            out = self.from_daemon(k)
            if out is not None:
                return out
        if k.pump is not None and k.pump in r and k.up not in r and (k.down is None or k.down not in r):
            self.from_pump(k, now)
        if k.up in r:
            out = self.from_source(k, now)
            if out is not None:
                return out
        if k.down is not None:
            try:
                self.px.flush(k.down)
            except OSError:
                return _DONE  # the daemon died: finish() tells
        return self.watch_stall(k, now)

    def from_daemon(self, k: Links) -> tuple[str, str] | bool | None:
        try:
            data = k.down.recv(65536)
        except OSError:
            data = b""
        if not data:
            return _DONE  # the daemon is done (or died): finish() tells
        return self.send_up(k, lambda: self.px.from_daemon(data))

    def from_pump(self, k: Links, now: float) -> None:
        """The push in the gaps only, a bite at a time and at the lowest priority: while page
        faults come, they are served first, and the restored worker's own work is not slowed
        down by this process's copying."""
        raise_priority(0, 19)
        try:
            n = self.px.pump_recv(k.pump, self.PUMP_BITE)
        except (ssl.SSLWantReadError, BlockingIOError):
            n = -1  # part of a TLS record: the rest comes later
        except OSError:
            n = 0
        finally:
            raise_priority(0)
        if n == 0:  # everything pushed, or the pump went away: requests bring the rest
            k.pump.close()
            k.pump = None
        elif n > 0 and self.a.throttle_bps:
            k.throttle_until = max(now, k.throttle_until) + n / self.a.throttle_bps

    def from_source(self, k: Links, now: float) -> tuple[str, str] | None:
        px, error = self.px, None
        try:
            n = recv_some(k.up, k.buf)
        except OSError as exc:
            n, error = 0, str(exc)
        if n == 0 and px.closed and not px.up_q:
            k.up_ended = True  # every page is here and the source said so: the daemon ends next
        elif n == 0:
            return "source", f"the source's page server closed the connection {error or ''}".strip()
        if not n:  # None: TLS, a record not whole yet or none of the source's data (a ticket)
            return None
        k.last_up = now
        out = self.send_up(k, lambda: px.from_source(memoryview(k.buf)[:n]))
        if out is None and self.a.throttle_bps:
            k.throttle_until = max(now, k.throttle_until) + n / self.a.throttle_bps
        return out

    def watch_stall(self, k: Links, now: float) -> tuple[str, str] | None:
        """A stall (requests owed, no answer for `stall_s`) fails the post-copy; progress is
        recorded five times a second."""
        px, stall_s = self.px, self.a.stall_s
        if px.up_q and now - k.last_up > stall_s:
            return "stall", f"no answer from the source's page server for {stall_s:g}s (network cut?)"
        if not px.up_q:
            k.last_up = now  # nothing owed: a wait for an answer starts only with a request
        if now - self.last_flush > 0.2:
            self.last_flush = now
            self.state(page_bytes=px.arrived_bytes, served_bytes=px.served_bytes, requests=px.requests,
                       cache_hits=px.hits, pushed_bytes=px.pushed_bytes)
        return None

    # -- the end --------------------------------------------------------------------------------
    def figures(self) -> dict[str, Any]:
        px = self.px
        return dict(page_bytes=px.arrived_bytes, served_bytes=px.served_bytes, requests=px.requests,
                    cache_hits=px.hits, pushed_bytes=px.pushed_bytes, pushed_dropped_bytes=px.pushed_dropped,
                    requested_bytes=px.page_bytes, seconds=round(time.monotonic() - self.t0, 3), ended_at=time.time())

    def failed(self, k: Links, why: str, error: str) -> int:
        """The memory cannot arrive: the tree must never run on without it."""
        fields = self.figures()
        killed = self.kill_tree()
        self.stop_daemon()
        for sock in (k.down, k.up):
            if sock is not None:
                sock.close()
        self.state(state="failed", why=why, error=error, killed_pid=killed, **fields)
        return 6

    def finish(self, k: Links) -> int:
        """The daemon closed its side: after a CLOSE the source answered, every page arrived."""
        fields = self.figures()
        k.up.close()
        if k.down is not None:
            k.down.close()
        try:
            rc = self.daemon.wait(timeout=30) if self.daemon else None
        except subprocess.TimeoutExpired:
            rc = self.stop_daemon()
        try:
            tree_alive = alive(int((self.cell_dir / "init.pid").read_text().strip()))
        except (OSError, ValueError):
            tree_alive = False
        fields["daemon_rc"] = rc
        if rc == 0 and self.px.closed and tree_alive:
            self.state(state="done", **fields)
            return 0
        if not tree_alive:
            self.state(state="failed", why="target", error="the restored tree died during post-copy", **fields)
            return 7
        killed = self.kill_tree()  # the daemon failed: its userfaultfds are gone with it
        self.state(state="failed", why="daemon", error=f"lazy-pages ended (exit {rc}) before every page arrived",
                   killed_pid=killed, **fields)
        return 8


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m relocator.agent.postcopy")
    p.add_argument("--cell-dir", required=True)
    p.add_argument("--image-dir", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--source-port", type=int, required=True)
    p.add_argument("--stall-s", type=float, default=3.0)
    p.add_argument("--throttle-bps", type=float, default=0.0)
    p.add_argument("--lazy-bytes", type=int, default=0)
    p.add_argument("--connect-timeout", type=float, default=5.0)
    # fetch every lazy page ahead of need (the daemon's own requests then find most of them
    # here), at most this many requests in flight and this many bytes held
    p.add_argument("--prefetch", type=int, default=0)
    p.add_argument("--prefetch-depth", type=int, default=1)
    p.add_argument("--cache-bytes", type=int, default=1 << 30)
    p.add_argument("--pump-port", type=int, default=0)  # the source's push channel (relocator.agent.pump)
    p.add_argument("--pump-unix", default="")  # its unix socket, when the source is on this host
    p.add_argument("--prefill-bytes", type=int, default=0)  # pushed bytes taken before the tree starts ...
    p.add_argument("--prefill-s", type=float, default=1.5)  # ... at most this long
    p.add_argument("--status-fd", type=int, default=-1)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return Keeper(args).run()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded for the agent
        write_state(Path(args.cell_dir), state="failed", why="keeper", error=f"{type(exc).__name__}: {exc}")
        raise
