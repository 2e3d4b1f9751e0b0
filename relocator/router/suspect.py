"""Unreachable workers: when no other replica can take over, the router holds the worker it
cannot reach ("suspect hold") and waits for the control plane (a switch, a release) or for
the worker to answer its health probe again, for at most `hold_s`."""

from __future__ import annotations

import asyncio
import logging
import time

from relocator.waits import WaitTimeout, until_async

from . import errors
from .table import Replica, ReplicaState, RoutingTable, StreamHandle
from .transport import Hooks, Probe

log = logging.getLogger("relocator.router.core")


class Patience:
    """One request's budget for waiting on unreachable workers: it starts suspect waits only
    within `unreachable_hold_s` of its first one (a worker whose /health answers but whose API
    does not cannot keep a request looping)."""

    __slots__ = ("since",)

    def __init__(self) -> None:
        self.since: float | None = None

    def allows(self, limit: float) -> bool:
        now = time.monotonic()
        if self.since is None:
            self.since = now
        return now - self.since < limit


class Suspects:
    """The suspect holds of one router core and their watchers."""

    def __init__(self, table: RoutingTable, hooks: Hooks, hold_s: float, probe: Probe | None,
                 probe_interval_s: float) -> None:
        self.table, self.hooks = table, hooks
        #: 0 = off: a request to an unreachable sole replica fails at once (502)
        self.hold_s = hold_s
        self.probe = probe
        self.probe_interval_s = probe_interval_s
        self.watchers: set[asyncio.Task] = set()

    def close(self) -> None:
        """Stop the watchers (the holds stay as they are)."""
        for t in list(self.watchers):
            t.cancel()

    def unreachable(self, r: Replica, handle: StreamHandle, model: str, failed: list[str],
                    patience: Patience) -> bool:
        """`r` could not be reached. True: the caller waits for `r` as for a held worker
        (it was switched meanwhile, is already held, or is now suspect-held because no other
        active replica of `model`, other than those in `failed`, can take over); False: the
        caller goes on as before (sibling, retry, error)."""
        if self.hold_s <= 0:
            return False
        if handle.moved:
            return True  # switched while we tried: try it again at its new endpoint
        if not patience.allows(self.hold_s):
            return False
        t = self.table
        try:
            if t.get(r.worker_id) is not r:  # pragma: no cover - removed and re-added
                return False
        except KeyError:
            return False  # removed
        if any(x is not r and x.state is ReplicaState.ACTIVE and x.worker_id not in failed
               for x in t.replicas(model)):
            return False
        if r.state is ReplicaState.HELD:
            return True
        epoch = t.suspect_hold(r.worker_id)
        if epoch is None:  # pragma: no cover - checked above
            return True
        log.warning("worker %s (%s) unreachable: holding it for up to %gs", r.worker_id,
                    r.endpoint, self.hold_s)
        self.hooks.suspect_hold(r.worker_id)
        task = asyncio.get_running_loop().create_task(self._watch(r, epoch))
        self.watchers.add(task)
        task.add_done_callback(self.watchers.discard)
        return True

    async def _watch(self, r: Replica, epoch: int) -> None:
        """Until the suspect hold ends: probe the endpoint every `probe_interval_s` (healthy:
        release, the waiters retry it); after `hold_s` fail the waiters with
        `worker_unreachable` and make the worker active again."""
        t = self.table
        deadline = time.monotonic() + self.hold_s
        outcome = "control"  # switched, released, held or removed through the control API
        looked = False

        async def over() -> bool:
            nonlocal outcome, looked
            if not t.is_suspect(r, epoch):
                return True
            if not looked:  # the first look is at once: the probes start an interval later
                looked = True
                return False
            if not await self._healthy(r, epoch, deadline):
                return False
            n = t.end_suspect(r, epoch)
            log.warning("worker %s healthy again: %d waiters released", r.worker_id, n)
            outcome = "recovered"
            return True

        try:
            await until_async(over, self.hold_s, self.probe_interval_s,
                              what=f"worker {r.worker_id} to be reachable")
        except WaitTimeout:
            if t.is_suspect(r, epoch):
                n = t.end_suspect(r, epoch, errors.worker_unreachable(r.worker_id, self.hold_s))
                log.warning("worker %s still unreachable after %gs: %d waiters failed",
                            r.worker_id, self.hold_s, n)
                outcome = "timeout"
        finally:
            self.hooks.suspect_end(r.worker_id, outcome)

    async def _healthy(self, r: Replica, epoch: int, deadline: float) -> bool:
        """The probe found `r` healthy while still in suspect hold `epoch`."""
        if self.probe is None or not self.table.is_suspect(r, epoch):
            return False
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            ok = await asyncio.wait_for(self.probe(r.endpoint, min(1.0, left)),
                                        min(1.0, left) + 0.1)
        except asyncio.CancelledError:
            raise
        except Exception:
            ok = False
        return bool(ok) and self.table.is_suspect(r, epoch)
