"""Unreachable workers: the router holds a worker it cannot reach (a "suspect" hold) when no
other replica can take over, and waits for the control plane (switch/release), a healthy
probe, or its own timer. Core tests with a fake upstream; one HTTP test with real processes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from relocator.ports import free_port
from relocator.router import errors
from relocator.router import state as state_io
from relocator.router.core import Hooks, RouterCore, Stream, Unary, UpstreamError
from relocator.router.fakeserver import FakeEngine, fake_tokenizer, generate, next_token
from relocator.router.table import ReplicaState, RoutingTable

ASYNC = pytest.mark.asyncio(loop_scope="session")
REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------- fake transport
class _Resp:
    def __init__(self, up: "FakeUpstream", ep: str, events: list[bytes], die_after: int | None):
        self.up, self.ep, self.events, self.die_after = up, ep, events, die_after
        self.status = 200
        self.content_type = "text/event-stream"
        self.closed = False

    async def read(self) -> bytes:
        return b"".join(self.events)

    async def chunks(self):
        for i, ev in enumerate(self.events):
            if self.die_after is not None and i == self.die_after:
                self.up.dead.add(self.ep)  # the worker died: its stream breaks, no reconnect
                raise UpstreamError("ClientPayloadError: connection reset")
            if self.closed:
                raise UpstreamError("closed")
            await asyncio.sleep(0)
            yield ev

    def close(self) -> None:
        self.closed = True


class FakeUpstream:
    """vLLM-framed, deterministic (the fakeserver's model). `dead`: endpoints that refuse
    connections (and fail /health); `die_after[ep]`: the next stream from ep breaks after N
    events and ep is dead from then on."""

    def __init__(self) -> None:
        self.dead: set[str] = set()
        self.die_after: dict[str, int] = {}
        self.posts: list[tuple[str, dict]] = []
        self.probes: list[str] = []

    async def post(self, url: str, body: bytes):
        await asyncio.sleep(0)
        ep, path = url.split("/v1/") if "/v1/" in url else url.rsplit("/", 1)
        if ep in self.dead:
            raise UpstreamError(f"ClientConnectorError: Cannot connect to host {ep}")
        b = json.loads(body)
        self.posts.append((ep, b))
        if path.endswith("detokenize"):
            return _Resp(self, ep, [json.dumps(
                {"prompt": fake_tokenizer().decode(b["tokens"])}).encode()], None)
        kind = "chat" if path.startswith("chat") else "completions"
        p = b.get("prompt")
        prompt = list(p) if isinstance(p, list) else list(str(p).encode())
        out, pieces, finish, reason = generate(prompt, b, b.get("max_tokens") or 16)
        text = "".join(pieces)
        if not b.get("stream"):
            return _Resp(self, ep, [json.dumps({"object": "text_completion", "choices": [
                {"index": 0, "text": text}]}).encode()], None)
        evs = FakeEngine("m")._events(kind, "cmpl-x", 1, prompt, out, pieces, finish, reason,
                                      b.get("return_token_ids") is True, b)
        return _Resp(self, ep, [e.encode() for e in evs], self.die_after.pop(ep, None))

    async def health(self, endpoint: str, timeout_s: float) -> bool:
        self.probes.append(endpoint)
        await asyncio.sleep(0)
        return endpoint not in self.dead


class RecHooks(Hooks):
    def __init__(self) -> None:
        self.suspects: list[str] = []
        self.ends: list[str] = []

    def suspect_hold(self, worker: str) -> None:
        self.suspects.append(worker)

    def suspect_end(self, worker: str, outcome: str) -> None:
        self.ends.append(outcome)


def make(replicas=(("w1", "http://a"),), hold_s=5.0, **kw):
    t = RoutingTable("least_in_flight", hold_timeout_s=kw.pop("hold_timeout_s", 10.0))
    for w, ep in replicas:
        t.add(w, "m", ep)
    up = FakeUpstream()
    hooks = RecHooks()
    core = RouterCore(t, up, hooks=hooks, unreachable_hold_s=hold_s, probe_interval_s=0.02,
                      **kw)
    return t, up, core, hooks


STREAM = {"model": "m", "prompt": "abc", "max_tokens": 20, "stream": True,
          "return_token_ids": True}
UNARY = {"model": "m", "prompt": "abc", "max_tokens": 5}


async def run_stream(core: RouterCore, body=STREAM) -> tuple[list[dict], list[int]]:
    res = await core.handle("completions", json.dumps(body).encode())
    assert isinstance(res, Stream)
    raw = b""
    async for c in res.chunks:
        raw += c
    events = [e[6:] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    ids = [t for c in chunks if c.get("choices") for t in c["choices"][0].get("token_ids") or []]
    return chunks, ids


async def until(cond, timeout=3.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.005)


def reference_ids(n=20) -> list[int]:
    ids, out = list(b"abc"), []
    for _ in range(n):
        ids.append(next_token(ids))
        out.append(ids[-1])
    return out


# ---------------------------------------------------------------------- core tests
@ASYNC
async def test_stream_of_dead_sole_replica_waits_and_continues_after_switch():
    t, up, core, hooks = make()
    up.die_after["http://a"] = 6
    task = asyncio.create_task(run_stream(core))
    await until(lambda: t.get("w1").suspect and t.held_requests() == 1)
    info = t.snapshot()["models"]["m"][0]
    assert info["suspect"] is True and info["state"] == "held"
    assert hooks.suspects == ["w1"]
    await asyncio.sleep(0.1)  # probes fail: it stays held
    assert not task.done() and up.probes and t.get("w1").suspect
    t.hold("w1")  # the controller noticed: a normal hold now
    t.switch("w1", "http://b")
    chunks, ids = await asyncio.wait_for(task, 3)
    assert ids == reference_ids()
    assert not any("error" in c for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    cont = [b for ep, b in up.posts if ep == "http://b" and "tokens" not in b]  # not /detokenize
    assert len(cont) == 1 and isinstance(cont[0]["prompt"], list) and cont[0]["max_tokens"] == 14
    r = t.get("w1")
    assert r.state is ReplicaState.ACTIVE and not r.suspect and r.in_flight == 0
    await until(lambda: hooks.ends == ["control"])


@ASYNC
async def test_new_requests_to_unreachable_sole_replica_wait_for_switch():
    t, up, core, hooks = make()
    up.dead.add("http://a")
    s = asyncio.create_task(run_stream(core))
    u = asyncio.create_task(core.handle("completions", json.dumps(UNARY).encode()))
    await until(lambda: t.held_requests() == 2)
    assert t.get("w1").suspect and hooks.suspects == ["w1"]  # one hold for both
    t.switch("w1", "http://b")  # switch alone (no hold first) ends it too
    _, ids = await asyncio.wait_for(s, 3)
    assert ids == reference_ids()
    res = await asyncio.wait_for(u, 3)
    assert isinstance(res, Unary) and res.status == 200
    assert {ep for ep, _ in up.posts} == {"http://b"}
    assert t.get("w1").in_flight == 0 and not t.get("w1").suspect


@ASYNC
async def test_health_recovers_releases_to_same_endpoint():
    t, up, core, hooks = make()
    up.dead.add("http://a")
    u = asyncio.create_task(core.handle("completions", json.dumps(UNARY).encode()))
    await until(lambda: t.held_requests() == 1)
    await asyncio.sleep(0.06)
    assert not u.done()
    up.dead.discard("http://a")  # a blip: the worker answers again
    res = await asyncio.wait_for(u, 2)
    assert res.status == 200 and [ep for ep, _ in up.posts] == ["http://a"]
    r = t.get("w1")
    assert r.state is ReplicaState.ACTIVE and not r.suspect and r.endpoint == "http://a"
    assert hooks.ends == ["recovered"]


@ASYNC
async def test_timeout_gives_clear_error_and_replica_active_again():
    t, up, core, hooks = make(hold_s=0.3)
    up.dead.add("http://a")
    t0 = time.monotonic()
    with pytest.raises(errors.RouterError) as ei:
        await core.handle("completions", json.dumps(UNARY).encode())
    assert 0.25 < time.monotonic() - t0 < 2
    e = ei.value
    assert e.status == 503 and e.code == "worker_unreachable"
    assert "w1 unreachable for 0.3 s" in e.message and e.body()["error"]["type"]
    r = t.get("w1")
    assert r.state is ReplicaState.ACTIVE and not r.suspect and r.in_flight == 0
    assert hooks.ends == ["timeout"]
    # a stream that already sent tokens gets the error as an SSE event
    up.dead.clear()
    up.die_after["http://a"] = 4
    chunks, ids = await run_stream(core)
    assert chunks[-1]["error"]["code"] == "worker_unreachable" and len(ids) == 4
    assert t.get("w1").state is ReplicaState.ACTIVE and t.held_requests() == 0


@ASYNC
async def test_sibling_takes_over_without_suspect_hold():
    t, up, core, hooks = make((("w1", "http://a"), ("w2", "http://b")))
    up.dead.add("http://a")
    for _ in range(3):
        res = await core.handle("completions", json.dumps(UNARY).encode())
        assert res.status == 200
    up.dead.clear()
    t.get("w2").in_flight = 5  # least_in_flight: the stream starts on w1
    up.die_after["http://a"] = 5
    _, ids = await run_stream(core)
    t.get("w2").in_flight -= 5
    assert ids == reference_ids()
    assert hooks.suspects == [] and not t.get("w1").suspect
    assert t.get("w1").state is ReplicaState.ACTIVE
    assert [ep for ep, b in up.posts if "tokens" not in b][-2:] == ["http://a", "http://b"]  # not /detokenize


@ASYNC
async def test_both_replicas_unreachable_suspect_holds_the_last_one():
    t, up, core, hooks = make((("w1", "http://a"), ("w2", "http://b")))
    up.dead.update({"http://a", "http://b"})
    u = asyncio.create_task(core.handle("completions", json.dumps(UNARY).encode()))
    await until(lambda: t.held_requests() == 1)
    held = [r for r in t.replicas() if r.suspect]
    assert len(held) == 1
    t.switch(held[0].worker_id, "http://c")
    assert (await asyncio.wait_for(u, 2)).status == 200


@ASYNC
async def test_disabled_keeps_todays_errors():
    t, up, core, hooks = make(hold_s=0)
    up.dead.add("http://a")
    with pytest.raises(errors.RouterError) as ei:
        await core.handle("completions", json.dumps(UNARY).encode())
    assert ei.value.status == 502 and ei.value.code == "upstream_unavailable"
    with pytest.raises(errors.RouterError) as ei:
        await run_stream(core)
    assert ei.value.code == "upstream_unavailable"
    up.dead.clear()
    up.die_after["http://a"] = 5
    chunks, _ = await run_stream(core)
    assert chunks[-1]["error"]["code"] == "continuation_failed"
    assert hooks.suspects == [] and t.held_requests() == 0


@ASYNC
async def test_a_stream_that_cannot_be_continued_leaves_its_replicas_once():
    """A failed continuation used to leave the broken replica a second time (its in-flight
    count went below zero, so least_in_flight sent it more than its share)."""
    t, up, core, hooks = make(replicas=(("w1", "http://a"), ("w2", "http://b")), hold_s=0)
    t.get("w2").in_flight = 5  # least_in_flight: the stream starts on w1
    up.die_after["http://a"] = 5
    up.dead.add("http://b")  # nowhere to continue
    chunks, _ = await run_stream(core)
    t.get("w2").in_flight -= 5
    assert chunks[-1]["error"]["code"] == "continuation_failed"
    assert t.get("w1").in_flight == 0 and t.get("w2").in_flight == 0


@ASYNC
async def test_control_hold_turns_suspect_into_normal_hold_release_and_remove():
    t, up, core, hooks = make(hold_s=0.2)
    up.dead.add("http://a")
    u = asyncio.create_task(core.handle("completions", json.dumps(UNARY).encode()))
    await until(lambda: t.held_requests() == 1)
    assert t.hold("w1")["suspect"] is False
    await asyncio.sleep(0.4)  # past the timer, and /health would not matter any more
    assert not u.done() and t.get("w1").state is ReplicaState.HELD
    # the state file never records a suspect hold, but this one is the controller's now
    assert state_io.dump(t)["replicas"][0]["held"] is True
    up.dead.clear()
    info = t.release("w1")  # rollback: the same endpoint again
    assert info["released"] == 1
    assert (await asyncio.wait_for(u, 2)).status == 200
    assert hooks.ends == ["control"]
    # a suspect hold is not persisted; remove fails its waiters with no_replica
    up.dead.add("http://a")
    u = asyncio.create_task(core.handle("completions", json.dumps(UNARY).encode()))
    await until(lambda: t.held_requests() == 1)
    assert state_io.dump(t)["replicas"][0]["held"] is False
    t.remove("w1")
    with pytest.raises(errors.RouterError) as ei:
        await u
    assert ei.value.code == "no_replica"
    await until(lambda: hooks.ends == ["control", "control"])


def test_table_suspect_epochs():
    t = RoutingTable()
    t.add("w", "m", "http://a")
    r = t.get("w")
    e1 = t.suspect_hold("w")
    assert e1 and r.suspect and t.suspect_hold("w") is None
    t.release("w")
    assert not r.suspect and t.end_suspect(r, e1) == 0  # a stale watcher does nothing
    e2 = t.suspect_hold("w")
    assert e2 != e1 and not t.is_suspect(r, e1) and t.is_suspect(r, e2)
    t.switch("w", "http://b", release=False)
    assert r.state is ReplicaState.HELD and not r.suspect


# ---------------------------------------------------------------------- real processes
def _backend(port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "relocator.router.fakeserver", "--port",
                             str(port), "--model", "fake", "--token-delay", "0.03"],
                            cwd=REPO, env=env, stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def _wait_health(session: aiohttp.ClientSession, url: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            async with session.get(url + "/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        assert time.monotonic() < deadline, f"{url} did not start"
        await asyncio.sleep(0.05)


@ASYNC
async def test_http_backend_sigkill_mid_stream_then_switch():
    from relocator.router.client import RouterControl
    from relocator.router.config import BackendConfig, RouterSettings
    from relocator.router.server import RouterServer

    p1, p2 = free_port(), free_port()
    u1, u2 = f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}"
    procs = [_backend(p1)]
    s = RouterSettings(port=0, control_port=0, unreachable_hold_s=20, hold_timeout_s=20,
                       backends=[BackendConfig(model="fake", url=u1, worker_id="w1")])
    srv = await RouterServer(s).start()
    session = aiohttp.ClientSession()
    rc = RouterControl(srv.control_url)
    try:
        await _wait_health(session, u1)
        body = {"model": "fake", "prompt": "relocate me", "max_tokens": 60, "stream": True,
                "return_token_ids": True}
        raw = b""
        async with session.post(srv.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            while raw.count(b"\n\n") < 10:
                raw += await r.content.readany()
            procs[0].send_signal(signal.SIGKILL)  # the worker dies mid-stream
            procs[0].wait()
            read = asyncio.create_task(r.content.read())
            await until(lambda: srv.table.get("w1").suspect, timeout=10)
            listing = await rc.replicas()
            assert listing["models"]["fake"][0]["suspect"] is True
            async with session.get(srv.url + "/metrics") as m:
                assert 'relocator_router_suspect_holds_total{backend="w1"} 1.0' in await m.text()
            procs.append(_backend(p2))  # the controller's replacement
            await _wait_health(session, u2)
            await rc.hold("w1")
            info = await rc.switch("w1", u2)
            assert info["suspect"] is False
            raw += await asyncio.wait_for(read, 20)
        events = [e[6:] for e in raw.decode().split("\n\n") if e]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert not any("error" in c for c in chunks)
        got = [t for c in chunks if c["choices"] for t in c["choices"][0]["token_ids"] or []]
        async with session.post(u2 + "/v1/completions", json=body) as r:
            ref_raw = await r.read()
        ref = [json.loads(e[6:]) for e in ref_raw.decode().split("\n\n")
               if e and e != "data: [DONE]"]
        want = [t for c in ref if c["choices"] for t in c["choices"][0]["token_ids"] or []]
        assert got == want and len(got) == 60
        assert srv.table.get("w1").endpoint == u2 and srv.table.get("w1").in_flight == 0
    finally:
        await rc.close()
        await session.close()
        await srv.stop()
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@ASYNC
async def test_hold_timeout_shorter_than_unreachable_hold_names_the_cause():
    t, up, core, hooks = make(hold_s=5, hold_timeout_s=0.2)
    up.dead.add("http://a")
    with pytest.raises(errors.RouterError) as ei:
        await core.handle("completions", json.dumps(UNARY).encode())
    assert ei.value.status == 503 and ei.value.code == "worker_unreachable"
    assert t.get("w1").suspect  # the hold itself runs on (timer, probe, control plane)
    up.dead.clear()
    await until(lambda: not t.get("w1").suspect)
    assert hooks.ends == ["recovered"]
