"""`transfer: handoff`, agent side: the warm-up of a target copy that is not in the router yet.
The copy itself starts as any launch does (`launch`: from a warm image of its kind when this
node's store has one, else cold); `prefill` then sends it the streams in flight on the source,
one prefill-only request each (max_tokens 1), all at once, so the engine's automatic prefix cache keeps their
KV and the continuation at the switch recomputes only the last few tokens."""

from __future__ import annotations

import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from relocator.agent.modes.base import ModeBase

#: at most this many prefill requests of one round in flight at once
MAX_PARALLEL = 32
#: one prefill request's limit: the tiny model prefills thousands of tokens a second on a CPU
PREFILL_TIMEOUT_S = 120.0


def prefill_body(model: str, ids: list[int]) -> dict[str, Any]:
    """An OpenAI completions request that only prefills `ids` (one greedy token out)."""
    return {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "stream": False}


def cached_tokens(body: bytes) -> int:
    """The prompt tokens the engine found in its prefix cache (vLLM with
    --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens); 0 if unsaid."""
    try:
        details = (json.loads(body).get("usage") or {}).get("prompt_tokens_details") or {}
        return int(details.get("cached_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def prefill_one(endpoint: str, model: str, ids: list[int]) -> int:
    """Prefill one token sequence on the copy at `endpoint`; the tokens its engine found cached."""
    req = urllib.request.Request(endpoint.rstrip("/") + "/v1/completions",
                                 data=json.dumps(prefill_body(model, ids)).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=PREFILL_TIMEOUT_S) as r:
        return cached_tokens(r.read())


class HandoffOps(ModeBase):
    def prioritize(self, cell_id: str, nice: int | None) -> int:
        """Give the cell's every thread the nice value `nice` (a handoff's source, favoured over
        the target copy starting next to it); None: normal again, this agent's own nice, what
        every copy it starts has (Ray's workers run at 15, not 0); the threads changed."""
        from relocator import procs
        from relocator.cell.cell import load_cell
        from relocator.warm.lowstart import normal_nice

        return procs.set_nice(load_cell(cell_id).pids(), normal_nice() if nice is None else nice)

    def prefill(self, endpoint: str, model: str, sequences: list[list[int]]) -> dict[str, Any]:
        """Prefill every token sequence on the copy at `endpoint` (this node's), all at once (the
        engine batches them: a round takes about one prefill, not one per stream, so the source
        runs less far ahead meanwhile); the figures of the round."""
        t0 = time.monotonic()
        if not sequences:
            return {"sequences": 0, "tokens": 0, "cached_tokens": 0, "seconds": 0.0}
        with ThreadPoolExecutor(min(len(sequences), MAX_PARALLEL)) as pool:
            cached = sum(pool.map(lambda ids: prefill_one(endpoint, model, ids), sequences))
        return {"sequences": len(sequences), "tokens": sum(map(len, sequences)), "cached_tokens": cached,
                "seconds": round(time.monotonic() - t0, 4)}


__all__ = ["HandoffOps", "cached_tokens", "prefill_body", "prefill_one"]
