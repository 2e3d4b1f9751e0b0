"""The reference engine (adapters/reference): the tiny Llama on plain torch, as a local worker.

Starts in seconds, frames its streams as vLLM does, continues greedy streams token-exactly from
prompt ids + sent ids, and the router's spliced streams read exactly like a direct run."""

from __future__ import annotations

import asyncio
import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import pytest

from adapters.base import LaunchSpec, get_adapter, get_codec
from loadtests.cutproxy import RepeatCutProxy
from relocator.local_worker import LocalWorker, start_local_worker
from relocator.ports import free_port

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def ref_worker(tiny_model_dir, tmp_path_factory) -> LocalWorker:
    spec = LaunchSpec(model_dir=tiny_model_dir, served_model_name=MODEL, port=free_port())
    w = start_local_worker(get_adapter("reference"), spec, log_dir=tmp_path_factory.mktemp("ref"))
    try:
        # in a thread of its own: the fixture may first be asked for inside a running loop
        with ThreadPoolExecutor(1) as ex:
            w.ready_s = ex.submit(asyncio.run, w.wait_ready(timeout=60)).result()  # type: ignore[attr-defined]
    except BaseException:
        w.stop()
        raise
    yield w
    w.stop()


async def _sse(resp: aiohttp.ClientResponse) -> list:
    out, buf = [], b""
    async for data in resp.content.iter_any():
        buf += data
        while b"\n\n" in buf:
            ev, buf = buf.split(b"\n\n", 1)
            assert ev.startswith(b"data: "), ev
            out.append("[DONE]" if ev[6:] == b"[DONE]" else json.loads(ev[6:]))
    return out


