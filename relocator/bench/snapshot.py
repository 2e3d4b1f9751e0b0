"""`relocator bench snapshot`: cold start vs restore of the same worker, in one run.

Measures, for the tiny vLLM CPU worker in a cell: new process to first generated token (cold
start), dump time and image size against the worker's resident memory, restore start to first
generated token (checksums and fingerprint verified), and CRIU's restore throughput against a
single-thread memcpy measured on this machine in the same run.
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
from relocator.snapshot import RestoreTarget, dump, restore, resume_source
from relocator.tinymodel import ensure_tiny_model
from relocator.worker import default_spec, launch_worker, wait_ready

Log = Callable[[str], None]


async def first_token_s(endpoint: str, model: str, started: float, deadline_s: float = 300.0) -> float:
    """Seconds from `started` to the first streamed token of a greedy request, polling until the
    server accepts it (the clock keeps running while it is not up yet)."""
    body = {"model": model, "prompt": "the cluster node", "max_tokens": 4, "temperature": 0, "stream": True}
    async with aiohttp.ClientSession() as session:
        while time.monotonic() - started < deadline_s:
            try:
                async with session.post(f"{endpoint}/v1/completions", json=body,
                                        timeout=aiohttp.ClientTimeout(total=30, sock_connect=0.5)) as resp:
                    if resp.status == 200:
                        async for line in resp.content:
                            if line.startswith(b"data: {"):
                                return time.monotonic() - started
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.02)
    raise TimeoutError(f"no token from {endpoint} within {deadline_s:.0f}s")


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


async def run(image_root: Path | None = None, log: Log = lambda _m: None) -> dict:
    model_dir = ensure_tiny_model()
    spec = default_spec(model_dir)
    workdir = Path(tempfile.mkdtemp(prefix="relocator-bench-", dir=image_root))
    cells: list[Cell] = []
    try:
        log("cold start: launching a new worker cell")
        t0 = time.monotonic()
        source = launch_worker(spec)
        cells.append(source)
        cold = await first_token_s(source.endpoint, spec.served_model_name, t0)
        log(f"cold start to first token: {cold:.2f} s")
        rss = rss_bytes(source)
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
    finally:
        for cell in cells:  # kill() is idempotent: also removes what a dead cell left
            if cell.is_stopped():
                resume_source(cell)
            cell.kill()
        shutil.rmtree(workdir, ignore_errors=True)
