"""The aiohttp front end: OpenAI API on one listener, the control API on another.

One pooled `aiohttp.ClientSession` carries every upstream request. Streams are written as the
core yields them; a client that goes away cancels the handler (handler_cancellation), which
closes the generator and with it the upstream request."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import signal
import socket
import time
from typing import Any

import aiohttp
from aiohttp import web

from relocator.choices import LogLevel
from relocator.waits import WaitTimeout, until_async

from . import auth, errors
from .config import RouterSettings
from .control import ControlAPI, error_response as _err, openai_errors as _openai_errors, serve_app
from .core import Stream, Unary
from .errors import RouterError
from .runtime import RouterRuntime, make_table
from .table import RoutingTable
from . import state as state_io
# the upstream pool moved to upstream.py (shared with the gateway shells); kept importable here
from .upstream import AiohttpUpstream, dead_peer_socket_factory  # noqa: F401

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


# ---------------------------------------------------------------------- blackout measure
class _ClientStream:
    """One client request as this server serves it: the worker it is on (set when the core
    registers its upstream request in the table; None while it waits for one, e.g. held) and
    when it last got bytes (at first: when it arrived)."""

    __slots__ = ("worker", "last", "pause")

    def __init__(self) -> None:
        self.worker: str | None = None
        self.last = time.monotonic()
        self.pause: _Pause | None = None

    def wrote(self) -> None:
        now = time.monotonic()
        if self.pause is not None:
            self.pause.resumed(self, now - self.last)
            self.pause = None
        self.last = now


class _Pause:
    """The client requests one switch of `worker` concerns (its streams, which the switch cuts
    over, and requests not on a worker yet, e.g. held for it), until each got bytes again or
    ended: the longest pause among them is observed once, when the last one is back. A request
    that lands on another worker is dropped."""

    __slots__ = ("worker", "waiting", "longest", "observe")

    def __init__(self, worker: str, streams: list[_ClientStream], observe) -> None:
        self.worker = worker
        self.waiting = set(streams)
        self.longest: float | None = None
        self.observe = observe
        for cs in streams:
            if cs.pause is not None:  # switched again before it resumed: this switch measures it
                cs.pause.gone(cs)
            cs.pause = self

    def resumed(self, cs: _ClientStream, seconds: float) -> None:
        self.longest = seconds if self.longest is None else max(self.longest, seconds)
        self.gone(cs)

    def gone(self, cs: _ClientStream) -> None:
        self.waiting.discard(cs)
        if not self.waiting and self.longest is not None:
            self.observe(self.longest)
            self.longest = None


#: the client stream of the request the current task serves (read by the table on register)
_current_stream: contextvars.ContextVar[_ClientStream | None] = contextvars.ContextVar(
    "relocator_client_stream", default=None)


class _WatchedTable(RoutingTable):
    """The routing table, telling the server which worker each client stream is on and when a
    worker is switched (control API or, while draining, the state file): what the blackout
    measure (`relocator_relocation_blackout_seconds`) needs."""

    def __init__(self, *args: Any, on_switch, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.on_switch = on_switch

    def register(self, r, handle) -> None:
        super().register(r, handle)
        cs = _current_stream.get()
        if cs is not None:
            cs.worker = handle.worker_id
            if cs.pause is not None and cs.pause.worker != cs.worker:  # not the switched worker's
                cs.pause.gone(cs)
                cs.pause = None

    def switch(self, worker_id: str, endpoint: str, *, release: bool = True, keep_inexact: bool = False,
               cut_from: str | None = None, at_token: bool = False) -> dict:
        self.on_switch(worker_id)
        return super().switch(worker_id, endpoint, release=release, keep_inexact=keep_inexact, cut_from=cut_from,
                              at_token=at_token)


class RouterServer:
    def __init__(self, settings: RouterSettings | None = None) -> None:
        self.settings = s = settings or RouterSettings()
        #: the core and what it shares with the gateway shells (table, tokenizers, hooks, pool)
        self.rt = RouterRuntime(s, table=make_table(s, _WatchedTable,
                                                    on_switch=self._pause_streams))
        self.table = self.rt.table
        self.tokenizers = self.rt.tokenizers
        self.hooks = self.rt.hooks
        #: client streams being written, for the blackout measure
        self._client_streams: set[_ClientStream] = set()
        self._runners: list[web.AppRunner] = []
        self._sites: list[web.BaseSite] = []
        self._listen_sock: socket.socket | None = None
        self.port = s.port
        self.control_port = s.control_port
        self.draining = False
        self._drain_task: asyncio.Task | None = None
        self._drain_deadline = 0.0
        self._drained = asyncio.Event()
        self._state_seen: tuple | None = None

    # ---- lifecycle -------------------------------------------------------------------
    async def start(self) -> "RouterServer":
        s = self.settings
        self.rt.start()
        api = web.Application(middlewares=[self._drain_mw, _openai_errors, self._auth_mw],
                              client_max_size=s.max_body_bytes + 1)
        api.router.add_post("/v1/completions", self._completions)
        api.router.add_post("/v1/chat/completions", self._chat)
        api.router.add_get("/v1/models", self._models)
        api.router.add_get("/health", self._health)
        api.router.add_get("/metrics", self._metrics)
        if s.listen_fd is not None:
            self._listen_sock = socket.socket(fileno=s.listen_fd)
            self.port = await self._serve(api, sock=self._listen_sock)
        else:
            self.port = await self._serve(api, s.host, s.port)
        control = ControlAPI(self.rt)
        ctl = control.app(outer=(self._drain_mw,), inner=(self._forward_mw,))
        self.control_port = await self._serve(ctl, control.host(), s.control_port)
        return self

    async def _serve(self, app: web.Application, host: str = "", port: int = 0,
                     sock: socket.socket | None = None) -> int:
        def keep(runner: web.AppRunner, site: web.BaseSite) -> None:
            self._runners.append(runner)
            self._sites.append(site)

        return await serve_app(app, host, port, sock, on_started=keep)

    async def stop(self) -> None:
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
        for r in self._runners:
            for h in r.server.connections if r.server is not None else ():
                h.force_close()  # nothing left to wait for (drained, or told to go)
            await r.cleanup()
        self._runners.clear()
        self._sites.clear()
        if self._listen_sock is not None:
            self._listen_sock.close()
        await self.rt.close()

    # ---- restarts: persisted table, graceful hand-over -------------------------------
    def persist(self) -> None:
        """Write the table after a control-API change (no-op without `state_file`)."""
        self.rt.persist()

    def drain(self) -> None:
        """SIGTERM of a supervised router: stop accepting (the shared listener stays open in
        the supervisor; its backlog waits for the replacement), tell the parent at once
        (SIGUSR1), keep serving what is in flight (bounded by drain_timeout_s) and follow the
        replacement's table changes through the state file, then exit. A second call: go now."""
        if self._drain_task is not None:
            self._drain_deadline = 0.0
            return
        self.draining = True
        self._drain_deadline = time.monotonic() + self.settings.drain_timeout_s
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())

    async def wait_drained(self) -> None:
        await self._drained.wait()

    async def _drain(self) -> None:
        s = self.settings
        try:
            for site in self._sites:
                await site.stop()  # listeners only; open connections stay
            if self._listen_sock is not None and self._listen_sock.fileno() >= 0:
                self._listen_sock.close()  # our copy; the supervisor keeps its own
            if s.supervised and os.getppid() > 1:
                try:
                    os.kill(os.getppid(), signal.SIGUSR1)
                except OSError as e:  # pragma: no cover
                    log.warning("could not signal the supervisor: %s", e)
            log.warning("draining: %d connections", sum(len(r.server.connections)
                                                        for r in self._runners if r.server))
            self._state_seen = self._state_key()
            idle: dict[Any, tuple[int, float]] = {}
            # no fixed timeout: a second drain() moves the deadline to now
            await until_async(lambda: self._drain_step(idle), None, 0.1, what="the drain")
            log.warning("drained")
        finally:
            self._drained.set()

    def _drain_step(self, idle: dict[Any, tuple[int, float]]) -> bool:
        """One look at the open connections while draining: True when none is left or the
        drain's time is up; idle keep-alive connections are closed (`idle`: each one's
        request count and since when it has not changed)."""
        if time.monotonic() >= self._drain_deadline:
            return True
        self._follow_state()
        now = time.monotonic()
        conns = [h for r in self._runners if r.server is not None
                 for h in r.server.connections]
        if not conns:
            return True
        for h in conns:
            busy = h._request_in_progress or bool(h._messages)  # type: ignore[attr-defined]
            count = h._request_count  # type: ignore[attr-defined]
            seen = idle.get(h)
            if busy or seen is None or seen[0] != count:
                idle[h] = (count, now)
            elif now - seen[1] >= self.settings.drain_idle_close_s:
                h.force_close()  # an idle keep-alive connection
        for h in [h for h in idle if h not in conns]:
            del idle[h]
        return False

    def _state_key(self) -> tuple | None:
        try:
            st = os.stat(self.settings.state_file)  # type: ignore[arg-type]
        except (OSError, TypeError):
            return None
        return (st.st_ino, st.st_mtime_ns, st.st_size)

    def _follow_state(self, force: bool = False) -> None:
        """Draining: apply what the replacement wrote (switch/release/hold/add)."""
        if self.settings.state_file is None:
            return
        key = self._state_key()
        if key is None or (key == self._state_seen and not force):
            return
        self._state_seen = key
        reps = state_io.load(self.settings.state_file)
        if reps is not None:
            done = state_io.follow(self.table, reps)
            if done:
                log.warning("draining: followed the new router: %s", done)

    @web.middleware
    async def _drain_mw(self, request: web.Request, handler):
        resp = await handler(request)
        if self.draining and not resp.prepared:
            resp.force_close()  # the client's next request opens a connection to the new router
        return resp

    @web.middleware
    async def _auth_mw(self, request: web.Request, handler):
        """With API keys set, every path but /health (and /metrics when metrics_public) wants
        one of them: OpenAI's 401 otherwise."""
        s = self.settings
        open_paths = ("/health", "/metrics") if s.metrics_public else ("/health",)
        if s.keys and request.path not in open_paths:
            header = request.headers.get("Authorization")
            if not auth.key_matches(header, s.keys):
                self.hooks.errors.labels("invalid_api_key").inc()
                raise auth.invalid_api_key(missing=not header)
        return await handler(request)

    @web.middleware
    async def _forward_mw(self, request: web.Request, handler):
        """Draining: a control call that still reaches us (a kept-alive connection) goes to the
        replacement (same control port, bound by it), which owns the table now."""
        if not self.draining:
            return await handler(request)
        assert self.upstream is not None
        body = await request.read()
        host = self.settings.control_host if self.settings.control_token else "127.0.0.1"
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        url = f"http://{host}:{self.control_port}{request.rel_url}"
        hdrs = {k: v for k, v in request.headers.items()
                if k.lower() in ("authorization", "content-type")}
        refused: list[Exception] = []

        async def forward() -> tuple[web.Response] | None:
            try:
                async with self.upstream.session.request(request.method, url, data=body or None,
                                                         headers=hdrs) as r:
                    # in a tuple: an empty web.Response is falsy (a mapping)
                    return (web.Response(status=r.status, body=await r.read(),
                                         content_type=r.content_type),)
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as e:
                refused[:] = [e]
                return None

        try:
            (out,) = await until_async(forward, 10.0, 0.05, what="the router's control API")
        except WaitTimeout:
            raise RouterError(503, f"router restarting: {refused[0] if refused else ''}",
                              code="router_restarting", type="server_error") from None
        self._follow_state(force=True)
        return out

    async def __aenter__(self) -> "RouterServer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def core(self):
        return self.rt.core

    @property
    def upstream(self):
        return self.rt.upstream

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def control_url(self) -> str:
        return f"http://127.0.0.1:{self.control_port}"

    # ---- OpenAI API ------------------------------------------------------------------
    async def _read_body(self, request: web.Request) -> bytes:
        limit = self.settings.max_body_bytes
        if request.content_length is not None and request.content_length > limit:
            raise errors.body_too_large(limit)
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise errors.body_too_large(limit) from None

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._proxy(request, "chat")

    async def _proxy(self, request: web.Request, kind: str) -> web.StreamResponse:
        raw = await self._read_body(request)
        assert self.core is not None
        cs = _ClientStream()
        _current_stream.set(cs)
        self._client_streams.add(cs)
        try:
            try:
                res = await self.core.handle(kind, raw, request.headers)  # type: ignore[arg-type]
            except RouterError as e:
                self.hooks.errors.labels(e.code or str(e.status)).inc()
                return _err(e)
            if isinstance(res, Unary):
                return web.Response(status=res.status, body=res.body,
                                    headers={"Content-Type": res.content_type})
            return await self._write_stream(request, res, cs)
        finally:
            self._client_streams.discard(cs)
            if cs.pause is not None:
                cs.pause.gone(cs)

    def _pause_streams(self, worker_id: str) -> None:
        """A switch of `worker_id`: measure the pause of the client streams it cuts over and of
        the requests it releases."""
        streams = [cs for cs in self._client_streams if cs.worker in (worker_id, None)]
        if streams:
            _Pause(worker_id, streams, self.hooks.blackout)

    async def _write_stream(self, request: web.Request, res: Stream,
                            cs: _ClientStream | None = None) -> web.StreamResponse:
        gen = res.chunks
        resp: web.StreamResponse | None = None
        try:
            async for chunk in gen:
                if resp is None:
                    resp = web.StreamResponse(status=res.status, headers=SSE_HEADERS)
                    if self.draining:
                        resp.force_close()
                    await resp.prepare(request)
                if cs is not None:
                    cs.wrote()
                await resp.write(chunk)
        except RouterError as e:  # raised before the first byte
            if resp is None:
                self.hooks.errors.labels(e.code or str(e.status)).inc()
                return _err(e)
            raise
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass  # client went away; finally closes the upstream
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
        if resp is None:
            resp = web.StreamResponse(status=res.status, headers=SSE_HEADERS)
            await resp.prepare(request)
        try:
            await resp.write_eof()
        except (ConnectionResetError, aiohttp.ClientConnectionResetError):
            pass
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        assert self.core is not None
        return web.Response(body=self.core.models_body(), content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        reps = self.table.replicas()
        return web.json_response({"status": "draining" if self.draining else "ok",
                                  "replicas": len(reps),
                                  "held": sum(r.state.value == "held" for r in reps)})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.hooks.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def serve_forever(settings: RouterSettings) -> None:
    srv = await RouterServer(settings).start()
    log.info("router on :%d, control on :%d", srv.port, srv.control_port)
    if settings.supervised:
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, srv.drain)
    try:
        await srv.wait_drained()
    finally:
        await srv.stop()


def run(settings: RouterSettings, log_level: str = "warning") -> None:
    """The process entry (`relocator router serve`, `python -m relocator.router`)."""
    logging.basicConfig(level=LogLevel(log_level.lower()).upper(),
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    try:
        import uvloop

        uvloop.install()
    except Exception:
        pass
    try:
        asyncio.run(serve_forever(settings))
    except KeyboardInterrupt:
        pass
