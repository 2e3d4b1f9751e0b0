"""Warm images ahead of need (issue 28): a reconcile step that keeps every warm image on
`prefetch.copies` other nodes besides the one that captured it, other hosts first
(configs/images.yaml), so a worker whose host is lost comes back from an image elsewhere.

Narrow collaborators (testable without Ray): `nodes()` the live nodes, `host_of()` their hosts,
`keys(node)` the images a node holds, `fetch(dst, src, key)` one copy (the target's agent pulls
it, checksummed), `cancel(dst, key)` stop that copy, `emit(kind, **fields)` events,
`count(outcome)` the stored counters behind `relocator_warm_copies_total`.

A copy ahead of need gives way to every relocation, suspend, resume or start (`busy()`: the
nodes they run on, see `busy_nodes`): none starts while one is under way or within
`prefetch.quiet_s` of one, and a running copy is cancelled as soon as one begins (its
transfer stopped, its partial image dropped by the agent) and retried at the next quiet round,
with a `warm_copy_deferred` event. A 1.5 GB copy beside a move on 2 cores once stretched the
move's DUMP from 6.5 to 11.2 s (and is the suspect of an SGLang move rolled back in CI).
Copies run one at a time; a failed copy is not retried to that node for FAILED_BACKOFF_S.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from relocator.controller.events import EventKind
from relocator.warm.config import WarmConfig, YieldScope
from relocator.warm.replicate import Copy, plan_copies

log = logging.getLogger("relocator.controller")
FAILED_BACKOFF_S = 300.0
KEYS_TIMEOUT_S = 10.0
#: how often a running copy looks for an operation it must give way to (seconds)
POLL_S = 0.25
#: how long a cancelled copy is waited for before its thread is left to end on its own
CANCEL_WAIT_S = 30.0
#: in `busy()`: an operation whose node is not chosen yet (a seating, a move without a target)
ANY_NODE = "*"
COUNTS = "warm_copies"  # store kind: {outcome, n} (metrics.py: relocator_warm_copies_total)

Busy = Callable[[], "set[str] | bool"]


def _thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="warm-copies", daemon=True).start()


def busy_nodes(claims: Any, store: Any) -> set[str]:
    """The nodes a relocation, suspend, resume, launch or replacement runs on now (ANY_NODE for
    one whose node is not chosen yet). Only in-memory claims when nothing is under way, so a
    running copy can ask often."""
    with claims.lock:
        workers, placing, naming = set(claims.busy), set(claims.placing), set(claims.naming)
    if not (workers or placing or naming):
        return set()
    out: set[str] = {ANY_NODE} if naming else set()
    for wid in workers | placing:
        w = store.worker(wid)
        if w is None:  # a demand being seated: its node (and its moves' nodes) not known yet
            out.add(ANY_NODE)
        elif w.node:
            out.add(w.node)
    for rel in store.open_relocations():
        out |= {rel.src, rel.dst or ANY_NODE}
    return out


def stored_counter(store: Any) -> Callable[[str], None]:
    """`count(outcome)` over the controller's store (kept across restarts, like every metric)."""
    lock = threading.Lock()

    def count(outcome: str) -> None:
        with lock:
            row = store.get(COUNTS, outcome) or {"outcome": outcome, "n": 0}
            store.put(COUNTS, outcome, {"outcome": outcome, "n": int(row["n"]) + 1})

    return count


