"""`relocator bench snapshot`: cold start vs restore of the same worker, in one run.

Measures, for the tiny vLLM CPU worker in a cell: new process to first generated token (cold
start), the warm image captured between ready and the first request (CRIU leave-running) and a
warm launch from it into a fresh cell to its first token, dump time and image size against the
worker's resident memory, restore start to first generated token (checksums and fingerprint
verified), and CRIU's restore throughput against a single-thread memcpy measured on this
machine in the same run.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

import aiohttp

from relocator.cell.cell import Cell
from relocator.router import sse
from relocator.snapshot import RestoreTarget, dump, restore, resume_source
from relocator.tinymodel import ensure_tiny_model
from relocator.waits import WaitTimeout, until_async
from relocator.worker import default_spec, launch_worker, wait_ready

Log = Callable[[str], None]


async def first_token_s(endpoint: str, model: str, started: float, deadline_s: float = 300.0) -> float:
    """Seconds from `started` to the first streamed token of a greedy request, polling until the
    server accepts it (the clock keeps running while it is not up yet)."""
    body = {"model": model, "prompt": "the cluster node", "max_tokens": 4, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        async def token() -> float | None:
            try:
                async with session.post(f"{endpoint}/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=30, sock_connect=0.5)) as resp:
                    if resp.status == 200:
                        async for payload in sse.read(resp.content.iter_any()):
                            if payload.startswith(b"{"):
                                return time.monotonic() - started
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
            return None

        try:
            return await until_async(token, deadline_s - (time.monotonic() - started), 0.02,
                                     what=f"a token from {endpoint}")
        except WaitTimeout:
            raise TimeoutError(f"no token from {endpoint} within {deadline_s:.0f}s") from None


def rss_bytes(cell: Cell) -> int:
    from relocator.procs import status_bytes

    return status_bytes(cell.pids())


def memcpy_bytes_per_s(size: int = 256 << 20, repeats: int = 5) -> float:
    """Best single-thread memcpy throughput between two already-touched buffers."""
    src, dst = bytearray(b"\x01" * size), bytearray(size)
    s = (ctypes.c_char * size).from_buffer(src)
    d = (ctypes.c_char * size).from_buffer(dst)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        ctypes.memmove(d, s, size)
        best = min(best, time.perf_counter() - t)
    return size / best


def _warm_launch(store, key: str, log: Log) -> tuple[Cell, float]:
    """Restore the warm image of `key` into a fresh cell; (the cell, when the restore started)."""
    from relocator.warm.start import restore_warm

    log("warm launch: restoring the warm image into a fresh cell")
    t = time.monotonic()
    return restore_warm(store, key), t


async def _cold_start_with_capture(spec, store, log: Log) -> tuple[Cell, dict]:
    """Launch a worker, capture its warm image once ready (leave-running, before its first
    request), then its first token. The cold figure is launch to ready plus ready to first
    token: the capture's freeze in between is not counted."""
    from relocator.warm.capture import capture

    log("cold start: launching a new worker cell")
    source = launch_worker(spec)
    ready_s = await wait_ready(source)
    rss_ready = rss_bytes(source)
    log(f"ready after {ready_s:.2f} s; capturing its warm image (CRIU leave-running)")
    t = time.monotonic()
    entry, _ = capture(source, store)
    capture_s = time.monotonic() - t
    log(f"warm image: {entry.bytes / 2**20:.0f} MiB in {capture_s:.2f} s (worker RSS {rss_ready / 2**20:.0f} MiB)")
    cold = ready_s + await first_token_s(source.endpoint, spec.served_model_name, time.monotonic())
    log(f"cold start to first token: {cold:.2f} s")
    return source, {"cold": cold, "entry": entry, "capture_s": capture_s, "rss_ready": rss_ready}


def _pool_spec(kv_pool_mb: int, touch_pool: bool):
    """The tiny worker's spec, with a KV pool of `kv_pool_mb` MiB (0: vLLM's default share)
    that stays untouched unless `touch_pool` (every page written, as bench relocation does)."""
    import os

    spec = default_spec(ensure_tiny_model())
    if kv_pool_mb and touch_pool:
        os.environ["RELOCATOR_KV_POOL_MB"] = str(kv_pool_mb)  # the adapter writes the pool
    elif kv_pool_mb:
        spec.extra_args += ["--kv-cache-memory-bytes", str(kv_pool_mb << 20)]
    return spec