async def _post(url: str, path: str, body: dict):
    async with aiohttp.ClientSession() as s:
        async with s.post(url + path, json=body, timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200, await r.text()
            return await (_sse(r) if body.get("stream") else r.json())


def _ids(chunks: list) -> list[int]:
    return [t for c in chunks if isinstance(c, dict) and c.get("choices")
            for t in (c["choices"][0].get("token_ids") or [])]


def _prompt_ids(chunks: list) -> list[int]:
    for c in chunks:
        if isinstance(c, dict):
            if c.get("prompt_token_ids"):
                return c["prompt_token_ids"]
            if c.get("choices") and c["choices"][0].get("prompt_token_ids"):
                return c["choices"][0]["prompt_token_ids"]
    raise AssertionError("no prompt ids")


def test_starts_in_seconds_and_serves(ref_worker: LocalWorker) -> None:
    print(f"reference engine ready in {ref_worker.ready_s:.2f}s")  # type: ignore[attr-defined]
    assert ref_worker.ready_s < 20  # type: ignore[attr-defined]

    async def run():
        body = {"model": MODEL, "prompt": "the cluster node", "max_tokens": 24,
                "temperature": 0, "return_token_ids": True}
        a = await _post(ref_worker.base_url, "/v1/completions", body)
        b = await _post(ref_worker.base_url, "/v1/completions", body)
        assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
        assert len(a["choices"][0]["token_ids"]) == a["usage"]["completion_tokens"] <= 24
        det = await _post(ref_worker.base_url, "/detokenize",
                          {"model": MODEL, "tokens": a["choices"][0]["prompt_token_ids"]})
        assert det["prompt"] == "the cluster node"
        # seeded sampling is reproducible; an unknown model is a 404
        s = dict(body, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True)
        x = await _post(ref_worker.base_url, "/v1/completions", s)
        y = await _post(ref_worker.base_url, "/v1/completions", s)
        assert x["choices"][0]["token_ids"] == y["choices"][0]["token_ids"]
        async with aiohttp.ClientSession() as sess:
            async with sess.post(ref_worker.base_url + "/v1/completions",
                                 json=dict(body, model="nope")) as r:
                assert r.status == 404
            async with sess.get(ref_worker.base_url + "/metrics") as r:
                m = get_adapter("reference").parse_metrics(await r.text())
        assert m["reference:request_success_total"] >= 4
        assert m["reference:num_requests_running"] == 0

    asyncio.run(run())


def _shape(chunks: list) -> list:
    """Keys of each event (top level and choice), consecutive repeats collapsed."""
    out: list = []
    for c in chunks:
        if c == "[DONE]":
            k = "[DONE]"
        else:
            ch = c["choices"][0] if c["choices"] else {}
            k = (tuple(c), tuple(ch), tuple(ch.get("delta") or ()),
                 tuple(n for n in ("prompt_token_ids", "token_ids")
                       if (c.get(n) if n in c else ch.get(n)) is not None))
        if not out or out[-1] != k:
            out.append(k)
    return out


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("want_ids", [False, True])
def test_stream_framing_is_vllms(ref_worker: LocalWorker, chat: bool, want_ids: bool) -> None:
    """Same keys, in the same order, as vLLM 0.32's streams (fakeserver imitates them)."""
    from relocator.router.fakeserver import FakeEngine

    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if want_ids:
        body["return_token_ids"] = True
    if chat:
        body["messages"] = [{"role": "user", "content": "a worker moves"}]
    else:
        body["prompt"] = "a worker moves"
    got = asyncio.run(_post(ref_worker.base_url,
                            "/v1/chat/completions" if chat else "/v1/completions", body))
    n = len(_ids(got)) if want_ids else 6
    pieces = ["x"] * n
    fake = [ev[6:-2] for ev in FakeEngine(model=MODEL)._events(
        "chat" if chat else "completions", "id", 0, [1, 2], list(range(n)), pieces, "length",
        None, want_ids, body)]
    fake = ["[DONE]" if f == "[DONE]" else json.loads(f) for f in fake]
    if chat:  # chunks without text carry no delta content: compare the text-bearing shape
        got = [c for c in got if c == "[DONE]" or not c["choices"]
               or c["choices"][0]["delta"] or c["choices"][0]["finish_reason"]]
        for c in got[1:]:
            if c != "[DONE]" and c["choices"] and not c["choices"][0]["delta"]:
                c["choices"][0]["delta"] = {"content": ""}
    assert _shape(got) == _shape(fake)
    assert got[-1] == "[DONE]" and got[-2]["usage"]["completion_tokens"] == 6


def test_continuation_is_token_exact_at_every_cut(ref_worker: LocalWorker) -> None:
    """A greedy stream continued from prompt ids + sent ids (the router's continuation request)
    gives exactly the rest of the uninterrupted run, at every cut point, with the
    continuations running concurrently."""
    codec = get_codec("reference")
    url = ref_worker.base_url

    async def run() -> int:
        checked = 0
        for chat in (False, True):
            body = {"model": MODEL, "max_tokens": 48, "temperature": 0, "ignore_eos": True,
                    "stream": True, "return_token_ids": True}
            if chat:
                body["messages"] = [{"role": "user", "content": "red river mountain"}]
            else:
                body["prompt"] = "the cluster node runs"
            path = "/v1/chat/completions" if chat else "/v1/completions"
            full = await _post(url, path, body)
            prompt, ids = _prompt_ids(full), _ids(full)
            assert len(ids) == 48
            kind = "chat" if chat else "completions"
            reqs = [codec.continuation_request(kind, body, prompt, ids[:k], text_by_router=True)
                    for k in range(1, 48)]
            outs = await asyncio.gather(*[_post(url, p, b) for p, b in reqs])
            for k, out in zip(range(1, 48), outs):
                assert ids[:k] + _ids(out) == ids, (chat, k)
                checked += 1
        return checked

    assert asyncio.run(run()) == 94


def test_stop_strings_min_tokens_and_eos(ref_worker: LocalWorker) -> None:
    url = ref_worker.base_url

    async def run():
        base = {"model": MODEL, "prompt": "a small", "max_tokens": 60, "temperature": 0,
                "ignore_eos": True}
        ref = (await _post(url, "/v1/completions", base))["choices"][0]["text"]
        stop = ref[len(ref) // 2: len(ref) // 2 + 3]
        got = (await _post(url, "/v1/completions", dict(base, stop=[stop])))["choices"][0]
        assert got["finish_reason"] == "stop" and got["stop_reason"] == stop
        assert got["text"] == ref[: ref.find(stop)]
        chunks = await _post(url, "/v1/completions", dict(base, stop=[stop], stream=True))
        assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == got["text"]
        # the stop token of a request, once min_tokens are out
        ids = (await _post(url, "/v1/completions", dict(base, return_token_ids=True)))
        ids = ids["choices"][0]["token_ids"]
        st = await _post(url, "/v1/completions", dict(base, stop_token_ids=[ids[3]],
                                                      return_token_ids=True))
        assert st["choices"][0]["token_ids"] == ids[:ids.index(ids[3]) + 1]
        assert st["choices"][0]["stop_reason"] == ids[3]
        mt = await _post(url, "/v1/completions", dict(base, stop_token_ids=[ids[3]],
                                                      min_tokens=10, return_token_ids=True))
        assert len(mt["choices"][0]["token_ids"]) >= 10

    asyncio.run(run())


async def test_router_splices_are_text_exact(ref_worker: LocalWorker, tiny_model_dir) -> None:
    """Streams through the router, cut every few events by a proxy and continued on the
    reference engine, read exactly like a direct run (completions and chat, with and without
    stop strings)."""
    import openai

    from relocator.router.config import BackendConfig, RouterSettings
    from relocator.router.server import RouterServer

    rng = random.Random(12)
    proxies = [await RepeatCutProxy(ref_worker.base_url, rng, lo=1200, hi=4000).start()
               for _ in range(2)]
    s = RouterSettings(port=0, control_port=0, hold_timeout_s=30, max_continuations=10_000,
                       retries=4, unreachable_hold_s=0,
                       backends=[BackendConfig(model=MODEL, url=p.url, worker_id=f"w{i}",
                                               tokenizer=str(tiny_model_dir), engine="reference")
                                 for i, p in enumerate(proxies)])
    srv = await RouterServer(s).start()
    direct = openai.AsyncOpenAI(base_url=ref_worker.base_url + "/v1", api_key="x", max_retries=0)
    via = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    words = "weight model cache graph request token stream node".split()
    prompts = [f"{rng.choice(words)} {rng.choice(words)} {i}" for i in range(4)]

    async def text_of(client, chat, prompt, stop):
        extra = {"ignore_eos": True, "min_tokens": 60 if stop else 0}
        kw = dict(model=MODEL, max_tokens=160, temperature=0, stream=True, extra_body=extra,
                  stop=stop or None)
        if chat:
            st = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], **kw)
            return "".join([c.choices[0].delta.content or "" async for c in st if c.choices])
        st = await client.completions.create(prompt=prompt, **kw)
        return "".join([c.choices[0].text async for c in st if c.choices])

    diffs, t0 = [], time.monotonic()
    try:
        for chat in (False, True):
            refs = await asyncio.gather(*[text_of(direct, chat, p, None) for p in prompts])
            stops = [[r[len(r) // 2: len(r) // 2 + 4], "walks"] for r in refs]
            for with_stop in (False, True):
                want = refs if not with_stop else await asyncio.gather(
                    *[text_of(direct, chat, p, st) for p, st in zip(prompts, stops)])
                got = await asyncio.gather(*[text_of(via, chat, p, st if with_stop else None)
                                             for p, st in zip(prompts, stops)])
                diffs += [(chat, with_stop, p, a, b) for p, a, b in zip(prompts, want, got)
                          if a != b]
        kinds = ("char", "stop_buffer", "clean", "engine_text")
        splices = {at: srv.hooks.splices.labels(at)._value.get() for at in kinds}
    finally:
        await direct.close()
        await via.close()
        await srv.stop()
        for p in proxies:
            await p.close()
    print(f"splices {splices}, cuts {sum(p.cuts for p in proxies)}, "
          f"{time.monotonic() - t0:.1f}s")
    assert not diffs, [(c, s, p, a[:60], b[:60]) for c, s, p, a, b in diffs[:3]]
    assert splices["engine_text"] == 0
    assert sum(splices.values()) >= 50, splices


@pytest.mark.integration
def test_criu_round_trip_in_a_cell(tiny_model_dir, tmp_path) -> None:
    """The reference engine in a real cell: dump, restore into a new cell, identical greedy
    output there; the stopped source resumes and serves the same."""
    from relocator.snapshot import dump, restore, resume_source
    from relocator.worker import default_spec, launch_worker, wait_ready

    prompts = ["the cluster node", "a worker moves to a new", "red river mountain light and"]

    async def greedy(endpoint: str) -> list[list[int]]:
        out = []
        for p in prompts:
            r = await _post(endpoint, "/v1/completions", {
                "model": MODEL, "prompt": p, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            out.append(r["choices"][0]["token_ids"])
        return out

    cell = launch_worker(default_spec(tiny_model_dir, engine="reference"), engine="reference")
    restored = None
    try:
        ready = asyncio.run(wait_ready(cell, timeout=60))
        print(f"reference engine ready in a cell in {ready:.2f}s")
        want = asyncio.run(greedy(cell.endpoint))
        t0 = time.monotonic()
        img = dump(cell, tmp_path / "image")
        t1 = time.monotonic()
        restored = restore(img)
        asyncio.run(wait_ready(restored, timeout=60))
        t2 = time.monotonic()
        print(f"dump {t1 - t0:.2f}s, restore until ready {t2 - t1:.2f}s")
        assert asyncio.run(greedy(restored.endpoint)) == want
        restored.kill()
        restored = None
        resume_source(cell)
        assert asyncio.run(greedy(cell.endpoint)) == want
    finally:
        if restored is not None:
            restored.kill()
        cell.kill()


def test_a_handoffs_prefill_is_found_in_its_prefix_cache(ref_worker: LocalWorker) -> None:
    """The handoff's warm-up op against the reference engine: a second round of longer sequences
    finds the first round's whole sequences cached, and the continuation after it says so in
    its usage (prompt_tokens_details.cached_tokens, as vLLM does) and in /metrics."""
    from relocator.agent.modes.handoff import HandoffOps

    url = ref_worker.base_url
    a, b = [311, 290, 305, 444, 123, 77, 45], [311, 12, 99, 8, 250]
    one = HandoffOps().prefill(url, MODEL, [a, b], engine="reference")
    two = HandoffOps().prefill(url, MODEL, [a + [5, 6, 7], b + [9]], engine="reference")
    assert two["cached_tokens"] == len(a) + len(b) > one["cached_tokens"], (one, two)

    async def run() -> dict:
        body = {"model": MODEL, "prompt": a + [5, 6, 7, 8], "max_tokens": 4, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        got = await _post(url, "/v1/completions", body)
        async with aiohttp.ClientSession() as s:
            async with s.get(url + "/metrics") as r:
                m = get_adapter("reference").parse_metrics(await r.text())
        return {"usage": got[-2]["usage"], "metrics": m}

    out = asyncio.run(run())
    assert out["usage"].get("prompt_tokens_details") == {"cached_tokens": len(a) + 3}, out["usage"]
    assert out["metrics"]["reference:prefix_cache_hits_total"] >= len(a) + len(b) + len(a) + 3, out["metrics"]
