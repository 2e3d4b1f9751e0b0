"""An engine that fails (an in-stream error event with code >= 500, or a 5xx answer before any
byte) is a break the router goes on from on another replica, not an error the client sees;
a 4xx, or a failure with no other replica left, reaches the client as the engine sent it.
Pure CPU: the router over HTTP against the fake vLLM-framed backend."""

from __future__ import annotations

import contextlib

import json

import aiohttp
import pytest

from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.engine_errors import error_code, split_failure
from relocator.router.fakeserver import start_fake, write_fake_tokenizer
from relocator.router.policies import Policy
from relocator.router.server import RouterServer

pytestmark = pytest.mark.asyncio(loop_scope="session")


class _First(Policy):
    """Always the first eligible replica in registration order: which replica serves is known,
    so a test proves where a request went, not what a counter happened to say."""

    def choose(self, replicas, key):
        return replicas[0]


async def _env(tmp_path, n: int):
    fakes, runners = [], []
    for _ in range(n):
        eng, runner, url = await start_fake("fake")
        fakes.append((eng, url))
        runners.append(runner)
    tok = str(write_fake_tokenizer(tmp_path))
    s = RouterSettings(port=0, control_port=0, hold_timeout_s=2.0, hold_queue_max=8,
                       policy="round_robin",
                       backends=[BackendConfig(model="fake", url=u, worker_id=f"w{i + 1}",
                                               tokenizer=tok) for i, (_, u) in enumerate(fakes)])
    srv = await RouterServer(s).start()
    srv.table.policy = _First()
    return srv, fakes, runners, aiohttp.ClientSession()


@contextlib.asynccontextmanager
async def _router(tmp_path, n: int):
    """The router in front of `n` fake engines: (server, fakes, session), all stopped after."""
    srv, fakes, runners, session = await _env(tmp_path, n)
    try:
        yield srv, fakes, session
    finally:
        await session.close()
        await srv.stop()
        for r in runners:
            await r.cleanup()


@pytest.fixture
async def two(tmp_path):
    async with _router(tmp_path, 2) as env:
        yield env


@pytest.fixture
async def three(tmp_path):
    async with _router(tmp_path, 3) as env:
        yield env


@pytest.fixture
async def one(tmp_path):
    async with _router(tmp_path, 1) as env:
        yield env


async def sse(session, url, body):
    async with session.post(url, json=body) as r:
        raw = await r.read()
        assert r.status == 200, (r.status, raw)
    events = [e[6:] for e in raw.decode().split("\n\n") if e]
    assert events[-1] == "[DONE]", raw
    return raw, [json.loads(e) for e in events[:-1]]


def ids_of(chunks):
    return [t for c in chunks if c.get("choices") for t in c["choices"][0].get("token_ids") or []]


def text_of(chunks, kind="completions"):
    if kind == "chat":
        return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks
                       if c.get("choices"))
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def failures(srv, where):
    return srv.hooks.registry.get_sample_value("relocator_router_engine_failures_total",
                                               {"where": where}) or 0


def _req(kind, **kw):
    path = "/v1/completions" if kind == "completions" else "/v1/chat/completions"
    body = {"model": "fake", "max_tokens": 20, "stream": True,
            "stream_options": {"include_usage": True}, **kw}
    body.update({"prompt": "abc"} if kind == "completions" else
                {"messages": [{"role": "user", "content": "abc"}]})
    return path, body


# ---------------------------------------------------------------- the shapes (pure functions)
async def test_error_shapes_of_vllm_and_sglang():
    vllm = {"error": {"message": "EngineCore encountered an issue.", "type": "InternalServerError",
                      "param": None, "code": 500}}
    sglang = {"error": {"object": "error", "message": "aborted", "type": "SERVICE_UNAVAILABLE",
                        "param": None, "code": 503}}
    old_vllm = {"object": "error", "message": "x", "type": "InternalServerError", "code": 500}
    assert [error_code(o) for o in (vllm, sglang, old_vllm)] == [500, 503, 500]
    assert error_code({"error": {"code": 400}}) == 400
    assert error_code({"error": {"code": "continuation_failed"}}) is None  # the router's own
    assert error_code({"choices": [{"text": "\"error\""}]}) is None
    ok = b'data: {"choices":[{"text":"a"}]}\n\n'
    bad = b"data: " + json.dumps(sglang).encode() + b"\n\n"
    assert split_failure(ok + bad + b"data: [DONE]\n\n") == (ok, bad)
    four = b'data: {"error":{"code":400}}\n\n'
    assert split_failure(ok + four) == (ok + four, None)


