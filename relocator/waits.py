"""The tree's one wait helper: poll a condition until it holds or a deadline passes (on tenacity).

`until(pred, timeout, every, what)` returns the first truthy value of `pred()` and raises
`WaitTimeout` (a `TimeoutError` naming `what`) at the deadline; `settle(...)` is the same poll that
gives up quietly (returns the last value) for the "wait a while, then act anyway" cases (SIGTERM,
wait, then SIGKILL); `until_async` is `until` for coroutines. An exception raised by `pred` is not
retried: it propagates at once, so a predicate can abort a wait (the process it waits for died).

Code that runs under `python -S` (the post-copy keeper and pump) cannot import tenacity and keeps
its own small loop: see relocator/agent/postcopy/keeper.py.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable, TypeVar

from tenacity import (AsyncRetrying, RetryCallState, Retrying, retry_if_result, stop_after_delay,
                      stop_never, wait_fixed)

T = TypeVar("T")


class WaitTimeout(TimeoutError):
    """`what` did not happen within `timeout` seconds; `last` is the predicate's last value."""

    def __init__(self, what: str, timeout: float, last: Any = None):
        super().__init__(f"timed out after {timeout:g}s waiting for {what}")
        self.what, self.timeout, self.last = what, timeout, last


def _falsy(value: Any) -> bool:
    return not value


def _stop(timeout: float | None):
    return stop_never if timeout is None else stop_after_delay(max(0.0, timeout))


def _last(state: RetryCallState) -> Any:
    return state.outcome.result() if state.outcome is not None else None


def until(pred: Callable[[], T], timeout: float | None, every: float = 0.1, what: str = "a condition",
          sleep: Callable[[float], None] | None = None) -> T:
    """The first truthy `pred()`, polled every `every` s; WaitTimeout after `timeout` s (None: never).
    `pred` runs at least once, and once more at (or just past) the deadline."""
    def fail(state: RetryCallState) -> T:
        raise WaitTimeout(what, timeout or 0.0, _last(state))

    kw = {"sleep": sleep} if sleep is not None else {}
    return Retrying(stop=_stop(timeout), wait=wait_fixed(every), retry=retry_if_result(_falsy),
                    retry_error_callback=fail, **kw)(pred)


def settle(pred: Callable[[], T], timeout: float | None, every: float = 0.1,
           sleep: Callable[[float], None] | None = None) -> T:
    """`until` that does not raise: the first truthy `pred()`, else its last (falsy) value at the
    deadline. For waits after which the caller acts either way."""
    kw = {"sleep": sleep} if sleep is not None else {}
    return Retrying(stop=_stop(timeout), wait=wait_fixed(every), retry=retry_if_result(_falsy),
                    retry_error_callback=_last, **kw)(pred)


def gone(alive: Callable[[], Any], timeout: float | None, every: float = 0.1,
         sleep: Callable[[float], None] | None = None) -> bool:
    """Wait until `alive()` turns falsy; True if it did within `timeout` (no raise)."""
    return settle(lambda: not alive(), timeout, every, sleep=sleep)


async def until_async(pred: Callable[[], T | Awaitable[T]], timeout: float | None, every: float = 0.1,
                      what: str = "a condition") -> T:
    """`until` for the event loop: `pred` may be a plain or a coroutine function; sleeps are
    `asyncio.sleep`, so other tasks run meanwhile."""
    async def call() -> T:
        value = pred()
        return await value if inspect.isawaitable(value) else value

    def fail(state: RetryCallState) -> T:
        raise WaitTimeout(what, timeout or 0.0, _last(state))

    return await AsyncRetrying(stop=_stop(timeout), wait=wait_fixed(every), retry=retry_if_result(_falsy),
                               retry_error_callback=fail, sleep=asyncio.sleep)(call)
