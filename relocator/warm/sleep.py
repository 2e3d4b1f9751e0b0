"""The engine asleep around a warm capture of a GPU worker (issue 28): its KV pool is freed
through the engine's own API before cuda-checkpoint, so the image holds no KV cache, and taken
back once the capture's dump is done (the worker then serves) and once a copy is restored from
that image (before it serves).

The order of a capture (relocator/warm/capture.py): sleep, cuda-checkpoint (lock + checkpoint),
CRIU dump leave-running, cuda restore + unlock, wake. The image records `engine_sleep_s` in its
manifest's timings; a restore of such an image (relocator/warm/start.py) wakes the copy.

Which calls: each engine adapter's `sleep_calls` (vLLM: `POST /sleep?level=1`, `POST /wake_up`;
SGLang: `POST /release_memory_occupation`, `POST /resume_memory_occupation` with the `kv_cache`
tag; the reference engine: its device extras' release/reserve). GPU workers only (a cell with
GPUs in its device profile): on CPU, CRIU leaves the untouched pool's pages out by itself, and
the CPU builds have no sleep mode. Relocations do not sleep the engine: the streams in flight
keep their KV cache across the move.
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from typing import Any, Iterator

from adapters.base import EngineCall, get_adapter
from relocator.cell import devices
from relocator.cell.cell import Cell, CellError

log = logging.getLogger("relocator.warm")
#: the manifest timing that says the image was taken asleep (the restored copy must be woken)
ASLEEP = "engine_sleep_s"


class EngineSleepError(CellError):
    """The engine refused or did not answer a sleep or wake call (the capture is given up; a
    restored copy that cannot wake is not used)."""


def timeout_s() -> float:
    """How long one call may take, connection retries included (RELOCATOR_SLEEP_TIMEOUT_S):
    level 1 copies the weights to host memory and back, ~1 s per 10 GB."""
    return float(os.environ.get("RELOCATOR_SLEEP_TIMEOUT_S", "300"))


def calls_for(cell: Cell) -> tuple[EngineCall, EngineCall] | None:
    """(sleep, wake) for the worker in `cell`: a GPU worker whose engine has them, else None."""
    if not devices.DeviceProfile.from_dict(cell.devices).gpus:
        return None
    return get_adapter(cell.engine).sleep_calls(cell.launch or {})


def call(base_url: str, c: EngineCall, timeout: float | None = None) -> dict[str, Any]:
    """One call; retried while the server does not accept connections (a restored copy's first
    moments). Raises EngineSleepError with the engine's answer."""
    from relocator import waits

    limit = timeout if timeout is not None else timeout_s()
    data = None if c.body is None else json.dumps(c.body).encode()
    req = urllib.request.Request(base_url + c.path, data=data, method=c.method,
                                 headers={"Content-Type": "application/json"} if data else {})
    errors: list[str] = []

    def attempt() -> tuple[dict[str, Any]] | None:  # (the answer,): {} is an answer too
        try:
            with urllib.request.urlopen(req, timeout=limit) as r:
                text = r.read().decode(errors="replace")
        except urllib.error.HTTPError as exc:
            body = exc.read().decode(errors="replace")[:300]
            raise EngineSleepError(f"{c.method} {c.path}: HTTP {exc.code}: {body}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError) as exc:
            errors.append(str(exc))
            return None  # not listening yet: again
        try:
            return (json.loads(text) if text.strip() else {},)
        except ValueError:
            return ({"text": text[:200]},)

    try:
        return waits.until(attempt, limit, every=0.1, what=f"{c.method} {c.path}")[0]
    except waits.WaitTimeout:
        raise EngineSleepError(f"{c.method} {c.path}: no answer in {limit:g} s "
                               f"({errors[-1] if errors else 'no attempt'})") from None


@contextmanager
def asleep(cell: Cell, timings: dict[str, float]) -> Iterator[bool]:
    """The engine of `cell` asleep for the block (True), or as it is when it has no sleep mode
    or no GPU (False). Timings: engine_sleep_s, engine_wake_s. A failed sleep is undone (the
    wake is tried) and raised; a failed wake is raised after the block."""
    calls = calls_for(cell)
    if calls is None:
        yield False
        return
    sleep, wake = calls
    t = time.monotonic()
    try:
        call(cell.endpoint, sleep)
    except EngineSleepError as exc:
        try:
            call(cell.endpoint, wake, timeout=30.0)
        except EngineSleepError as undo:
            log.warning("cell %s: wake after a failed sleep failed too: %s", cell.id, undo)
        raise EngineSleepError(f"cell {cell.id} ({cell.engine}) did not go to sleep: {exc}") from None
    timings[ASLEEP] = time.monotonic() - t
    try:
        yield True
    except BaseException:
        try:  # the block's error is the one to raise
            call(cell.endpoint, wake)
        except EngineSleepError as exc:
            log.warning("cell %s: wake after a failed capture failed: %s", cell.id, exc)
        raise
    t = time.monotonic()
    try:
        call(cell.endpoint, wake)
    except EngineSleepError as exc:
        raise EngineSleepError(f"cell {cell.id} ({cell.engine}) did not wake after its capture: {exc}") from None
    timings["engine_wake_s"] = time.monotonic() - t


def wake_restored(cell: Cell, manifest_timings: dict[str, float]) -> float | None:
    """Wake a copy restored from an image taken asleep (seconds, or None: nothing to wake).
    Raises EngineSleepError: that copy must not serve."""
    if ASLEEP not in manifest_timings:
        return None
    calls = calls_for(cell)
    if calls is None:
        raise EngineSleepError(f"cell {cell.id}: its image was taken asleep, but {cell.engine} here "
                               "has no wake call for it")
    t = time.monotonic()
    try:
        call(cell.endpoint, calls[1])
    except EngineSleepError as exc:
        raise EngineSleepError(f"cell {cell.id} ({cell.engine}), restored asleep, did not wake: {exc}") from None
    return time.monotonic() - t
