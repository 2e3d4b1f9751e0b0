"""relocator.waits: the one wait helper (no real sleeps: a fake clock drives tenacity)."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from relocator import waits


def test_until_returns_the_first_truthy_value():
    values = iter([None, 0, "", "ready", "later"])
    assert waits.until(lambda: next(values), timeout=5, every=0, what="x") == "ready"


def test_until_raises_a_timeout_naming_what_it_waited_for(monkeypatch):
    calls = itertools.count()
    with pytest.raises(waits.WaitTimeout) as err:
        waits.until(lambda: next(calls) < 0, timeout=0.05, every=0.01, what="the cell's init pid")
    assert isinstance(err.value, TimeoutError)
    assert "the cell's init pid" in str(err.value)
    assert err.value.last is False
    assert next(calls) >= 2  # polled more than once before giving up


def test_an_exception_from_the_predicate_aborts_at_once():
    calls = []

    def pred():
        calls.append(1)
        raise RuntimeError("the process died")

    with pytest.raises(RuntimeError, match="died"):
        waits.until(pred, timeout=5, every=0)
    assert calls == [1]


def test_settle_gives_up_quietly_with_the_last_value():
    assert waits.settle(lambda: 0, timeout=0.02, every=0.005) == 0
    assert waits.settle(lambda: 7, timeout=0.02, every=0.005) == 7


def test_gone_reports_whether_the_thing_went_away():
    left = iter([True, True, False])
    assert waits.gone(lambda: next(left), timeout=5, every=0) is True
    assert waits.gone(lambda: True, timeout=0.02, every=0.005) is False


def test_until_async_takes_coroutines_and_plain_functions():
    values = iter([False, False, 3])

    async def pred():
        return next(values)

    assert asyncio.run(waits.until_async(pred, timeout=5, every=0)) == 3
    assert asyncio.run(waits.until_async(lambda: "now", timeout=5, every=0)) == "now"
    with pytest.raises(waits.WaitTimeout, match="a token"):
        asyncio.run(waits.until_async(lambda: None, timeout=0.02, every=0.005, what="a token"))


def test_a_local_worker_waits_until_ready_and_fails_when_its_process_exits(tmp_path):
    from types import SimpleNamespace

    from relocator.local_worker import LocalWorker

    answers = iter([False, False, True])
    adapter = SimpleNamespace(is_ready=lambda _url: asyncio.sleep(0, next(answers)))
    proc = SimpleNamespace(poll=lambda: None, returncode=None)
    w = LocalWorker(adapter, SimpleNamespace(port=1, served_model_name="m"), proc, tmp_path / "log")
    assert asyncio.run(w.wait_ready(timeout=30)) >= 0

    proc.poll, proc.returncode = (lambda: 3), 3
    with pytest.raises(RuntimeError, match="exited with 3"):
        asyncio.run(w.wait_ready(timeout=30))
