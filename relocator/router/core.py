"""The transport-agnostic router core.

A front end (the aiohttp server here; an Envoy ext_proc service or another proxy elsewhere)
gives `RouterCore.handle()` the request path kind and raw body and gets back a `Unary` or a
`Stream` (an async iterator of bytes to write). The core does parsing and validation,
replica selection (policies, hold queue), retries before the first byte, and stream
continuation across a switch or a broken upstream. I/O to the engines goes through the
`Upstream` protocol, so tests can use fakes."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Mapping

from adapters.base import DEFAULT_ENGINE, get_codec
from adapters.codec import ContinuationCodec, Kind

from . import errors, fanout
from .engine_calls import EngineCalls
from .engine_errors import Failures
from .errors import RouterError
from .stream import DONE, StreamState
from .suspect import Patience, Suspects
from .table import Replica, ReplicaState, RoutingTable, StreamHandle
from .tokenizers import TokenizerRegistry
from .transport import Hooks, Probe, Stream, Unary, Upstream, UpstreamError, UpstreamResponse
from .validate import check_required, parse_body  # parse_body: re-exported (gateways, tests)

log = logging.getLogger(__name__)

PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


class _Moved(Exception):
    pass


@dataclass
class _Try:
    """One attempt at a replica: `out` when it answered, else why not (`moved`: the worker
    moved meanwhile, ask again at its new place; `wait`: unreachable and held, wait for its
    switch or release; otherwise `error`: unreachable, go on to another)."""

    handle: StreamHandle
    out: Any = None
    moved: bool = False
    wait: bool = False
    error: Exception | None = None


# ---------------------------------------------------------------------- the core
class RouterCore:
    def __init__(self, table: RoutingTable, upstream: Upstream, *,
                 engine: str = DEFAULT_ENGINE, max_body_bytes: int = 4 << 20,
                 retries: int = 2, max_continuations: int = 8, continuation: bool = True,
                 hooks: Hooks | None = None, unreachable_hold_s: float = 0.0,
                 probe: Probe | None = None, probe_interval_s: float = 0.5,
                 tokenizers: TokenizerRegistry | None = None) -> None:
        self.table = table
        #: per model: the tokenizer continued streams' text is made with
        self.tokenizers = tokenizers if tokenizers is not None else TokenizerRegistry()
        self.upstream = upstream
        self.calls = EngineCalls(lambda url, body: self.upstream.post(url, body), self.tokenizers)
        #: the engine of replicas registered without one
        self.engine = engine
        self._codecs: dict[str, ContinuationCodec] = {}
        self.max_body_bytes = max_body_bytes
        self.retries = retries
        self.max_continuations = max_continuations
        self.continuation = continuation
        self.hooks = hooks or Hooks()
        self.suspects = Suspects(table, self.hooks, unreachable_hold_s,
                                 probe if probe is not None else getattr(upstream, "health", None),
                                 probe_interval_s)
        self.failures = Failures(table, self.hooks)

    # ---- the suspect holds (router/suspect.py) ------------------------------------------
    @property
    def unreachable_hold_s(self) -> float:
        """0 = off: a request to an unreachable sole replica fails at once (502)."""
        return self.suspects.hold_s

    @unreachable_hold_s.setter
    def unreachable_hold_s(self, v: float) -> None:
        self.suspects.hold_s = v

    def codec(self, r: Replica) -> ContinuationCodec:
        """The continuation codec of `r`'s engine."""
        name = r.engine or self.engine
        c = self._codecs.get(name)
        if c is None:
            c = self._codecs[name] = get_codec(name)
        return c

    def close(self) -> None:
        """Stop the suspect-hold watchers (the holds stay as they are)."""
        self.suspects.close()

    # ---- entry point -------------------------------------------------------------------
    async def handle(self, kind: Kind, raw: bytes,
                     headers: Mapping[str, str] | None = None) -> Unary | Stream:
        t0 = time.perf_counter()
        if len(raw) > self.max_body_bytes:
            raise errors.body_too_large(self.max_body_bytes)
        body = parse_body(raw, self.table)
        model = body["model"]
        check_required(kind, body)
        key = self.affinity_key(body, headers) if self.table.policy.needs_key else None
        if body.get("stream") is True:
            return await self._stream(kind, raw, body, model, key, t0)
        return await self._unary(kind, raw, model, key, t0)

    @staticmethod
    def affinity_key(body: dict, headers: Mapping[str, str] | None) -> str | None:
        if headers:
            for h in ("x-session-id", "X-Session-Id"):
                if h in headers:
                    return "s:" + headers[h]
        if isinstance(body.get("user"), str):
            return "u:" + body["user"]
        p = body.get("prompt")
        if p is None and isinstance(body.get("messages"), list):
            p = json.dumps(body["messages"][:2], sort_keys=True)
        if isinstance(p, list):
            p = json.dumps(p[:64])
        return "p:" + p[:256] if isinstance(p, str) and p else None

    # ---- one attempt: register, send, classify --------------------------------------------
    async def _attempt(self, r: Replica, model: str, failed: list[str], patience: Patience,
                       send: Callable[[Replica, StreamHandle], Awaitable[Any]]) -> _Try:
        """Register a request to `r`, `send(r, handle)` it and classify what happened (an
        unreachable `r` that is not waited for joins `failed`). `r` is left unless `send`
        returned: then the caller leaves it (`_leave`) when done with it."""
        handle = StreamHandle(r.worker_id)
        self.table.register(r, handle)
        self.hooks.in_flight(r.worker_id, 1)
        ok = False
        try:
            out = await send(r, handle)
            ok = True
            return _Try(handle, out)
        except _Moved:
            return _Try(handle, moved=True)
        except UpstreamError as e:
            if self.suspects.unreachable(r, handle, model, failed, patience):
                return _Try(handle, wait=True, error=e)  # acquire / wait_for finds it held
            failed.append(r.worker_id)
            self.hooks.retried()
            return _Try(handle, error=e)
        finally:
            if not ok:
                self._leave(r, handle)

    def _leave(self, r: Replica, handle: StreamHandle) -> None:
        self.table.unregister(r, handle)
        self.table.done(r)
        self.hooks.in_flight(r.worker_id, -1)

    # ---- upstream I/O with abort hooks ---------------------------------------------------
    async def _open(self, r: Replica, handle: StreamHandle, path: str,
                    body: bytes) -> UpstreamResponse:
        handle.endpoint = r.endpoint
        task = asyncio.ensure_future(self.upstream.post(r.endpoint + path, body))
        handle.abort = task.cancel
        try:
            resp = await task
        except asyncio.CancelledError:
            if handle.moved and not _cancelling():
                raise _Moved() from None
            task.cancel()
            raise
        handle.abort = resp.close
        if handle.moved:
            resp.close()
            raise _Moved()
        return resp

    @staticmethod
    async def _read(resp: UpstreamResponse, handle: StreamHandle) -> bytes:
        """The whole body of `resp`; _Moved if the worker moved meanwhile."""
        rtask = asyncio.ensure_future(resp.read())
        handle.abort = rtask.cancel
        try:
            data = await rtask
        except asyncio.CancelledError:
            resp.close()
            if handle.moved and not _cancelling():
                raise _Moved() from None
            raise
        if handle.moved:
            raise _Moved()
        return data

    # ---- non-streaming -------------------------------------------------------------------
    async def _unary(self, kind: Kind, raw: bytes, model: str, key: str | None,
                     t0: float) -> Unary:
        path = PATHS[kind]
        tried: list[str] = []
        moves = 0
        last: Exception | None = None
        patience = Patience()

        async def send(r: Replica, handle: StreamHandle) -> tuple[UpstreamResponse, bytes]:
            resp = await self._open(r, handle, path, raw)
            return resp, await self._read(resp, handle)

        while len(tried) <= self.retries and moves <= self.max_continuations:
            r = await self.table.acquire(model, key, exclude=tried)
            t = await self._attempt(r, model, tried, patience, send)
            if t.out is None:
                moves += t.moved  # the worker moved while we waited: ask again, at its new place
                last = t.error or last
                continue
            resp, data = t.out
            if self.failures.answered(model, r.worker_id, resp.status, [], tried,
                                      len(tried) < self.retries):
                self._drop(r, t.handle, resp)
                continue
            self._leave(r, t.handle)
            self.hooks.ttfb(time.perf_counter() - t0)
            self.hooks.request_done(r.worker_id, resp.status)
            return Unary(resp.status, data, resp.content_type or "application/json")
        raise errors.upstream_unavailable(f"No replica of `{model}` answered: {last}")

    # ---- streaming -----------------------------------------------------------------------
    async def _stream(self, kind: Kind, raw: bytes, body: dict, model: str, key: str | None,
                      t0: float) -> Unary | Stream:
        if self.continuation and fanout.wants_fan_out(kind, body):
            return await self._fan_out(kind, body, model, key, t0)
        st = StreamState(kind, body, raw, continuation=self.continuation)
        path = PATHS[kind]
        tried: list[str] = []
        shun: list[str] = []  # replicas whose engine failed this request: not again
        last: Exception | None = None
        patience = Patience()

        async def send(r: Replica, handle: StreamHandle) -> UpstreamResponse:
            handle.stream = st  # a handoff lists its progress (RoutingTable.streams)
            # the replica's engine frames the stream
            p, data = await self._first_request(st, r, model, path)
            return await self._open(r, handle, p, data)

        while len(tried) <= self.retries:
            r = await self.table.acquire(model, key, exclude=tried)
            t = await self._attempt(r, model, tried, patience, send)
            if t.out is None:
                last = t.error or last
                continue
            if t.out.status != 200:
                if self.failures.answered(model, r.worker_id, t.out.status, shun, tried,
                                          len(tried) < self.retries):
                    self._drop(r, t.handle, t.out)
                    continue
                return await self._refused(r, t.handle, t.out)
            return Stream(self._pump(st, model, path, r, t.handle, t.out, t0, shun, patience))
        raise errors.upstream_unavailable(f"No replica of `{model}` answered: {last}")

    def _drop(self, r: Replica, handle: StreamHandle, resp: UpstreamResponse) -> None:
        resp.close()
        self._leave(r, handle)

    async def _refused(self, r: Replica, handle: StreamHandle,
                       resp: UpstreamResponse) -> Unary:
        """The engine refused the stream before its first byte: its answer, as it is."""
        try:
            data = await resp.read()
        except UpstreamError as e:
            data = errors.upstream_unavailable(str(e)).json_body()
        finally:
            resp.close()
            self._leave(r, handle)
        self.hooks.request_done(r.worker_id, resp.status)
        return Unary(resp.status, data, resp.content_type or "application/json")

    async def _fan_out(self, kind: Kind, body: dict, model: str, key: str | None,
                       t0: float) -> Unary | Stream:
        """`n > 1`: one stream per choice, each continued on its own when its worker moves,
        merged into the client's one stream (router/fanout.py)."""
        subs = fanout.part_bodies(body)
        got = await asyncio.gather(*(self._stream(kind, json.dumps(sub).encode(), sub, model,
                                                  key, t0) for sub in subs),
                                   return_exceptions=True)
        streams = [g for g in got if isinstance(g, Stream)]
        refused = next((g for g in got if not isinstance(g, Stream)), None)
        if refused is not None:  # one part was refused before any byte: so is the request
            for s in streams:
                await s.chunks.aclose()  # type: ignore[attr-defined]
            if isinstance(refused, BaseException):
                raise refused
            return refused
        return Stream(fanout.merged(body, [s.chunks for s in streams]))  # type: ignore[misc]

    async def _pump(self, st: StreamState, model: str, path: str, r: Replica,
                    handle: StreamHandle, resp: UpstreamResponse, t0: float, shun: list[str],
                    patience: Patience | None = None) -> AsyncIterator[bytes]:
        patience = patience or Patience()
        status = 200
        left = False  # r was left (a failed reopen): not again
        try:
            while True:
                async for out in self._relay(st, handle, resp, t0):
                    yield out
                if st.done or st.cut:  # cut sets done
                    return
                if st.finished:
                    yield st.tail_after_finish()
                    return
                # ---- the upstream broke (worker moved or died) before the end --------
                outcome, refusal = self._after_break(st)
                if st.engine_error is not None:  # a failed engine (router/engine_errors.py)
                    failure, st.engine_error = st.engine_error, None
                    refusal = self.failures.in_stream(model, r.worker_id, shun, failure,
                                                      len(st.sent_ids), refusal)
                if refusal is not None:
                    status = 599
                    yield refusal
                    return
                moved = handle.moved
                self._leave(r, handle)
                left = True
                r, handle, resp = await self._reopen(st, model, path, r, moved, outcome,
                                                     patience, shun)
                left = False
                if outcome == "continued":
                    self.hooks.continued("ok")
        except RouterError as e:
            status = e.status
            if not st.sent_any:
                raise
            yield e.sse_event()
        finally:
            resp.close()
            if not left:
                self._leave(r, handle)
            self.hooks.request_done(r.worker_id, status)
            if st.splices:
                self.hooks.stream_spliced(sorted(set(st.splices)))

    async def _relay(self, st: StreamState, handle: StreamHandle, resp: UpstreamResponse,
                     t0: float) -> AsyncIterator[bytes]:
        """What one upstream response gives the client, until it ends or breaks (then
        closed); the TTFB is taken at the stream's first byte."""
        try:
            async for data in resp.chunks():
                was_silent = not st.sent_any
                out = st.feed(data)
                if out:
                    if was_silent:
                        self.hooks.ttfb(time.perf_counter() - t0)
                    yield out
                if st.done or st.engine_error is not None:  # the end, or a failed engine
                    break
                if out and handle.cut_due:  # a switch at_token: cut right after this token
                    handle.cut_due = False
                    break
        except UpstreamError:
            pass
        except asyncio.CancelledError:
            if not (handle.moved and not _cancelling()):
                raise
        resp.close()

    def _after_break(self, st: StreamState) -> tuple[str, bytes | None]:
        """How a stream broken before its end goes on: ("retry" | "continued", None), or
        (_, the error event that ends it)."""
        if not st.sent_any:
            return "retry", None
        if not st.track:
            self.hooks.continued("impossible")
            return "", errors.continuation_failed(
                f"The upstream stream broke and cannot be continued "
                f"({st.unsupported}).").sse_event()
        if st.legs >= self.max_continuations:
            self.hooks.continued("too_many")
            return "", errors.continuation_failed("Too many continuations.").sse_event()
        return "continued", None

    async def _reopen(self, st: StreamState, model: str, path: str, prev: Replica,
                      moved: bool, outcome: str, patience: Patience, shun: list[str]):
        """Find where the stream broken on `prev` (left already) goes on, open the
        continuation there; (replica, handle, response)."""
        attempts = 0
        last: Exception | None = None
        failed: list[str] = []

        async def send(r: Replica, handle: StreamHandle) -> UpstreamResponse:
            handle.stream = st
            if outcome == "retry":
                p, data = await self._first_request(st, r, model, path)
            else:
                p, req = await self._continuation_request(st, r, model)
                data = json.dumps(req).encode()
            return await self._open(r, handle, p, data)

        while attempts <= self.retries:
            attempts += 1
            r = await self._next_replica(model, prev, moved, shun)
            t = await self._attempt(r, model, failed, patience, send)
            if t.out is None:
                last = t.error or last
                if t.moved or t.wait:
                    attempts -= 1  # the next turn waits for its switch or release
                prev, moved = r, t.moved or (t.wait and t.handle.moved)
                continue
            if self.failures.answered(model, r.worker_id, t.out.status, shun, None,
                                      attempts <= self.retries):
                self._drop(r, t.handle, t.out)
                prev, moved = r, False
                continue
            if t.out.status != 200:
                raise await self._continuation_refused(r, t.handle, t.out)
            if outcome != "retry":
                st.begin_continuation(self.codec(r))
                self.hooks.splice(st.splice_at)
            return r, t.handle, t.out
        raise errors.continuation_failed(f"No replica of `{model}` could continue the stream: "
                                         f"{last}")

    async def _next_replica(self, model: str, prev: Replica, moved: bool,
                            shun: list[str] | None = None) -> Replica:
        """Where a stream broken on `prev` goes on: an active sibling while `prev` is held (cut
        at the hold, or broken during the freeze: RoutingTable.hold), else the same worker at its
        new endpoint (it moved, or died while held: wait for its switch), else another replica."""
        if prev.worker_id in _ids(self.table.replicas(model)) and \
                (moved or prev.state is ReplicaState.HELD) and not \
                (prev.state is ReplicaState.HELD and self.table.active_sibling(prev)):
            return await self.table.wait_for(prev)
        return await self.table.acquire(model, None, exclude=[prev.worker_id, *(shun or ())])

    async def _continuation_refused(self, r: Replica, handle: StreamHandle,
                                    resp: UpstreamResponse) -> RouterError:
        try:
            detail = (await resp.read())[:500].decode(errors="replace")
        except UpstreamError:
            detail = ""
        resp.close()
        self._leave(r, handle)
        return errors.continuation_failed(
            f"Continuation request refused by {r.worker_id}: {resp.status} {detail}")

    async def _first_request(self, st: StreamState, r: Replica, model: str, path: str) -> tuple[str, bytes]:
        """(path, body) of the stream's first request to `r` (again, after a retry). A stream
        that the engine sends without token ids (`codec.translates`: SGLang's chat) goes out
        as a continuation from its first token, on the prompt ids the engine renders."""
        codec = self.codec(r)
        if st.continuation and codec.translates(st.kind, st.body):
            prompt = await self.calls.prompt_ids(r, codec, st)
            if prompt is not None:
                tok = await self.calls.tokenizer(r, codec, model, prompt)
                st.use_translated(codec, prompt, tok)
                p, req = codec.continuation_request(st.kind, st.body, prompt, [],
                                                    text_by_router=st.text is not None)
                return p, json.dumps(req).encode()
        return path, st.use(codec)

    async def _continuation_request(self, st: StreamState, r: Replica, model: str):
        prompt = st.prompt_ids
        if prompt is None:
            raise errors.continuation_failed("The stream broke before the engine reported the "
                                             "prompt's token ids.")
        sent = st.sent_ids
        codec = self.codec(r)
        if st.legs == 0:
            st.make_text(await self.calls.tokenizer(r, codec, model, sent))
        self._report_inexact(st, codec.inexact_reasons(st.kind, st.body, sent))
        return codec.continuation_request(st.kind, st.body, prompt, sent,
                                          text_by_router=st.text is not None)

    def _report_inexact(self, st: StreamState, reasons: list[str]) -> None:
        """A continuation that may not give the uninterrupted run's tokens is counted and
        logged, never silent (docs/router.md, "What a continuation keeps")."""
        for why in reasons:
            if why not in st.inexact:
                st.inexact.append(why)
                self.hooks.continuation_inexact(why)
        if reasons:
            log.info("stream continued inexactly after %d tokens: %s", len(st.sent_ids),
                     ", ".join(reasons))

    def models_body(self) -> bytes:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "relocator",
                 "root": m, "parent": None} for m in self.table.models()]
        return json.dumps({"object": "list", "data": data}).encode()


def _ids(reps: list[Replica]) -> set[str]:
    return {x.worker_id for x in reps}


def _cancelling() -> int:
    t = asyncio.current_task()
    return t.cancelling() if t is not None else 0


__all__ = ["RouterCore", "Upstream", "UpstreamResponse", "UpstreamError", "Unary", "Stream",
           "Hooks", "DONE"]
