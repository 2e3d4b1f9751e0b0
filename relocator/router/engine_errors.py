"""An engine that failed, as the router tells it from the engine's own answer.

vLLM and SGLang report a failure inside a stream that has started as one SSE event,
`data: {"error": {"message", "type", "param", "code"}}` (SGLang adds `"object": "error"`;
older vLLM put the fields at the top level with `"object": "error"`), then `[DONE]`. A code
>= 500 is the engine's fault (vLLM's "EngineCore encountered an issue", SGLang's aborts with a
5xx status): the router treats it as a broken upstream and continues the stream elsewhere. A
4xx is the request's own fault and reaches the client. Before the first byte, an HTTP answer
in `RETRY_STATUSES` is retried on another replica (docs/router.md, "Engine failures")."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from . import sse

if TYPE_CHECKING:
    from .table import RoutingTable
    from .transport import Hooks

log = logging.getLogger(__name__)

#: HTTP answers before any byte that are the engine's fault, not the request's
RETRY_STATUSES = frozenset({500, 502, 503, 504})


def error_code(obj: dict) -> int | None:
    """The status code an engine's error object carries; None when `obj` is no error (a chunk)
    or its code is not a number."""
    if "choices" in obj:
        return None
    err: Any = obj.get("error")
    src = err if isinstance(err, dict) else obj if obj.get("object") == "error" else None
    if src is None:
        return None
    code = src.get("code")
    if isinstance(code, bool):
        return None
    if isinstance(code, int):
        return code
    if isinstance(code, str) and code.isdigit():
        return int(code)
    return None


def is_engine_failure(obj: dict) -> bool:
    code = error_code(obj)
    return code is not None and code >= 500


def split_failure(events: bytes) -> tuple[bytes, bytes | None]:
    """(the whole events before the first engine-failure event, that event), or
    (`events`, None) when there is none. `events` are whole events (sse.Framer)."""
    if b'"error"' not in events:  # the hot path: a JSON key, never escaped text
        return events, None
    start = 0
    while start < len(events):
        end = events.find(b"\n\n", start)
        end = len(events) if end < 0 else end + 2
        ev = events[start:end]
        if b'"error"' in ev:
            for p in sse.payloads(ev):
                obj = sse.json_object(p)
                if obj is not None and is_engine_failure(obj):
                    return events[:start], ev
        start = end
    return events, None


class Failures:
    """A router's engine failures: counted (`Hooks.engine_failure`), and whether the request
    goes on elsewhere. A replica whose engine failed joins the request's `shun` list: the core
    excludes it from that request's later picks (the routing table stays as it is: the
    controller removes dead workers)."""

    def __init__(self, table: RoutingTable, hooks: Hooks) -> None:
        self.table = table
        self.hooks = hooks

    def others(self, model: str, exclude: list[str]) -> bool:
        """A replica of `model` outside `exclude` is registered (acquire would pick it)."""
        return any(x.worker_id not in exclude for x in self.table.replicas(model))

    def answered(self, model: str, worker: str, status: int, shun: list[str],
                 tried: list[str] | None, budget_left: bool) -> bool:
        """`worker` answered `status` before any byte. True: an engine failure, dropped, the
        request goes on to a replica not yet tried; False: the answer goes to the client."""
        if status not in RETRY_STATUSES:
            return False
        self.hooks.engine_failure("first")
        shun.append(worker)
        if tried is not None:
            tried.append(worker)
        if not budget_left or not self.others(model, shun + (tried or [])):
            return False
        log.warning("engine of %s answered %d: retrying on another replica of %s", worker,
                    status, model)
        self.hooks.retried()
        return True

    def in_stream(self, model: str, worker: str, shun: list[str], failure: bytes, sent: int,
                  refusal: bytes | None) -> bytes | None:
        """`worker`'s engine ended the stream with the event `failure` after `sent` tokens: a
        break like a lost connection, continued on another replica (None), unless none is left
        or the stream cannot go on (`refusal`): then the engine's event ends it, as it was sent."""
        self.hooks.engine_failure("stream")
        shun.append(worker)
        if refusal is None and self.others(model, shun):
            log.warning("engine of %s failed mid-stream after %d tokens: continuing elsewhere",
                        worker, sent)
            return None
        return failure + sse.DONE
