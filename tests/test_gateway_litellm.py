"""The LiteLLM plugin (relocator.gateways.litellm) in a real LiteLLM proxy (the pinned release
in .venv-gateway) in front of two real vLLM CPU workers, with the official openai client.

A move is what the worker's clients see of it (relocator.bench.moveproxy): the controller's
HOLD through the plugin's control API, the source frozen as by a CRIU dump, SWITCH to the
copy's endpoint (here the second vLLM server, same weights: greedy output is identical), then
the source killed (RELEASE). The plugin runs the router core in LiteLLM's process, so its streams
are continued token-exactly on the copy and requests that arrive during the hold wait."""

from __future__ import annotations

import asyncio
import json

import pytest

from relocator.bench.moveproxy import MoveProxy
from relocator.gateways.litellm_proxy import LITELLM_VERSION, LiteLLMProxy, available, plugin_config
from relocator.ports import free_port
from relocator.router.client import RouterControl

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

N = 600  # tokens per stream
#: LiteLLM ends a stream whose last REPEATED_STREAMING_CHUNK_LIMIT (100) chunks carry the same
#: text (docs/gateways.md); the random tiny model's greedy output can loop like that, so the
#: move test streams only prompts whose reference has no run of identical chunks near it
MAX_RUN = 50


@pytest.fixture(scope="module", autouse=True)
def _need_litellm():
    why = available()
    if why:
        pytest.skip(why)


def _proxy(tmp_path, model, url, tokenizer):
    cport = free_port()
    cfg = tmp_path / "relocator-gateway.yaml"
    cfg.write_text(json.dumps({"control_port": cport, "hold_timeout_s": 120,
                               "backends": [{"model": model, "url": url, "worker_id": "w0",
                                             "tokenizer": str(tokenizer)}]}))
    p = LiteLLMProxy(plugin_config([model]), tmp_path, free_port(),
                     env={"RELOCATOR_GATEWAY_CONFIG": str(cfg)})
    return p, f"http://127.0.0.1:{cport}"


async def _stream(client, model, prompt, progress=None):
    st = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=N,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    text, usage, pieces = "", None, []
    async for c in st:
        if c.choices:
            pieces.append(c.choices[0].delta.content)
            text += c.choices[0].delta.content or ""
            if progress is not None:
                progress[prompt] = progress.get(prompt, 0) + 1
        if c.usage:
            usage = c.usage
    return text, usage, longest_run(pieces)


def longest_run(pieces: list) -> int:
    """The longest run of consecutive chunks with the same text (what LiteLLM counts)."""
    best = run = 0
    for i, p in enumerate(pieces):
        run = run + 1 if i and p == pieces[i - 1] else 1
        best = max(best, run)
    return best


async def test_longest_run() -> None:
    assert longest_run([]) == 0
    assert longest_run(["a", "b", "b", "b", "a"]) == 3 and longest_run(["x"]) == 1


async def _loop_free_prompts(client, model: str, want: int) -> dict[str, tuple]:
    """`want` prompts, each with its reference (text, usage), whose reference output has no run
    of identical chunks that LiteLLM could take for a looping model (checked, not hoped)."""
    ref: dict[str, tuple] = {}
    for round_ in range(4):
        cands = [f"relocate worker {round_}.{i} while it streams" for i in range(want)]
        for p, (text, usage, run) in zip(cands, await asyncio.gather(
                *[_stream(client, model, p) for p in cands])):
            if run < MAX_RUN and len(ref) < want:
                ref[p] = (text, usage)
        if len(ref) == want:
            return ref
    pytest.fail(f"only {len(ref)} of {4 * want} prompts stream without a run of {MAX_RUN} "
                "identical chunks on this model")


async def test_pinned_litellm_installed():
    from importlib.metadata import version

    import subprocess

    from relocator.gateways.litellm_proxy import gateway_python

    out = subprocess.run([str(gateway_python()), "-c",
                          "from importlib.metadata import version; print(version('litellm'))"],
                         capture_output=True, text=True, check=True).stdout.strip()
    assert out == LITELLM_VERSION
    assert version("openai")  # the client side lives in .venv


