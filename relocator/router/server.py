"""The aiohttp front end: OpenAI API on one listener, the control API on another.

One pooled `aiohttp.ClientSession` carries every upstream request. Streams are written as the
core yields them; a client that goes away cancels the handler (handler_cancellation), which
closes the generator and with it the upstream request."""

from __future__ import annotations

import asyncio
import contextvars
import errno
import hmac
import json
import logging
import os
import signal
import socket
import time
from typing import Any, AsyncIterator

import aiohttp
from aiohttp import web

from relocator.choices import LogLevel

from . import errors
from .config import RouterEngine, RouterSettings
from .core import RouterCore, Stream, Unary, UpstreamError
from .errors import RouterError
from .metrics import PromHooks
from .policies import make_policy
from .table import RoutingTable
from . import state as state_io
from .tokenizers import TokenizerRegistry

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}


# ---------------------------------------------------------------------- upstream adapter
class _Resp:
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

    async def post(self, url: str, body: bytes) -> _Resp:
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
                return _Resp(r)
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

    def switch(self, worker_id: str, endpoint: str, *, release: bool = True) -> dict:
        self.on_switch(worker_id)
        return super().switch(worker_id, endpoint, release=release)


# ---------------------------------------------------------------------- helpers
def _err(e: RouterError) -> web.Response:
    return web.Response(status=e.status, body=e.json_body(), content_type="application/json")


@web.middleware
async def _openai_errors(request: web.Request, handler):
    try:
        return await handler(request)
    except RouterError as e:
        return _err(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "http_error")
        return _err(RouterError(e.status, e.reason or "error", code=code))


