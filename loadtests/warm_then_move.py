"""A worker moved seconds after its own warm start, in a loop, without Ray: the sequence of the
unexplained segfault (docs/benchmarks.md, "CI of stop 37"), to tell whether it reproduces here.

Cold-starts one vLLM CPU worker in a cell, captures its warm image (leave-running), then for
each round and delay: a warm restore A under 4 greedy streams, A dumped (left stopped) DELAY s
after it is ready and killed, the dump restored as B, B under 4 streams for `--serve-s`, B
checked alive and its log for a segfault. A crashed B's image and log are kept under `--root`
(removed when nothing crashed).

    RELOCATOR_IMAGE_KEY=$(head -c16 /dev/urandom | xxd -p) \
        python -m loadtests.warm_then_move --delays 1,3 --rounds 4

Exits 1 when any B crashed (so a loop in a shell can stop at the first one).
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import threading
import time
from pathlib import Path

import aiohttp

from relocator.snapshot import dump, restore
from relocator.tinymodel import ensure_tiny_model
from relocator.warm.capture import capture
from relocator.warm.start import restore_warm
from relocator.warm.store import ImageStore
from relocator.worker import default_spec, launch_worker, wait_ready

STREAMS = 4


class Streams(threading.Thread):
    """4 greedy completions at a time against one endpoint until stopped; counts and errors."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(daemon=True)
        self.endpoint, self.stopped, self.ok, self.errors = endpoint, False, 0, []

    def run(self) -> None:
        async def one(session: aiohttp.ClientSession, i: int) -> None:
            body = {"model": "tiny-llama", "prompt": f"stream {i} the cluster", "max_tokens": 64,
                    "temperature": 0}
            while not self.stopped:
                try:
                    async with session.post(f"{self.endpoint}/v1/completions", json=body,
                                            timeout=aiohttp.ClientTimeout(total=60)) as r:
                        r.raise_for_status()
                        await r.read()
                    self.ok += 1
                except Exception as exc:  # a dead engine: counted, the loop goes on
                    self.errors.append(repr(exc)[:100])
                    await asyncio.sleep(0.2)

        async def main() -> None:
            async with aiohttp.ClientSession() as session:
                await asyncio.gather(*(one(session, i) for i in range(STREAMS)))

        asyncio.run(main())


def log(*words: object) -> None:
    print(time.strftime("%H:%M:%S"), *words, flush=True)


def one_round(store: ImageStore, key: str, delay: float, root: Path, name: str, serve_s: float) -> bool:
    """Warm restore, move after `delay`, serve; True when the moved copy crashed."""
    a = restore_warm(store, key)
    asyncio.run(wait_ready(a, timeout=120))
    load_a = Streams(a.endpoint)
    load_a.start()
    time.sleep(delay)
    image = root / f"move-{name}"
    dump(a, image)
    load_a.stopped = True
    a.kill()
    b = restore(image)
    try:
        asyncio.run(wait_ready(b, timeout=120))
        load_b = Streams(b.endpoint)
        load_b.start()
        end = time.monotonic() + serve_s
        while time.monotonic() < end and b.is_alive():
            time.sleep(0.5)
        load_b.stopped = True
        tail = b.log_tail(80)
        crashed = not b.is_alive() or "Segfault" in tail or "SIGSEGV" in tail
        log(f"{name}: moved copy alive={b.is_alive()} crashed={crashed} served={load_b.ok} "
            f"errors={len(load_b.errors)} (A served {load_a.ok})")
    finally:
        b.kill()
    if crashed:
        (root / f"crash-{name}.log").write_text(tail)
        log(f"kept {image} and crash-{name}.log")
    else:
        shutil.rmtree(image, ignore_errors=True)
    return crashed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="1,3", help="seconds from A ready to its dump, comma-separated")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--serve-s", type=float, default=20.0, help="how long B serves before the check")
    parser.add_argument("--root", type=Path, default=Path("/dev/shm/relocator-warm-then-move"))
    args = parser.parse_args(argv)
    try:
        delays = [float(x) for x in args.delays.split(",")]
    except ValueError:
        parser.error(f"--delays: comma-separated seconds, not {args.delays!r}")
    shutil.rmtree(args.root, ignore_errors=True)
    args.root.mkdir(parents=True)
    source = launch_worker(default_spec(ensure_tiny_model()))
    crashes = 0
    try:
        asyncio.run(wait_ready(source))
        store = ImageStore(args.root / "warm", max_bytes=8 << 30)
        entry, _ = capture(source, store)
        log("warm image", entry.key)
        for r in range(args.rounds):
            for d in delays:
                crashes += one_round(store, entry.key, d, args.root, f"{r}-{d:g}s", args.serve_s)
    finally:
        source.kill()
        if not crashes:  # the store holds a ~1 GB image in tmpfs: only a crash's is worth keeping
            shutil.rmtree(args.root, ignore_errors=True)
    log(f"{crashes} crash(es) in {args.rounds * len(delays)} move(s)")
    return 1 if crashes else 0


if __name__ == "__main__":
    sys.exit(main())
