"""Periodic consolidation: a reconcile step that packs running workers onto fewer nodes when the
plan is worth it (config `controller.consolidate`: enabled, min_gain_nodes, max_moves_per_hour;
off by default).

Narrow collaborators (testable without Ray): `plan(max_moves)` returns a consolidation plan
({"nodes_freed", "moves"}) without running it, `run(max_moves)` runs one and returns what
happened, `busy()` says the cluster is doing something else (a demand waiting or being seated,
a relocation open): packing then would fight it. A run goes on its own thread (`spawn`), one at
a time; its failure is logged and counted, and the next round tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from typing import Any, Callable

log = logging.getLogger("relocator.controller")
HOUR_S = 3600.0


def _thread(fn: Callable[[], None]) -> None:
    threading.Thread(target=fn, name="consolidate", daemon=True).start()


class PeriodicConsolidation:
    def __init__(self, config: Any, plan: Callable[[int], dict], run: Callable[[int], dict],
                 busy: Callable[[], bool], clock: Callable[[], float] = time.time,
                 spawn: Callable[[Callable[[], None]], None] = _thread) -> None:
        from relocator.cluster.config import ConsolidateSection

        self.config = config if isinstance(config, ConsolidateSection) else ConsolidateSection.model_validate(
            config or {})
        self._plan, self._run, self._busy, self._clock, self._spawn = plan, run, busy, clock, spawn
        self._moves: deque[float] = deque()  # when each move this hour was started
        self._running = threading.Event()
        self.last: dict[str, Any] = {}  # the last round's outcome: {"at", "ran", "why" | "result" | "error"}

    def budget(self) -> int:
        """Moves left in the sliding hour."""
        now = self._clock()
        while self._moves and now - self._moves[0] >= HOUR_S:
            self._moves.popleft()
        return max(0, self.config.max_moves_per_hour - len(self._moves))

    def update(self) -> None:
        """One round: skipped (and why) unless enabled, idle, within the hourly cap and worth
        `min_gain_nodes` freed nodes; otherwise the consolidation starts on its own thread."""
        why = self._why_not()
        if why:
            self.last = {"at": self._clock(), "ran": False, "why": why}
            return
        budget = self.budget()
        plan = self._plan(budget)
        gain = len(plan.get("nodes_freed", []))
        if not plan.get("moves") or gain < self.config.min_gain_nodes:
            self.last = {"at": self._clock(), "ran": False,
                         "why": f"frees {gain} node(s), below min_gain_nodes={self.config.min_gain_nodes}"}
            return
        self._running.set()
        now = self._clock()
        self._moves.extend([now] * len(plan["moves"]))  # counted when started: a failed move counts too

        def body() -> None:
            try:
                res = self._run(budget)
                self.last = {"at": self._clock(), "ran": True, "result": res}
                log.warning("periodic consolidation: %d move(s), nodes freed %s", len(res.get("moves", [])),
                            res.get("nodes_freed"))
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                self.last = {"at": self._clock(), "ran": True, "error": str(exc)}
                log.warning("periodic consolidation failed: %s", exc)
            finally:
                self._running.clear()

        self._spawn(body)

    def _why_not(self) -> str:
        if not self.config.enabled:
            return "disabled"
        if self._running.is_set():
            return "a consolidation is running"
        if self._busy():
            return "demands, relocations or a drain in progress"
        if self.budget() <= 0:
            return f"max_moves_per_hour={self.config.max_moves_per_hour} reached"
        return ""
