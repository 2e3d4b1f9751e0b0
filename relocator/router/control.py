"""The control API (`/control/...`) over aiohttp, the same in every shell: the standalone
router, the LiteLLM plugin and the endpoint picker each serve it on their `RouterRuntime`, so
the controller moves a worker's traffic the same way whatever gateway fronts it."""

from __future__ import annotations

import asyncio
import hmac
import socket
import time
from typing import Callable

from aiohttp import web

from . import catchup, errors
from .config import RouterEngine
from .errors import RouterError
from .runtime import RouterRuntime
from .tokenizers import TokenizerRegistry


def error_response(e: RouterError) -> web.Response:
    return web.Response(status=e.status, body=e.json_body(), content_type="application/json")


@web.middleware
async def openai_errors(request: web.Request, handler):
    """RouterErrors and aiohttp's own 4xx as OpenAI-shaped JSON."""
    try:
        return await handler(request)
    except RouterError as e:
        return error_response(e)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status, "http_error")
        return error_response(RouterError(e.status, e.reason or "error", code=code))


class ControlAPI:
    """Handlers for the routing table of `rt`: list, add, remove, hold, switch, release, a
    worker's streams in flight, and whether the router reaches it. Every
    change is persisted (`rt.persist`)."""

    def __init__(self, rt: RouterRuntime) -> None:
        self.rt = rt

    def app(self, outer: tuple = (), inner: tuple = ()) -> web.Application:
        """The aiohttp application; `outer` middlewares run before the error/auth ones,
        `inner` after them (the standalone router's draining hooks)."""
        a = web.Application(middlewares=[*outer, openai_errors, self._auth, *inner],
                            client_max_size=1 << 20)
        a.router.add_get("/control/replicas", self.list)
        a.router.add_post("/control/replicas", self.add)
        a.router.add_delete("/control/replicas/{worker}", self.remove)
        a.router.add_post("/control/workers/{worker}/hold", self.hold)
        a.router.add_post("/control/workers/{worker}/switch", self.switch)
        a.router.add_post("/control/workers/{worker}/release", self.release)
        a.router.add_get("/control/workers/{worker}/streams", self.streams)
        a.router.add_get("/control/workers/{worker}/reach", self.reach)
        return a

    def host(self) -> str:
        """Where to listen: loopback unless a token protects the API."""
        s = self.rt.settings
        return s.control_host if s.control_token else "127.0.0.1"

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        token = self.rt.settings.control_token
        if token:
            got = request.headers.get("Authorization", "")
            if not hmac.compare_digest(got.encode(), f"Bearer {token}".encode()):
                raise errors.unauthorized()
        return await handler(request)

    @staticmethod
    async def _json(request: web.Request) -> dict:
        try:
            body = await request.json() if request.can_read_body else {}
        except (ValueError, RecursionError) as e:
            raise errors.bad_request(f"Malformed JSON body: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise errors.bad_request("The request body must be a JSON object.", code="invalid_json")
        return body

    def _worker(self, request: web.Request) -> str:
        w = request.match_info["worker"]
        try:
            self.rt.table.get(w)
        except KeyError:
            raise RouterError(404, f"Unknown worker `{w}`.", code="worker_not_found",
                              param="worker") from None
        return w

    async def list(self, request: web.Request) -> web.Response:
        return web.json_response(self.rt.table.snapshot())

    async def add(self, request: web.Request) -> web.Response:
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
        gpus = b.get("gpus")
        if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, (int, float)) or not gpus > 0):
            raise errors.bad_request("gpus must be a number > 0 (whole GPUs, or a share of one such as 0.25)",
                                     param="gpus")
        try:
            r = self.rt.table.add(b["worker_id"], b["model"], b["url"], engine, gpus)
        except ValueError as e:
            raise RouterError(409, str(e), code="conflict") from None
        if tok:
            self.rt.tokenizers.register(b["model"], tok)
            # loaded now, off the event loop, not at the first splice
            await asyncio.to_thread(self.rt.tokenizers.load, b["model"])
        self.rt.persist()
        return web.json_response(r.info())

    async def remove(self, request: web.Request) -> web.Response:
        info = self.rt.table.remove(self._worker(request)).info()
        self.rt.persist()
        return web.json_response(info)

    async def hold(self, request: web.Request) -> web.Response:
        info = self.rt.table.hold(self._worker(request))
        self.rt.persist()
        return web.json_response(info)

    async def switch(self, request: web.Request) -> web.Response:
        w = self._worker(request)
        b = await self._json(request)
        ep = b.get("endpoint")
        if not isinstance(ep, str) or not ep.startswith(("http://", "https://")):
            raise errors.bad_request("Missing or invalid 'endpoint' (http[s]://host:port).",
                                     param="endpoint")
        release = b.get("release", True)
        if not isinstance(release, bool):  # "false" must not read as true
            raise errors.bad_request(f"'release' must be true or false, not {release!r}.",
                                     param="release")
        keep = b.get("keep_inexact", False)
        if not isinstance(keep, bool):
            raise errors.bad_request(f"'keep_inexact' must be true or false, not {keep!r}.",
                                     param="keep_inexact")
        cut_from = b.get("cut_from")
        if cut_from is not None and not isinstance(cut_from, str):
            raise errors.bad_request("'cut_from' must be an endpoint (http[s]://host:port).", param="cut_from")
        at_token = b.get("at_token", False)
        if not isinstance(at_token, bool):
            raise errors.bad_request(f"'at_token' must be true or false, not {at_token!r}.", param="at_token")
        rounds = b.get("catch_up_rounds", 0)
        if not isinstance(rounds, int) or isinstance(rounds, bool) or not 0 <= rounds <= catchup.MAX_ROUNDS:
            raise errors.bad_request(f"'catch_up_rounds' must be an integer 0-{catchup.MAX_ROUNDS}, "
                                     f"not {rounds!r}.", param="catch_up_rounds")
        caught = None
        if rounds and self.rt.core is not None:  # a handoff: the target's last prefill, then the cut
            self.rt.table.get(w)  # 404 before any work
            caught = await catchup.catch_up(self.rt.core, w, ep, rounds)
        info = self.rt.table.switch(w, ep, release=release, keep_inexact=keep, cut_from=cut_from, at_token=at_token)
        if caught is not None:
            info["catch_up"] = caught
        self.rt.persist()
        return web.json_response(info)

    async def streams(self, request: web.Request) -> web.Response:
        """The worker's streams in flight: prompt ids, ids sent, why a continuation would be
        inexact (a handoff's warm-up prefills the target from them)."""
        return web.json_response({"streams": self.rt.table.streams(self._worker(request))})

    async def reach(self, request: web.Request) -> web.Response:
        """Whether this router reaches the worker's endpoint now (its /health within `timeout_s`,
        default 2, at most 30): a handoff checks the target copy from where the clients' traffic
        goes before it stops the source (a copy alive to its agent may still be cut off from here)."""
        w = self._worker(request)
        raw = request.query.get("timeout_s", "2")
        try:
            timeout = float(raw)
        except ValueError:
            timeout = -1.0
        if not 0 < timeout <= 30:
            raise errors.bad_request(f"'timeout_s' must be a number of seconds in (0, 30], not {raw!r}.",
                                     param="timeout_s")
        url = self.rt.table.get(w).endpoint
        if self.rt.upstream is None:
            raise RouterError(503, "The router's upstream pool is not open yet; retry later.",
                              type="service_unavailable", code="not_ready")
        t0 = time.monotonic()
        ok = await self.rt.upstream.health(url, timeout)
        return web.json_response({"worker": w, "endpoint": url, "reachable": bool(ok),
                                  "seconds": round(time.monotonic() - t0, 4)})

    async def release(self, request: web.Request) -> web.Response:
        info = self.rt.table.release(self._worker(request))
        self.rt.persist()
        return web.json_response(info)


async def serve_app(app: web.Application, host: str = "", port: int = 0,
                    sock: socket.socket | None = None,
                    on_started: Callable[[web.AppRunner, web.BaseSite], None] | None = None) -> int:
    """Serve `app` (handler cancellation on, no access log); returns the bound port."""
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site: web.BaseSite
    if sock is not None:
        site = web.SockSite(runner, sock, backlog=1024)
    else:
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    if on_started is not None:
        on_started(runner, site)
    return runner.addresses[0][1]
