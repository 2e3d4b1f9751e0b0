"""The router's OpenAI API keys (issue 26 item 3): loopback by default, 401 in OpenAI's shape
without the key, the key accepted (streams too), /health open, /metrics behind the key unless
metrics_public, a non-loopback bind refused without a key. Fake backend, no processes."""

from __future__ import annotations

import json

import aiohttp
import pytest
from pydantic import ValidationError

from relocator.router import auth
from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.fakeserver import start_fake
from relocator.router.server import RouterServer

aio = pytest.mark.asyncio(loop_scope="session")
KEY = "sk-test-key-1"


@pytest.fixture
async def keyed(tmp_path, monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    eng, runner, url = await start_fake("fake")
    key_file = tmp_path / "keys"
    key_file.write_text("# second key\nsk-from-file\n")
    s = RouterSettings(port=0, control_port=0, api_keys=[KEY], api_key_file=key_file,
                       backends=[BackendConfig(model="fake", url=url, worker_id="w1")])
    srv = await RouterServer(s).start()
    session = aiohttp.ClientSession()
    yield srv, session
    await session.close()
    await srv.stop()
    await runner.cleanup()


BODY = {"model": "fake", "prompt": "hello", "max_tokens": 4}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _assert_401(r: aiohttp.ClientResponse) -> None:
    assert r.status == 401
    err = (await r.json())["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_api_key"
    assert err["param"] is None and err["message"]


@aio
@pytest.mark.parametrize("headers", [{}, _bearer("sk-wrong"), {"Authorization": KEY},
                                     _bearer(KEY + "x"), _bearer(KEY[:-1])])
async def test_refused_without_the_key(keyed, headers):
    srv, s = keyed
    for method, path, body in [("POST", "/v1/completions", BODY),
                               ("POST", "/v1/completions", {**BODY, "stream": True}),
                               ("POST", "/v1/chat/completions",
                                {"model": "fake", "messages": [{"role": "user", "content": "hi"}]}),
                               ("GET", "/v1/models", None), ("GET", "/metrics", None)]:
        async with s.request(method, srv.url + path, json=body, headers=headers) as r:
            await _assert_401(r)


@aio
@pytest.mark.parametrize("key", [KEY, "sk-from-file"])
async def test_accepted_with_a_key(keyed, key):
    srv, s = keyed
    async with s.post(srv.url + "/v1/completions", json=BODY, headers=_bearer(key)) as r:
        assert r.status == 200 and (await r.json())["choices"]
    async with s.post(srv.url + "/v1/completions", json={**BODY, "stream": True},
                      headers=_bearer(key)) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    assert raw.rstrip().endswith("data: [DONE]") and '"choices"' in raw
    async with s.get(srv.url + "/metrics", headers=_bearer(key)) as r:
        assert r.status == 200
    async with s.get(srv.url + "/health") as r:  # open: liveness probes carry no key
        assert r.status == 200 and (await r.json())["status"] == "ok"


@aio
async def test_env_key_and_public_metrics(monkeypatch):
    monkeypatch.setenv(auth.ENV_KEY, "sk-env")
    eng, runner, url = await start_fake("fake")
    srv = await RouterServer(RouterSettings(port=0, control_port=0, metrics_public=True,
                                            backends=[BackendConfig(model="fake", url=url)])).start()
    try:
        async with aiohttp.ClientSession(headers=auth.client_headers()) as s:  # our clients' way
            async with s.post(srv.url + "/v1/completions", json=BODY) as r:
                assert r.status == 200
        async with aiohttp.ClientSession() as s:
            async with s.get(srv.url + "/metrics") as r:
                assert r.status == 200
            async with s.post(srv.url + "/v1/completions", json=BODY) as r:
                await _assert_401(r)
    finally:
        await srv.stop()
        await runner.cleanup()


def test_default_binds_loopback(monkeypatch):
    monkeypatch.delenv("RELOCATOR_ROUTER_HOST", raising=False)
    assert RouterSettings().host == "127.0.0.1"
    assert auth.is_loopback(RouterSettings().host)


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.0.0.5", "router.example"])
def test_non_loopback_bind_needs_a_key(monkeypatch, host):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)
    with pytest.raises(ValidationError, match="needs an API key"):
        RouterSettings(host=host)
    assert RouterSettings(host=host, api_keys=["k"]).keys == (b"k",)
    assert RouterSettings(host=host, insecure=True).keys == ()


def test_key_matches():
    keys = (b"a1", b"b2")
    assert auth.key_matches("Bearer b2", keys)
    assert not auth.key_matches("Bearer b", keys)
    assert not auth.key_matches(None, keys)
    assert not auth.key_matches("b2", keys)
    with pytest.raises(ValidationError):
        RouterSettings(api_keys=["has space"])


def test_local_cluster_router_binds_loopback():
    """`relocator up` runs the router on this machine: its supervisor's socket and the
    router's --host are loopback."""
    import io
    from pathlib import Path

    from relocator.cluster.routerproc import RouterSupervisor

    sup = RouterSupervisor(port=0, control_port=1, state_file=Path("/nonexistent"),
                           log_file=io.BytesIO())
    try:
        assert sup.sock.getsockname()[0] == "127.0.0.1"
        assert sup.cmd[sup.cmd.index("--host") + 1] == "127.0.0.1"
    finally:
        sup.sock.close()


def test_error_body_is_openai_shape():
    body = json.loads(auth.invalid_api_key(missing=True).json_body())
    assert body["error"]["code"] == "invalid_api_key"


@aio
async def test_our_stream_clients_send_the_env_key(keyed, monkeypatch):
    """relocator.cluster.streams (demo, chaos, bench) reaches a keyed router given
    RELOCATOR_API_KEY; without it each request is refused."""
    from relocator.cluster.streams import reference

    srv, _ = keyed
    monkeypatch.setenv(auth.ENV_KEY, KEY)
    ok = await reference(srv.url, "fake", 4, 2)
    assert all(not r.error and r.finish_reason for r in ok.values()), ok
    monkeypatch.delenv(auth.ENV_KEY)
    with pytest.raises(RuntimeError, match="HTTP 401"):
        await reference(srv.url, "fake", 4, 1)
