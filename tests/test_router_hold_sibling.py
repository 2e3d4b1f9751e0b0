"""A hold with an active sibling moves the held worker's streams to the sibling at once.

A relocation holds the worker, then freezes it: a frozen worker's connections neither answer nor
break (CRIU keeps them in repair mode behind its packet filter), so a stream left on it waited
out the whole freeze (the README demo: 6.5-6.9 s on the moved worker's clients in some runs,
0.3-1.0 s in others). The fake engine's `stall_after` is that frozen worker: it stops sending and
keeps the connection open."""

from __future__ import annotations

import asyncio

import pytest

from relocator.router.client import RouterControl
from relocator.router.core import RouterCore
from relocator.router.table import ReplicaState, RoutingTable, StreamHandle
from tests.test_router_http import env, sse  # noqa: F401 - the fixture and its reader

BODY = {"model": "fake", "max_tokens": 24, "stream": True, "prompt": "abc", "return_token_ids": True}


def _ids(chunks: list[dict]) -> list[int]:
    return [t for c in chunks if c["choices"] for t in c["choices"][0].get("token_ids") or []]


async def _stalled_stream(srv, fakes, s) -> asyncio.Task:
    """A stream on w1 that stops after 7 tokens, its connection left open (a frozen worker)."""
    fakes[0][0].knobs.stall_after = 7
    task = asyncio.create_task(sse(s, srv.url + "/v1/completions", BODY))
    for _ in range(500):
        await asyncio.sleep(0.01)
        if fakes[0][0]._stalls:
            return task
    raise AssertionError("the stream never reached w1's stall")


@pytest.mark.asyncio(loop_scope="session")
async def test_hold_with_a_sibling_continues_a_frozen_workers_stream_there(env):  # noqa: F811
    srv, fakes, s = env
    _, ref = await sse(s, fakes[1][1] + "/v1/completions", BODY)
    rc = RouterControl(srv.control_url)
    task = await _stalled_stream(srv, fakes, s)
    await rc.add_replica("w2", "fake", fakes[1][1])
    n2 = len(fakes[1][0].requests)
    info = await rc.hold("w1")
    assert info["state"] == "held" and info["moved_streams"] == 1
    _, got = await asyncio.wait_for(task, 10)  # no switch, no release: the sibling finished it
    fakes[0][0].unstall()
    assert _ids(got) == _ids(ref) and len(_ids(got)) == 24
    cont = fakes[1][0].requests[n2:]
    assert len(cont) == 1 and cont[0]["max_tokens"] == 24 - 7  # a continuation, not a retry
    assert srv.table.get("w1").streams == set()
    await rc.release("w1")
    await rc.close()


@pytest.mark.asyncio(loop_scope="session")
async def test_hold_without_a_sibling_keeps_the_stream_for_the_switch(env):  # noqa: F811
    srv, fakes, s = env
    _, ref = await sse(s, fakes[0][1] + "/v1/completions", BODY)
    rc = RouterControl(srv.control_url)
    task = await _stalled_stream(srv, fakes, s)
    info = await rc.hold("w1")
    assert info["moved_streams"] == 0
    assert not any(h.moved for h in srv.table.get("w1").streams)
    # a sibling that appears later takes the held worker's streams at the next hold call
    await rc.add_replica("w2", "fake", fakes[1][1])
    info = await rc.hold("w1")
    assert info["moved_streams"] == 1
    _, got = await asyncio.wait_for(task, 10)
    fakes[0][0].unstall()
    assert _ids(got) == _ids(ref)
    await rc.release("w1")
    await rc.close()


def test_hold_cuts_nothing_when_siblings_are_not_preferred_or_all_held():
    t = RoutingTable(prefer_sibling_when_held=False)
    t.add("w1", "m", "http://a")
    t.add("w2", "m", "http://b")
    h = StreamHandle("w1")
    t.register(t.get("w1"), h)
    assert t.hold("w1")["moved_streams"] == 0 and not h.moved
    t = RoutingTable()
    t.add("w1", "m", "http://a")
    t.add("w2", "m", "http://b")
    t.add("x", "other", "http://c")  # another model is no sibling
    t.hold("w2")
    h = StreamHandle("w1")
    t.register(t.get("w1"), h)
    assert t.hold("w1")["moved_streams"] == 0 and not h.moved  # the only sibling is held too
    t.release("w2")
    assert t.hold("w1")["moved_streams"] == 1 and h.moved


@pytest.mark.asyncio
async def test_a_stream_broken_on_a_held_worker_goes_to_an_active_sibling():
    t = RoutingTable()
    a, b = t.add("w1", "m", "http://a"), t.add("w2", "m", "http://b")
    core = RouterCore(t, upstream=None)  # type: ignore[arg-type]
    t.hold("w1")
    for moved in (False, True):  # broken (reset) or cut at the hold
        got = await core._next_replica("m", a, moved)
        assert got is b
        t.done(got)
    t.hold("w2")  # no active sibling left: wait for w1's switch, at its new endpoint
    waiter = asyncio.ensure_future(core._next_replica("m", a, False))
    await asyncio.sleep(0)
    assert not waiter.done()
    t.switch("w1", "http://a2")
    assert await waiter is a and a.endpoint == "http://a2" and a.state is ReplicaState.ACTIVE
    core.close()
