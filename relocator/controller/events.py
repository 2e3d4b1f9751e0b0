"""Events a platform can react to: relocation phases, rollbacks, lost nodes and workers,
replacements.

Each event is appended to the controller's store (numbered: the number is a subscriber's
cursor, so a subscriber misses nothing across a controller restart), written as one JSON line
to `DIR/events.jsonl` (logger `relocator.events`), and wakes every subscriber waiting in
`EventLog.wait` (what `relocator.connect().events()` calls: a long poll, not a loop of polls).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

from relocator.choices import Choice
from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")
json_log = logging.getLogger("relocator.events")


class EventKind(Choice):
    RELOCATION_STARTED = "relocation_started"  # from, to, transfer
    PHASE_STARTED = "phase_started"  # phase (persisted before it starts)
    PHASE_ENDED = "phase_ended"  # phase, ok, seconds, error
    ROLLBACK = "rollback"  # from_phase, steps, errors, source_serving_s
    RELOCATION_RECOVERING = "relocation_recovering"  # phase: a restarted controller takes it over
    RELOCATION_FINISHED = "relocation_finished"  # result, reason, error, phases
    NODE_LOST = "node_lost"  # node
    WORKER_LOST = "worker_lost"  # worker, node, error
    REPLACEMENT_STARTED = "replacement_started"  # worker, from_node
    REPLACEMENT_FINISHED = "replacement_finished"  # worker, from_node, to_node, how, ok, seconds, error
    # the scheduling layer (docs/api.md): demands, the moves that make room, suspends, resumes
    DEMAND_PENDING = "demand_pending"  # demand, demand_kind, model, gpus, priority, reason
    DEMAND_PLACED = "demand_placed"  # demand, demand_kind, worker, node, moves, suspended, seconds
    ROOM_PLANNED = "room_planned"  # demand, node, moves [{worker, from, to}], suspends
    WORKER_SUSPENDED = "worker_suspended"  # worker, node, reason, image_bytes, sibling, seconds
    WORKER_RESUMED = "worker_resumed"  # worker, node, seconds, suspended_s (in_place: a paused one)
    WORKER_EVICTED = "worker_evicted"  # worker, node, reason, by, seconds (preemption: evict-requeue)
    WORKER_PREEMPTIBLE = "worker_preemptible"  # worker, node, deadline, priority: past its time limit
    SUSPEND_FAILED = "suspend_failed"  # worker, node, reason, error, failures, retry_in_s (its back-off)
    CONSOLIDATED = "consolidated"  # moves, nodes_freed, gpus_moved, results
    # every change of a worker's state outside a relocation (states.transition)
    WORKER_STATE = "worker_state"  # worker, node, from, to, why
    # how a start went (issue 28): how (warm: restored from its kind's image | cold), key, reason, capture
    WORKER_STARTED = "worker_started"  # worker, node, cell, how, key, reason, capture, copied, seconds
    # policies (docs/policies.md): what a policy planned when it fired, how it went; GPU health
    POLICY_PLANNED = "policy_planned"  # policy, trigger, action, firing, steps, move_s, short_by_s
    POLICY_OUTCOME = "policy_outcome"  # policy, firing, results, ok, met_deadline, seconds
    GPU_HEALTH = "gpu_health"  # node, gpu, from, to (healthy | draining | ready_for_reset | failed), why
    # warm images copied ahead of need (controller/warmcopies.py): key, src, dst, bytes, seconds | error
    WARM_IMAGE_COPIED = "warm_image_copied"
    WARM_COPY_FAILED = "warm_copy_failed"
    # a copy ahead of need that gave way to a relocation or a start: key, src, dst, why,
    # cancelled (true: it was running, its transfer stopped and partial image dropped); retried later
    WARM_COPY_DEFERRED = "warm_copy_deferred"


def json_line_logger(path: Path | None) -> None:
    """`relocator.events` writes one JSON object per line to `path` (once per process)."""
    if path is None or any(getattr(h, "_relocator_events", False) for h in json_log.handlers):
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    h = logging.FileHandler(path)
    h.setFormatter(logging.Formatter("%(message)s"))
    h._relocator_events = True  # type: ignore[attr-defined]
    json_log.addHandler(h)
    json_log.setLevel(logging.INFO)
    json_log.propagate = False


class EventLog:
    def __init__(self, store: Store, json_path: Path | None = None) -> None:
        self.store = store
        self._cond = threading.Condition()
        self._last = store.last_event_seq()
        json_line_logger(json_path)

    @property
    def last(self) -> int:
        return self._last

    def emit(self, kind: EventKind | str, fields: dict[str, Any]) -> dict[str, Any]:
        """Record one event; never raises (an event that cannot be stored is logged)."""
        ev = {"ts": round(time.time(), 6), "kind": EventKind(kind).value, **fields}
        try:
            with self._cond:  # numbered and announced in the same order
                ev = {"seq": self.store.append_event(ev), **ev}
                self._last = ev["seq"]
                self._cond.notify_all()
        except Exception as exc:  # noqa: BLE001 - an event never breaks what it reports
            log.warning("event %s not stored: %s", ev["kind"], exc)
        json_log.info(json.dumps(ev, default=str, separators=(",", ":")))
        return ev

    def wait(self, after: int, timeout: float = 20.0, limit: int = 1000) -> dict[str, Any]:
        """Events numbered above `after` (at most `limit`), waiting up to `timeout` for the first
        one. Returns {"events": [...], "cursor": the number to pass next time}."""
        with self._cond:
            self._cond.wait_for(lambda: self._last > after, timeout=max(0.0, timeout))
        events = self.store.events_after(after, limit) if self._last > after else []
        return {"events": events, "cursor": events[-1]["seq"] if events else max(after, 0)}
