"""What the controller is doing right now, in memory (not stored): which workers a thread owns,
which demands are being seated, which ids and reservations are taken but not yet recorded.
Shared by the state managers; one lock guards it all."""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

log = logging.getLogger("relocator.controller")


@dataclass
class Claims:
    lock: threading.RLock = field(default_factory=threading.RLock)
    seating: threading.RLock = field(default_factory=threading.RLock)  # one seating (or packing) at a time
    wake: threading.Event = field(default_factory=threading.Event)  # set: run the reconcile loop now
    busy: set[str] = field(default_factory=set)  # workers a thread owns (a move, a start, a suspend)
    placing: set[str] = field(default_factory=set)  # demands being seated now
    naming: set[str] = field(default_factory=set)  # worker ids chosen by launches not yet recorded
    reservations: set[str] = field(default_factory=set)  # placement groups asked for, not yet recorded

    def take(self, worker: str, refusal: str) -> None:
        """Own `worker`, or RuntimeError(refusal) when a thread owns it already."""
        with self.lock:
            if worker in self.busy:
                raise RuntimeError(refusal)
            self.busy.add(worker)

    def release(self, worker: str) -> None:
        with self.lock:
            self.busy.discard(worker)

    def unplace(self, demand: str) -> None:
        with self.lock:
            self.placing.discard(demand)


def best_effort(what: str, *steps: Callable[[], Any]) -> None:
    """Each cleanup step in turn: one that fails is logged and the rest still run."""
    for fn in steps:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            log.warning("%s: %s", what, exc)


def collect(errors: list[str], what: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001
        errors.append(f"{what}: {exc}")


def collect_into(out: list[dict], wid: str, fn: Callable[[], dict]) -> None:
    try:
        out.append(fn())
    except Exception as exc:  # noqa: BLE001 - the rest goes on
        out.append({"worker": wid, "error": str(exc)})
