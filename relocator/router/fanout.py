"""A streaming request with `n > 1` choices, served as n one-choice streams merged into one.

A stream's continuation follows one sequence of token ids, so an `n > 1` stream could not be
continued when its worker moved (every move broke it). Sent as n requests with `n = 1`, each
choice is a stream of its own that the router continues like any other; this module merges
them back into the client's one stream: choice indexes, one id, one usage chunk, one [DONE].

The merged stream is the one vLLM would have sent: vLLM serves `n > 1` as n child requests
whose seeds are `seed + index` (vllm/v1/engine/parallel_sampling.py), which is what each part
gets here, and reports usage with the prompt counted once and the completions summed."""

from __future__ import annotations

import asyncio
from typing import Any, AsyncGenerator, AsyncIterator

from adapters.codec import dumps

from . import sse
from .errors import RouterError
from .sse import DONE
from .stream import lax_bool

#: more choices than this are sent as they are (one request, not continued on a move)
MAX_CHOICES = 32


def wants_fan_out(kind: str, body: dict) -> bool:
    """An `n > 1` stream whose choices can each be continued: one prompt, no beam search,
    not greedy."""
    n = body.get("n")
    if type(n) is not int or not 1 < n <= MAX_CHOICES or body.get("use_beam_search"):
        return False
    t = body.get("temperature")
    if isinstance(t, (int, float)) and t < 1e-5:
        return False  # vLLM refuses n > 1 with greedy sampling: the engine says so, as before
    if kind == "completions":
        p = body.get("prompt")
        return isinstance(p, str) or (isinstance(p, list) and all(type(t) is int for t in p))
    return True


def part_bodies(body: dict) -> list[dict]:
    """The n one-choice requests, usage asked of each (the merge sums it)."""
    so = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
    parts = []
    for i in range(body["n"]):
        part = {**body, "n": 1,
                "stream_options": {**so, "include_usage": True}}
        if type(body.get("seed")) is int:
            part["seed"] = body["seed"] + i
        parts.append(part)
    return parts


class Merge:
    """Rewrites the parts' events into the client's stream."""

    def __init__(self, body: dict, n: int) -> None:
        so = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        # the flags as StreamState (and vLLM) read them: "false" is false, per-chunk usage
        # only with include_usage
        self.include_usage = lax_bool(so.get("include_usage"))
        self.continuous = self.include_usage and lax_bool(so.get("continuous_usage_stats"))
        self.id: str | None = None
        self.created: Any = None
        self.tmpl: dict = {}
        self.prompt_tokens: int | None = None
        self.completion = [0] * n  # each part's completion tokens so far
        self.extra: dict = {}  # the first part's other usage fields (e.g. prompt_tokens_details)

    def events(self, index: int, data: bytes) -> list[bytes]:
        out = []
        for payload in sse.payloads(data):
            obj = sse.json_object(payload)  # [DONE] is none: one comes at the end of the merge
            if obj is None:
                continue
            if "error" in obj and "choices" not in obj:
                out.append(b"data: " + dumps(obj) + b"\n\n")  # this choice ended in an error
                continue
            self._note_usage(index, obj.pop("usage", None))
            choices = obj.get("choices") or []
            if not choices:
                continue  # a part's usage chunk: merged at the end
            if self.id is None:
                self.id, self.created = obj.get("id"), obj.get("created")
                self.tmpl = {k: obj.get(k) for k in ("id", "object", "created", "model")}
            obj["id"], obj["created"] = self.id, self.created
            for c in choices:
                if isinstance(c, dict):
                    c["index"] = index
            if self.continuous:
                obj["usage"] = self.usage()
            out.append(b"data: " + dumps(obj) + b"\n\n")
        return out

    def _note_usage(self, index: int, usage: Any) -> None:
        if not isinstance(usage, dict):
            return
        if isinstance(usage.get("completion_tokens"), int):
            self.completion[index] = usage["completion_tokens"]
        if index == 0 and isinstance(usage.get("prompt_tokens"), int):
            self.prompt_tokens = usage["prompt_tokens"]
            self.extra = {k: v for k, v in usage.items()
                          if k not in ("prompt_tokens", "completion_tokens", "total_tokens")}

    def usage(self) -> dict:
        p, c = self.prompt_tokens or 0, sum(self.completion)
        return {"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, **self.extra}

    def tail(self) -> bytes:
        out = b""
        if self.include_usage:
            obj = {**self.tmpl, "choices": [], "usage": self.usage()}
            out += b"data: " + dumps(obj) + b"\n\n"
        return out + DONE


async def merged(body: dict, parts: list[AsyncGenerator[bytes, None]]) -> AsyncIterator[bytes]:
    """The parts' streams as one: events in the order they arrive, each choice re-indexed."""
    m = Merge(body, len(parts))
    q: asyncio.Queue = asyncio.Queue()

    async def drain(i: int, it: AsyncGenerator[bytes, None]) -> None:
        try:
            async for data in it:
                await q.put((i, data))
        except RouterError as e:  # a part that could not start: its choice ends in the error
            await q.put((i, e.sse_event()))
        finally:
            await q.put((i, None))

    tasks = [asyncio.ensure_future(drain(i, it)) for i, it in enumerate(parts)]
    open_parts = len(parts)
    try:
        while open_parts:
            i, data = await q.get()
            if data is None:
                open_parts -= 1
                continue
            out = m.events(i, data)
            if out:
                yield b"".join(out)
        yield m.tail()
    finally:
        # the client went away (or the merge ended): every part's upstream is aborted
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for it in parts:
            await it.aclose()
