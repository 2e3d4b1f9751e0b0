"""Every start of a known kind is a warm restore (issue 28): the agent's launch, on its node's
store in the cluster (relocator.warm.roots.open_cluster_store).

A start first restores the warm image of its kind; when there is none (or it is damaged,
incompatible, or CRIU fails) nothing has started and the worker is launched cold, the reason
kept in the launch's answer (the controller puts it in a `worker_started` event). A cold
worker, once ready, is captured (CRIU leave-running) when its kind has no image yet: the
worker waits only for the freeze; hashing, signing and filing run on while it serves. One
capture per kind per node at a time; a start of that kind waits for it to be filed. A failed
capture never fails the launch. `warm.enabled: false` (RELOCATOR_WARM__ENABLED=0) turns all
of it off.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from relocator.cpucap import this_thread_capped
from relocator.procs import this_thread_niced
from relocator.warm.config import WarmConfig
from relocator.warm.lowstart import START_CPUS, captured_at_normal, renice

log = logging.getLogger("relocator.warm")
#: how long a start waits for the filing of its kind's image in progress (seconds)
FILING_WAIT_S = 120.0


class WarmStarts:
    """One per agent: its node's store, the captures in flight."""

    def __init__(self, node: str, base_dir: str | Path,
                 fetch: Callable[[str], dict[str, Any] | None] | None = None) -> None:
        self.node, self.base_dir = node, Path(base_dir)
        #: fetch(key): copy that kind's image from a peer node into this store (None: none has
        #: it); a start that finds no image here tries it before starting cold
        self.fetch = fetch
        self._guard = threading.Lock()
        self._filing: dict[str, threading.Event] = {}  # key -> set once filed (or given up)
        self._not_filed: dict[str, str] = {}  # key -> why its last capture was not filed (a full store)

    def store(self, cfg: WarmConfig):
        from relocator.warm.roots import open_cluster_store

        return open_cluster_store(self.base_dir, self.node, cfg)

    # -- a start ---------------------------------------------------------------------------------
    def start(self, spec, engine: str, cell_id: str, gpu_ids: list[int] | None,
              ready_timeout: float, nice: int | None = None) -> tuple[Any, float, dict[str, Any]]:
        """(the ready cell, seconds to ready, how it started: {how: warm|cold, key, reason,
        capture}). Raises only what a cold launch raises. `nice`: the start and the copy at that
        CPU priority (a handoff's target next to its serving source: relocator.warm.lowstart)."""
        from relocator.worker import launch_worker, wait_ready

        cfg = WarmConfig.load()
        niced = {"nice": nice} if nice is not None else {}
        with this_thread_niced(nice):  # what the start forks (CRIU, a cold engine) inherits it
            cell, warm = self._restore(cfg, spec, engine, cell_id, gpu_ids, ready_timeout, nice)
            if cell is not None:
                return cell, warm.pop("ready_s"), {**warm, **niced}
            cell = launch_worker(spec, engine=engine, cell_id=cell_id, gpu_ids=gpu_ids)
            renice(cell, nice)
            try:
                ready_s = asyncio.run(wait_ready(cell, timeout=ready_timeout))
            except BaseException:
                cell.kill()
                raise
            warm["capture"] = captured_at_normal(cell, nice, lambda: self.capture(cfg, cell))
            return cell, ready_s, {**warm, **niced}

    def _restore(self, cfg: WarmConfig, spec, engine: str, cell_id: str, gpu_ids: list[int] | None,
                 ready_timeout: float, nice: int | None = None) -> tuple[Any, dict[str, Any]]:
        """The warm copy, ready, or (None, why it starts cold). A low start (`nice` given) is
        capped at START_CPUS from its copy to its ready answer (relocator/cpucap.py); the restored
        tree stays capped until the caller sets it back to normal (lowstart.set_priority)."""
        with this_thread_capped(START_CPUS if nice is not None else None) as capped:
            cell, warm = self._restore_warm(cfg, spec, engine, cell_id, gpu_ids, ready_timeout, nice)
        if capped and cell is not None:
            warm["cpu_cap"] = START_CPUS
        return cell, warm

    def _restore_warm(self, cfg: WarmConfig, spec, engine: str, cell_id: str, gpu_ids: list[int] | None,
                      ready_timeout: float, nice: int | None = None) -> tuple[Any, dict[str, Any]]:
        from relocator.cell.cell import CellError, CellFenced
        from relocator.snapshot.criu import CriuError
        from relocator.snapshot.manifest import ImageError
        from relocator.snapshot.snapshot import IncompatibleImage, RestoreTarget
        from relocator.warm.roots import NoTmpfsRoom
        from relocator.warm.start import NoWarmImage, key_for_launch, restore_warm
        from relocator.warm.store import StoreFull
        from relocator.worker import wait_ready

        if not cfg.enabled:
            return None, {"how": "cold", "key": None, "reason": "warm images are off (warm.enabled)"}
        key = None
        t0 = time.monotonic()
        copied: dict[str, Any] | None = None
        fetch_why = ""
        try:
            key = key_for_launch(spec, engine, gpu_ids)
            self._wait_filing(key)
            copied, fetch_why = self._fetch_if_missing(cfg, key)
            cell = restore_warm(self.store(cfg), key, RestoreTarget(cell_id=cell_id, gpu_ids=gpu_ids))
        except CellFenced:  # its node was declared lost: no cold start of it either
            raise
        except (NoWarmImage, ImageError, IncompatibleImage, CriuError, CellError, NoTmpfsRoom, StoreFull,
                OSError) as exc:
            why = [f"{type(exc).__name__}: {exc}"]
            if isinstance(exc, NoWarmImage):  # say why there is none: the copy, the last capture
                why += [w for w in (fetch_why, self._not_filed.get(key or "", "")) if w]
            return None, {"how": "cold", "key": key, "reason": "; ".join(why)}
        renice(cell, nice)  # CRIU put back each thread's nice of the image
        try:
            asyncio.run(wait_ready(cell, timeout=min(ready_timeout, 120.0)))
        except Exception as exc:  # noqa: BLE001 - a copy that does not serve: start cold instead
            cell.kill()
            return None, {"how": "cold", "key": key, "reason": f"the restored copy did not get ready: {exc}"}
        how = {"how": "warm", "key": key, "reason": "", "ready_s": time.monotonic() - t0}
        return cell, ({**how, "copied": copied} if copied else how)

    def _fetch_if_missing(self, cfg: WarmConfig, key: str) -> tuple[dict[str, Any] | None, str]:
        """(the on-demand copy of `key` from a peer when this store lacks it, or None; why there
        is none, for the cold start's reason: no live peer holds it (its only holder lost), or
        the copy failed: a full store, a damaged image, a lost peer)."""
        if self.fetch is None or not cfg.prefetch.on_demand or self.store(cfg).path_of(key).is_dir():
            return None, ""
        try:
            got = self.fetch(key)
        except Exception as exc:  # noqa: BLE001 - no copy: the start goes on (cold)
            log.warning("warm image %s not copied to %s: %s", key, self.node, exc)
            return None, f"the copy from a peer failed: {type(exc).__name__}: {exc}"
        return got, ("" if got else "no live peer holds one")

    def _wait_filing(self, key: str) -> None:
        with self._guard:
            ev = self._filing.get(key)
        if ev is not None:
            ev.wait(FILING_WAIT_S)

    # -- the capture -------------------------------------------------------------------------------
    def capture(self, cfg: WarmConfig, cell) -> dict[str, Any]:
        """Capture a ready cold worker of a kind the store lacks: {dumped, key, freeze_s,
        reason}. The dump's freeze is all the worker waits for; never raises."""
        from relocator.warm.capture import Staged, dump_staged, key_of_cell

        if not (cfg.enabled and cfg.capture.enabled):
            return {"dumped": False, "reason": "capture is off (warm.capture.enabled)"}
        key = None
        try:
            key = key_of_cell(cell)
            with self._guard:
                if key in self._filing:
                    return {"dumped": False, "key": key, "reason": "a capture of this kind is under way"}
                self._filing[key] = threading.Event()
            staged = dump_staged(cell, self.store(cfg), key=key)
        except Exception as exc:  # noqa: BLE001 - a capture never fails the launch
            log.warning("warm capture of %s failed: %s", cell.id, exc)
            self._filed(key, f"{type(exc).__name__}: {exc}")
            return {"dumped": False, "key": key, "reason": f"{type(exc).__name__}: {exc}"}
        if not isinstance(staged, Staged):
            self._filed(key)
            return {"dumped": False, "key": key, "reason": "the store has this kind already"}
        threading.Thread(target=self._file, args=(staged,), name=f"warm-file-{key[-8:]}", daemon=True).start()
        return {"dumped": True, "key": key, "reason": "", "freeze_s": round(staged.timings.get("criu_dump_s", 0.0), 3)}

    def _file(self, staged) -> None:
        from relocator.warm.capture import file_staged

        why = ""
        try:
            with this_thread_niced(19):  # hashing 1.5 GB right after a launch: a move may start meanwhile
                entry = file_staged(staged)
            log.info("warm image %s filed (%d bytes) from %s", staged.key, entry.bytes, staged.cell.id)
        except Exception as exc:  # noqa: BLE001 - nothing filed; the next cold start tries again
            log.warning("warm image %s of %s not filed: %s", staged.key, staged.cell.id, exc)
            why = f"{type(exc).__name__}: {exc}"
        finally:
            self._filed(staged.key, why)

    def _filed(self, key: str | None, why: str = "") -> None:
        """The capture of `key` is over; `why` it filed nothing (kept for the next cold start's
        reason), or "" when it did."""
        with self._guard:
            ev = self._filing.pop(key, None) if key else None
            if key and why:
                self._not_filed[key] = f"its last capture here was not filed: {why}"
            elif key:
                self._not_filed.pop(key, None)
        if ev is not None:
            ev.set()

    def images(self) -> list[dict[str, Any]]:
        """The node's warm images, most recently used first."""
        store = self.store(WarmConfig.load())
        return [e.to_dict() for e in store.list()]
