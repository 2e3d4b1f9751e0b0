"""Post-copy: the worker runs on the target before its memory has arrived.

Source: `criu dump --lazy-pages` writes every image but the worker's anonymous memory, then
keeps the tree frozen and serves that memory from a page server (`LazySource`). Target:
`criu restore --lazy-pages` starts the tree at once with that memory registered with
userfaultfd; the `criu lazy-pages` daemon fills it from the source, a faulting page first and
everything else in the background (`Keeper`).

The daemon does not talk to the source directly but through the **keeper**, a small process of
its own (it outlives the agent that started it) that relays the page-server protocol, counts
what arrives, and owns the one dangerous moment of post-copy: when the source stops answering,
the daemon would give up and the kernel would hand the worker zero-filled pages instead of its
memory. The keeper kills the target's tree first (SIGKILL to its PID-namespace init) and only
then lets the daemon go, so a worker whose memory cannot arrive never runs on without it. The
same holds for a stall: requests outstanding and nothing from the source for `stall_s` (a
network cut). The controller then rolls back (source alive) or replaces the worker (source
lost), see docs/snapshots.md "Post-copy".

The keeper records its progress in `<cell dir>/postcopy.json` (state: starting, ready,
running, done, failed; pages bytes; why it failed), which the agent reads.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import ssl
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STATE_FILE = "postcopy.json"
PAGE_SIZE = 4096
# struct page_server_iov {u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id} (natural alignment)
PSI = struct.Struct("<I4xQQQ")
PS_IOV_GET, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 7, 0x1023, 0x1024
PS_CMD_MASK = (1 << 16) - 1


class PostCopyFailed(RuntimeError):
    """The post-copy did not complete; `why` is one of: target (its tree died), source (the
    page server went away), stall (no answer: network cut), daemon (lazy-pages failed)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


# -- state file -------------------------------------------------------------------------------
def write_state(cell_dir: Path, state_file: str = STATE_FILE, **fields: Any) -> dict:
    """Merge `fields` into a cell's state file (the keeper's; the pump's is pump.json)."""
    path = Path(cell_dir) / state_file
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    state.update(fields, updated=time.time())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return state


