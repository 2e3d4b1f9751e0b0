"""The routing table: model -> replicas (worker id -> endpoint, state), and the hold /
switch / release protocol. Pure asyncio; no transport."""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from . import errors
from .policies import Policy, make_policy


#: a switch `at_token` (a handoff's): the longest a stream waits for its next token before it is
#: cut anyway (a stream in its prefill, or a stalled source)
AT_TOKEN_WAIT_S = 1.0


class ReplicaState(str, enum.Enum):
    ACTIVE = "active"
    HELD = "held"


@dataclass(eq=False)
class StreamHandle:
    """One in-flight upstream request, registered so that a switch can cut it over.

    `abort` is set by the transport to a callable that drops the upstream connection; a switch
    sets `moved` and calls it. The request's own loop notices the break and continues."""

    worker_id: str
    abort: Callable[[], None] | None = None
    moved: bool = False
    #: the request's StreamState (a stream's legs only): what a handoff warms up and keeps
    stream: Any = None
    endpoint: str = ""  # where its upstream request went
    #: a switch `at_token`: the request's relay ends the leg right after the next token it
    #: passes on (the client's gap is then the continuation's first token only, not also the
    #: time since the source's last token); AT_TOKEN_WAIT_S later it is cut in any case
    cut_due: bool = False

    def progress(self) -> dict | None:
        """The stream's prompt ids, the ids sent so far and whether a continuation of it is
        exact (docs/router.md "What a continuation keeps"); None: nothing to warm up."""
        st = self.stream
        prompt = st.prompt_ids if st is not None else None
        if prompt is None:
            return None
        sent = st.sent_ids
        return {"prompt_ids": prompt, "sent_ids": sent, "endpoint": self.endpoint,
                "inexact": st.leg_codec.inexact_reasons(st.kind, st.body, sent)}

    def cut_at_token(self, wait_s: float | None = None) -> None:
        """Cut at the stream's next token boundary (its relay ends the leg: `cut_due`), at the
        latest `wait_s` (AT_TOKEN_WAIT_S) from now; at once where no event loop runs."""
        wait_s = AT_TOKEN_WAIT_S if wait_s is None else wait_s
        self.moved = True
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.cut()
            return
        self.cut_due = True
        loop.call_later(wait_s, lambda: self.cut() if self.cut_due else None)

    def cut(self) -> None:
        self.moved = True
        self.cut_due = False
        if self.abort is not None:
            try:
                self.abort()
            except Exception:  # pragma: no cover - transport specific
                pass


@dataclass(eq=False)
class Replica:
    worker_id: str
    model: str
    endpoint: str
    state: ReplicaState = ReplicaState.ACTIVE
    in_flight: int = 0
    generation: int = 0  # bumped on every switch
    waiters: collections.deque = field(default_factory=collections.deque)
    streams: set = field(default_factory=set)
    held_since: float | None = None
    #: held by the router itself because it could not reach the worker (not by the control
    #: API); ends on switch/release/remove, a healthy probe, or the router's timer
    suspect: bool = False
    suspect_epoch: int = 0
    #: the worker's engine (its continuation codec); None: the router's default engine
    engine: str | None = None
    #: the GPUs the worker holds, whole or a share of one (0.25: relocator.shares); None: not told
    gpus: float | None = None

    def info(self) -> dict:
        return {"worker_id": self.worker_id, "model": self.model, "endpoint": self.endpoint,
                "engine": self.engine, "gpus": self.gpus,
                "state": self.state.value, "in_flight": self.in_flight,
                "held_requests": len(self.waiters), "generation": self.generation,
                "suspect": self.suspect}


