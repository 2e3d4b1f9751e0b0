"""The abuse pass against a real router process (fake backend in its own process): no crash,
no 5xx the router makes itself beyond the known one, fds back to baseline, in-flight 0."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest

from loadtests.abuse import AbuseConfig, listener_pid, loopback_target, proc_stats, run_abuse
from relocator.ports import free_port
from relocator.router.bench import _Proc, _wait_http

pytestmark = pytest.mark.asyncio(loop_scope="session")

# Known router finding (reported, not yet fixed in relocator/router): a JSON body nested
# ~100k levels deep makes json.loads raise RecursionError, which the router does not map to
# 400, so aiohttp answers 500. The router survives it. Remove from here once fixed.
KNOWN: set[tuple[str, str]] = set()  # findings accepted for now: none


@pytest.fixture
async def router_proc():
    py = sys.executable
    bport, rport, cport = free_port(), free_port(), free_port()
    procs = [_Proc([py, "-m", "relocator.router.fakeserver", "--port", str(bport),
                    "--model", "fake", "--tokens", "16"])]
    try:
        await _wait_http(f"http://127.0.0.1:{bport}/health")
        env = dict(os.environ, RELOCATOR_ROUTER_CONTROL_PORT=str(cport))
        procs.append(_Proc([py, "-m", "relocator", "router", "serve", "--host", "127.0.0.1",
                            "--port", str(rport), "--backend", f"w1@fake=http://127.0.0.1:{bport}"],
                           env=env))
        await _wait_http(f"http://127.0.0.1:{rport}/health")
        yield procs[-1], f"http://127.0.0.1:{rport}", f"http://127.0.0.1:{cport}"
    finally:
        for p in reversed(procs):
            p.stop()


async def test_loopback_only_and_proc_facts():
    for bad in ("http://10.0.0.1:8000", "https://127.0.0.1:8000", "http://example.invalid:1"):
        with pytest.raises((ValueError, OSError)):
            loopback_target(bad)
    assert loopback_target("http://localhost:9") [1] == 9
    st = proc_stats(os.getpid())
    assert st["fds"] > 0 and st["rss_mb"] > 0
    assert proc_stats(2 ** 22 + 12345) is None


@pytest.mark.parametrize("scan_order", [sorted, lambda pids: sorted(pids, reverse=True)])
async def test_listener_pid_names_the_child_of_a_shared_socket_whatever_the_pid_order(monkeypatch, scan_order):
    """Parent and child hold one listening socket (the router daemon's case): the child is the
    server, also when its pid is below its parent's (pids wrap around; a CI run met it)."""
    import socket
    import subprocess
    import sys

    import loadtests.abuse as abuse

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    assert listener_pid(port) == os.getpid()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], pass_fds=(s.fileno(),))
    try:
        real_pids = abuse.psutil.pids
        monkeypatch.setattr(abuse.psutil, "pids", lambda: scan_order(real_pids()))
        assert listener_pid(port) == child.pid
        assert listener_pid(port, "10.1.2.3") is None  # not listened on at that address
    finally:
        child.kill()
        child.wait()
        s.close()


async def test_abuse_pass(router_proc):
    proc, api, ctl = router_proc
    assert listener_pid(int(api.rsplit(":", 1)[1])) == proc.p.pid
    rep = await asyncio.wait_for(run_abuse(AbuseConfig(
        router=api, control=ctl, rounds=2, scale=0.5, slow_s=1.5, settle_s=8)), 120)
    print(json.dumps(rep, indent=1)[:4000])
    assert rep["pid"] == proc.p.pid and proc.p.poll() is None
    assert rep["crashed"] is None
    assert rep["leak"]["fds"] is False and rep["leak"]["fds_over_baseline"] <= 4
    assert rep["leak"]["rss"] is False
    assert rep["leak"]["in_flight_left"] == 0
    unexpected = [f for f in rep["findings"] if (f["section"], f["case"]) not in KNOWN]
    assert not unexpected
    assert rep["cases"] > 200
    assert rep["statuses"]["slow-probe"].get("200", 0) >= 3  # served while being abused
    # and it still serves a normal stream afterwards
    from loadtests import LoadConfig, run_load

    lr = await run_load(LoadConfig(url=api, concurrency=4, requests=8, output_tokens=[8]))
    assert lr.summary()["failed_requests"] == 0


async def test_cli_abuse_json(router_proc):
    proc, api, ctl = router_proc
    p = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "relocator", "abuse", "--router", api, "--control", ctl,
        "--rounds", "1", "--scale", "0.2", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 90)
    d = json.loads(out)
    assert d["crashed"] is None and d["pid"] == proc.p.pid
    # exit 1 while the known deep-nesting 500 is there, 0 once fixed
    assert p.returncode == (0 if d["ok"] else 1), err.decode()
    assert proc.p.poll() is None


async def test_field_by_field_against_the_router_core():
    """`loadtests.abuse.field_cases` (each field the router reads, each wrong type, both
    endpoints, streamed and not) against the router core and the fake engine, no HTTP
    front: nothing the router answers is a 5xx, and what it refuses itself is a 400 in
    OpenAI's shape (a non-object `stream_options` crashed the stream state: a 500)."""
    from collections import Counter

    from loadtests.abuse import field_cases
    from relocator.router.core import RouterCore, Stream
    from relocator.router.errors import RouterError
    from relocator.router.fakeserver import start_fake
    from relocator.router.table import RoutingTable
    from relocator.router.upstream import AiohttpUpstream

    eng, runner, url = await start_fake("fake")
    table = RoutingTable()
    table.add("w1", "fake", url)
    upstream = AiohttpUpstream()
    core = RouterCore(table, upstream)
    statuses: Counter = Counter()
    refused: dict[str, dict] = {}
    bad: list[tuple[str, str]] = []
    sem = asyncio.Semaphore(16)

    async def one(kind: str, name: str, body: bytes) -> None:
        async with sem:
            try:
                res = await core.handle(kind, body)
                if isinstance(res, Stream):
                    async for _ in res.chunks:
                        pass
                st = res.status
            except RouterError as e:
                st = e.status
                refused[name] = e.body()
            except Exception as e:  # the front end would answer 500
                st = 500
                bad.append((name, repr(e)))
            statuses[st] += 1
            if st >= 500:
                bad.append((name, str(st)))

    cases = field_cases("fake")
    try:
        await asyncio.gather(*(one(*c) for c in cases))
    finally:
        await upstream.close()
        await runner.cleanup()
    print(len(cases), dict(statuses))
    assert not bad, bad[:10]
    assert sum(statuses.values()) == len(cases) > 2000
    assert statuses[200] > 500 and statuses[400] > 200  # both sides exercised
    for path in ("/v1/completions", "/v1/chat/completions"):
        for v in ("string", "true", "mixed list", "huge"):
            err = refused[f"{path} stream=True stream_options={v}"]["error"]
            assert err["param"] == "stream_options" and err["type"] == "invalid_request_error"
            assert set(err) == {"message", "type", "param", "code"}
    assert refused["/v1/completions stream=True max_tokens=string"]["error"]["param"] == \
        "max_tokens"
