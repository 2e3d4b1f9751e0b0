"""`transfer: handoff`, agent side: the warm-up of a target copy that is not in the router yet.
The copy itself starts as any launch does (`launch`: from a warm image of its kind when this
node's store has one, else cold); `prefill` then sends it the streams in flight on the source,
one prefill-only request each (max_tokens 1), so the engine's automatic prefix cache keeps their
KV and the continuation at the switch recomputes only the last few tokens."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

from relocator.agent.modes.base import ModeBase

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


class HandoffOps(ModeBase):
    def prefill(self, endpoint: str, model: str, sequences: list[list[int]]) -> dict[str, Any]:
        """Prefill each token sequence on the copy at `endpoint` (this node's), one after the
        other; the figures of the round."""
        t0 = time.monotonic()
        tokens = cached = 0
        for ids in sequences:
            req = urllib.request.Request(endpoint.rstrip("/") + "/v1/completions",
                                         data=json.dumps(prefill_body(model, ids)).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
            with urllib.request.urlopen(req, timeout=PREFILL_TIMEOUT_S) as r:
                cached += cached_tokens(r.read())
            tokens += len(ids)
        return {"sequences": len(sequences), "tokens": tokens, "cached_tokens": cached,
                "seconds": round(time.monotonic() - t0, 4)}


__all__ = ["HandoffOps", "cached_tokens", "prefill_body"]
