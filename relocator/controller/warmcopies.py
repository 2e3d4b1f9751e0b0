"""Warm images ahead of need (issue 28): a reconcile step that keeps every warm image on
`prefetch.copies` other nodes besides the one that captured it, other hosts first
(configs/images.yaml), so a worker whose host is lost comes back from an image elsewhere.

Narrow collaborators (testable without Ray): `nodes()` the live nodes, `host_of()` their hosts,
`keys(node)` the images a node holds, `fetch(dst, src, key)` one copy (the target's agent pulls
it, checksummed), `emit(kind, **fields)` events. Copies run on their own thread, one at a time
(each is an image's bytes over the network), never started while a relocation or a start is
under way (`busy()`: they would take its CPU and network); a failed copy is not retried to that node for
FAILED_BACKOFF_S.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from relocator.controller.events import EventKind
from relocator.warm.config import WarmConfig
from relocator.warm.replicate import Copy, plan_copies

log = logging.getLogger("relocator.controller")
FAILED_BACKOFF_S = 300.0
KEYS_TIMEOUT_S = 10.0


def _thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="warm-copies", daemon=True).start()


class WarmCopies:
    def __init__(self, nodes: Callable[[], list[str]], keys: Callable[[str], list[str]],
                 fetch: Callable[[str, str, str], dict], emit: Callable[..., Any],
                 host_of: Callable[[], dict[str, str]] = dict, cordoned: Callable[[], set[str]] = set,
                 busy: Callable[[], bool] = lambda: False,
                 config: Callable[[], WarmConfig] = WarmConfig.load,
                 clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[Callable[[], None]], None] = _thread) -> None:
        self._nodes, self._keys, self._fetch, self._emit = nodes, keys, fetch, emit
        self._host_of, self._cordoned, self._busy = host_of, cordoned, busy
        self._config, self._clock, self._spawn = config, clock, spawn
        self._next = 0.0
        self._running = threading.Event()
        self._failed: dict[tuple[str, str], float] = {}  # (key, node) -> when it failed
        self.last: dict[str, Any] = {}  # the last round: {"planned": [...]} or {"why": ...}
        self.holders: dict[str, set[str]] = {}  # the last round's {live node: keys it holds}

    def update(self) -> None:
        """One round when due: what each live node holds, the copies missing, started."""
        now = self._clock()
        if now < self._next or self._running.is_set():
            return
        if self._busy():  # a move or a start under way: a copy would take its CPU and network
            self.last = {"why": "a relocation or a start is under way"}
            return
        cfg = self._config()
        self._next = now + cfg.prefetch.interval_s
        if not cfg.enabled or cfg.prefetch.copies <= 0:
            self.last = {"why": "warm images or their copies are off (warm.enabled, prefetch.copies)"}
            return
        holders = self.holders = self._holders()
        if not any(holders.values()):
            self.last = {"planned": []}
            return
        avoid = {pair for pair, at in self._failed.items() if now - at < FAILED_BACKOFF_S}
        keys = set().union(*holders.values())
        avoid |= {(k, n) for n in self._cordoned() for k in keys}  # a cordoned node gets no new copies
        plan = plan_copies(holders, cfg.prefetch.copies, self._host_of(), avoid=avoid)
        self.last = {"planned": [c.to_dict() for c in plan]}
        if plan:
            self._running.set()
            self._spawn(lambda: self._run(plan))

    def prefetch(self, dst: str, key: str | None = None, src: str | None = None) -> dict[str, Any]:
        """`relocator images prefetch`: copy to `dst` now every image it lacks (or `key`; from
        `src`, else from any holder). {copied: [...], already: [...], failed: [...]}."""
        holders = self._holders()
        if dst not in holders:
            raise ValueError(f"no live node {dst!r} answered (live: {', '.join(sorted(holders)) or 'none'})")
        if src is not None and src not in holders:
            raise ValueError(f"no live node {src!r} answered (live: {', '.join(sorted(holders))})")
        keys = {key} if key else (holders[src] if src else set().union(*holders.values()))
        out: dict[str, list] = {"copied": [], "already": [], "failed": []}
        for k in sorted(keys):
            if k in holders[dst]:
                out["already"].append(k)
                continue
            frm = src if src else next((n for n in sorted(holders) if k in holders[n]), None)
            if frm is None or k not in holders[frm]:
                out["failed"].append({"key": k, "error": f"no live node holds {k}"})
                continue
            try:
                got = self._fetch(dst, frm, k)
                out["copied"].append({"key": k, "from": frm, "bytes": got.get("bytes"), "seconds": got.get("seconds")})
            except Exception as exc:  # noqa: BLE001 - reported, the others go on
                out["failed"].append({"key": k, "from": frm, "error": f"{type(exc).__name__}: {exc}"})
        return out

    def holders_of(self, key: str) -> tuple[set[str], set[str]]:
        """(the nodes that held `key` at the last round, every node that answered then)."""
        return {n for n, keys in self.holders.items() if key in keys}, set(self.holders)

    def _holders(self) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for node in self._nodes():
            try:
                out[node] = set(self._keys(node))
            except Exception as exc:  # noqa: BLE001 - a node that does not answer is left out
                log.info("warm copies: %s did not list its images: %s", node, exc)
        return out

    def _run(self, plan: list[Copy]) -> None:
        try:
            for copy in plan:
                self._one(copy)
        finally:
            self._running.clear()

    def _one(self, copy: Copy) -> None:
        t0 = self._clock()
        try:
            got = self._fetch(copy.dst, copy.src, copy.key)
        except Exception as exc:  # noqa: BLE001 - counted, retried after the backoff
            self._failed[(copy.key, copy.dst)] = self._clock()
            log.warning("warm image %s not copied %s -> %s: %s", copy.key, copy.src, copy.dst, exc)
            self._emit(EventKind.WARM_COPY_FAILED, key=copy.key, src=copy.src, dst=copy.dst,
                       error=f"{type(exc).__name__}: {exc}")
            return
        self._failed.pop((copy.key, copy.dst), None)
        if got.get("copied"):
            self._emit(EventKind.WARM_IMAGE_COPIED, key=copy.key, src=copy.src, dst=copy.dst,
                       bytes=got.get("bytes"), seconds=round(self._clock() - t0, 3))
