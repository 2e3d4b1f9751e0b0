"""A handoff's last warm-up, done by the router itself right before its switch.

The controller's warm-up rounds (relocator/controller/transfers/handoff.py) prefill the target
copy while the source runs ahead; between their last round and the switch the source decodes on
(a round trip through the controller, Ray and the target's agent), and every token it makes then
is recomputed at the switch by all the continuations at once: that was the blackout. Here the
router, which has each stream's progress in hand, prefills the target with exactly the requests
the continuations will send (the replica's codec: `continuation_request`, cut to one token), for
all streams at once, in rounds until each is within `gap` tokens; the cut follows in the same
step of the event loop. It also loads and checks the model's tokenizer (EngineCalls.tokenizer)
before the cut, once, instead of in eight continuations at the splice. Best effort: a prefill
that fails ends the catch-up, and the continuations compute what is missing."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

from .table import StreamHandle
from .transport import UpstreamError

#: the router core (relocator.router.core.RouterCore): its table, codecs, upstream, engine calls
RouterCore = Any

log = logging.getLogger(__name__)

#: a stream within this many tokens of its last prefill needs no further round
GAP_TOKENS = 2
#: the most rounds one switch may ask for
MAX_ROUNDS = 8
#: the whole catch-up's limit (within the control client's 10 s): past it the switch goes ahead
TIMEOUT_S = 5.0


def _due(handles: list[StreamHandle], endpoint: str, done: dict[StreamHandle, int],
         gap: int) -> list[tuple[StreamHandle, list[int], list[int]]]:
    """The exact streams not on `endpoint` yet that are more than `gap` tokens past their last
    prefill: (handle, prompt ids, ids sent)."""
    out = []
    for h in handles:
        st = h.stream
        if st is None or not st.track or h.endpoint == endpoint:
            continue
        prompt = st.prompt_ids
        if prompt is None:
            continue
        sent = st.sent_ids
        if st.leg_codec.inexact_reasons(st.kind, st.body, sent):
            continue  # kept on the source at the switch (keep_inexact)
        if h in done and len(prompt) + len(sent) - done[h] <= gap:
            continue
        out.append((h, prompt, sent))
    return out


def prefill_request(core: RouterCore, h: StreamHandle, prompt: list[int],
                    sent: list[int]) -> tuple[str, bytes]:
    """(path, body) of the continuation `h` would send now, generating one token only: its KV
    (prompt + sent) stays in the engine's prefix cache for the real continuation."""
    st = h.stream
    r = core.table.get(h.worker_id)
    path, req = core.codec(r).continuation_request(st.kind, st.body, prompt, sent,
                                                   text_by_router=st.text is not None)
    for k in ("min_tokens", "max_completion_tokens"):
        req.pop(k, None)
    req["max_tokens"] = 1
    req.pop("stream_options", None)
    return path, json.dumps(req).encode()


async def _prefill(core: RouterCore, endpoint: str, h: StreamHandle, prompt: list[int],
                   sent: list[int]) -> int:
    path, body = prefill_request(core, h, prompt, sent)
    resp = await core.upstream.post(endpoint + path, body)
    try:
        await resp.read()
        if resp.status != 200:
            raise UpstreamError(f"prefill on {endpoint}: HTTP {resp.status}")
    finally:
        resp.close()
    return len(prompt) + len(sent)


async def _rounds(core: RouterCore, worker_id: str, endpoint: str, rounds: int, gap: int,
                  out: dict[str, Any]) -> None:
    r = core.table.get(worker_id)
    done: dict[StreamHandle, int] = {}
    behind = None  # tokens the last round had to prefill
    for _ in range(rounds):  # bounded by rounds (and TIMEOUT_S), not a deadline loop
        todo = _due(list(r.streams), endpoint, done, gap)
        lag = sum(len(p) + len(s) - done.get(h, 0) for h, p, s in todo)
        if not todo or (behind is not None and lag >= behind):
            return  # caught up, or not catching up (the source decodes as fast as the target prefills)
        behind = lag
        if not out["rounds"]:  # the tokenizer for the continued text, checked once, before the cut
            h, _, sent = todo[0]
            await core.calls.tokenizer(r, core.codec(r), r.model, sent)
        out["rounds"] += 1
        got = await asyncio.gather(*(_prefill(core, endpoint, h, p, s) for h, p, s in todo))
        for (h, p, s), n in zip(todo, got):
            out["tokens"] += n - done.get(h, 0)
            done[h] = n
        out["streams"] = len(done)


async def catch_up(core: RouterCore, worker_id: str, endpoint: str, rounds: int,
                   gap: int = GAP_TOKENS) -> dict[str, Any]:
    """Prefill `endpoint` (the worker's target copy) with each exact stream of the worker, all at
    once, for at most `rounds` rounds, until every one is within `gap` tokens. Figures: rounds,
    streams, tokens (sent to prefill: a stream's whole sequence in its first round, then what it
    grew by), seconds, error (if it stopped)."""
    endpoint = endpoint.rstrip("/")
    out: dict[str, Any] = {"rounds": 0, "streams": 0, "tokens": 0}
    t0 = time.perf_counter()
    try:
        await asyncio.wait_for(_rounds(core, worker_id, endpoint, min(rounds, MAX_ROUNDS), gap, out),
                               TIMEOUT_S)
    except (UpstreamError, asyncio.TimeoutError, OSError) as e:
        out["error"] = f"{type(e).__name__}: {e}"
        log.warning("catch-up of %s on %s stopped (%s): the switch goes ahead", worker_id, endpoint,
                    out["error"])
    out["seconds"] = round(time.perf_counter() - t0, 4)
    return out


__all__ = ["GAP_TOKENS", "MAX_ROUNDS", "catch_up", "prefill_request"]