class RoutingTable:
    """Replicas by model, a policy, and the hold queues.

    hold(w): new requests that would go to w (no active sibling) wait, FIFO, bounded, with a
    timeout (with an active sibling they go there, and so do w's streams in flight); switch(w, endpoint): w now lives at endpoint, every stream in flight on w is cut
    (its owner continues it on the new endpoint), the queue is released in arrival order;
    release(w): un-hold without moving (the rollback path).

    suspect_hold(w): the router's own hold of a worker it cannot reach (no other active
    replica could take its requests); the same waiting, ended by the control API (hold turns it
    into a normal hold; switch, release and remove end it as usual) or by the router
    (end_suspect: a healthy probe releases it, the timer fails its waiters)."""

    def __init__(self, policy: Policy | str = "least_in_flight", *, hold_queue_max: int = 1024,
                 hold_timeout_s: float = 60.0, prefer_sibling_when_held: bool = True) -> None:
        self.policy = make_policy(policy) if isinstance(policy, str) else policy
        self.hold_queue_max = hold_queue_max
        self.hold_timeout_s = hold_timeout_s
        self.prefer_sibling_when_held = prefer_sibling_when_held
        self._replicas: dict[str, Replica] = {}
        self._by_model: dict[str, list[Replica]] = {}
        self.on_held_change: Callable[[int], None] | None = None
        self.dispatch_log: collections.deque = collections.deque(maxlen=256)
        self._suspect_seq = 0

    # ---- inventory -------------------------------------------------------------------
    def add(self, worker_id: str, model: str, endpoint: str, engine: str | None = None,
            gpus: float | None = None) -> Replica:
        endpoint = endpoint.rstrip("/")
        old = self._replicas.get(worker_id)
        if old is not None:
            if old.model != model:
                raise ValueError(f"worker {worker_id} already serves {old.model!r}")
            old.endpoint = endpoint
            if engine is not None:
                old.engine = engine
            if gpus is not None:
                old.gpus = gpus
            return old
        r = Replica(worker_id, model, endpoint, engine=engine, gpus=gpus)
        self._replicas[worker_id] = r
        self._by_model.setdefault(model, []).append(r)
        return r

    def remove(self, worker_id: str) -> Replica:
        r = self.get(worker_id)
        del self._replicas[worker_id]
        lst = self._by_model[r.model]
        lst.remove(r)
        if not lst:
            del self._by_model[r.model]
        while r.waiters:
            fut = r.waiters.popleft()
            if not fut.done():
                fut.set_exception(errors.no_replica(r.model))
        self._held_changed()
        for s in list(r.streams):
            s.cut()
        return r

    def get(self, worker_id: str) -> Replica:
        try:
            return self._replicas[worker_id]
        except KeyError:
            raise KeyError(f"unknown worker {worker_id!r}") from None

    def models(self) -> list[str]:
        return sorted(self._by_model)

    def replicas(self, model: str | None = None) -> list[Replica]:
        if model is None:
            return list(self._replicas.values())
        return list(self._by_model.get(model, ()))

    def has_model(self, model: str) -> bool:
        return model in self._by_model

    def held_requests(self) -> int:
        return sum(len(r.waiters) for r in self._replicas.values())

    # ---- selection -------------------------------------------------------------------
    async def acquire(self, model: str, key: str | None = None,
                      exclude: Iterable[str] = ()) -> Replica:
        """Pick a replica for one request and count it in flight. Waits (bounded) when the
        only candidates are held. Raises RouterError 404/503."""
        reps = self._by_model.get(model)
        if not reps:
            raise errors.model_not_found(model)
        if exclude:
            ex = set(exclude)
            cands = [r for r in reps if r.worker_id not in ex] or list(reps)
        else:
            cands = reps
        active = [r for r in cands if r.state is ReplicaState.ACTIVE]
        if active and (self.prefer_sibling_when_held or len(active) == len(cands)):
            r = self.policy.choose(active, key) if len(active) > 1 else active[0]
            r.in_flight += 1
            return r
        held = [r for r in cands if r.state is ReplicaState.HELD]
        if not held:  # pragma: no cover - cands are active or held
            raise errors.no_replica(model)
        target = held[0] if len(held) == 1 else min(held, key=lambda x: len(x.waiters))
        return await self.wait_for(target)

    async def wait_for(self, r: Replica) -> Replica:
        """Wait until held replica `r` is switched or released, FIFO; count it in flight."""
        if r.state is ReplicaState.ACTIVE:
            r.in_flight += 1
            return r
        if len(r.waiters) >= self.hold_queue_max:
            raise errors.hold_queue_full(r.worker_id)
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        r.waiters.append(fut)
        self._held_changed()
        ok = False
        try:
            got: Replica = await asyncio.wait_for(asyncio.shield(fut), self.hold_timeout_s)
            ok = True
            return got  # in_flight was counted by _release for this waiter
        except asyncio.TimeoutError:
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                ok = True  # released at the very instant the timeout fired
                return fut.result()
            if r.suspect:  # held by the router itself: the worker did not answer
                raise errors.worker_unreachable(r.worker_id, self.hold_timeout_s) from None
            raise errors.hold_timeout(r.worker_id, self.hold_timeout_s) from None
        finally:
            if not ok:
                if fut.done() and not fut.cancelled() and fut.exception() is None:
                    fut.result().in_flight -= 1  # released, but our caller went away
                elif not fut.done():
                    fut.cancel()
            try:
                r.waiters.remove(fut)
            except ValueError:
                pass
            self._held_changed()

    def done(self, r: Replica) -> None:
        r.in_flight -= 1

    # ---- streams ---------------------------------------------------------------------
    def register(self, r: Replica, handle: StreamHandle) -> None:
        r.streams.add(handle)

    def unregister(self, r: Replica, handle: StreamHandle) -> None:
        r.streams.discard(handle)

    # ---- relocation protocol ---------------------------------------------------------
    def hold(self, worker_id: str) -> dict:
        """New requests for the worker wait (or go to an active sibling). With an active sibling
        (`prefer_sibling_when_held`) its streams in flight are cut too, and continued there at
        once (core: `_next_replica`): a relocation is about to freeze the worker, and a frozen
        worker's connections neither answer nor break (CRIU holds them in repair mode behind its
        packet filter), so a stream left on it would wait out the whole freeze."""
        r = self.get(worker_id)
        if r.state is not ReplicaState.HELD:
            r.state = ReplicaState.HELD
            r.held_since = time.monotonic()
        r.suspect = False  # the control plane owns this hold now: no probe, no timer
        moved = 0
        if self.active_sibling(r):
            for s in list(r.streams):
                moved += 1
                s.cut()
        info = r.info()
        info["moved_streams"] = moved
        return info

    def active_sibling(self, r: Replica) -> bool:
        """Another replica of `r`'s model is active and may take `r`'s requests while `r` is
        held (`prefer_sibling_when_held`)."""
        return self.prefer_sibling_when_held and any(
            x is not r and x.state is ReplicaState.ACTIVE for x in self._by_model.get(r.model, ()))

    def streams(self, worker_id: str) -> list[dict]:
        """The progress of every stream in flight on the worker (StreamHandle.progress)."""
        got = (h.progress() for h in list(self.get(worker_id).streams))
        return [p for p in got if p is not None]

    def switch(self, worker_id: str, endpoint: str, *, release: bool = True,
               keep_inexact: bool = False, cut_from: str | None = None, at_token: bool = False) -> dict:
        """`keep_inexact`: a stream whose continuation would not be exact is not cut: it ends
        on the endpoint it has (a handoff's source, serving on for a window). `cut_from`: only
        streams reading from that endpoint are cut (the handoff's source, past its window).
        `at_token`: each stream is cut right after its next token (StreamHandle.cut_at_token):
        a source that serves on (a handoff) keeps the client's gap to the continuation's start."""
        r = self.get(worker_id)
        old = r.endpoint
        r.endpoint = endpoint.rstrip("/")
        r.suspect = False
        r.generation += 1
        moved = kept = 0
        for s in list(r.streams):
            if cut_from is not None and s.endpoint != cut_from.rstrip("/"):
                continue  # already on the target: left alone
            p = s.progress() if keep_inexact else None
            if p is not None and p["inexact"]:
                kept += 1
                continue
            moved += 1
            if at_token:
                s.cut_at_token()
            else:
                s.cut()
        info = r.info()
        info["moved_streams"] = moved
        info["kept_streams"] = kept
        info["previous_endpoint"] = old
        if release:
            info["released"] = self._release(r)
        return info

    def release(self, worker_id: str) -> dict:
        r = self.get(worker_id)
        n = self._release(r)
        info = r.info()
        info["released"] = n
        return info

    # ---- the router's own hold of an unreachable worker -------------------------------
    def suspect_hold(self, worker_id: str) -> int | None:
        """Hold an active worker that cannot be reached; returns the hold's epoch (for
        is_suspect / end_suspect), or None if the worker is already held."""
        r = self.get(worker_id)
        if r.state is ReplicaState.HELD:
            return None
        self._suspect_seq += 1
        r.state = ReplicaState.HELD
        r.held_since = time.monotonic()
        r.suspect = True
        r.suspect_epoch = self._suspect_seq
        return r.suspect_epoch

    def is_suspect(self, r: Replica, epoch: int) -> bool:
        """Is `r` still in the table and still in the suspect hold `epoch`?"""
        return r.suspect and r.suspect_epoch == epoch and self._replicas.get(r.worker_id) is r

    def end_suspect(self, r: Replica, epoch: int, error: Exception | None = None) -> int:
        """End suspect hold `epoch` (no-op if it already ended): release the waiters (they
        retry the same endpoint), or with `error`, fail them; the worker is active again."""
        if not self.is_suspect(r, epoch):
            return 0
        if error is None:
            return self._release(r)
        r.state = ReplicaState.ACTIVE
        r.held_since = None
        r.suspect = False
        n = 0
        while r.waiters:
            fut = r.waiters.popleft()
            if not fut.done():
                fut.set_exception(error)
                n += 1
        self._held_changed()
        return n

    def _release(self, r: Replica) -> int:
        r.state = ReplicaState.ACTIVE
        r.held_since = None
        r.suspect = False
        n = 0
        while r.waiters:  # arrival order: futures resolve (and their tasks wake) FIFO
            fut = r.waiters.popleft()
            if not fut.done():
                r.in_flight += 1
                fut.set_result(r)
                n += 1
        self._held_changed()
        return n

    def _held_changed(self) -> None:
        if self.on_held_change is not None:
            self.on_held_change(self.held_requests())

    def snapshot(self) -> dict:
        return {"policy": self.policy.name,
                "models": {m: [r.info() for r in reps] for m, reps in self._by_model.items()}}
