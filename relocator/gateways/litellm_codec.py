"""What the LiteLLM plugin translates, with no LiteLLM import (unit-testable anywhere): the
OpenAI chat request the router core gets from what LiteLLM hands a custom provider, and the
core's SSE stream as LiteLLM's generic chunks (`GenericStreamingChunk` fields)."""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from relocator.router import sse


class StreamError(Exception):
    """An error event in the core's stream (e.g. `continuation_failed`): the stream ends."""

    def __init__(self, status: int, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


#: OpenAI request fields LiteLLM hands a custom provider in `optional_params` that are passed on
#: as they are (anything else LiteLLM put there is LiteLLM's own bookkeeping)
_DROP = {"stream", "litellm_session_id", "litellm_call_id", "extra_body", "extra_headers",
         "api_base", "api_key", "metadata", "max_retries", "num_retries", "timeout"}


def request_body(model: str, messages: list, optional_params: dict, stream: bool) -> bytes:
    """The OpenAI chat request the core sees, from what LiteLLM passes a custom provider."""
    body: dict[str, Any] = {"model": model, "messages": messages}
    for k, v in optional_params.items():
        if k not in _DROP and v is not None:
            body[k] = v
    extra = optional_params.get("extra_body")
    if isinstance(extra, dict):  # e.g. ignore_eos, min_tokens: vLLM's own sampling fields
        body.update(extra)
    if stream:
        body["stream"] = True
        # usage in the last chunk: LiteLLM reports it (and bills by it)
        opts = body.get("stream_options")
        body["stream_options"] = {**(opts if isinstance(opts, dict) else {}),
                                  "include_usage": True}
    return json.dumps(body).encode()


def chunk_of(event: dict) -> dict | None:
    """One OpenAI chat.completion.chunk as LiteLLM's generic chunk (None: nothing in it)."""
    usage = event.get("usage")
    choices = event.get("choices") or []
    if not choices:
        if not usage:
            return None
        return {"text": "", "is_finished": False, "finish_reason": "", "index": 0,
                "tool_use": None, "usage": _usage(usage)}
    ch = choices[0]
    delta = ch.get("delta") or {}
    finish = ch.get("finish_reason")
    return {"text": delta.get("content") or "", "tool_use": None, "is_finished": bool(finish),
            "finish_reason": finish or "", "usage": _usage(usage) if usage else None,
            "index": ch.get("index", 0)}


def _usage(u: dict) -> dict:
    return {"prompt_tokens": u.get("prompt_tokens", 0),
            "completion_tokens": u.get("completion_tokens", 0),
            "total_tokens": u.get("total_tokens", 0)}


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict]:
    """The JSON events of the core's stream (it yields whole events only); `[DONE]` ends it,
    an error event (`continuation_failed`, `worker_unreachable`, ...) is raised."""
    async for payload in sse.read(chunks):
        if payload == sse.DONE_PAYLOAD:
            return
        obj = json.loads(payload)
        if "error" in obj and "choices" not in obj:
            err = obj["error"] if isinstance(obj["error"], dict) else {"message": obj["error"]}
            code = err.get("code")
            raise StreamError(503 if code in ("worker_unreachable", "hold_timeout") else 502,
                              str(err.get("message")), code)
        yield obj
