"""The router in front of real vLLM CPU workers (tiny random-weight Llama, greedy)."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from loadtests.cutproxy import RepeatCutProxy
from relocator.router.client import RouterControl
from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.server import RouterServer

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="session")]

N = 400


async def _router(*workers, tokenizer=None, **settings):
    s = RouterSettings(port=0, control_port=0, hold_timeout_s=30,
                       backends=[BackendConfig(model=w.model, url=w.base_url, worker_id=f"w{i}",
                                               tokenizer=str(tokenizer) if tokenizer else None)
                                 for i, w in enumerate(workers)], **settings)
    return await RouterServer(s).start()


async def _read_sse(resp, on_event=None):
    chunks, buf = [], b""
    async for data in resp.content.iter_any():
        buf += data
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            payload = ev[6:]
            if payload == b"[DONE]":
                chunks.append("[DONE]")
                continue
            chunks.append(json.loads(payload))
            if on_event:
                await on_event(chunks[-1])
    return chunks


def _ids(chunks):
    return [t for c in chunks if isinstance(c, dict) and c.get("choices")
            for t in (c["choices"][0].get("token_ids") or [])]


def _text(chunks, chat):
    out = ""
    for c in chunks:
        if isinstance(c, dict) and c.get("choices"):
            ch = c["choices"][0]
            out += (ch["delta"].get("content") or "") if chat else ch["text"]
    return out


def _body(model, chat, **kw):
    b = {"model": model, "max_tokens": N, "temperature": 0, "ignore_eos": True, "stream": True,
         "stream_options": {"include_usage": True}}
    b.update({"messages": [{"role": "user", "content": "the quick brown fox"}]} if chat else
             {"prompt": "the quick brown fox jumps over"})
    b.update(kw)
    return b


async def test_openai_client_through_router(vllm_server):
    import openai

    srv = await _router(vllm_server)
    try:
        direct = openai.AsyncOpenAI(base_url=vllm_server.base_url + "/v1", api_key="x")
        via = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x")
        m = vllm_server.model
        kw = dict(model=m, prompt="hello there", max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})  # 12 tokens whatever the random model says
        a = await direct.completions.create(**kw)
        b = await via.completions.create(**kw)
        assert a.choices[0].text == b.choices[0].text
        msgs = [{"role": "user", "content": "hi"}]
        a = await direct.chat.completions.create(model=m, messages=msgs, max_tokens=12,
                                                 temperature=0)
        b = await via.chat.completions.create(model=m, messages=msgs, max_tokens=12,
                                              temperature=0)
        assert a.choices[0].message.content == b.choices[0].message.content
        for chat in (False, True):
            if chat:
                st = await via.chat.completions.create(model=m, messages=msgs, max_tokens=12,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True})
                parts = [c async for c in st]
                text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
                assert text == a.choices[0].message.content
            else:
                st = await via.completions.create(**kw, stream=True,
                                                  stream_options={"include_usage": True})
                parts = [c async for c in st]
                assert parts[-1].usage.completion_tokens == 12
        models = await via.models.list()
        assert [x.id for x in models.data] == [m]
        with pytest.raises(openai.NotFoundError):
            await via.completions.create(model="nope", prompt="x", max_tokens=2)
        with pytest.raises(openai.BadRequestError):  # vLLM's own 400 passes through
            await via.completions.create(model=m, prompt="x", max_tokens=-1)
        await direct.close()
        await via.close()
    finally:
        await srv.stop()


async def test_stream_bytes_same_as_direct(vllm_server):
    srv = await _router(vllm_server)
    try:
        async with aiohttp.ClientSession() as s:
            body = _body(vllm_server.model, chat=False, max_tokens=10, return_token_ids=False)
            async with s.post(vllm_server.base_url + "/v1/completions", json=body) as r:
                direct = await _read_sse(r)
            async with s.post(srv.url + "/v1/completions", json=body) as r:
                via = await _read_sse(r)
        # vLLM coalesces tokens into chunks by timing, so chunk boundaries may differ between
        # two runs; what must match is the content and the exact shape of every event.
        def merged(cs: list) -> dict:
            events = [c for c in cs if isinstance(c, dict) and c.get("choices")]
            return {
                "text": "".join(c["choices"][0].get("text") or "" for c in events),
                "finish": [c["choices"][0].get("finish_reason") for c in events][-1],
                "shapes": {(tuple(sorted(c)), tuple(sorted(c["choices"][0]))) for c in events},
                "model": {c.get("model") for c in events},
                "tail": cs[-1],
            }

        assert merged(direct) == merged(via)
        assert via[-1] == "[DONE]"
    finally:
        await srv.stop()


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
@pytest.mark.parametrize("how", ["freeze_switch", "cut"])
async def test_continuation_token_exact(vllm_server, vllm_server_b, tiny_model_dir, chat, how):
    """A stream moved mid-way to a second worker equals an uninterrupted reference run.

    freeze_switch: worker A's connection goes silent mid-event (as under a CRIU dump), the
    controller holds A and switches it to B's endpoint. cut: A's connection drops mid-event
    (a dying worker) and the router continues on sibling B."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = _body(vllm_server.model, chat, return_token_ids=True)
    async with aiohttp.ClientSession() as s:
        async with s.post(vllm_server_b.base_url + path, json=body) as r:
            ref = await _read_sse(r)
        proxy = await _CutProxy.start(vllm_server.base_url, limit=2500,
                                      mode="freeze" if how == "freeze_switch" else "cut")
        if how == "freeze_switch":
            srv = await _router(_W(proxy.url, vllm_server.model), tokenizer=tiny_model_dir)
        else:
            srv = await _router(_W(proxy.url, vllm_server.model), vllm_server_b,
                                tokenizer=tiny_model_dir)
        rc = RouterControl(srv.control_url)
        try:
            async def run():
                async with s.post(srv.url + path, json=body) as r:
                    assert r.status == 200
                    return await _read_sse(r)

            task = asyncio.ensure_future(run())
            await asyncio.wait_for(proxy.tripped.wait(), 60)
            if how == "freeze_switch":
                await asyncio.sleep(0.2)  # the stream is now silent, not broken
                assert not task.done()
                await rc.hold("w0")
                info = await rc.switch("w0", vllm_server_b.base_url)
                assert info["moved_streams"] == 1
            got = await asyncio.wait_for(task, 120)
        finally:
            await rc.close()
            await srv.stop()
            await proxy.close()
    assert got[-1] == "[DONE]"
    assert not any(isinstance(c, dict) and "error" in c for c in got), got
    assert 0 < len(_ids(got[:3]))
    assert _ids(got) == _ids(ref)
    assert len({c["id"] for c in got if isinstance(c, dict)}) == 1
    assert _text(got, chat) == _text(ref, chat)
    usage = [c["usage"] for c in got if isinstance(c, dict) and c.get("usage")][-1]
    ref_usage = [c["usage"] for c in ref if isinstance(c, dict) and c.get("usage")][-1]
    assert usage["completion_tokens"] == ref_usage["completion_tokens"] == N
    assert usage["prompt_tokens"] == ref_usage["prompt_tokens"]
    obj = {c["object"] for c in got if isinstance(c, dict)}
    assert obj == {"chat.completion.chunk" if chat else "text_completion"}


