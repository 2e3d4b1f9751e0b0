"""A worker move as its clients' connections see it, without a cluster: a loopback TCP proxy in
front of the source worker. `freeze()` stops forwarding but keeps every connection open (what
a CRIU dump does to a worker's sockets: the peer goes silent), `kill()` drops them all (RELEASE
kills the stopped source). Between the two the control plane switches the worker to its new
endpoint. Used by the gateway tests and `relocator bench gateway`."""

from __future__ import annotations

import asyncio


class MoveProxy:
    def __init__(self, target_url: str) -> None:
        self.host, port = target_url.split("//")[1].rstrip("/").split(":")
        self.port = int(port)
        self.server: asyncio.AbstractServer | None = None
        self.url = ""
        self.frozen = asyncio.Event()
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        #: response bytes forwarded so far (a test waits for streams to be under way)
        self.forwarded = 0

    async def start(self) -> "MoveProxy":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0, backlog=1024)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        if self.frozen.is_set():  # a dumped worker accepts nothing either
            cw.transport.abort()
            return
        try:
            ur, uw = await asyncio.open_connection(self.host, self.port)
        except OSError:
            cw.transport.abort()
            return
        self._writers.update((cw, uw))
        for t in (asyncio.ensure_future(self._pipe(cr, uw, False)),
                  asyncio.ensure_future(self._pipe(ur, cw, True))):
            self._tasks.add(t)
            t.add_done_callback(self._tasks.discard)

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter,
                    response: bool) -> None:
        try:
            while data := await r.read(65536):
                if self.frozen.is_set():
                    return  # silent from now on; the sockets stay open until kill()
                w.write(data)
                if response:
                    self.forwarded += len(data)
                await w.drain()
            if not self.frozen.is_set():
                w.close()
        except Exception:
            pass

    def freeze(self) -> None:
        self.frozen.set()

    def kill(self) -> None:
        for w in list(self._writers):
            w.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        self.kill()
        for t in list(self._tasks):
            t.cancel()
        if self.server is not None:
            self.server.close()
