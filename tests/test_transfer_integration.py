"""Post-copy pieces with real CRIU on a real vLLM CPU worker in a cell (the session's
`worker_cell`, left running after each test): a lazy dump given up before and after the target
connected (the source serves again, token-identical), a post-copy restore that completes (the
copy answers token-identical; the source's lazy dump ends with the tree stopped), and the
source's page server dying mid-post-copy (the keeper kills the copy before it can run on with
zero-filled memory)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import aiohttp
import pytest

from relocator.agent.pagestream import landed
from relocator.agent.postcopy import LazySource, TargetSession, read_state
from relocator.agent.transfer import iter_chunks, receive_chunks
from relocator.snapshot import RestoreTarget, criu, dump_lazy, restore, resume_source
from relocator.worker import wait_ready

pytestmark = pytest.mark.integration
PROMPT = "a worker moves to a new"


async def _greedy(endpoint: str, max_tokens: int = 16) -> list[int]:
    async with aiohttp.ClientSession() as s:
        body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        async with s.post(f"{endpoint}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
            assert r.status == 200, await r.text()
            return (await r.json())["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def ref(worker_cell) -> list[int]:
    if not criu.lazy_dump_pipes()[0] or not criu.feature("uffd-noncoop")[0]:
        pytest.skip("post-copy is not possible here (relocator preflight: transfer postcopy)")
    return asyncio.run(_greedy(worker_cell.endpoint))


def _lazy(cell, tmp: Path):
    img, proc, port = dump_lazy(cell, tmp / "src", "127.0.0.1")
    LazySource(cell.dir).record(proc.pid, "127.0.0.1", port, str(img.path))
    assert cell.is_stopped() and img.manifest.pages == "lazy"
    return img, proc, port


def _serves_again(cell, ref: list[int]) -> None:
    assert not LazySource(cell.dir).running()
    resume_source(cell)
    asyncio.run(wait_ready(cell, timeout=60))
    assert asyncio.run(_greedy(cell.endpoint)) == ref


def test_lazy_dump_given_up_before_the_target_connects(worker_cell, ref, tmp_path) -> None:
    _, proc, _ = _lazy(worker_cell, tmp_path)
    assert LazySource(worker_cell.dir).abort(proc) == "connected and closed"
    assert proc.poll() == 0  # CRIU ended as after a normal dump: the tree stopped
    _serves_again(worker_cell, ref)


def test_lazy_dump_cut_loose_after_the_target_connected(worker_cell, ref, tmp_path) -> None:
    _, proc, port = _lazy(worker_cell, tmp_path)
    hung = socket.create_connection(("127.0.0.1", port))  # a target that went silent
    time.sleep(0.2)
    assert LazySource(worker_cell.dir).abort(proc) in ("socket destroyed", "killed")
    hung.close()
    _serves_again(worker_cell, ref)


def _copy_small_images(img, tmp: Path) -> Path:
    dst = tmp / "dst"
    receive_chunks(iter_chunks(img.path), dst, present=landed)
    return dst


def test_postcopy_restore_completes_token_identical(worker_cell, ref, tmp_path) -> None:
    img, proc, port = _lazy(worker_cell, tmp_path)
    dst = _copy_small_images(img, tmp_path)
    copy = restore(dst, RestoreTarget(verify="auto"), lazy=TargetSession("127.0.0.1", port))
    try:
        asyncio.run(wait_ready(copy, timeout=120, poll=0.02))
        assert asyncio.run(_greedy(copy.endpoint)) == ref
        deadline = time.monotonic() + 120
        while (read_state(copy.dir) or {}).get("state") not in ("done", "failed") and time.monotonic() < deadline:
            time.sleep(0.05)
        st = read_state(copy.dir)
        assert st["state"] == "done", {k: st.get(k) for k in ("why", "error", "page_bytes", "lazy_bytes", "pushed_bytes",
                                                              "prefill_bytes", "daemon_rc", "requests")}
        assert st["page_bytes"] >= 0.9 * st["lazy_bytes"] > 0
        assert proc.wait(30) == 0 and worker_cell.is_stopped()  # every page served: the tree left stopped
        assert asyncio.run(_greedy(copy.endpoint)) == ref  # and the copy runs on, all its memory there
    finally:
        copy.kill()
        LazySource(worker_cell.dir).clear()
    _serves_again(worker_cell, ref)


def test_source_lost_mid_postcopy_kills_the_copy(worker_cell, ref, tmp_path) -> None:
    img, proc, port = _lazy(worker_cell, tmp_path)
    dst = _copy_small_images(img, tmp_path)
    # paced: the background transfer takes ~10 s, the source dies well before it ends
    copy = restore(dst, RestoreTarget(verify="auto"), lazy=TargetSession("127.0.0.1", port, throttle_bps=1e8))
    try:
        deadline = time.monotonic() + 60
        while (read_state(copy.dir) or {}).get("page_bytes", 0) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # the source's page server dies with its node
        proc.wait()
        deadline = time.monotonic() + 30
        while (read_state(copy.dir) or {}).get("state") != "failed" and time.monotonic() < deadline:
            time.sleep(0.02)
        st = read_state(copy.dir)
        assert st["state"] == "failed" and st["why"] == "source", st
        assert st["killed_pid"] == copy.init_pid and not copy.is_alive()
        assert st["page_bytes"] < st["lazy_bytes"]
    finally:
        copy.kill()
    LazySource(worker_cell.dir).clear()
    _serves_again(worker_cell, ref)  # the SIGKILLed dump let go of the tree: it runs on