async def run(image_root: Path | None = None, log: Log = lambda _m: None, kv_pool_mb: int = 0,
              touch_pool: bool = False) -> dict:
    from relocator.warm.store import ImageStore

    spec = _pool_spec(kv_pool_mb, touch_pool)
    workdir = Path(tempfile.mkdtemp(prefix="relocator-bench-", dir=image_root))
    store = ImageStore(workdir / "warm", max_bytes=1 << 40)  # the bench's own, not a node's
    cells: list[Cell] = []
    try:
        source, cold_run = await _cold_start_with_capture(spec, store, log)
        cells.append(source)
        cold, warm_entry = cold_run["cold"], cold_run["entry"]
        rss = rss_bytes(source)
        warm_cell, t = _warm_launch(store, warm_entry.key, log)
        cells.append(warm_cell)
        warm_ttft = await first_token_s(warm_cell.endpoint, spec.served_model_name, t)
        log(f"warm launch to first token: {warm_ttft:.2f} s ({cold / warm_ttft:.1f}x faster than cold)")
        cold_run["warm_timings"] = json.loads((warm_cell.dir / "restore_timings.json").read_text())
        warm_cell.kill()
        log("dumping the serving worker")
        t = time.monotonic()
        image = dump(source, workdir / "image")
        dump_total = time.monotonic() - t
        log(f"dump: criu {image.manifest.timings['criu_dump_s']:.2f} s, with checksums {dump_total:.2f} s, "
            f"{image.bytes / 2**20:.0f} MiB")
        log("restoring into a new cell while the stopped source still exists")
        t = time.monotonic()
        restored = restore(image)
        cells.append(restored)
        restore_ttft = await first_token_s(restored.endpoint, spec.served_model_name, t)
        timings = json.loads((restored.dir / "restore_timings.json").read_text())
        log(f"restore to first token: {restore_ttft:.2f} s (verify {timings['verify_s']:.2f} s, "
            f"criu {timings['criu_restore_s']:.2f} s)")
        log("restoring again with a full sha256 pass over the image (no verified stamp)")
        restored.kill()
        t = time.monotonic()
        again = restore(image, RestoreTarget(verify="full"))
        cells.append(again)
        full_ttft = await first_token_s(again.endpoint, spec.served_model_name, t)
        full_timings = json.loads((again.dir / "restore_timings.json").read_text())
        log(f"restore (full verify) to first token: {full_ttft:.2f} s (verify {full_timings['verify_s']:.2f} s)")
        return {**_figures(cold, restore_ttft, full_ttft, dump_total, image, timings, full_timings, rss),
                **_warm_figures(cold, warm_ttft, cold_run, kv_pool_mb, touch_pool)}
    finally:
        for cell in cells:  # kill() is idempotent: also removes what a dead cell left
            if cell.is_stopped():
                resume_source(cell)
            cell.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def _warm_figures(cold: float, warm_ttft: float, cold_run: dict, kv_pool_mb: int, touch_pool: bool) -> dict:
    entry, rss_ready = cold_run["entry"], cold_run["rss_ready"]
    return {
        "warm_launch_to_first_token_s": round(warm_ttft, 3),
        "warm_speedup": round(cold / warm_ttft, 2),
        "warm_capture_s": round(cold_run["capture_s"], 3),
        "warm_verified_by": cold_run["warm_timings"]["verified_by"],
        "warm_restore_criu_s": round(cold_run["warm_timings"]["criu_restore_s"], 3),
        "warm_image_bytes": entry.bytes,
        "ready_worker_rss_bytes": rss_ready,
        "warm_image_to_rss": round(entry.bytes / rss_ready, 3) if rss_ready else None,
        "kv_pool_mb": kv_pool_mb or None,  # None: vLLM's default share of memory
        "kv_pool_touched": bool(kv_pool_mb and touch_pool),
    }


def _figures(cold: float, restore_ttft: float, full_ttft: float, dump_total: float, image, timings: dict,
             full_timings: dict, rss: int) -> dict:
    memcpy = memcpy_bytes_per_s()
    restore_bps = image.bytes / timings["criu_restore_s"]
    return {
        "cold_start_to_first_token_s": round(cold, 3),
        "restore_to_first_token_s": round(restore_ttft, 3),
        "speedup": round(cold / restore_ttft, 2),
        "dump_s": round(image.manifest.timings["criu_dump_s"], 3),
        "dump_with_checksums_s": round(dump_total, 3),
        "restore_verified_by": timings["verified_by"],
        "restore_verify_s": round(timings["verify_s"], 3),
        "restore_full_verify_to_first_token_s": round(full_ttft, 3),
        "full_verify_s": round(full_timings["verify_s"], 3),
        "restore_criu_s": round(timings["criu_restore_s"], 3),
        "image_bytes": image.bytes,
        "worker_rss_bytes": rss,
        "image_to_rss": round(image.bytes / rss, 3) if rss else None,
        "restore_bytes_per_s": round(restore_bps),
        "memcpy_bytes_per_s": round(memcpy),
        "restore_to_memcpy": round(restore_bps / memcpy, 3),
    }