class _W:
    def __init__(self, base_url, model):
        self.base_url, self.model = base_url, model


class _CutProxy:
    """Loopback TCP proxy in front of a worker. After `limit` bytes of response it either
    goes silent (freeze: what a client sees while CRIU dumps the worker) or drops the
    connection (cut: a dying worker)."""

    def __init__(self, limit, mode):
        self.limit, self.mode = limit, mode
        self.writers = []
        self.server = None
        self.url = ""
        self.tripped = asyncio.Event()

    @classmethod
    async def start(cls, target_url, limit=2500, mode="cut"):
        self = cls(limit, mode)
        host, port = target_url.split("//")[1].split(":")

        async def pipe(r, w, limited):
            n = 0
            try:
                while data := await r.read(65536):
                    if limited and not self.tripped.is_set() and n + len(data) >= self.limit:
                        w.write(data[: self.limit - n])
                        self.tripped.set()
                        if self.mode == "cut":
                            self.cut()
                        return  # freeze: stop forwarding, keep both sockets open
                    n += len(data)
                    w.write(data)
                    await w.drain()
            except Exception:
                pass

        async def handle(cr, cw):
            ur, uw = await asyncio.open_connection(host, int(port))
            self.writers += [cw, uw]
            asyncio.ensure_future(pipe(cr, uw, False))
            asyncio.ensure_future(pipe(ur, cw, not self.tripped.is_set()))

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    def cut(self):
        for w in self.writers:
            w.transport.abort()
        self.writers.clear()

    async def close(self):
        self.cut()
        self.server.close()


