"""The keeper's page-server proxy: the lazy-pages daemon's requests answered in order, from
pages pushed (relocator.agent.pump) or fetched ahead when they are here, through the source's
page server otherwise. Pure protocol state, no sockets of its own but the push channel's reads:
the keeper (relocator.agent.postcopy.keeper) moves the bytes. Stdlib only (`python -S`)."""

from __future__ import annotations

import bisect
import os
import socket
import time
from collections import deque

from relocator.agent.postcopy.base import FRAME, PAGE_SIZE, PS_CMD_MASK, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE, PS_IOV_GET, PSI


class Proxy:
    """The keeper's page-server proxy. The daemon gets its answers strictly in the order it
    asked (it matches them by order); an answer is ready at once when the pages were fetched
    ahead, else when the source's answer to the forwarded request arrives. Ahead-of-need
    requests (`prefetch_depth` in flight, at most `cache_bytes` held) walk every lazy run."""

    MAX_PAGES = 1024  # what the daemon asks at most; the source clamps to its own runs
    FAULT_WINDOW_S = 0.25  # background requests stay small this long after a page fault ...
    BUSY_PAGES = 16  # ... at most 64 KiB each

    def __init__(self, ranges: list[tuple[int, int, int]], depth: int, cache_bytes: int,
                 pushed: bool = False) -> None:
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
        starts = self.starts.get(pid)
        if not starts:
            return None
        i = bisect.bisect_right(starts, vaddr)
        return starts[i] if i < len(starts) else None

    def _keep(self, pid: int, at: int, data, end: int) -> None:
        self.cache.setdefault(pid, {})[at] = [end, data, 0]
        bisect.insort(self.starts.setdefault(pid, []), at)
        self.cached += end - at

    # -- the push channel ---------------------------------------------------------------------
    def pump_recv(self, sock: socket.socket, limit: int) -> int:
        """Read at most `limit` bytes of the push channel, straight into the frame they belong
        to; 0 when it closed (everything pushed, or the pump went away)."""
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
