"""The streaming load of a chaos run (its own thread and event loop) and its greedy reference."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from relocator import waits
from relocator.chaos.config import MODEL


def _reference(lcfg: Any, endpoint: str, engine: str | None) -> Any:
    """Greedy outputs of the mix before any move, straight from a worker. A chat stream whose
    engine carries no token ids in it (SGLang: the router sends it as a completions stream on
    the engine's own rendering of the messages) is taken through the router instead, before
    any move; tests/test_sglang_adapter.py checks that path against the engine's own chat."""
    import dataclasses

    from adapters.base import DEFAULT_ENGINE, get_codec
    from loadtests import Reference, build_specs, make_reference

    codec = get_codec(engine or DEFAULT_ENGINE)
    specs = [s for s in build_specs(lcfg) if s.greedy]
    via_router = [s for s in specs if codec.translates(s.kind, s.body(MODEL))]
    direct = [s for s in specs if s not in via_router]
    ref = Reference()
    for part, url in ((direct, endpoint), (via_router, lcfg.url)):
        if part:  # (an empty `specs` means "the default mix")
            more = asyncio.run(make_reference(dataclasses.replace(lcfg, specs=part), url=url))
            ref.update(more)
            ref.text.update(more.text)
    return ref


def _chat_fraction(engine: str | None) -> float:
    """Half the streams are chat, unless the engine cannot continue a chat stream: chaos
    checks moves, not what an engine cannot do."""
    from adapters.base import DEFAULT_ENGINE, get_codec

    codec = get_codec(engine or DEFAULT_ENGINE)
    return 0.5 if codec.unsupported_reason("chat", {"messages": []}) is None else 0.0


class _LoadThread:
    def __init__(self, cfg) -> None:
        from loadtests import run_load

        self.loop = asyncio.new_event_loop()
        self.stop_ev: asyncio.Event | None = None
        self.report = None
        self.error: BaseException | None = None

        async def main():
            self.stop_ev = asyncio.Event()
            return await run_load(cfg, stop=self.stop_ev)

        def body():
            try:
                self.report = self.loop.run_until_complete(main())
            except BaseException as exc:  # noqa: BLE001
                self.error = exc

        self.t = threading.Thread(target=body, daemon=True)

    def start(self) -> "_LoadThread":
        self.t.start()
        return self

    def stop(self, timeout: float = 300) -> Any:
        waits.settle(lambda: self.stop_ev is not None or not self.t.is_alive(), None, every=0.05)
        if self.stop_ev is not None:
            self.loop.call_soon_threadsafe(self.stop_ev.set)
        self.t.join(timeout)
        if self.error:
            raise self.error
        return self.report
