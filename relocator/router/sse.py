"""Server-sent events as the OpenAI streaming APIs frame them: the one SSE reader of the tree.

An event is one or more lines ending in a blank line; its `data:` lines carry the payload (a
JSON chunk, or `[DONE]` at the end). The router reads its upstreams with `Framer` and
`payloads`; clients (load tests, benchmarks, relocation runs) read a response with `read`."""

from __future__ import annotations

import json
from typing import Any, AsyncIterable, AsyncIterator, Iterator

#: the payload of the stream's last event
DONE_PAYLOAD = b"[DONE]"
DONE = b"data: [DONE]\n\n"


def event(payload: bytes) -> bytes:
    """One event carrying `payload`."""
    return b"data: " + payload + b"\n\n"


class Framer:
    """Cuts a byte stream into whole events: `push` returns the events complete so far and
    keeps a partial one for the next push."""

    __slots__ = ("buf",)

    def __init__(self) -> None:
        self.buf = b""

    def push(self, data: bytes) -> bytes:
        """The whole events of what came so far (b"": none yet), each ending in a blank line."""
        if self.buf:
            data = self.buf + data
            self.buf = b""
        end = data.rfind(b"\n\n")
        if end < 0:
            self.buf = data
            return b""
        end += 2
        if end != len(data):
            self.buf, data = data[end:], data[:end]
        return data

    def clear(self) -> None:
        """Drop a partial event (the stream it came from is gone)."""
        self.buf = b""


def payloads(data: bytes) -> Iterator[bytes]:
    """The `data:` payload of each whole event in `data`, stripped (an event of several data
    lines gives them joined by a newline); events without data are skipped."""
    for ev in data.split(b"\n\n"):
        lines = [line.strip()[5:].strip() for line in ev.split(b"\n")
                 if line.strip().startswith(b"data:")]
        if lines:
            yield b"\n".join(lines)


def json_object(payload: bytes) -> dict | None:
    """The payload as a JSON object; None when it is not one (not JSON, or another value)."""
    try:
        obj: Any = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def ends_done(chunk: bytes) -> bool:
    """`chunk` (a response's last) ends the stream with [DONE]: for clients that only count
    whole streams and do not read events."""
    return chunk.rstrip().endswith(b"data: [DONE]")


async def read(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The payloads of a response body arriving in `chunks` (aiohttp: `r.content.iter_any()`),
    `[DONE]` included, as each event completes; a partial event at the end is dropped."""
    framer = Framer()
    async for chunk in chunks:
        for p in payloads(framer.push(chunk)):
            yield p