def read_state(cell_dir: Path, state_file: str = STATE_FILE) -> dict | None:
    try:
        return json.loads((Path(cell_dir) / state_file).read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# -- the keeper process ---------------------------------------------------------------------------
class Keeper:
    PUMP_BITE = 64 << 10  # push-channel bytes read between two looks at the daemon and the source
    PUMP_QUIET_S = 0.005  # ... and only once no page fault came for this long
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.cell_dir = Path(args.cell_dir)
        self.daemon: subprocess.Popen | None = None
        self.t0 = time.monotonic()
        self.last_flush = 0.0
        self.px: _Proxy | None = None  # made in run() (before the daemon: pre-paging fills it)

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
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
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
        _raise_priority(0)
        self.state(state="starting", keeper_pid=os.getpid(), upstream=f"{a.source}:{a.source_port}",
                   page_bytes=0, lazy_bytes=a.lazy_bytes, started_at=time.time())
        # the daemon's end of its page-server connection is one of a socket pair (--ps-socket):
        # no listening port that another local process could reach first and be served from
        down, daemon_end = socket.socketpair()
        from relocator.credentials import client_context

        tls = client_context()  # the cluster's CA and this node's certificate (None: opted out by hand)
        try:
            up = _connect(a.source, a.source_port, a.connect_timeout, tls)
        except OSError as exc:
            self.state(state="failed", why="source", error=f"cannot reach the source's page server: {exc}")
            return 3
        # a TLS record read in part blocks until its rest comes: a cut link then ends in a
        # timeout (a stall) instead of a relay stuck for ever
        up.settimeout(a.stall_s)
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        pump = None
        if a.pump_port:
            try:  # the push channel is an accelerator only: without it every page comes by request
                pump = _connect(a.source, a.pump_port, a.connect_timeout, tls, rcvbuf=4 << 20)
                pump.settimeout(None)
            except OSError as exc:
                self.state(pump_error=f"cannot reach the source's pump: {exc}")
        from relocator.snapshot import criu

        self.px = self.proxy(pushed=pump is not None)
        if pump is not None and a.prefill_bytes > 0:
            pump = self.prefill(pump)
        try:
            d = criu.lazy_pages(Path(a.image_dir), self.cell_dir, ps_socket=daemon_end.fileno())
        except criu.CriuError as exc:
            up.close()
            self.state(state="failed", why="daemon", error=str(exc)[:2000])
            return 4
        finally:
            daemon_end.close()  # the daemon has its copy
        self.daemon = d.proc
        self.state(state="ready", daemon_pid=d.pid)
        if a.status_fd >= 0:
            os.write(a.status_fd, b"\0")
            os.close(a.status_fd)
        try:
            return self.relay(None, up, pump, down=down)
        finally:
            if pump is not None:
                pump.close()

    def proxy(self, pushed: bool) -> "_Proxy":
        """The proxy between the daemon and the source; it fetches ahead itself only when asked
        to and nothing is pushed (the push brings every page already)."""
        a = self.a
        ranges = _lazy_ranges(Path(a.image_dir)) if a.prefetch and not pushed else []
        return _Proxy(ranges, a.prefetch_depth, a.cache_bytes, pushed=pushed)

    def prefill(self, pump: socket.socket) -> socket.socket | None:
        """Pre-paging: before the tree starts, take what the push brings, up to `prefill_bytes`
        or `prefill_s`. The restored worker's first requests then find their pages here instead
        of faulting each one through the source (measured: the faults after the switch went from
        ~1 s to ~0.06 s, docs/benchmarks.md); the bound keeps the blackout flat in image size.
        Returns the push connection, or None once it ended."""
        a, px = self.a, self.px
        t0 = time.monotonic()
        deadline = t0 + a.prefill_s
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

    def relay(self, lst: socket.socket | None, up: socket.socket, pump: socket.socket | None = None,
              down: socket.socket | None = None) -> int:
        """Serve the daemon's requests in order, from pages pushed (or fetched ahead) when they
        are here, through the source's page server otherwise. The daemon is `down` (connected
        already) or the first connection on `lst`."""
        a = self.a
        px = self.px or self.proxy(pushed=pump is not None)
        last_up = time.monotonic()
        self.state(state="running")
        why = error = None
        up_ended = False  # the source ended its session after acknowledging the CLOSE (TLS does)
        throttle_until = 0.0
        buf = bytearray(1 << 20)
        view = memoryview(buf)

        def send_up(data: bytes) -> None:
            up.sendall(data)

        try:
            for req in px.next_prefetch():
                send_up(req)
        except OSError as exc:
            why, error = "source", f"the source's page server went away: {exc}"
        while why is None:
            now = time.monotonic()
            wait = 0.2
            socks = [down if down is not None else lst]
            if now >= throttle_until:
                if not up_ended:
                    socks.append(up)
                if pump is not None and px.cached < px.cache_cap:
                    quiet = px.last_fault + self.PUMP_QUIET_S - now
                    if quiet <= 0:
                        socks.append(pump)
                    else:  # not even looked at while faults come (a readable socket would spin)
                        wait = min(wait, quiet)
            else:
                wait = min(wait, throttle_until - now)
            buffered = [s for s in socks if _pending(s)]  # TLS: decrypted already, select cannot see it
            r, _, _ = select.select(socks, [], [], 0 if buffered else wait)
            r = list(set(r) | set(buffered))
            now = time.monotonic()
            if down is None and lst in r:
                down, _ = lst.accept()
                if down.family != socket.AF_UNIX:
                    down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.state(connected_at=time.time())
                continue
            if down is None and self.daemon is not None and self.daemon.poll() is not None:
                why, error = "daemon", f"lazy-pages exited ({self.daemon.returncode}) before it connected"
                break
            if down is not None and down in r:
                try:
                    data = down.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    break  # the daemon is done (or died): see below
                try:
                    for req in px.from_daemon(data):
                        send_up(req)
                except OSError as exc:
                    why, error = "source", f"the source's page server went away: {exc}"
                    break
            if pump is not None and pump in r and up not in r and (down is None or down not in r):
                # the push in the gaps only, a bite at a time and at the lowest priority: while
                # page faults come, they are served first, and the restored worker's own work
                # is not slowed down by this process's copying
                _raise_priority(0, 19)
                try:
                    n = px.pump_recv(pump, self.PUMP_BITE)
                except (ssl.SSLWantReadError, BlockingIOError):
                    n = -1  # part of a TLS record: the rest comes later
                except OSError:
                    n = 0
                finally:
                    _raise_priority(0)
                if n < 0:
                    pass
                elif not n:  # everything pushed, or the pump went away: requests bring the rest
                    pump.close()
                    pump = None
                elif a.throttle_bps:
                    throttle_until = max(now, throttle_until) + n / a.throttle_bps
            if up in r:
                try:
                    n = _recv_some(up, buf)
                except OSError as exc:
                    n, error = 0, str(exc)
                if n == 0 and px.closed and not px.up_q:
                    up_ended = True  # every page is here and the source said so: the daemon ends next
                elif n == 0:
                    why, error = "source", f"the source's page server closed the connection {error or ''}".strip()
                    break
                if n:  # None: TLS, a record not whole yet or none of the source's data (a ticket)
                    last_up = now
                    try:
                        for req in px.from_source(view[:n]):
                            send_up(req)
                    except OSError as exc:
                        why, error = "source", f"the source's page server went away: {exc}"
                        break
                    if a.throttle_bps:
                        throttle_until = max(now, throttle_until) + n / a.throttle_bps
            if down is not None:
                try:
                    px.flush(down)
                except OSError:
                    break  # the daemon died: see below
            if px.up_q and now - last_up > a.stall_s:
                why, error = "stall", f"no answer from the source's page server for {a.stall_s:g}s (network cut?)"
                break
            if not px.up_q:
                last_up = now  # nothing owed: a wait for an answer starts only with a request
            if now - self.last_flush > 0.2:
                self.last_flush = now
                self.state(page_bytes=px.arrived_bytes, served_bytes=px.served_bytes, requests=px.requests,
                           cache_hits=px.hits, pushed_bytes=px.pushed_bytes)
        if px.trace is not None:
            Path(os.environ["RELOCATOR_POSTCOPY_TRACE"], f"{self.cell_dir.name}.json").write_text(json.dumps(px.trace))
        fields = dict(page_bytes=px.arrived_bytes, served_bytes=px.served_bytes, requests=px.requests,
                      cache_hits=px.hits, pushed_bytes=px.pushed_bytes, pushed_dropped_bytes=px.pushed_dropped,
                      requested_bytes=px.page_bytes, seconds=round(time.monotonic() - self.t0, 3), ended_at=time.time())
        if why is not None:
            # the memory cannot arrive: the tree must never run on without it
            killed = self.kill_tree()
            self.stop_daemon()
            for sock in (down, up):
                if sock is not None:
                    sock.close()
            self.state(state="failed", why=why, error=error, killed_pid=killed, **fields)
            return 6
        # the daemon closed its side: after a CLOSE the source answered, every page arrived
        up.close()
        if down is not None:
            down.close()
        try:
            rc = self.daemon.wait(timeout=30) if self.daemon else None
        except subprocess.TimeoutExpired:
            rc = self.stop_daemon()
        tree_alive = True
        try:
            tree_alive = _alive(int((self.cell_dir / "init.pid").read_text().strip()))
        except (OSError, ValueError):
            tree_alive = False
        fields["daemon_rc"] = rc
        if rc == 0 and px.closed and tree_alive:
            self.state(state="done", **fields)
            return 0
        if not tree_alive:
            self.state(state="failed", why="target", error="the restored tree died during post-copy", **fields)
            return 7
        killed = self.kill_tree()  # the daemon failed: its userfaultfds are gone with it
        self.state(state="failed", why="daemon", error=f"lazy-pages ended (exit {rc}) before every page arrived",
                   killed_pid=killed, **fields)
        return 8


PRIORITY = -10  # nice value of the processes a post-copy's page faults wait on


def _connect(host: str, port: int, timeout: float, tls: ssl.SSLContext | None, rcvbuf: int = 0) -> socket.socket:
    """A connection to the source (its page server or pump): TLS, the source's certificate
    checked against the cluster's CA and this node's presented, unless `tls` is None."""
    sock = socket.create_connection((host, port), timeout=timeout)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock)
    except BaseException:
        sock.close()
        raise


