"""vLLM 0.32's non-streamed response bodies, for the servers that imitate its framing (the
reference engine, adapters/reference/server.py, and the router's fake engine,
relocator/router/fakeserver.py)."""

from __future__ import annotations

from typing import Any


def usage_of(prompt: list[int], out: list[int], cached_tokens: int = 0) -> dict:
    """A request's usage; `prompt_tokens_details` only when some prompt tokens came from the
    prefix cache (vLLM with --enable-prompt-tokens-details writes it only then)."""
    u: dict[str, Any] = {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + len(out),
                         "completion_tokens": len(out)}
    if cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return u


def completion_body(kind: str, rid: str, created: int, model: str, prompt: list[int],
                    out: list[int], text: str, finish: str | None, stop_reason: Any,
                    want_ids: bool, cached_tokens: int = 0) -> dict:
    """The JSON body of a finished completion (`kind` "completions") or chat completion."""
    usage = usage_of(prompt, out, cached_tokens)
    if kind == "chat":
        ch = {"index": 0, "message": {"role": "assistant", "content": text},
              "logprobs": None, "finish_reason": finish, "stop_reason": stop_reason,
              "token_ids": out if want_ids else None}
        return {"id": rid, "object": "chat.completion", "created": created,
                "model": model, "choices": [ch], "usage": usage,
                "prompt_token_ids": prompt if want_ids else None}
    ch = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish,
          "stop_reason": stop_reason, "token_ids": out if want_ids else None,
          "prompt_token_ids": prompt if want_ids else None}
    return {"id": rid, "object": "text_completion", "created": created,
            "model": model, "choices": [ch], "usage": usage}
