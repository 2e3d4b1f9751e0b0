"""`transfer: handoff`, agent side: the warm-up of a target copy that is not in the router yet.
The copy itself starts as any launch does (`launch`: from a warm image of its kind when this
node's store has one, else cold); `prefill` then sends it the streams in flight on the source,
one prefill-only request each (max_tokens 1), all at once, so the engine's prefix cache (vLLM's
automatic prefix caching, SGLang's radix cache, the reference engine's adapters/reference/prefixcache.py)
keeps their KV and the continuation at the switch recomputes only the last few tokens. Each engine's
request and answer are its codec's (`prefill_request`, `prefill_cached_tokens`)."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from adapters.base import DEFAULT_ENGINE, get_codec
from relocator.agent.modes.base import ModeBase

#: at most this many prefill requests of one round in flight at once
MAX_PARALLEL = 32
#: one prefill request's limit: the tiny model prefills thousands of tokens a second on a CPU
PREFILL_TIMEOUT_S = 120.0


def prefill_request(model: str, ids: list[int], engine: str = DEFAULT_ENGINE) -> tuple[str, dict[str, Any]]:
    """(path, body) of a request that only prefills `ids` on `engine` (one greedy token out):
    OpenAI completions with a token-id prompt on vLLM and the reference engine, SGLang's native
    /generate with input_ids (the engine's codec: ContinuationCodec.prefill_request)."""
    return get_codec(engine).prefill_request(model, ids)


def cached_tokens(body: bytes, engine: str = DEFAULT_ENGINE) -> int:
    """The prompt tokens `engine` found in its prefix cache, from its answer `body` (vLLM and the
    reference engine: usage.prompt_tokens_details.cached_tokens; SGLang: meta_info.cached_tokens);
    0 if unsaid."""
    try:
        obj = json.loads(body)
    except ValueError:
        return 0
    return get_codec(engine).prefill_cached_tokens(obj)


def engine_at(endpoint: str) -> str:
    """The engine of this node's cell serving `endpoint` (the target copy the agent started, with
    the worker record's engine); the default engine when no cell here serves it."""
    from relocator.cell.cell import list_cells

    want = endpoint.rstrip("/")
    cells = [c for c in list_cells() if c.endpoint == want]
    cells.sort(key=lambda c: not c.is_alive())  # a live one first (a dead record may linger)
    return cells[0].engine if cells else DEFAULT_ENGINE


def prefill_one(endpoint: str, model: str, ids: list[int], engine: str = DEFAULT_ENGINE) -> int:
    """Prefill one token sequence on the copy at `endpoint`; the tokens its engine found cached."""
    path, body = prefill_request(model, ids, engine)
    req = urllib.request.Request(endpoint.rstrip("/") + path, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=PREFILL_TIMEOUT_S) as r:
        return cached_tokens(r.read(), engine)


class HandoffOps(ModeBase):
    def prioritize(self, cell_id: str, nice: int | None) -> int:
        """Give the cell's every thread the nice value `nice` (a handoff's source, favoured over
        the target copy starting next to it); None: normal again, this agent's own nice, what
        every copy it starts has (Ray's workers run at 15, not 0); the threads changed."""
        from relocator.cell.cell import load_cell
        from relocator.warm.lowstart import set_priority

        # and the cell's session (autogroup): sessions share the CPU first, threads within them
        return set_priority(load_cell(cell_id), nice)

    def prefill(self, endpoint: str, model: str, sequences: list[list[int]],
                engine: str | None = None) -> dict[str, Any]:
        """Prefill every token sequence on the copy at `endpoint` (this node's), all at once (the
        engine batches them: a round takes about one prefill, not one per stream, so the source
        runs less far ahead meanwhile), in `engine`'s form (None: the engine of the cell at
        `endpoint`, the worker record's); the figures of the round."""
        t0 = time.monotonic()
        engine = engine or engine_at(endpoint)
        if not sequences:
            return {"sequences": 0, "tokens": 0, "cached_tokens": 0, "seconds": 0.0, "engine": engine}
        with ThreadPoolExecutor(min(len(sequences), MAX_PARALLEL)) as pool:
            cached = sum(pool.map(lambda ids: prefill_one(endpoint, model, ids, engine), sequences))
        return {"sequences": len(sequences), "tokens": sum(map(len, sequences)), "cached_tokens": cached,
                "seconds": round(time.monotonic() - t0, 4), "engine": engine}


__all__ = ["HandoffOps", "cached_tokens", "engine_at", "prefill_one", "prefill_request"]
