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
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Mapping, Protocol

from adapters.base import DEFAULT_ENGINE, get_codec
from adapters.codec import ContinuationCodec, Kind

from . import errors, fanout
from .errors import RouterError
from .stream import DONE, StreamState
from .tokenizers import TokenizerRegistry
from .table import Replica, ReplicaState, RoutingTable, StreamHandle

log = logging.getLogger(__name__)

PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


# ---------------------------------------------------------------------- transport protocol
class UpstreamError(Exception):
    """The upstream could not be reached or its connection broke."""


class UpstreamResponse(Protocol):
    status: int
    content_type: str

    async def read(self) -> bytes: ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    def close(self) -> None: ...


class Upstream(Protocol):
    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        """Send a JSON POST; return once status and headers are in. Raise UpstreamError."""

    # Optional: `async def health(self, endpoint: str, timeout_s: float) -> bool` (GET
    # {endpoint}/health answered 200). Used to end a suspect hold early (RouterCore `probe`).


#: async (endpoint, timeout_s) -> healthy?
Probe = Callable[[str, float], Awaitable[bool]]


@dataclass
class Unary:
    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass
class Stream:
    chunks: AsyncIterator[bytes]
    status: int = 200
    headers: dict = field(default_factory=lambda: {"Content-Type": "text/event-stream"})


class Hooks:
    """Metric callbacks; the default does nothing (the server plugs Prometheus in)."""

    def request_done(self, worker: str, status: int) -> None: ...
    def ttfb(self, seconds: float) -> None: ...
    def in_flight(self, worker: str, delta: int) -> None: ...
    def continued(self, outcome: str) -> None: ...
    def splice(self, at: str) -> None: ...
    def stream_spliced(self, kinds: list[str]) -> None: ...
    def continuation_inexact(self, reason: str) -> None: ...
    def retried(self) -> None: ...
    def suspect_hold(self, worker: str) -> None: ...
    def suspect_end(self, worker: str, outcome: str) -> None: ...


class _Moved(Exception):
    pass