async def test_text_exact_across_hundreds_of_splices(vllm_server, vllm_server_b, tiny_model_dir):
    """What users read: every stream's concatenated text, through the official openai client,
    equals the same request made directly, while every stream is cut and continued every few
    tokens (the random-weight model emits incomplete UTF-8 often, so many splices fall inside a
    character; stop strings keep text held back at every splice). Completions and chat, with
    and without stop strings (issue 20)."""
    import random

    import openai

    rng = random.Random(20)
    proxies = [await RepeatCutProxy(w.base_url, rng).start() for w in (vllm_server,
                                                                       vllm_server_b)]
    srv = await _router(*[_W(p.url, vllm_server.model) for p in proxies], tokenizer=tiny_model_dir,
                        max_continuations=10_000, retries=4, unreachable_hold_s=0)
    direct = openai.AsyncOpenAI(base_url=vllm_server_b.base_url + "/v1", api_key="x", max_retries=3)  # the baseline: a keep-alive race may drop one connection
    via = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    m = vllm_server.model
    words = "weight model scheduler packing cache graph request token stream node".split()
    prompts = [f"{rng.choice(words)} {rng.choice(words)} {rng.choice(words)} {i}" for i in range(6)]

    async def text_of(client, chat, prompt, stop):
        extra = {"ignore_eos": True, "min_tokens": 120 if stop else 0}
        kw = dict(model=m, max_tokens=400, temperature=0, stream=True, extra_body=extra,
                  stop=stop or None)
        if chat:
            st = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **kw)
            return "".join([c.choices[0].delta.content or "" async for c in st if c.choices])
        st = await client.completions.create(prompt=prompt, **kw)
        return "".join([c.choices[0].text async for c in st if c.choices])

    diffs, streams = [], 0
    try:
        for chat in (False, True):
            refs = await asyncio.gather(*[text_of(direct, chat, p, None) for p in prompts])
            # stop strings that do occur after min_tokens' worth of text: the engine holds back
            # len-1 characters at every step, and the stream ends at the first occurrence
            stops = [[r[len(r) // 2: len(r) // 2 + 4], "walks"] for r in refs]
            for with_stop in (False, True):
                want = refs if not with_stop else await asyncio.gather(
                    *[text_of(direct, chat, p, st) for p, st in zip(prompts, stops)])
                got = await asyncio.gather(*[text_of(via, chat, p, st if with_stop else None)
                                             for p, st in zip(prompts, stops)])
                streams += len(got)
                diffs += [(chat, with_stop, p, a, b) for p, a, b in zip(prompts, want, got)
                          if a != b]
        kinds = ("char", "stop_buffer", "clean", "engine_text")
        splices = {at: srv.hooks.splices.labels(at)._value.get() for at in kinds}
        spliced = {at: srv.hooks.spliced_streams.labels(at)._value.get() for at in kinds}
    finally:
        await direct.close()
        await via.close()
        await srv.stop()
        for p in proxies:
            await p.close()
    print(f"streams {streams}, splices {splices}, streams by splice {spliced}, "
          f"cuts {sum(p.cuts for p in proxies)}")
    assert not diffs, [(c, s, p, a[:80], b[:80], len(a), len(b)) for c, s, p, a, b in diffs[:3]]
    assert splices["engine_text"] == 0
    assert sum(splices.values()) >= 200, splices  # hundreds of splices
    assert splices["char"] >= 20 and splices["stop_buffer"] >= 20, splices
    assert spliced["char"] >= 6 and spliced["stop_buffer"] >= 6, spliced
