"""What the router core exchanges with its shells and its engines: the `Upstream` protocol
(I/O to the engines, fakes in tests), the answers a shell writes (`Unary`, `Stream`) and the
metric callbacks (`Hooks`). No I/O here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Protocol


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
    def engine_failure(self, where: str) -> None: ...  # "stream" | "first" (engine_errors.py)
    def suspect_hold(self, worker: str) -> None: ...
    def suspect_end(self, worker: str, outcome: str) -> None: ...
