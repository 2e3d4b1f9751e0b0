"""A worker whose node vanishes sends no FIN: the router's upstream connection must notice the
dead peer (keepalive + TCP_USER_TIMEOUT) instead of waiting on it forever. Real sockets: a fake
engine in a network namespace of its own, whose veth is then removed while it keeps running."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request

import pytest

from relocator.cell import netns
from relocator.router.core import UpstreamError
from relocator.router.server import AiohttpUpstream

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="network namespaces and TCP_USER_TIMEOUT are Linux")


@pytest.fixture
def vanishing_engine():
    link = netns.create("rl-test-deadpeer")
    proc = subprocess.Popen(["ip", "netns", "exec", link.name, sys.executable, "-m", "relocator.router.fakeserver",
                             "--host", link.cell_ip, "--port", "9000", "--tokens", "400", "--token-delay", "0.05"])
    url = f"http://{link.cell_ip}:9000"
    deadline = time.monotonic() + 20
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    yield link, url
    proc.kill()
    proc.wait()
    netns.delete(link.name)


async def _read_until_error(dead_peer_s: float, url: str, link, limit_s: float) -> float | None:
    """Start a stream, cut the cell's link after a few chunks; seconds until the upstream
    reported the broken stream, None if it was still waiting after `limit_s`."""
    upstream = AiohttpUpstream(dead_peer_s=dead_peer_s)
    body = json.dumps({"model": "fake", "prompt": "hi", "stream": True, "max_tokens": 400}).encode()
    resp = await upstream.post(url + "/v1/completions", body)
    it = resp.chunks().__aiter__()
    for _ in range(3):
        await it.__anext__()
    subprocess.run(["ip", "link", "del", link.host_if], check=True)  # the node is gone: no FIN, no RST
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(limit_s):
            while True:
                await it.__anext__()
    except UpstreamError:
        return time.monotonic() - t0
    except TimeoutError:
        return None
    except StopAsyncIteration:
        return time.monotonic() - t0
    finally:
        resp.close()
        await upstream.close()


def test_stream_from_a_vanished_worker_breaks_instead_of_hanging(vanishing_engine) -> None:
    link, url = vanishing_engine
    took = asyncio.run(_read_until_error(3.0, url, link, limit_s=20.0))
    assert took is not None, "the upstream read still waited on a vanished peer after 20 s"
    assert took < 15.0
