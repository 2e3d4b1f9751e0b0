"""The router over HTTP against the fake vLLM-framed SSE backend (fast, no vLLM)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from relocator.router.client import ControlError, RouterControl, RouterControlSync
from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.fakeserver import Knobs, start_fake, write_fake_tokenizer
from relocator.router.server import RouterServer

pytestmark = pytest.mark.asyncio(loop_scope="session")


@pytest.fixture
async def env(tmp_path):
    fakes = []
    runners = []
    for _ in range(2):
        eng, runner, url = await start_fake("fake")
        fakes.append((eng, url))
        runners.append(runner)
    s = RouterSettings(port=0, control_port=0, hold_timeout_s=2.0, hold_queue_max=8,
                       max_body_bytes=10_000, policy="round_robin",
                       backends=[BackendConfig(model="fake", url=fakes[0][1], worker_id="w1",
                                               tokenizer=str(write_fake_tokenizer(tmp_path)))])
    srv = await RouterServer(s).start()
    session = aiohttp.ClientSession()
    yield srv, fakes, session
    await session.close()
    await srv.stop()
    for r in runners:
        await r.cleanup()


async def sse(session, url, body):
    async with session.post(url, json=body) as r:
        assert r.status == 200, await r.text()
        assert r.headers["Content-Type"].startswith("text/event-stream")
        raw = await r.read()
    events = [e[6:] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]"
    return raw, [json.loads(e) for e in events[:-1]]


def text_of(chunks, kind="completions"):
    if kind == "chat":
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


async def test_passthrough_bytes_identical(env):
    srv, fakes, s = env
    body = {"model": "fake", "prompt": "hello", "max_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}}
    direct, _ = await sse(s, fakes[0][1] + "/v1/completions", body)
    via, chunks = await sse(s, srv.url + "/v1/completions", body)
    # same bytes except the request id / created stamp
    norm = lambda b: [{k: v for k, v in json.loads(e[6:]).items() if k not in ("id", "created")}
                      for e in b.decode().split("\n\n") if e and e != "data: [DONE]"]
    assert norm(direct) == norm(via)
    assert b'"token_ids":null' in via and b'"token_ids":[' not in via
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    # the router did ask for ids
    assert fakes[0][0].requests[-1]["return_token_ids"] is True


async def test_client_asked_ids_kept(env):
    srv, fakes, s = env
    body = {"model": "fake", "prompt": "hi", "max_tokens": 5, "stream": True,
            "return_token_ids": True}
    _, chunks = await sse(s, srv.url + "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == list(b"hi")
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 5


async def test_non_stream_and_models_health_metrics(env):
    srv, fakes, s = env
    async with s.post(srv.url + "/v1/chat/completions", json={
            "model": "fake", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4}) as r:
        assert r.status == 200
        b = await r.json()
        assert b["object"] == "chat.completion" and len(b["choices"][0]["message"]["content"]) == 4
    async with s.get(srv.url + "/v1/models") as r:
        assert [m["id"] for m in (await r.json())["data"]] == ["fake"]
    async with s.get(srv.url + "/health") as r:
        assert r.status == 200
    async with s.get(srv.url + "/metrics") as r:
        t = await r.text()
        assert "relocator_router_requests_total" in t and "relocator_router_ttfb_seconds" in t
        assert "relocator_router_held_requests" in t


@pytest.mark.parametrize("kind", ["completions", "chat"])
@pytest.mark.parametrize("mode", ["cut", "stall_switch"])
async def test_continuation_token_exact(env, kind, mode):
    srv, fakes, s = env
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    base = {"model": "fake", "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}}
    base.update({"prompt": "abc"} if kind == "completions" else
                {"messages": [{"role": "user", "content": "abc"}]})
    _, ref = await sse(s, fakes[1][1] + path, dict(base, return_token_ids=True))
    ref_ids = [t for c in ref if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    rc = RouterControl(srv.control_url)
    if mode == "cut":
        await rc.add_replica("w2", "fake", fakes[1][1])
        fakes[0][0].knobs.cut_after = 7
        raw, got = await sse(s, srv.url + path, dict(base, return_token_ids=True))
    else:
        fakes[0][0].knobs.stall_after = 7
        task = asyncio.create_task(sse(s, srv.url + path, dict(base, return_token_ids=True)))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if fakes[0][0]._stalls:
                break
        await rc.hold("w1")
        info = await rc.switch("w1", fakes[1][1])
        assert info["moved_streams"] == 1
        raw, got = await task
        fakes[0][0].unstall()
    await rc.close()
    got_ids = [t for c in got if c["choices"] for t in c["choices"][0].get("token_ids") or []]
    assert got_ids == ref_ids
    assert text_of(got, kind) == text_of(ref, kind)
    ids = {c["id"] for c in got}
    assert len(ids) == 1
    objs = {c["object"] for c in got}
    assert objs == {"chat.completion.chunk" if kind == "chat" else "text_completion"}
    assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]][-1] == "length"
    assert got[-1]["usage"]["completion_tokens"] == 20
    assert got[-1]["usage"]["prompt_tokens"] == ref[-1]["usage"]["prompt_tokens"]
    cont = fakes[1][0].requests[-1]
    assert cont["max_tokens"] < 20 and isinstance(cont["prompt"], list)


async def test_continuation_strips_ids_when_not_asked(env):
    srv, fakes, s = env
    rc = RouterControlSync(srv.control_url)
    await asyncio.to_thread(rc.add_replica, "w2", "fake", fakes[1][1])
    fakes[0][0].knobs.cut_after = 3
    raw, got = await sse(s, srv.url + "/v1/chat/completions", {
        "model": "fake", "messages": [{"role": "user", "content": "q"}], "max_tokens": 10,
        "stream": True})
    assert b'"token_ids":[' not in raw and b'"prompt_token_ids":[' not in raw
    assert len(text_of(got, "chat")) == 10


async def test_stop_string_across_splice(env):
    srv, fakes, s = env
    rc = RouterControl(srv.control_url)
    await rc.add_replica("w2", "fake", fakes[1][1])
    await rc.close()
    body = {"model": "fake", "prompt": "abc", "max_tokens": 20, "stream": True}
    _, ref = await sse(s, fakes[1][1] + "/v1/completions", body)
    full = text_of(ref)
    stop = full[5:8]  # cut after 6 events: the stop string straddles the splice
    assert stop not in full[:7]
    _, ref_stop = await sse(s, fakes[1][1] + "/v1/completions", dict(body, stop=[stop]))
    fakes[0][0].knobs.cut_after = 6
    _, got = await sse(s, srv.url + "/v1/completions", dict(body, stop=[stop]))
    assert text_of(got) == text_of(ref_stop) == full[:5]
    fins = [c["choices"][0]["finish_reason"] for c in got if c["choices"]]
    assert fins[-1] == "stop"


async def test_continuation_impossible_gives_error_event(env):
    srv, fakes, s = env
    fakes[0][0].knobs.cut_after = 3
    raw, got = await sse(s, srv.url + "/v1/completions", {
        "model": "fake", "prompt": "a", "max_tokens": 10, "stream": True, "use_beam_search": True})
    assert got[-1]["error"]["code"] == "continuation_failed"  # n > 1 is continued now (fan-out)


async def test_break_without_sibling_errors_cleanly(env):
    srv, fakes, s = env
    fakes[0][0].knobs.cut_after = 3
    body = {"model": "fake", "prompt": "a", "max_tokens": 10, "stream": True}
    raw, got = await sse(s, srv.url + "/v1/completions", body)
    # only w1 exists: the continuation goes back to w1 (the cut was one-shot) and completes
    _, ref = await sse(s, fakes[0][1] + "/v1/completions", body)
    assert text_of(got) == text_of(ref) and len(ref) == 10


async def test_hold_release_order_and_timeout(env):
    srv, fakes, s = env
    rc = RouterControl(srv.control_url)
    await rc.hold("w1")

    async def one(i):
        async with s.post(srv.url + "/v1/completions", json={
                "model": "fake", "prompt": f"p{i}", "max_tokens": 2}) as r:
            return r.status

    tasks = []
    for i in range(5):
        tasks.append(asyncio.create_task(one(i)))
        for _ in range(100):
            await asyncio.sleep(0.005)
            if srv.table.held_requests() == i + 1:
                break
    assert srv.table.held_requests() == 5
    n0 = len(fakes[0][0].requests)
    info = await rc.release("w1")
    assert info["released"] == 5
    assert await asyncio.gather(*tasks) == [200] * 5
    assert [r["prompt"] for r in fakes[0][0].requests[n0:]] == [f"p{i}" for i in range(5)]
    # timeout: a clean 503 in OpenAI's shape
    await rc.hold("w1")
    async with s.post(srv.url + "/v1/completions", json={
            "model": "fake", "prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 503
        assert (await r.json())["error"]["code"] == "hold_timeout"
    await rc.release("w1")
    await rc.close()


async def test_hold_goes_to_sibling(env):
    srv, fakes, s = env
    rc = RouterControl(srv.control_url)
    await rc.add_replica("w2", "fake", fakes[1][1])
    await rc.hold("w1")
    for _ in range(3):
        async with s.post(srv.url + "/v1/completions", json={
                "model": "fake", "prompt": "x", "max_tokens": 2}) as r:
            assert r.status == 200
    assert len(fakes[1][0].requests) == 3
    await rc.close()


async def test_bad_inputs(env):
    srv, fakes, s = env
    u = srv.url + "/v1/completions"

    async def status(data, headers=None, url=u):
        async with s.post(url, data=data, headers=headers or {"Content-Type": "application/json"}) as r:
            b = await r.json()
            assert set(b["error"]) >= {"message", "type", "code"}
            return r.status, b["error"]["code"]

    assert await status(b"{not json") == (400, "invalid_json")
    assert await status(b"[1]") == (400, "invalid_json")
    assert await status(json.dumps({"prompt": "x"})) == (400, "missing_model")
    assert await status(json.dumps({"model": "nope", "prompt": "x"})) == (404, "model_not_found")
    assert await status(json.dumps({"model": "fake", "prompt": "x" * 20_000})) == (
        413, "request_too_large")
    assert await status(json.dumps({"model": "fake"}), url=srv.url + "/v1/chat/completions") == (
        400, "missing_required_parameter")
    async with s.get(srv.url + "/v1/nothing") as r:
        assert r.status == 404 and (await r.json())["error"]["code"] == "not_found"
    # upstream down, unreachable_hold_s=0: today's immediate 502 (the suspect hold is
    # tested in test_router_unreachable.py)
    srv.core.unreachable_hold_s = 0
    rc = RouterControl(srv.control_url)
    await rc.add_replica("dead", "deadmodel", "http://127.0.0.1:9")
    assert await status(json.dumps({"model": "deadmodel", "prompt": "x"})) == (
        502, "upstream_unavailable")
    assert await status(json.dumps({"model": "deadmodel", "prompt": "x", "stream": True})) == (
        502, "upstream_unavailable")
    # control API errors
    with pytest.raises(ControlError) as ei:
        await rc.hold("ghost")
    assert ei.value.status == 404
    with pytest.raises(ControlError) as ei:
        await rc.switch("w1", "not-a-url")
    assert ei.value.status == 400
    await rc.close()


async def test_control_token():
    eng, runner, url = await start_fake("fake")
    s = RouterSettings(port=0, control_port=0, control_token="sekret",
                       backends=[BackendConfig(model="fake", url=url, worker_id="w1")])
    async with RouterServer(s) as srv:
        with pytest.raises(ControlError) as ei:
            await RouterControl(srv.control_url, token="wrong").hold("w1")
        assert ei.value.status == 401
        assert ei.value.body["error"]["code"] == "invalid_token"
        with pytest.raises(ControlError):
            await asyncio.to_thread(RouterControlSync(srv.control_url).hold, "w1")
        async with RouterControl(srv.control_url, token="sekret") as rc:
            assert (await rc.hold("w1"))["state"] == "held"
            assert (await rc.release("w1"))["state"] == "active"
    await runner.cleanup()
    with pytest.raises(ValueError):
        RouterSettings(control_host="0.0.0.0")


async def test_client_disconnect_aborts_upstream(env):
    srv, fakes, s = env
    fakes[0][0].knobs.token_delay_s = 0.02
    async with aiohttp.ClientSession() as s2:
        r = await s2.post(srv.url + "/v1/completions", json={
            "model": "fake", "prompt": "x", "max_tokens": 200, "stream": True})
        await r.content.readany()
        r.close()
    for _ in range(100):
        await asyncio.sleep(0.02)
        if fakes[0][0].active == 0 and srv.table.get("w1").in_flight == 0:
            break
    assert fakes[0][0].active == 0
    assert srv.table.get("w1").in_flight == 0
    assert not srv.table.get("w1").streams


async def test_openai_client(env):
    import openai

    srv, fakes, s = env
    c = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
    r = await c.completions.create(model="fake", prompt="hey", max_tokens=6)
    _, ref = await sse(s, fakes[0][1] + "/v1/completions", {"model": "fake", "prompt": "hey",
                                                            "max_tokens": 6, "stream": True})
    assert r.choices[0].text == text_of(ref) and r.usage.completion_tokens == 6
    msgs = [{"role": "user", "content": "y"}]
    st = await c.chat.completions.create(model="fake", messages=msgs, max_tokens=6, stream=True)
    text = "".join([ch.choices[0].delta.content or "" async for ch in st if ch.choices])
    _, ref = await sse(s, fakes[0][1] + "/v1/chat/completions", {
        "model": "fake", "messages": msgs, "max_tokens": 6, "stream": True})
    assert text == text_of(ref, "chat") and text
    with pytest.raises(openai.NotFoundError):
        await c.completions.create(model="nope", prompt="x")
    await c.close()


async def test_control_add_checks_the_tokenizer_path(env, tmp_path):
    srv, fakes, s = env
    async with RouterControl(srv.control_url) as rc:
        with pytest.raises(ControlError) as e:
            await rc.add_replica("w3", "fake", fakes[1][1], tokenizer=str(tmp_path / "none"))
        assert e.value.status == 400 and "tokenizer" in json.dumps(e.value.body)
        assert "w3" not in json.dumps(await rc.replicas())
        await rc.add_replica("w3", "other", fakes[1][1], tokenizer=str(tmp_path))
    assert srv.tokenizers.load("other") is not None


@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_n_choices_each_continued_on_their_own(env, kind):
    """`n > 1` used to end with continuation_failed at every move: each choice is now a stream
    of its own (seed + index, as vLLM's child requests), continued alone and merged back."""
    srv, fakes, s = env
    rc = RouterControl(srv.control_url)
    await rc.add_replica("w2", "fake", fakes[1][1])
    await rc.close()
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    base = {"model": "fake", "max_tokens": 12, "stream": True, "seed": 7, "temperature": 0.7,
            "stream_options": {"include_usage": True}}
    base.update({"prompt": "abc"} if kind == "completions" else
                {"messages": [{"role": "user", "content": "abc"}]})
    _, ref = await sse(s, fakes[1][1] + path, dict(base, n=1))
    fakes[0][0].knobs.token_delay_s = 0.005  # each event on the wire before the cut
    fakes[0][0].knobs.cut_after = 4  # one of the choices breaks mid-stream
    _, got = await sse(s, srv.url + path, dict(base, n=3))
    assert {c["id"] for c in got} == {got[0]["id"]}
    for i in range(3):
        mine = [c for c in got if c["choices"] and c["choices"][0]["index"] == i]
        assert text_of(mine, kind) == text_of(ref, kind), i
        assert mine[-1]["choices"][0]["finish_reason"] == "length"
    usage = [c for c in got if c.get("usage")]
    assert len(usage) == 1 and not usage[0]["choices"], usage  # one usage chunk, at the end
    assert usage[0]["usage"]["completion_tokens"] == 3 * 12
    assert usage[0]["usage"]["prompt_tokens"] == ref[-1]["usage"]["prompt_tokens"]
    parts = [r for r in fakes[0][0].requests + fakes[1][0].requests if r.get("n") == 1]
    assert sorted({r["seed"] for r in parts}) == [7, 8, 9]
    conts = [r for f in fakes for r in f[0].requests if isinstance(r.get("prompt"), list)]
    assert len(conts) == 1, [f[0].requests for f in fakes]  # the broken choice was continued, the others untouched