class _Patience:
    """One request's budget for waiting on unreachable workers: it starts suspect waits only
    within `unreachable_hold_s` of its first one (a worker whose /health answers but whose API
    does not cannot keep a request looping)."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def allows(self, limit: float) -> bool:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        return now - self.since < limit


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
        self._tokenizer_checked: set[str] = set()
        self.upstream = upstream
        #: the engine of replicas registered without one
        self.engine = engine
        self._codecs: dict[str, ContinuationCodec] = {}
        self.max_body_bytes = max_body_bytes
        self.retries = retries
        self.max_continuations = max_continuations
        self.continuation = continuation
        self.hooks = hooks or Hooks()
        #: 0 = off: a request to an unreachable sole replica fails at once (502)
        self.unreachable_hold_s = unreachable_hold_s
        self.probe: Probe | None = probe if probe is not None else getattr(upstream, "health",
                                                                              None)
        self.probe_interval_s = probe_interval_s
        self._watchers: set[asyncio.Task] = set()

    def codec(self, r: Replica) -> ContinuationCodec:
        """The continuation codec of `r`'s engine."""
        name = r.engine or self.engine
        c = self._codecs.get(name)
        if c is None:
            c = self._codecs[name] = get_codec(name)
        return c

    def close(self) -> None:
        """Stop the suspect-hold watchers (the holds stay as they are)."""
        for t in list(self._watchers):
            t.cancel()

    # ---- entry point -------------------------------------------------------------------
    async def handle(self, kind: Kind, raw: bytes,
                     headers: Mapping[str, str] | None = None) -> Unary | Stream:
        t0 = time.perf_counter()
        if len(raw) > self.max_body_bytes:
            raise errors.body_too_large(self.max_body_bytes)
        body = parse_body(raw, self.table)
        model = body["model"]
        if kind == "chat" and not isinstance(body.get("messages"), list):
            raise errors.bad_request("Missing required parameter: 'messages'.",
                                     code="missing_required_parameter", param="messages")
        if kind == "completions" and "prompt" not in body:
            raise errors.bad_request("Missing required parameter: 'prompt'.",
                                     code="missing_required_parameter", param="prompt")
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

    # ---- upstream I/O with abort hooks ---------------------------------------------------
    async def _open(self, r: Replica, handle: StreamHandle, path: str,
                    body: bytes) -> UpstreamResponse:
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

    # ---- non-streaming -------------------------------------------------------------------
    async def _unary(self, kind: Kind, raw: bytes, model: str, key: str | None,
                     t0: float) -> Unary:
        path = PATHS[kind]
        tried: list[str] = []
        moves = 0
        last: Exception | None = None
        patience = _Patience()
        while len(tried) <= self.retries and moves <= self.max_continuations:
            r = await self.table.acquire(model, key, exclude=tried)
            handle = StreamHandle(r.worker_id)
            self.table.register(r, handle)
            self.hooks.in_flight(r.worker_id, 1)
            try:
                resp = await self._open(r, handle, path, raw)
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
            except _Moved:
                moves += 1  # the worker moved while we waited: ask again, at its new place
                continue
            except UpstreamError as e:
                last = e
                if self._unreachable(r, handle, model, tried, patience):
                    continue  # wait for it (acquire finds it held)
                tried.append(r.worker_id)
                self.hooks.retried()
                continue
            finally:
                self.table.unregister(r, handle)
                self.table.done(r)
                self.hooks.in_flight(r.worker_id, -1)
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
        last: Exception | None = None
        patience = _Patience()
        while True:
            if len(tried) > self.retries:
                raise errors.upstream_unavailable(f"No replica of `{model}` answered: {last}")
            r = await self.table.acquire(model, key, exclude=tried)
            handle = StreamHandle(r.worker_id)
            self.table.register(r, handle)
            self.hooks.in_flight(r.worker_id, 1)
            ok = False
            try:
                # the replica's engine frames the stream
                p, send = await self._first_request(st, r, model, path)
                resp = await self._open(r, handle, p, send)
                ok = True
            except _Moved:
                continue
            except UpstreamError as e:
                last = e
                if self._unreachable(r, handle, model, tried, patience):
                    continue  # wait for it (acquire finds it held)
                tried.append(r.worker_id)
                self.hooks.retried()
                continue
            finally:
                if not ok:
                    self._leave(r, handle)
            if resp.status != 200:
                try:
                    data = await resp.read()
                except UpstreamError as e:
                    data = errors.upstream_unavailable(str(e)).json_body()
                finally:
                    resp.close()
                    self._leave(r, handle)
                self.hooks.request_done(r.worker_id, resp.status)
                return Unary(resp.status, data, resp.content_type or "application/json")
            return Stream(self._pump(st, model, path, r, handle, resp, t0, patience))

    async def _fan_out(self, kind: Kind, body: dict, model: str, key: str | None,
                       t0: float) -> Unary | Stream:
        """`n > 1`: one stream per choice, each continued on its own when its worker moves,
        merged into the client's one stream (router/fanout.py)."""
        subs = fanout.part_bodies(body)
        got = await asyncio.gather(*(self._stream(kind, json.dumps(sub).encode(), sub, model, key, t0)
                                     for sub in subs), return_exceptions=True)
        streams = [g for g in got if isinstance(g, Stream)]
        refused = next((g for g in got if not isinstance(g, Stream)), None)
        if refused is not None:  # one part was refused before any byte: so is the request
            for s in streams:
                await s.chunks.aclose()  # type: ignore[attr-defined]
            if isinstance(refused, BaseException):
                raise refused
            return refused
        return Stream(fanout.merged(body, [s.chunks for s in streams]))  # type: ignore[misc]

    def _leave(self, r: Replica, handle: StreamHandle) -> None:
        self.table.unregister(r, handle)
        self.table.done(r)
        self.hooks.in_flight(r.worker_id, -1)

    async def _pump(self, st: StreamState, model: str, path: str, r: Replica,
                    handle: StreamHandle, resp: UpstreamResponse, t0: float,
                    patience: _Patience | None = None) -> AsyncIterator[bytes]:
        patience = patience or _Patience()
        first = True
        status = 200
        try:
            while True:
                try:
                    async for data in resp.chunks():
                        out = st.feed(data)
                        if out:
                            if first:
                                self.hooks.ttfb(time.perf_counter() - t0)
                                first = False
                            yield out
                        if st.done:
                            break
                except UpstreamError:
                    pass
                except asyncio.CancelledError:
                    if not (handle.moved and not _cancelling()):
                        raise
                resp.close()
                if st.done:
                    return
                if st.cut:  # pragma: no cover - cut sets done
                    return
                if st.finished:
                    yield st.tail_after_finish()
                    return
                # ---- the upstream broke (worker moved or died) before the end --------
                if not st.sent_any:
                    outcome = "retry"
                elif not st.track:
                    self.hooks.continued("impossible")
                    status = 599
                    yield errors.continuation_failed(
                        f"The upstream stream broke and cannot be continued "
                        f"({st.unsupported}).").sse_event()
                    return
                elif st.legs >= self.max_continuations:
                    self.hooks.continued("too_many")
                    status = 599
                    yield errors.continuation_failed("Too many continuations.").sse_event()
                    return
                else:
                    outcome = "continued"
                r, handle, resp = await self._reopen(st, model, path, r, handle, outcome,
                                                     patience)
                if outcome == "continued":
                    self.hooks.continued("ok")
        except RouterError as e:
            status = e.status
            if not st.sent_any:
                raise
            yield e.sse_event()
        finally:
            resp.close()
            self._leave(r, handle)
            self.hooks.request_done(r.worker_id, status)
            if st.splices:
                self.hooks.stream_spliced(sorted(set(st.splices)))

    async def _reopen(self, st: StreamState, model: str, path: str, r: Replica,
                      handle: StreamHandle, outcome: str, patience: _Patience):
        """Leave the broken replica, find where to go on, open the continuation there."""
        moved = handle.moved
        self._leave(r, handle)
        prev = r
        attempts = 0
        last: Exception | None = None
        failed: list[str] = []
        while attempts <= self.retries:
            attempts += 1
            if moved and prev.worker_id in _ids(self.table.replicas(model)):
                r = await self.table.wait_for(prev)  # same worker, at its new endpoint
            elif prev.worker_id in _ids(self.table.replicas(model)) and \
                    prev.state.value == "held":
                r = await self.table.wait_for(prev)  # died while held: wait for its switch
            else:
                r = await self.table.acquire(model, None, exclude=[prev.worker_id])
            handle = StreamHandle(r.worker_id)
            self.table.register(r, handle)
            self.hooks.in_flight(r.worker_id, 1)
            try:
                if outcome == "retry":
                    p, body = await self._first_request(st, r, model, path)
                else:
                    p, req = await self._continuation_request(st, r, model)
                    body = json.dumps(req).encode()
                resp = await self._open(r, handle, p, body)
            except _Moved:
                self._leave(r, handle)
                prev, moved = r, True
                attempts -= 1
                continue
            except UpstreamError as e:
                self._leave(r, handle)
                last = e
                if self._unreachable(r, handle, model, failed, patience):
                    prev, moved = r, handle.moved
                    attempts -= 1  # held: the next turn waits for its switch or release
                    continue
                failed.append(r.worker_id)
                prev, moved = r, False
                self.hooks.retried()
                continue
            except BaseException:
                self._leave(r, handle)
                raise
            if resp.status != 200:
                try:
                    detail = (await resp.read())[:500].decode(errors="replace")
                except UpstreamError:
                    detail = ""
                resp.close()
                # keep r/handle registered: _pump's finally leaves them
                return_err = errors.continuation_failed(
                    f"Continuation request refused by {r.worker_id}: {resp.status} {detail}")
                self._leave(r, handle)
                raise return_err
            if outcome != "retry":
                st.begin_continuation(self.codec(r))
                self.hooks.splice(st.splice_at)
            return r, handle, resp
        raise errors.continuation_failed(f"No replica of `{model}` could continue the stream: "
                                         f"{last}")

    # ---- unreachable workers: hold them and wait for the control plane -------------------
    def _unreachable(self, r: Replica, handle: StreamHandle, model: str,
                     failed: list[str], patience: _Patience) -> bool:
        """`r` could not be reached. True: the caller waits for `r` as for a held worker
        (it was switched meanwhile, is already held, or is now suspect-held because no other
        active replica of `model`, other than those in `failed`, can take over); False: the
        caller goes on as before (sibling, retry, error)."""
        if self.unreachable_hold_s <= 0:
            return False
        if handle.moved:
            return True  # switched while we tried: try it again at its new endpoint
        if not patience.allows(self.unreachable_hold_s):
            return False
        t = self.table
        try:
            if t.get(r.worker_id) is not r:  # pragma: no cover - removed and re-added
                return False
        except KeyError:
            return False  # removed
        if any(x is not r and x.state is ReplicaState.ACTIVE and x.worker_id not in failed
               for x in t.replicas(model)):
            return False
        if r.state is ReplicaState.HELD:
            return True
        epoch = t.suspect_hold(r.worker_id)
        if epoch is None:  # pragma: no cover - checked above
            return True
        log.warning("worker %s (%s) unreachable: holding it for up to %gs", r.worker_id,
                    r.endpoint, self.unreachable_hold_s)
        self.hooks.suspect_hold(r.worker_id)
        task = asyncio.get_running_loop().create_task(self._watch_suspect(r, epoch))
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)
        return True

    async def _watch_suspect(self, r: Replica, epoch: int) -> None:
        """Until the suspect hold ends: probe the endpoint every `probe_interval_s` (healthy:
        release, the waiters retry it); after `unreachable_hold_s` fail the waiters with
        `worker_unreachable` and make the worker active again."""
        t = self.table
        deadline = time.monotonic() + self.unreachable_hold_s
        outcome = "control"  # switched, released, held or removed through the control API
        try:
            while t.is_suspect(r, epoch):
                left = deadline - time.monotonic()
                if left <= 0:
                    n = t.end_suspect(r, epoch, errors.worker_unreachable(
                        r.worker_id, self.unreachable_hold_s))
                    log.warning("worker %s still unreachable after %gs: %d waiters failed",
                                r.worker_id, self.unreachable_hold_s, n)
                    outcome = "timeout"
                    break
                await asyncio.sleep(min(self.probe_interval_s, left))
                if self.probe is None or not t.is_suspect(r, epoch):
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    continue
                try:
                    ok = await asyncio.wait_for(
                        self.probe(r.endpoint, min(1.0, left)), min(1.0, left) + 0.1)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    ok = False
                if ok and t.is_suspect(r, epoch):
                    n = t.end_suspect(r, epoch)
                    log.warning("worker %s healthy again: %d waiters released", r.worker_id, n)
                    outcome = "recovered"
                    break
        finally:
            self.hooks.suspect_end(r.worker_id, outcome)

    async def _first_request(self, st: StreamState, r: Replica, model: str, path: str) -> tuple[str, bytes]:
        """(path, body) of the stream's first request to `r` (again, after a retry). A stream
        that the engine sends without token ids (`codec.translates`: SGLang's chat) goes out
        as a continuation from its first token, on the prompt ids the engine renders."""
        codec = self.codec(r)
        if st.continuation and codec.translates(st.kind, st.body):
            prompt = await self._prompt_ids(r, codec, st)
            if prompt is not None:
                tok = await self._tokenizer(r, model, prompt)
                st.use_translated(codec, prompt, tok)
                p, req = codec.continuation_request(st.kind, st.body, prompt, [],
                                                    text_by_router=st.text is not None)
                return p, json.dumps(req).encode()
        return path, st.use(codec)

    async def _prompt_ids(self, r: Replica, codec: ContinuationCodec, st: StreamState) -> list[int] | None:
        """The prompt ids `r`'s engine renders for the request; None when it refuses (the
        request then goes to the engine as it is, which answers with its own error)."""
        path, req = codec.prompt_ids_request(st.kind, st.body) or (None, None)
        if path is None:
            return None
        resp = await self.upstream.post(r.endpoint + path, json.dumps(req).encode())  # UpstreamError: retried
        try:
            if resp.status != 200:
                return None
            data = await resp.read()
        finally:
            resp.close()
        try:
            return codec.parse_prompt_ids(json.loads(data))
        except ValueError as e:
            log.warning("prompt ids from %s unusable (%s): request sent as it is", r.worker_id, e)
            return None

    async def _continuation_request(self, st: StreamState, r: Replica, model: str):
        prompt = st.prompt_ids
        if prompt is None:
            raise errors.continuation_failed("The stream broke before the engine reported the "
                                             "prompt's token ids.")
        sent = st.sent_ids
        if st.legs == 0:
            st.make_text(await self._tokenizer(r, model, sent))
        codec = self.codec(r)
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

    async def _tokenizer(self, r: Replica, model: str, sample: list[int]):
        """The model's tokenizer for continued text, checked once against the engine's own
        detokenizer on `sample` (a tokenizer that decodes otherwise is not used); None: the
        continuation carries the engine's text."""
        tok = self.tokenizers.load(model)
        if tok is None or model in self._tokenizer_checked or not sample:
            return tok
        engine_text = await self._detokenize(r, model, sample)
        if engine_text is None:
            return tok  # the engine cannot say; trust the configured tokenizer
        ours = tok.decode(sample, skip_special_tokens=False)
        if ours != engine_text:
            self.tokenizers.distrust(model, f"{len(sample)} ids decode to {ours[:40]!r}... here, "
                                            f"{engine_text[:40]!r}... on {r.worker_id}")
            return None
        self._tokenizer_checked.add(model)
        return tok

    async def _detokenize(self, r: Replica, model: str, ids: list[int]) -> str | None:
        """The text of `ids` from `r`'s detokenizer; None if unsupported or it failed."""
        codec = self.codec(r)
        req = codec.detokenize_request(model, ids)
        if req is None or not ids:
            return None
        try:
            resp = await self.upstream.post(r.endpoint + req[0], json.dumps(req[1]).encode())
            try:
                if resp.status != 200:
                    return None
                return codec.parse_detokenize(json.loads(await resp.read()))
            finally:
                resp.close()
        except Exception as e:  # pragma: no cover - best effort
            log.warning("detokenize failed on %s: %s", r.worker_id, e)
            return None

    def models_body(self) -> bytes:
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "relocator",
                 "root": m, "parent": None} for m in self.table.models()]
        return json.dumps({"object": "list", "data": data}).encode()