async def test_move_under_streaming_load_through_litellm(vllm_server, vllm_server_b,
                                                         tiny_model_dir, tmp_path):
    import openai

    model = vllm_server.model
    direct = openai.AsyncOpenAI(base_url=vllm_server_b.base_url + "/v1", api_key="x",
                                max_retries=0)
    ref = await _loop_free_prompts(direct, model, 8)
    await direct.close()
    prompts, late = list(ref)[:6], list(ref)[6:]  # the late ones arrive during the hold

    mp = await MoveProxy(vllm_server.base_url).start()
    proxy, control = _proxy(tmp_path, model, mp.url, tiny_model_dir)
    await asyncio.to_thread(proxy.start)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0,
                                timeout=300)
    rc = RouterControl(control)
    try:
        progress: dict[str, int] = {}
        first = [asyncio.ensure_future(_stream(client, model, p, progress)) for p in prompts]
        # move while the source streams: after ~30 KB of its ~200 KB per stream no stream can
        # be complete. (LiteLLM reads ahead of its client, so the client's progress says little
        # about the upstream; on a busy machine it may not have dispatched every request yet:
        # those wait for the switch like the late ones.) The source goes silent first, then the
        # hold: the plugin's control API is served by LiteLLM's busy event loop, and the source
        # must not finish the streams meanwhile.
        while mp.forwarded < 30_000:
            await asyncio.sleep(0.002)
            assert not any(t.done() for t in first), ([t.exception() for t in first
                                                       if t.done()], proxy.tail())
        mp.freeze()                                                    # DUMP
        await rc.hold("w0")                                            # HOLD
        second = [asyncio.ensure_future(_stream(client, model, p)) for p in late]
        await asyncio.sleep(0.5)
        early = [t.exception() for t in second if t.done()]
        assert not early, (early, proxy.tail())  # they wait for the switch
        held = (await rc.replicas())["models"][model][0]
        info = await rc.switch("w0", vllm_server_b.base_url)            # SWITCH
        mp.kill()                                                      # RELEASE
        got = await asyncio.wait_for(asyncio.gather(*first, *second), 300)
    finally:
        await rc.close()
        await client.close()
        proxy.stop()
        await mp.close()
    assert info["moved_streams"] >= 1, (info, proxy.tail())  # cut mid-way and continued
    assert held["state"] == "held"
    for p, (text, usage, _) in zip(prompts + late, got):
        want_text, want_usage = ref[p]
        assert text == want_text, (p, text[:80], want_text[:80])  # nothing lost or repeated
        assert usage.completion_tokens == want_usage.completion_tokens == N
        assert usage.prompt_tokens == want_usage.prompt_tokens


async def test_errors_and_unary_through_litellm(tmp_path):
    """Clear errors through LiteLLM (no cooldown after them), a plain request passes through."""
    import openai

    from relocator.router.fakeserver import Knobs, start_fake

    eng, runner, url = await start_fake("fake", knobs=Knobs(tokens=12, token_delay_s=0.01))
    cport = free_port()
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(json.dumps({"control_port": cport, "hold_timeout_s": 1,
                               "backends": [{"model": "fake", "url": url, "worker_id": "w0"}]}))
    proxy = LiteLLMProxy(plugin_config(["fake", "ghost"]), tmp_path, free_port(),
                         env={"RELOCATOR_GATEWAY_CONFIG": str(cfg)})
    await asyncio.to_thread(proxy.start)
    client = openai.AsyncOpenAI(base_url=proxy.url + "/v1", api_key=proxy.key, max_retries=0)
    direct = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    rc = RouterControl(f"http://127.0.0.1:{cport}")
    msgs = [{"role": "user", "content": "hi"}]
    try:
        a = await client.chat.completions.create(model="fake", messages=msgs, max_tokens=12)
        b = await direct.chat.completions.create(model="fake", messages=msgs, max_tokens=12)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert a.usage.completion_tokens == 12
        for stream in (False, True, True):  # in LiteLLM's list, not in the routing table
            with pytest.raises(openai.NotFoundError, match="ghost"):
                r = await client.chat.completions.create(model="ghost", messages=msgs,
                                                         max_tokens=3, stream=stream)
                if stream:
                    [x async for x in r]
        await rc.hold("w0")  # never switched: the hold runs out
        with pytest.raises(openai.InternalServerError, match="relocated"):
            await client.chat.completions.create(model="fake", messages=msgs, max_tokens=3)
        await rc.release("w0")
        r = await client.chat.completions.create(model="fake", messages=msgs, max_tokens=3,
                                                 stream=True)
        assert "".join([x.choices[0].delta.content or "" async for x in r if x.choices])
        import urllib.request

        with urllib.request.urlopen(f"http://127.0.0.1:{cport}/metrics", timeout=5) as m:
            text = m.read().decode()
        assert 'relocator_router_requests_total{backend="w0",status="200"}' in text, text[:2000]
        # a client that goes away: LiteLLM closes the plugin's stream, the core the upstream one
        import aiohttp

        async with aiohttp.ClientSession() as s:
            r = await s.post(proxy.url + "/v1/chat/completions",
                             headers={"Authorization": f"Bearer {proxy.key}"},
                             json={"model": "fake", "messages": msgs, "max_tokens": 2000,
                                   "stream": True})
            await r.content.readany()
            assert (await rc.replicas())["models"]["fake"][0]["in_flight"] == 1
            r.close()
        for _ in range(200):
            if (await rc.replicas())["models"]["fake"][0]["in_flight"] == 0:
                break
            await asyncio.sleep(0.1)
        assert (await rc.replicas())["models"]["fake"][0]["in_flight"] == 0
        assert eng.aborted >= 1
    finally:
        await rc.close()
        await client.close()
        await direct.close()
        proxy.stop()
        await runner.cleanup()