# ---------------------------------------------------------------- in-stream failures
@pytest.mark.parametrize("kind", ["completions", "chat"])
async def test_engine_failure_mid_stream_is_continued_token_exact(two, kind):
    srv, fakes, s = two
    path, body = _req(kind, return_token_ids=True)
    _, ref = await sse(s, fakes[1][1] + path, body)
    fakes[0][0].knobs.error_after = 7
    raw, got = await sse(s, srv.url + path, body)
    assert b'"error"' not in raw, raw
    assert ids_of(got) == ids_of(ref), (ids_of(got), ids_of(ref))
    assert text_of(got, kind) == text_of(ref, kind)
    assert len({c["id"] for c in got}) == 1, got
    assert got[-1]["usage"]["completion_tokens"] == 20, got[-1]
    assert [c["choices"][0]["finish_reason"] for c in got if c["choices"]][-1] == "length"
    assert len(fakes[0][0].requests) == 1, fakes[0][0].requests
    cont = fakes[1][0].requests[-1]
    assert isinstance(cont["prompt"], list) and cont["max_tokens"] < 20, cont
    assert failures(srv, "stream") == 1


async def test_engine_failure_before_any_token_is_retried_from_the_start(two):
    srv, fakes, s = two
    path, body = _req("chat")
    _, ref = await sse(s, fakes[1][1] + path, body)
    fakes[0][0].knobs.error_after = 0  # the chat stream's role chunk never went out
    raw, got = await sse(s, srv.url + path, body)
    assert b'"error"' not in raw, raw
    assert text_of(got, "chat") == text_of(ref, "chat") and len(text_of(ref, "chat")) == 20
    assert fakes[1][0].requests[-1].get("messages"), "a retry, not a continuation"


async def test_a_failed_replica_does_not_get_the_stream_again(three):
    srv, fakes, s = three
    path, body = _req("completions", return_token_ids=True)
    _, ref = await sse(s, fakes[2][1] + path, body)
    n3 = len(fakes[2][0].requests)
    fakes[0][0].knobs.error_after = 3
    fakes[1][0].knobs.error_after = 2  # the continuation on w2 fails too
    raw, got = await sse(s, srv.url + path, body)
    assert b'"error"' not in raw, raw
    assert ids_of(got) == ids_of(ref)
    # w1 is first in the policy's order: only the shunning kept it from the third leg
    assert len(fakes[0][0].requests) == 1, fakes[0][0].requests
    assert len(fakes[1][0].requests) == 1 and len(fakes[2][0].requests) == n3 + 1
    assert failures(srv, "stream") == 2


async def test_a_4xx_error_event_passes_through(two):
    srv, fakes, s = two
    path, body = _req("completions")
    fakes[0][0].knobs.error_after = 3
    fakes[0][0].knobs.error_code = 400
    _, got = await sse(s, srv.url + path, body)
    assert got[-1]["error"]["code"] == 400, got[-1]
    assert len(text_of(got)) == 3 and fakes[1][0].requests == [], fakes[1][0].requests
    assert failures(srv, "stream") == 0


async def test_a_sole_replica_failure_event_reaches_the_client(one):
    srv, fakes, s = one
    path, body = _req("completions")
    fakes[0][0].knobs.error_after = 3
    _, got = await sse(s, srv.url + path, body)
    assert got[-1]["error"]["code"] == 500, got[-1]
    assert got[-1]["error"]["message"].startswith("EngineCore"), got[-1]
    assert len(fakes[0][0].requests) == 1 and failures(srv, "stream") == 1


# ---------------------------------------------------------------- 5xx before any byte
@pytest.mark.parametrize("stream", [True, False])
async def test_a_500_first_answer_is_retried_on_the_sibling(two, stream):
    srv, fakes, s = two
    fakes[0][0].knobs.fail_status = 500
    body = {"model": "fake", "prompt": "abc", "max_tokens": 6, "stream": stream}
    async with s.post(srv.url + "/v1/completions", json=body) as r:
        data = await r.read()
        assert r.status == 200, (r.status, data)
    assert b'"error"' not in data, data
    assert len(fakes[0][0].requests) == 1 and len(fakes[1][0].requests) == 1, \
        (fakes[0][0].requests, fakes[1][0].requests)
    assert failures(srv, "first") == 1


async def test_a_4xx_first_answer_passes_through(two):
    srv, fakes, s = two
    fakes[0][0].knobs.fail_status = 429
    body = {"model": "fake", "prompt": "abc", "max_tokens": 6, "stream": True}
    async with s.post(srv.url + "/v1/completions", json=body) as r:
        assert r.status == 429, await r.read()
        assert (await r.json())["error"]["message"] == "injected failure"
    assert fakes[1][0].requests == [] and failures(srv, "first") == 0


@pytest.mark.parametrize("stream", [True, False])
async def test_a_sole_replica_500_reaches_the_client(one, stream):
    srv, fakes, s = one
    fakes[0][0].knobs.fail_status = 500
    body = {"model": "fake", "prompt": "abc", "max_tokens": 6, "stream": stream}
    async with s.post(srv.url + "/v1/completions", json=body) as r:
        assert r.status == 500, await r.read()
        assert (await r.json())["error"]["message"] == "injected failure"
    assert len(fakes[0][0].requests) == 1 and failures(srv, "first") == 1
