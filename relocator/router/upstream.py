"""The upstream pool every shell shares: `AiohttpUpstream` implements the core's `Upstream`
protocol over one pooled `aiohttp.ClientSession` (the standalone router, the LiteLLM plugin and
the endpoint picker's continuation listener all send engine requests through it)."""

from __future__ import annotations

import asyncio
import errno
import socket
from typing import AsyncIterator

import aiohttp

from .transport import UpstreamError


class UpstreamResp:
    __slots__ = ("_r", "status", "content_type")

    def __init__(self, r: aiohttp.ClientResponse) -> None:
        self._r = r
        self.status = r.status
        self.content_type = r.headers.get("Content-Type", "application/json")

    async def read(self) -> bytes:
        try:
            return await self._r.read()
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
            raise UpstreamError(f"{type(e).__name__}: {e}") from None

    async def chunks(self) -> AsyncIterator[bytes]:
        content = self._r.content
        try:
            while True:
                data = await content.readany()
                if not data:
                    return
                yield data
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError) as e:
            raise UpstreamError(f"{type(e).__name__}: {e}") from None

    def close(self) -> None:
        r = self._r
        r.close()
        # wake a reader parked on a frozen connection (close() alone may not)
        exc = aiohttp.ClientConnectionError("upstream aborted by router")
        try:
            r.content.set_exception(exc)
        except Exception:  # pragma: no cover
            pass


def dead_peer_socket_factory(dead_peer_s: float):
    """Upstream sockets that notice a vanished peer: keepalive probes on idle connections and
    TCP_USER_TIMEOUT on unacknowledged data. A frozen (SIGSTOPped) worker is not affected: its
    kernel keeps acknowledging."""
    idle = max(1, int(dead_peer_s / 3))
    interval = max(1, int(dead_peer_s / 6))

    def factory(addr_info) -> socket.socket:
        family, type_, proto, _, _ = addr_info
        sock = socket.socket(family=family, type=type_, proto=proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, val in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", 3),
                         ("TCP_USER_TIMEOUT", int(dead_peer_s * 1000))):
            if hasattr(socket, opt):  # Linux
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
        return sock

    return factory


class AiohttpUpstream:
    def __init__(self, connect_timeout_s: float = 5.0, pool_limit: int = 0, dead_peer_s: float = 15.0) -> None:
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=pool_limit, limit_per_host=0,
                                           enable_cleanup_closed=False,
                                           socket_factory=dead_peer_socket_factory(dead_peer_s)),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
            auto_decompress=False, skip_auto_headers=("User-Agent",))
        self._hdrs = {"Content-Type": "application/json"}

    async def post(self, url: str, body: bytes) -> UpstreamResp:
        # Idle pooled connections to a worker that was frozen by a dump and then resumed
        # (rollback) come back reset: drop them and try again before giving up (issue 4).
        for attempt in range(9):
            try:
                r = await self.session.post(url, data=body, headers=self._hdrs)
            except (aiohttp.ServerDisconnectedError, ConnectionResetError, BrokenPipeError) as e:
                stale = e
            except aiohttp.ClientOSError as e:
                if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                    raise UpstreamError(f"{type(e).__name__}: {e}") from None
                stale = e
            except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError, OSError) as e:
                raise UpstreamError(f"{type(e).__name__}: {e}") from None
            else:
                return UpstreamResp(r)
        raise UpstreamError(f"{type(stale).__name__}: {stale}")

    async def health(self, endpoint: str, timeout_s: float = 1.0) -> bool:
        """GET {endpoint}/health answered 200 within `timeout_s` (the suspect-hold probe)."""
        try:
            async with self.session.get(endpoint + "/health",
                                        timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, ConnectionError, asyncio.TimeoutError, OSError):
            return False

    async def close(self) -> None:
        await self.session.close()