def _recv_some(sock: socket.socket, buf: bytearray) -> int | None:
    """What `sock` has now, without blocking (select said it is readable): a TLS socket may have
    only part of a record, or a record with no data of the peer in it (TLS 1.3 session tickets):
    None then, where a blocking read would wait for the next answer."""
    if not isinstance(sock, ssl.SSLSocket):
        return sock.recv_into(buf)
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv_into(buf)
    except ssl.SSLWantReadError:
        return None
    finally:
        sock.settimeout(timeout)


def _knock(address: str, port: int) -> None:
    """Connect to a lazy dump's page server as a keeper would (TLS, this node's certificate: a
    refused handshake would fail the dump and let its tree run) and leave at once, cleanly: it
    then ends as after a session, the tree stopped."""
    from relocator.credentials import client_context

    sock = _connect(address, port, 2.0, client_context())
    try:
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(0.3)
            try:  # take in the server's records after the handshake (TLS 1.3 session tickets):
                sock.recv(1)  # a socket closed with them unread resets the connection
            except OSError:
                pass
            try:
                sock = sock.unwrap()  # close_notify: CRIU reads the end of the session
            except OSError:
                pass
    finally:
        sock.close()


def _pending(sock: socket.socket) -> bool:
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0


def _raise_priority(pid: int, nice: int = PRIORITY) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:  # not root: as is
        pass