class WarmCopies:
    def __init__(self, nodes: Callable[[], list[str]], keys: Callable[[str], list[str]],
                 fetch: Callable[[str, str, str], dict], emit: Callable[..., Any],
                 host_of: Callable[[], dict[str, str]] = dict, cordoned: Callable[[], set[str]] = set,
                 busy: Busy = set, cancel: Callable[[str, str], Any] = lambda dst, key: None,
                 count: Callable[[str], None] = lambda outcome: None,
                 config: Callable[[], WarmConfig] = WarmConfig.load,
                 clock: Callable[[], float] = time.monotonic,
                 spawn: Callable[[Callable[[], None]], None] = _thread, poll_s: float = POLL_S) -> None:
        self._nodes, self._keys, self._fetch, self._emit = nodes, keys, fetch, emit
        self._host_of, self._cordoned, self._busy, self._cancel = host_of, cordoned, busy, cancel
        self._count, self._config, self._clock, self._spawn, self._poll_s = count, config, clock, spawn, poll_s
        self._next = 0.0
        self._busy_at = float("-inf")  # when an operation was last seen under way
        self._running = threading.Event()
        self._failed: dict[tuple[str, str], float] = {}  # (key, node) -> when it failed
        self.last: dict[str, Any] = {}  # the last round: {"planned": [...]} or {"why": ...}
        self.holders: dict[str, set[str]] = {}  # the last round's {live node: keys it holds}
        self.copying: Copy | None = None  # the copy under way

    def update(self) -> None:
        """One round when due: what each live node holds, the copies missing, started."""
        now = self._clock()
        if self._running.is_set():
            return
        cfg = self._config()
        busy = self._busy_now()
        if busy:  # a move or a start under way: a copy would take its CPU and network
            self.last = {"why": f"a relocation or a start is under way (on {', '.join(sorted(busy))})"}
            return
        quiet = now - self._busy_at
        if quiet < cfg.prefetch.quiet_s:
            self.last = {"why": f"waiting for {cfg.prefetch.quiet_s:g} s with no relocation or start "
                                f"({quiet:.1f} s so far)"}
            return
        if now < self._next:
            return
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
            self._spawn(lambda: self._run(plan, cfg.prefetch.yield_to))

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

    # -- giving way --------------------------------------------------------------------------------
    def _busy_now(self) -> set[str]:
        try:
            got = self._busy()
        except Exception as exc:  # noqa: BLE001 - unknown: give way (a copy is never urgent)
            log.info("warm copies: what is under way is unknown: %s", exc)
            got = {ANY_NODE}
        nodes = ({ANY_NODE} if got else set()) if isinstance(got, bool) else set(got)
        if nodes:
            self._busy_at = self._clock()
        return nodes

    def _conflict(self, copy: Copy, scope: YieldScope) -> str | None:
        """Why `copy` must give way now (None: it may run)."""
        busy = self._busy_now()
        if not busy:
            return None
        if scope is YieldScope.CLUSTER or ANY_NODE in busy:
            return f"a relocation or a start is under way (on {', '.join(sorted(busy))})"
        hosts = self._host_of()
        host = lambda n: hosts.get(n, n)  # noqa: E731
        mine = {host(copy.src), host(copy.dst)}
        near = sorted(n for n in busy if host(n) in mine)
        return f"a relocation or a start is under way on {', '.join(near)}" if near else None

    def _deferred(self, copy: Copy, why: str, started: bool, **fields: Any) -> None:
        self._next = 0.0  # retried at the first quiet round, not an interval later
        self._count("deferred")
        log.info("warm image %s copy %s -> %s deferred: %s", copy.key, copy.src, copy.dst, why)
        self._emit(EventKind.WARM_COPY_DEFERRED, key=copy.key, src=copy.src, dst=copy.dst, why=why,
                   cancelled=started, **fields)

    # -- the copies ----------------------------------------------------------------------------------
    def _run(self, plan: list[Copy], scope: YieldScope = YieldScope.CLUSTER) -> None:
        try:
            for i, copy in enumerate(plan):
                why = self._conflict(copy, scope)
                if why is None:
                    why = self._one(copy, scope)
                if why is not None:  # this copy and the rest of the round wait for a quiet round
                    self._deferred(copy, why, started=self.copying is not None)
                    for later in plan[i + 1:]:
                        self._deferred(later, why, started=False)
                    return
        finally:
            self.copying = None
            self._running.clear()

    def _one(self, copy: Copy, scope: YieldScope) -> str | None:
        """Run one copy, cancelling it when an operation begins: None when it ended (copied or
        failed), else why it was cancelled (`self.copying` stays set then)."""
        t0 = self._clock()
        self.copying = copy
        done = threading.Event()
        box: dict[str, Any] = {}

        def go() -> None:
            try:
                box["got"] = self._fetch(copy.dst, copy.src, copy.key)
            except BaseException as exc:  # noqa: BLE001 - read by the watcher below
                box["error"] = exc
            finally:
                done.set()

        threading.Thread(target=go, name=f"warm-copy-{copy.key[-8:]}", daemon=True).start()
        why = None
        while not done.wait(self._poll_s):
            why = self._conflict(copy, scope)
            if why is not None:
                break
        if why is not None and not done.is_set():
            try:
                self._cancel(copy.dst, copy.key)  # the agent stops the stream and drops the partial image
            except Exception as exc:  # noqa: BLE001 - the copy still runs at nice 19; it is not waited for
                log.warning("warm image %s copy to %s not cancelled: %s", copy.key, copy.dst, exc)
            if not done.wait(CANCEL_WAIT_S):
                log.warning("warm image %s copy to %s still running %.0f s after its cancel",
                            copy.key, copy.dst, CANCEL_WAIT_S)
        got, exc = box.get("got"), box.get("error")
        if why is not None and got is None:
            return why  # cancelled (its error is the cancel's): not a failure, no backoff
        self.copying = None
        if exc is not None:
            self._failed[(copy.key, copy.dst)] = self._clock()
            self._count("failed")
            log.warning("warm image %s not copied %s -> %s: %s", copy.key, copy.src, copy.dst, exc)
            self._emit(EventKind.WARM_COPY_FAILED, key=copy.key, src=copy.src, dst=copy.dst,
                       error=f"{type(exc).__name__}: {exc}")
            return None
        self._failed.pop((copy.key, copy.dst), None)
        if got and got.get("copied"):
            self._count("copied")
            self._emit(EventKind.WARM_IMAGE_COPIED, key=copy.key, src=copy.src, dst=copy.dst,
                       bytes=got.get("bytes"), seconds=round(self._clock() - t0, 3))
        return None
