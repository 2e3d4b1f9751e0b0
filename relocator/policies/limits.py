"""Hysteresis and budget, per policy: a condition must hold `hold_s` unbroken before it is
acted on, the same condition is left alone for `cooldown_s` after, and at most
`max_moves_per_hour` budgeted steps start in any sliding hour. Clock injected (tests)."""

from __future__ import annotations

from collections import deque
from typing import Callable

from relocator.policies.spec import Limits

HOUR_S = 3600.0


class PolicyLimits:
    def __init__(self, limits: Limits, clock: Callable[[], float]) -> None:
        self.limits, self.clock = limits, clock
        self.first_seen: dict[str, float] = {}  # condition key -> since when it holds, unbroken
        self.acted: dict[str, float] = {}  # condition key -> when it was last acted on
        self.running: set[str] = set()  # keys whose action is in progress
        self._spent: deque[float] = deque()  # when each budgeted step started

    def observe(self, keys: set[str]) -> None:
        """This round's true conditions: a key that is not among them starts over."""
        now = self.clock()
        for k in list(self.first_seen):
            if k not in keys:
                del self.first_seen[k]
        for k in keys:
            self.first_seen.setdefault(k, now)

    def held_for(self, key: str) -> float:
        return self.clock() - self.first_seen.get(key, self.clock())

    def budget_left(self) -> int:
        now = self.clock()
        while self._spent and now - self._spent[0] >= HOUR_S:
            self._spent.popleft()
        return max(0, self.limits.max_moves_per_hour - len(self._spent))

    def verdict(self, key: str, cost: int) -> str:
        """'' when the condition may be acted on now, else why not."""
        if key in self.running:
            return "running"
        left = self.limits.hold_s - self.held_for(key)
        if left > 0:
            return f"holding: {left:.1f} s more before acting"
        if key in self.acted and self.clock() - self.acted[key] < self.limits.cooldown_s:
            return f"cooldown: acted {self.clock() - self.acted[key]:.0f} s ago (cooldown_s={self.limits.cooldown_s:g})"
        if cost and self.budget_left() < cost:
            return (f"budget: {cost} move(s) wanted, {self.budget_left()} left of "
                    f"max_moves_per_hour={self.limits.max_moves_per_hour}")
        return ""

    def spend(self, key: str, cost: int) -> None:
        now = self.clock()
        self.acted[key] = now
        self._spent.extend([now] * cost)