def _lazy_ranges(image_dir: Path) -> list[tuple[int, int, int]]:
    """(pagemap id, vaddr, pages) of every run of pages the image left in the source. The id
    is what the page server knows the process by (the daemon asks with the same)."""
    from relocator.snapshot import images

    out = []
    for p in sorted(image_dir.glob("pagemap-*.img")):
        try:
            pid = int(p.stem.split("-", 1)[1])
            runs = images.lazy_runs(p)
        except (ValueError, images.ImageFormatError):
            continue
        out += [(pid, vaddr, n) for vaddr, n in runs]
    return out


class _Proxy:
    """The keeper's page-server proxy. The daemon gets its answers strictly in the order it
    asked (it matches them by order); an answer is ready at once when the pages were fetched
    ahead, else when the source's answer to the forwarded request arrives. Ahead-of-need
    requests (`prefetch_depth` in flight, at most `cache_bytes` held) walk every lazy run."""

    MAX_PAGES = 1024  # what the daemon asks at most; the source clamps to its own runs
    FAULT_WINDOW_S = 0.25  # background requests stay small this long after a page fault ...
    BUSY_PAGES = 16  # ... at most 64 KiB each

    def __init__(self, ranges: list[tuple[int, int, int]], depth: int, cache_bytes: int,
                 pushed: bool = False) -> None:
        from collections import deque

        self.todo = deque(ranges)
        self.depth, self.cache_cap = depth, cache_bytes
        self.cache: dict[int, dict[int, list]] = {}  # id -> {start vaddr: [end, data, served pages]}
        self.starts: dict[int, list[int]] = {}  # id -> the cached runs' starts, sorted
        self.cached = 0
        self.up_q: deque = deque()  # what the source owes, in order: (kind, id, vaddr, pages, slot)
        self.down_q: deque = deque()  # the daemon's requests, in order: slots
        self.in_buf = b""  # daemon bytes not yet a whole request
        self.head = b""  # the source's answer being read: header ...
        self.body = bytearray()  # ... and pages
        self.need = 0
        self.page_bytes = self.served_bytes = self.requests = self.hits = 0
        self.closing = self.closed = False
        self.pf_inflight = 0
        self.xfer_pages = 16  # 64 KiB after a fault, +64 KiB per answer while no fault comes
        self.last_fault = float("-inf")
        # the push channel (relocator.agent.pump): frames being read, and what went by request,
        # so that a pushed copy of a page the daemon already has is dropped, not kept forever
        self.pushed = pushed
        self.missed: dict[int, set[int]] = {}
        self.p_head = b""
        self.p_body = bytearray()
        self.p_need = 0
        self.pushed_bytes = self.pushed_dropped = 0
        self.trace: list | None = [] if os.environ.get("RELOCATOR_POSTCOPY_TRACE") else None

    # -- ahead of need ------------------------------------------------------------------
    def next_prefetch(self) -> list[bytes]:
        """Requests ahead of need, fault-friendly like CRIU's own background transfer: never
        while a request of the daemon waits on the source (one connection: an answer queued
        behind megabytes of prefetch is a stalled page fault), small after each fault, growing
        while none come."""
        out = []
        if any(kind == "d" for kind, *_ in self.up_q):
            return out
        while (self.todo and not self.closing and self.pf_inflight < self.depth
               and self.cached < self.cache_cap):
            pid, vaddr, n = self.todo.popleft()
            take = min(n, self.xfer_pages)
            self.xfer_pages = min(self.MAX_PAGES, self.xfer_pages + 16)
            if n > take:
                self.todo.appendleft((pid, vaddr + take * PAGE_SIZE, n - take))
            self.up_q.append(("pf", pid, vaddr, take, None))
            self.pf_inflight += 1
            out.append(PSI.pack(PS_IOV_GET, take, vaddr, pid))
        return out

    def _lookup(self, pid: int, vaddr: int, n: int) -> list | None:
        import bisect

        chunks = self.cache.get(pid)
        starts = self.starts.get(pid)
        if not chunks or not starts:
            return None
        i = bisect.bisect_right(starts, vaddr) - 1
        if i < 0:
            return None
        start = starts[i]
        end, data, served = chunks[start]
        if vaddr >= end:
            return None
        take = min(n, (end - vaddr) // PAGE_SIZE)
        off = vaddr - start
        out = memoryview(data)[off:off + take * PAGE_SIZE]  # no copy: sent from the cache as is
        served += take
        if served * PAGE_SIZE >= end - start:
            del chunks[start]
            starts.pop(i)
            self.cached -= end - start
        else:
            chunks[start][2] = served
        return [PSI.pack(6 | (4 << 16), take, vaddr, pid), out]  # PS_IOV_ADD_F, PE_PRESENT

    @property
    def pushed_kept(self) -> int:
        """Pushed bytes that count: less the copies of pages already asked for (dropped)."""
        return self.pushed_bytes - self.pushed_dropped

    @property
    def arrived_bytes(self) -> int:
        """Memory that reached the target: answers to requests plus what the push brought."""
        return self.page_bytes + self.pushed_kept

    def _next_start(self, pid: int, vaddr: int) -> int | None:
        import bisect

        starts = self.starts.get(pid)
        if not starts:
            return None
        i = bisect.bisect_right(starts, vaddr)
        return starts[i] if i < len(starts) else None

    def _keep(self, pid: int, at: int, data, end: int) -> None:
        import bisect

        self.cache.setdefault(pid, {})[at] = [end, data, 0]
        bisect.insort(self.starts.setdefault(pid, []), at)
        self.cached += end - at

    # -- the push channel ---------------------------------------------------------------------
    def pump_recv(self, sock: socket.socket, limit: int) -> int:
        """Read at most `limit` bytes of the push channel, straight into the frame they belong
        to; 0 when it closed (everything pushed, or the pump went away)."""
        from relocator.agent.pump import FRAME

        if len(self.p_head) < FRAME.size:
            got = sock.recv(FRAME.size - len(self.p_head))
            if not got:
                return 0
            self.p_head += got
            if len(self.p_head) == FRAME.size:
                self.p_body, self.p_need = bytearray(FRAME.unpack(self.p_head)[2]), 0
            return len(got)
        n = sock.recv_into(memoryview(self.p_body)[self.p_need:], min(limit, len(self.p_body) - self.p_need))
        if not n:
            return 0
        self.p_need += n  # bytes of the body read so far
        if self.p_need == len(self.p_body):
            pid, vaddr, _size = FRAME.unpack(self.p_head)
            self._pushed(pid, vaddr, self.p_body)
            self.p_head, self.p_body, self.p_need = b"", bytearray(), 0
        return n

    def _pushed(self, pid: int, vaddr: int, body: bytearray) -> None:
        """Keep a pushed run, less the pages the daemon already asked the source for."""
        self.pushed_bytes += len(body)
        pages = len(body) // PAGE_SIZE
        p0 = vaddr // PAGE_SIZE
        missed = self.missed.get(pid)
        if not missed or missed.isdisjoint(range(p0, p0 + pages)):
            self._keep(pid, vaddr, body, vaddr + pages * PAGE_SIZE)
            return
        view = memoryview(body)
        run = None
        for i in range(pages + 1):
            gone = i == pages or (p0 + i) in missed
            if gone and run is not None:
                self._keep(pid, vaddr + run * PAGE_SIZE, view[run * PAGE_SIZE:i * PAGE_SIZE], vaddr + i * PAGE_SIZE)
                run = None
            elif not gone and run is None:
                run = i
            if gone and i < pages:
                self.pushed_dropped += PAGE_SIZE

    # -- the daemon ------------------------------------------------------------------------
    def from_daemon(self, data: bytes) -> list[bytes]:
        self.in_buf += data
        out = []
        while len(self.in_buf) >= PSI.size:
            raw = self.in_buf[:PSI.size]
            self.in_buf = self.in_buf[PSI.size:]
            cmd, n, vaddr, pid = PSI.unpack(raw)
            self.requests += 1
            slot = {"data": None, "t": time.monotonic(), "n": n}
            self.down_q.append(slot)
            cmd &= PS_CMD_MASK
            if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
                self.closing = True
                self.up_q.append(("close", 0, 0, 0, slot))
                # a daemon on a passed socket (--ps-socket, the keeper's socket pair) says
                # FORCE_CLOSE; the source gets the CLOSE of a daemon connected by TCP, as before
                out.append(raw if cmd == PS_IOV_CLOSE else PSI.pack(PS_IOV_CLOSE, n, vaddr, pid))
                continue
            busy = False
            if cmd == PS_IOV_GET:
                now = time.monotonic()
                if n <= 1:  # the daemon asks one page for a fault, more for its background copy
                    self.last_fault = now
                else:
                    busy = now - self.last_fault < self.FAULT_WINDOW_S and n > self.BUSY_PAGES
            hit = self._lookup(pid, vaddr, n) if cmd == PS_IOV_GET else None
            if hit is not None:
                self.hits += 1
                slot["data"] = hit
            else:
                if busy:
                    # answers come back in order on one connection: while faults come, a page
                    # fault must not wait behind megabytes of background copy. The daemon takes
                    # fewer pages than it asked for and asks the rest later
                    n = self.BUSY_PAGES
                    raw = PSI.pack(cmd, n, vaddr, pid)
                if cmd == PS_IOV_GET and self.pushed:
                    # up to the next pushed run only: the daemon asks the rest later and finds it
                    nxt = self._next_start(pid, vaddr)
                    if nxt is not None and vaddr + n * PAGE_SIZE > nxt:
                        n = max(1, (nxt - vaddr) // PAGE_SIZE)
                        raw = PSI.pack(cmd, n, vaddr, pid)
                    p0 = vaddr // PAGE_SIZE
                    self.missed.setdefault(pid, set()).update(range(p0, p0 + n))
                self.up_q.append(("d", pid, vaddr, n, slot))
                self.xfer_pages = 16
                out.append(raw)
        return out

    def flush(self, down: socket.socket) -> None:
        while self.down_q and self.down_q[0]["data"] is not None:
            slot = self.down_q.popleft()
            parts = slot["data"]
            for part in parts:
                down.sendall(part)
            if self.trace is not None:
                self.trace.append((round(slot["t"], 4), slot["n"], round(time.monotonic() - slot["t"], 5)))
            self.served_bytes += sum(len(p) for p in parts[1:])

    # -- the source ------------------------------------------------------------------------
    def from_source(self, data: memoryview) -> list[bytes]:
        pos = 0
        while pos < len(data):
            if not self.up_q:
                return []  # nothing owed: stray bytes, dropped
            kind = self.up_q[0][0]
            if kind == "close":
                want = 4 - len(self.head)
                self.head += bytes(data[pos:pos + want])
                pos += want
                if len(self.head) == 4:
                    _, _, _, _, slot = self.up_q.popleft()
                    slot["data"], self.head = [self.head], b""
                    self.closed = True
                continue
            if len(self.head) < PSI.size:
                want = PSI.size - len(self.head)
                self.head += bytes(data[pos:pos + want])
                pos += want
                if len(self.head) == PSI.size:
                    self.need = PSI.unpack(self.head)[1] * PAGE_SIZE
                    self.body = bytearray()
                if len(self.head) < PSI.size or self.need:
                    continue
            else:
                take = min(self.need, len(data) - pos)
                self.body += data[pos:pos + take]
                pos += take
                self.need -= take
                self.page_bytes += take
                if self.need:
                    continue
            self._answered()
        return self.next_prefetch()

    def _answered(self) -> None:
        kind, pid, vaddr, n, slot = self.up_q.popleft()
        _cmd, got, at, _dst = PSI.unpack(self.head)
        if kind == "d":
            slot["data"] = [self.head, self.body]
        else:  # fetched ahead: keep until the daemon asks; the rest of the run comes next
            self.pf_inflight -= 1
            if got:
                self._keep(pid, at, self.body, at + got * PAGE_SIZE)
            if got < n:
                self.todo.appendleft((pid, vaddr + got * PAGE_SIZE, n - got))
        self.head, self.body, self.need = b"", bytearray(), 0


def main(argv: list[str] | None = None) -> int:
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
    p.add_argument("--prefill-bytes", type=int, default=0)  # pushed bytes taken before the tree starts ...
    p.add_argument("--prefill-s", type=float, default=1.5)  # ... at most this long
    p.add_argument("--status-fd", type=int, default=-1)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return Keeper(args).run()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded for the agent
        write_state(Path(args.cell_dir), state="failed", why="keeper", error=f"{type(exc).__name__}: {exc}")
        raise


# -- the agent's side ------------------------------------------------------------------------------
class TargetSession:
    """What a target agent starts for one post-copy restore (snapshot.restore's `lazy` hook)."""

    def __init__(self, source: str, port: int, stall_s: float = 3.0, throttle_bps: float = 0.0,
                 ready_timeout: float = 60.0, pump_port: int = 0) -> None:
        self.source, self.port, self.pump_port = source, port, pump_port
        self.stall_s, self.throttle_bps, self.ready_timeout = stall_s, throttle_bps, ready_timeout
        self.proc = None

    def start(self, image_dir: Path, cell_dir: Path) -> None:
        from relocator.snapshot import criu
        from relocator.snapshot.images import lazy_bytes

        try:
            lazy = lazy_bytes(image_dir)
        except Exception:  # noqa: BLE001 - only a figure
            lazy = 0
        from relocator.credentials import tls_files

        tls_files()  # this node's certificates, or a CredentialsError naming what is missing
        repo = str(Path(__file__).resolve().parents[2])
        # `python -S`: the keeper needs the standard library and this package only, and starts
        # in a few tens of milliseconds instead of the site's (editable installs) ~0.15 s
        argv = [sys.executable, "-S", "-m", "relocator.agent.postcopy", "--cell-dir", str(cell_dir),
                "--image-dir", str(image_dir), "--source", self.source, "--source-port", str(self.port),
                "--stall-s", str(self.stall_s), "--throttle-bps", str(self.throttle_bps), "--lazy-bytes", str(lazy),
                # off by default: with a 3 GB image, fetching ahead (even fault-friendly) doubled
                # the health check and the blackout on a 2-core node (docs/benchmarks.md, issue 14);
                # RELOCATOR_POSTCOPY_PREFETCH=1 turns it on
                "--prefetch", os.environ.get("RELOCATOR_POSTCOPY_PREFETCH", "0"), "--pump-port", str(self.pump_port),
                # pre-paging: the first MiB of the push before the tree starts (0: none)
                "--prefill-bytes", str(prefill_mb() << 20)]
        env = {**os.environ, "PYTHONPATH": repo}
        try:
            self.proc = criu.CriuProcess(argv, cell_dir / "keeper.log", "post-copy keeper", cwd=repo, env=env)
            self.proc.start(timeout=self.ready_timeout)
        except criu.CriuError as exc:
            state = read_state(cell_dir) or {}
            raise criu.CriuError(f"post-copy could not start: {state.get('error') or exc}") from None

    def abort(self) -> None:
        """The restore failed: stop the keeper (and with it the daemon and the source link)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                self.proc.kill()


def prefill_mb() -> int:
    """RELOCATOR_POSTCOPY_PREFILL_MB (default 1024; 0: the tree starts with none of its memory)."""
    raw = os.environ.get("RELOCATOR_POSTCOPY_PREFILL_MB", "1024")
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"RELOCATOR_POSTCOPY_PREFILL_MB must be a whole number of MiB, not {raw!r}") from None


def stop_keeper(cell_dir: Path) -> None:
    """Stop a cell's keeper and daemon if they still run (the cell is being killed)."""
    st = read_state(cell_dir) or {}
    for key in ("keeper_pid", "daemon_pid"):
        pid = st.get(key)
        if pid and _alive(pid) and _is_ours(pid, cell_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _is_ours(pid: int, cell_dir: Path, marker: str = "") -> bool:
    """`pid` still runs a keeper, daemon (or, with `marker` in its arguments, a pump) of this
    cell (not a reused pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(cell_dir) in argv and marker in argv


# -- the source's side ------------------------------------------------------------------------------
class LazySource:
    """The lazy dump of one cell on its source node, recorded in `<cell dir>/lazy_dump.json`
    (pid, port) so that a restarted agent finds it again."""

    FILE = "lazy_dump.json"

    def __init__(self, cell_dir: Path) -> None:
        self.cell_dir = Path(cell_dir)

    def record(self, pid: int, address: str, port: int, image_dir: str) -> None:
        (self.cell_dir / self.FILE).write_text(json.dumps(
            {"pid": pid, "address": address, "port": port, "image_dir": image_dir, "started_at": time.time()}))

    def info(self) -> dict | None:
        try:
            return json.loads((self.cell_dir / self.FILE).read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        info = self.info()
        return bool(info) and _alive(info["pid"]) and _is_dump(info["pid"], info.get("image_dir", ""))

    def wait(self, timeout: float, proc=None) -> dict:
        """Until the lazy dump has exited (every page served, or the transfer broke)."""
        info = self.info() or {}
        deadline = time.monotonic() + timeout
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return {"done": False}
        else:  # not our child (the agent restarted): watch the pid
            while self.running():
                if time.monotonic() > deadline:
                    return {"done": False}
                time.sleep(0.05)
        return {"done": True, "rc": rc, "pid": info.get("pid")}

    def abort(self, proc=None) -> str:
        """End the lazy dump so that its tree can be resumed: a dump not yet connected is
        connected to (TLS, as a keeper) and left (it then ends as if done, the tree stopped); a
        connected one gets
        its socket destroyed (`ss -K`: CRIU sees the transfer fail and lets the tree run);
        SIGKILL if neither ends it."""
        info = self.info()
        if not info or not self.running():
            self.clear()
            return "not running"
        pid, port, address = info["pid"], info["port"], info["address"]
        how = "connected and closed"
        try:
            _knock(address, port)
        except (OSError, RuntimeError):
            how = "socket destroyed"
            subprocess.run(["ss", "-K", "-t", "state", "established", f"( sport = :{port} )"],
                           capture_output=True)
        deadline = time.monotonic() + 5
        while self.running() and time.monotonic() < deadline:
            if how == "connected and closed" and time.monotonic() > deadline - 4:
                how = "socket destroyed"
                subprocess.run(["ss", "-K", "-t", "state", "established", f"( sport = :{port} )"],
                               capture_output=True)
            time.sleep(0.02)
        if self.running():
            how = "killed"
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while _alive(pid) and time.monotonic() < deadline + 5:
                time.sleep(0.02)
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                pass
        self.clear()
        return how

    def clear(self) -> None:
        from relocator.agent import pump

        pump.stop(self.cell_dir)  # it ends by itself with the dump; this makes sure
        (self.cell_dir / self.FILE).unlink(missing_ok=True)


def _is_dump(pid: int, image_dir: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and argv[0].endswith(b"criu") and b"--lazy-pages" in argv and (
        not image_dir or image_dir.encode() in argv)


if __name__ == "__main__":
    sys.exit(main())
