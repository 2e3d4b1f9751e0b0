"""A loopback TCP proxy that breaks every connection after a random number of response bytes.

Put in front of a worker, it makes every stream through it break again and again, mid-event,
as a worker that dies or is switched away does: the router continues the stream wherever it
goes next, which may break it again. Used by the text-exactness test and `relocator bench
splices` to make hundreds of splices in a short run. Seeded: the same seed cuts the same way.
"""

from __future__ import annotations

import asyncio
import random


class RepeatCutProxy:
    def __init__(self, target_url: str, rng: random.Random, lo: int = 1500, hi: int = 6000):
        self.host, port = target_url.split("//")[1].rstrip("/").split(":")
        self.port, self.rng, self.lo, self.hi = int(port), rng, lo, hi
        self.cuts = 0
        self.server: asyncio.AbstractServer | None = None
        self.url = ""
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()  # strong references: a pending task is kept

    async def start(self) -> "RepeatCutProxy":
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        if me is not None:
            self._tasks.add(me)
            me.add_done_callback(self._tasks.discard)
        try:
            ur, uw = await asyncio.open_connection(self.host, self.port)
        except OSError:
            cw.transport.abort()
            return
        self._open.update((cw, uw))
        limit = self.rng.randint(self.lo, self.hi)

        async def up() -> None:
            try:
                while data := await cr.read(65536):
                    uw.write(data)
                    await uw.drain()
            except Exception:  # noqa: BLE001 - the other side went away
                pass

        async def down() -> None:
            n = 0
            try:
                while data := await ur.read(65536):
                    if n + len(data) >= limit:
                        cw.write(data[: limit - n])
                        await cw.drain()
                        self.cuts += 1
                        break
                    n += len(data)
                    cw.write(data)
                    await cw.drain()
            except Exception:  # noqa: BLE001
                pass
            for w in (cw, uw):
                w.transport.abort()
                self._open.discard(w)

        t = asyncio.ensure_future(up())
        await down()
        t.cancel()

    async def close(self) -> None:
        """Stop listening and drop every open connection; handlers end on their own."""
        if self.server is not None:
            self.server.close()
        for w in list(self._open):
            w.transport.abort()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=5)