class RouterServer:
    def __init__(self, settings: RouterSettings | None = None) -> None:
        self.settings = s = settings or RouterSettings()
        self.table = _WatchedTable(make_policy(s.policy, **s.policy_args),
                                   hold_queue_max=s.hold_queue_max,
                                   hold_timeout_s=s.hold_timeout_s,
                                   prefer_sibling_when_held=s.prefer_sibling_when_held,
                                   on_switch=self._pause_streams)
        #: client streams being written, for the blackout measure
        self._client_streams: set[_ClientStream] = set()
        #: per model, the tokenizer continued streams' text is made with
        self.tokenizers = TokenizerRegistry()
        for i, b in enumerate(s.backends):
            self.table.add(b.worker_id or f"{b.model}-{i}", b.model, b.url,
                           b.engine.value if b.engine else None)
            if b.tokenizer:
                self.tokenizers.register(b.model, b.tokenizer)
        if s.state_file is not None:  # newer than the config: it wins
            reps = state_io.load(s.state_file)
            if reps:
                log.info("router state: %d replicas from %s",
                         state_io.restore(self.table, reps), s.state_file)
                for model, path in state_io.tokenizers_of(reps).items():
                    self.tokenizers.register(model, path)
        self.hooks = PromHooks()
        self.table.on_held_change = self.hooks.held_changed
        self.upstream: AiohttpUpstream | None = None
        self.core: RouterCore | None = None
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
        self.upstream = AiohttpUpstream(s.connect_timeout_s, s.pool_limit, s.upstream_dead_peer_s)
        self.core = RouterCore(self.table, self.upstream, engine=s.engine.value,
                               max_body_bytes=s.max_body_bytes, retries=s.retries,
                               max_continuations=s.max_continuations,
                               continuation=s.continuation, hooks=self.hooks,
                               unreachable_hold_s=s.unreachable_hold_s,
                               probe=self.upstream.health, tokenizers=self.tokenizers)
        api = web.Application(middlewares=[self._drain_mw, _openai_errors],
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
        ctl = web.Application(middlewares=[self._drain_mw, _openai_errors, self._auth,
                                           self._forward_mw], client_max_size=1 << 20)
        ctl.router.add_get("/control/replicas", self._c_list)
        ctl.router.add_post("/control/replicas", self._c_add)
        ctl.router.add_delete("/control/replicas/{worker}", self._c_remove)
        ctl.router.add_post("/control/workers/{worker}/hold", self._c_hold)
        ctl.router.add_post("/control/workers/{worker}/switch", self._c_switch)
        ctl.router.add_post("/control/workers/{worker}/release", self._c_release)
        host = s.control_host if s.control_token else "127.0.0.1"
        self.control_port = await self._serve(ctl, host, s.control_port)
        return self

    async def _serve(self, app: web.Application, host: str = "", port: int = 0,
                     sock: socket.socket | None = None) -> int:
        runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await runner.setup()
        site: web.BaseSite
        if sock is not None:
            site = web.SockSite(runner, sock, backlog=1024)
        else:
            site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
        await site.start()
        self._runners.append(runner)
        self._sites.append(site)
        return runner.addresses[0][1]

    async def stop(self) -> None:
        if self._drain_task is not None and not self._drain_task.done():
            self._drain_task.cancel()
        for r in self._runners:
            for h in r.server.connections if r.server is not None else ():
                h.force_close()  # nothing left to wait for (drained, or told to go)
            await r.cleanup()
        self._runners.clear()
        self._sites.clear()
        if self.core is not None:
            self.core.close()
        if self._listen_sock is not None:
            self._listen_sock.close()
        if self.upstream is not None:
            await self.upstream.close()

    # ---- restarts: persisted table, graceful hand-over -------------------------------
    def persist(self) -> None:
        """Write the table after a control-API change (no-op without `state_file`)."""
        path = self.settings.state_file
        if path is None:
            return
        try:
            state_io.save(path, self.table, self.tokenizers.paths)
        except OSError as e:
            log.warning("router state %s not written: %s", path, e)

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
            while time.monotonic() < self._drain_deadline:
                self._follow_state()
                now = time.monotonic()
                conns = [h for r in self._runners if r.server is not None
                         for h in r.server.connections]
                if not conns:
                    break
                for h in conns:
                    busy = h._request_in_progress or bool(h._messages)  # type: ignore[attr-defined]
                    count = h._request_count  # type: ignore[attr-defined]
                    seen = idle.get(h)
                    if busy or seen is None or seen[0] != count:
                        idle[h] = (count, now)
                    elif now - seen[1] >= s.drain_idle_close_s:
                        h.force_close()  # an idle keep-alive connection
                idle = {h: v for h, v in idle.items() if h in conns}
                await asyncio.sleep(0.1)
            log.warning("drained")
        finally:
            self._drained.set()

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
        deadline = time.monotonic() + 10.0
        while True:
            try:
                async with self.upstream.session.request(request.method, url, data=body or None,
                                                         headers=hdrs) as r:
                    out = web.Response(status=r.status, body=await r.read(),
                                       content_type=r.content_type)
                break
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as e:
                if time.monotonic() > deadline:
                    raise RouterError(503, f"router restarting: {e}", code="router_restarting",
                                      type="server_error") from None
                await asyncio.sleep(0.05)
        self._follow_state(force=True)
        return out

    async def __aenter__(self) -> "RouterServer":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

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

    # ---- control API -----------------------------------------------------------------
    @web.middleware
    async def _auth(self, request: web.Request, handler):
        token = self.settings.control_token
        if token:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                raise errors.unauthorized()
        return await handler(request)

    async def _json(self, request: web.Request) -> dict:
        try:
            body = await request.json() if request.can_read_body else {}
        except (ValueError, RecursionError) as e:
            raise errors.bad_request(f"Malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise errors.bad_request("The request body must be a JSON object.", code="invalid_json")
        return body

    def _worker(self, request: web.Request):
        w = request.match_info["worker"]
        try:
            self.table.get(w)
        except KeyError:
            raise RouterError(404, f"Unknown worker `{w}`.", code="worker_not_found",
                              param="worker") from None
        return w

    async def _c_list(self, request: web.Request) -> web.Response:
        return web.json_response(self.table.snapshot())

    async def _c_add(self, request: web.Request) -> web.Response:
        b = await self._json(request)
        for k in ("worker_id", "model", "url"):
            if not isinstance(b.get(k), str) or not b[k]:
                raise errors.bad_request(f"Missing required parameter: '{k}'.",
                                         code="missing_required_parameter", param=k)
        if not b["url"].startswith(("http://", "https://")):
            raise errors.bad_request("url must start with http:// or https://", param="url")
        tok = b.get("tokenizer")
        if tok is not None:
            why = (TokenizerRegistry.check_path(tok) if isinstance(tok, str) and tok
                   else "tokenizer must be a path")
            if why:
                raise errors.bad_request(f"tokenizer: {why}", param="tokenizer")
        engine = b.get("engine")
        if engine is not None:
            try:
                engine = RouterEngine(engine).value
            except ValueError as e:
                raise errors.bad_request(str(e), param="engine") from None
        try:
            r = self.table.add(b["worker_id"], b["model"], b["url"], engine)
        except ValueError as e:
            raise RouterError(409, str(e), code="conflict") from None
        if tok:
            self.tokenizers.register(b["model"], tok)
            # loaded now, off the event loop, not at the first splice
            await asyncio.to_thread(self.tokenizers.load, b["model"])
        self.persist()
        return web.json_response(r.info())

    async def _c_remove(self, request: web.Request) -> web.Response:
        info = self.table.remove(self._worker(request)).info()
        self.persist()
        return web.json_response(info)

    async def _c_hold(self, request: web.Request) -> web.Response:
        info = self.table.hold(self._worker(request))
        self.persist()
        return web.json_response(info)

    async def _c_switch(self, request: web.Request) -> web.Response:
        w = self._worker(request)
        b = await self._json(request)
        ep = b.get("endpoint")
        if not isinstance(ep, str) or not ep.startswith(("http://", "https://")):
            raise errors.bad_request("Missing or invalid 'endpoint' (http[s]://host:port).",
                                     param="endpoint")
        release = b.get("release", True)
        if not isinstance(release, bool):  # "false" must not read as true
            raise errors.bad_request(f"'release' must be true or false, not {release!r}.", param="release")
        info = self.table.switch(w, ep, release=release)
        self.persist()
        return web.json_response(info)

    async def _c_release(self, request: web.Request) -> web.Response:
        info = self.table.release(self._worker(request))
        self.persist()
        return web.json_response(info)


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
