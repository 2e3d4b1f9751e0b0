"""`relocator bench router`: TTFB and throughput direct vs. through this router vs. through
the Rust vllm-router, in one run, against the same fast fake SSE backend, at a fixed number
of concurrent streams. Each side runs in its own process; the load generator is here."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

from relocator.ports import free_port
from relocator.waits import until_async

from . import sse


async def _wait_http(url: str, timeout: float = 30.0) -> None:
    """`url` answers below 500 within `timeout` s (WaitTimeout, a TimeoutError, otherwise)."""
    async with aiohttp.ClientSession() as s:
        async def up() -> bool:
            try:
                async with s.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r:
                    return r.status < 500
            except Exception:
                return False

        await until_async(up, timeout, 0.1, what=f"{url} to come up")


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def load(url: str, model: str, concurrency: int, duration_s: float, tokens: int,
               warmup_s: float = 0.5) -> dict[str, Any]:
    body = {"model": model, "prompt": "benchmark prompt", "max_tokens": tokens, "stream": True}
    ttfb: list[float] = []
    done = 0
    errors = 0
    stop_at = time.perf_counter() + warmup_s + duration_s
    measure_from = time.perf_counter() + warmup_s
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as s:
        async def worker() -> None:
            nonlocal done, errors
            while True:
                t0 = time.perf_counter()
                if t0 >= stop_at:
                    return
                try:
                    async with s.post(url + "/v1/completions", json=body) as r:
                        first = None
                        async for chunk in r.content.iter_any():
                            if first is None:
                                first = time.perf_counter() - t0
                            last = chunk
                        ok = r.status == 200 and sse.ends_done(last)
                except Exception:
                    ok = False
                if t0 >= measure_from:
                    if ok:
                        done += 1
                        ttfb.append(first)  # type: ignore[arg-type]
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return {"ttfb_p50_ms": round(_pct(ttfb, 50) * 1e3, 3),
            "ttfb_p90_ms": round(_pct(ttfb, 90) * 1e3, 3),
            "ttfb_p99_ms": round(_pct(ttfb, 99) * 1e3, 3),
            "req_per_s": round(done / duration_s, 1), "requests": done, "errors": errors}


class _Proc:
    def __init__(self, args: list[str], env: dict | None = None) -> None:
        self.p = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  env=env, start_new_session=True)

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()


def _vllm_router_bin() -> str | None:
    cand = Path(sys.executable).with_name("vllm-router")
    return str(cand) if cand.exists() else shutil.which("vllm-router")


async def run_bench(concurrency: int = 100, duration_s: float = 5.0, tokens: int = 16,
                    model: str = "fake", vllm_url: str | None = None) -> dict[str, Any]:
    py = sys.executable
    procs: list[_Proc] = []
    out: dict[str, Any] = {"config": {"concurrency": concurrency, "duration_s": duration_s,
                                      "tokens_per_stream": tokens, "backend": "fake SSE server"}}
    try:
        bport = free_port()
        procs.append(_Proc([py, "-m", "relocator.router.fakeserver", "--port", str(bport),
                            "--model", model, "--tokens", str(tokens)]))
        backend = f"http://127.0.0.1:{bport}"
        await _wait_http(backend + "/health")
        out["direct"] = await load(backend, model, concurrency, duration_s, tokens)

        rport, cport = free_port(), free_port()
        env = dict(os.environ, RELOCATOR_ROUTER_CONTROL_PORT=str(cport))
        procs.append(_Proc([py, "-m", "relocator", "router", "serve", "--host", "127.0.0.1",
                            "--port", str(rport), "--backend", f"{model}={backend}"], env=env))
        await _wait_http(f"http://127.0.0.1:{rport}/health")
        out["relocator"] = await load(f"http://127.0.0.1:{rport}", model, concurrency,
                                      duration_s, tokens)
        procs[-1].stop()

        vr = _vllm_router_bin()
        if vr is None:
            out["vllm_router"] = {"error": "vllm-router is not installed (pip install vllm-router)"}
        else:
            vport = free_port()
            p = _Proc([vr, "--host", "127.0.0.1", "--port", str(vport), "--worker-urls", backend,
                       "--policy", "round_robin", "--log-level", "warning",
                       "--prometheus-port", str(free_port())])
            procs.append(p)
            try:
                await _wait_http(f"http://127.0.0.1:{vport}/health", 30)
                out["vllm_router"] = await load(f"http://127.0.0.1:{vport}", model,
                                                concurrency, duration_s, tokens)
            except TimeoutError as e:
                err = p.p.stderr.read(2000).decode(errors="replace") if p.p.poll() is not None \
                    else ""
                out["vllm_router"] = {"error": f"{e} {err}".strip()}
        for k in ("relocator", "vllm_router"):
            if "error" not in out.get(k, {"error": 1}):
                out[k]["added_ttfb_p50_ms"] = round(out[k]["ttfb_p50_ms"] -
                                                    out["direct"]["ttfb_p50_ms"], 3)
                out[k]["added_ttfb_p99_ms"] = round(out[k]["ttfb_p99_ms"] -
                                                    out["direct"]["ttfb_p99_ms"], 3)
        if vllm_url:
            out["correctness_vllm"] = await correctness(vllm_url)
    finally:
        for p in reversed(procs):
            p.stop()
    return out


async def correctness(vllm_url: str) -> dict[str, Any]:
    """Greedy streams through the router equal direct ones on a real vLLM worker, including a
    stream switched mid-way (to the same worker: the continuation path)."""
    from relocator.cluster.streams import compare_ids

    from .client import RouterControl
    from .config import BackendConfig, RouterSettings
    from .server import RouterServer

    async with aiohttp.ClientSession() as s:
        async with s.get(vllm_url + "/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        srv = await RouterServer(RouterSettings(port=0, control_port=0, backends=[
            BackendConfig(model=model, url=vllm_url, worker_id="w0")])).start()
        try:
            body = {"model": model, "prompt": "the quick brown fox", "max_tokens": 200,
                    "temperature": 0, "ignore_eos": True, "stream": True,
                    "return_token_ids": True}

            async def ids(url: str, switch: bool) -> list[int]:
                got: list[int] = []
                async with s.post(url + "/v1/completions", json=body) as r:
                    async for p in sse.read(r.content.iter_any()):
                        c = sse.json_object(p)
                        if c is not None:
                            got += c["choices"][0].get("token_ids") or []
                        if switch and got:
                            switch = False
                            async with RouterControl(srv.control_url) as rc:
                                await rc.switch("w0", vllm_url)
                return got

            ref = await ids(vllm_url, False)
            plain = await ids(srv.url, False)
            moved = await ids(srv.url, True)
            return {"model": model, "tokens": len(ref),
                    "passthrough_identical": compare_ids(ref, plain)["first_divergence"] < 0,
                    "continued_identical": compare_ids(ref, moved)["first_divergence"] < 0}
        finally:
            await srv.stop()
