"""Time budgets of a chaos run: one per step (a fault's move and what follows it) and one for
the whole run. A run that overruns one ends with the verdict `stalled`, naming the step (its
fault), the last event seen and what the runner was waiting for; the clean-up still runs.

The steps run on a thread of their own (`guarded`): a call that blocks on a controller that is
gone for good (a Ray call waiting on an actor that cannot be restarted) cannot hold the run
past its budget. The runner's poll loops call `Watch.check`, so an abandoned step thread stops
at its next poll instead of acting on the cluster during the clean-up.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable


class Stalled(RuntimeError):
    """A budget ran out (or the run gave up on this step): `verdict` says where."""

    def __init__(self, verdict: dict[str, Any]) -> None:
        super().__init__(f"stalled in {verdict.get('step')}: waiting for {verdict.get('waiting_for')}")
        self.verdict = verdict


@dataclass
class Watch:
    run_budget_s: float
    step_budget_s: float
    clock: Callable[[], float] = time.monotonic
    step: str = "setup"
    fault: str | None = None
    last_event: str | None = None
    waiting_for: str | None = None
    _t0: float = field(init=False)
    _step_t0: float = field(init=False)
    _step_budget: float | None = field(init=False, default=None)  # None: only the run's budget
    _abandoned: dict[str, Any] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self._t0 = self._step_t0 = self.clock()

    def begin(self, step: str, fault: str | None = None, budget_s: float | None = None) -> None:
        """A step starts: its own budget (default `step_budget_s`) counts from now."""
        self.step, self.fault, self.waiting_for = step, fault, None
        self._step_t0 = self.clock()
        self._step_budget = budget_s if budget_s is not None else self.step_budget_s

    def phase(self, step: str) -> None:
        """Work outside the steps (launch, checks): the run's budget only."""
        self.step, self.fault, self.waiting_for, self._step_budget = step, None, None, None

    def seen(self, event: str) -> None:
        self.last_event = event

    def waiting(self, what: str) -> None:
        self.waiting_for = what

    def expired(self) -> dict[str, Any] | None:
        """The stall verdict once a budget has run out (or the run gave up), else None."""
        if self._abandoned is not None:
            return self._abandoned
        now = self.clock()
        if now - self._t0 > self.run_budget_s:
            return self._verdict("run", self.run_budget_s, now - self._t0)
        if self._step_budget is not None and now - self._step_t0 > self._step_budget:
            return self._verdict("step", self._step_budget, now - self._step_t0)
        return None

    def check(self) -> None:
        v = self.expired()
        if v is not None:
            raise Stalled(v)

    def abandon(self, verdict: dict[str, Any]) -> None:
        """The run stops waiting for the step thread: its next `check` raises."""
        self._abandoned = verdict

    def _verdict(self, budget: str, budget_s: float, elapsed: float) -> dict[str, Any]:
        return {"verdict": "stalled", "budget": budget, "budget_s": budget_s, "elapsed_s": round(elapsed, 1),
                "step": self.step, "fault": self.fault, "last_event": self.last_event,
                "waiting_for": self.waiting_for}


def guarded(fn: Callable[[], Any], watch: Watch, poll_s: float = 0.2) -> dict[str, Any] | None:
    """Run `fn` on a daemon thread until it returns or `watch` runs out. Returns None when it
    returned, else the stall verdict (`fn` is left behind, told to stop at its next check).
    An exception of `fn` is raised here; a `Stalled` it raised is its verdict."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    t = threading.Thread(target=body, daemon=True, name="chaos-steps")
    t.start()
    while t.is_alive():
        t.join(poll_s)
        v = watch.expired()
        if v is not None and t.is_alive():
            watch.abandon(v)
            return v
    err = box.get("error")
    if isinstance(err, Stalled):
        return err.verdict
    if err is not None:
        raise err
    return None