def parse_body(raw: bytes, table: RoutingTable) -> dict:
    """A request body as a JSON object naming a model the table serves, or a 4xx RouterError."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        # RecursionError: JSON nested deeper than the parser's stack (an abuse case).
        raise errors.bad_request(f"Malformed JSON body: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise errors.bad_request("The request body must be a JSON object.",
                                 code="invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("Missing required parameter: 'model'.",
                                 code="missing_model", param="model")
    if not table.has_model(model):
        raise errors.model_not_found(model)
    check_types(body)
    return body


#: fields the router itself uses before an engine has validated them (stream state, the
#: translated first request's text making and budget): the wrong type would crash it. The
#: rest is the engine's to validate.
_INT_FIELDS = ("max_tokens", "max_completion_tokens", "min_tokens")


def check_types(body: dict) -> None:
    """A 400 for a field of the wrong type that the router reads itself."""
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise errors.bad_request(f"'stream_options' must be an object, not "
                                 f"{_json_type(so)}.", code="invalid_type",
                                 param="stream_options")
    for k in _INT_FIELDS:
        v = body.get(k)
        if v is None or (isinstance(v, int) and not isinstance(v, bool)):
            continue
        if isinstance(v, float) and v.is_integer():
            continue  # 5.0 is 5, as the engine reads it (inf and NaN are not integers)
        raise errors.bad_request(f"'{k}' must be an integer, not {_json_type(v)}.",
                                 code="invalid_type", param=k)


def _json_type(v: object) -> str:
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return f"the number {v!r}"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(v), type(v).__name__)


def _ids(reps: list[Replica]) -> set[str]:
    return {x.worker_id for x in reps}


def _cancelling() -> int:
    t = asyncio.current_task()
    return t.cancelling() if t is not None else 0


__all__ = ["RouterCore", "Upstream", "UpstreamResponse", "UpstreamError", "Unary", "Stream",
           "Hooks", "DONE"]
