"""Capture a warm image: dump a ready worker that has not served yet, with CRIU
leave-running, into its node's store under its kind's key. The worker goes on (to serve) as if
nothing happened; the dump costs it one freeze of a few seconds before its first request.

On CPU the engine's untouched KV pool is not in the image: the launcher allocates it without
writing it (adapters/vllm/launcher.py) and CRIU dumps only pages that were ever touched. On a
GPU the engine is put to sleep first through its own API (relocator/warm/sleep.py: vLLM sleep
level 1, SGLang release_memory_occupation), so its KV pool is not in the image either; the
device memory goes through cuda-checkpoint and comes back at once after the dump, then the
engine wakes and serves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from relocator.cell import devices
from relocator import procs
from relocator.cell.cell import Cell, CellError
from relocator.snapshot import criu, cuda
from relocator.snapshot.fingerprint import Fingerprint
from relocator.snapshot.manifest import CellInfo, Manifest, PagesMode, hash_files, write_manifest, write_stamp
from relocator.snapshot.snapshot import fingerprint_of
from relocator.warm import sleep
from relocator.warm.key import key_of, kind_of
from relocator.warm.store import Entry, ImageStore

Progress = Callable[[str, float | None], None]


def _noop(_step: str, _frac: float | None) -> None:
    pass


def key_of_cell(cell: Cell, fingerprint: Fingerprint | None = None) -> str:
    """The warm image key of the worker running in `cell` on this host."""
    return key_of(kind_of(fingerprint or fingerprint_of(cell), cell.launch, cell.devices))


def _dump_running(cell: Cell, image_dir, timings: dict[str, float]) -> None:
    """CRIU dump, leave-running; a GPU cell's engine asleep and its device memory checkpointed
    around it."""
    with sleep.asleep(cell, timings):
        _checkpointed_dump(cell, image_dir, timings)


def _checkpointed_dump(cell: Cell, image_dir, timings: dict[str, float]) -> None:
    cuda_pids: list[int] = []
    if cuda.available():
        cuda_pids = cuda.checkpoint(cell.pids())
    try:
        netns_inode = procs.ns_inode("net", cell.init_pid)
        if netns_inode is None:
            raise CellError(f"cell {cell.id}: its network namespace is gone (the worker exited?)")
        dump_args, _ = devices.criu_external_args(devices.DeviceProfile.from_dict(cell.devices))
        t = time.monotonic()
        criu.dump(cell.init_pid, image_dir, netns_inode, leave_stopped=False, leave_running=True,
                  extra_args=dump_args)
        timings["criu_dump_s"] = time.monotonic() - t
    finally:
        if cuda_pids:
            cuda.restore(cuda_pids)


@dataclass
class Staged:
    """A leave-running dump waiting to be hashed, signed and filed (`file_staged`)."""

    cell: Cell
    store: ImageStore
    key: str
    path: Path
    fingerprint: Fingerprint
    timings: dict[str, float]


def dump_staged(cell: Cell, store: ImageStore, progress: Progress = _noop,
                key: str | None = None) -> Staged | Entry:
    """The part of a capture the worker waits for: its freeze for the leave-running dump.
    Returns the stored entry when its kind has one already (nothing dumped), else the staged
    dump for `file_staged` (which may run while the worker serves). StoreFull: no room."""
    if not cell.is_alive() or cell.is_stopped():
        raise CellError(f"cell {cell.id} is not running; a warm image is taken of a running worker")
    if not cell.launch:
        raise CellError(f"cell {cell.id} has no launch record; its kind is unknown")
    progress("fingerprint", None)
    fingerprint = fingerprint_of(cell)
    key = key or key_of_cell(cell, fingerprint)
    existing = store.get(key)
    if existing is not None:
        return existing
    # a full store (or tmpfs) refuses before the dump writes a byte; half the RSS is a floor of
    # the image (measured 0.67-0.72 of it), so a capture that fits is never refused here
    store.check_room(procs.rss_bytes(cell.pids()) // 2)
    staged = store.staging(key)
    timings: dict[str, float] = {}
    try:
        progress("criu dump (leave running)", None)
        _dump_running(cell, staged, timings)
    except BaseException:
        store.discard(staged)
        raise
    return Staged(cell, store, key, staged, fingerprint, timings)


def file_staged(s: Staged, progress: Progress = _noop) -> Entry:
    """Hash, sign and commit a staged dump (StoreFull / ImageError: nothing filed)."""
    cell = s.cell
    try:
        progress("checksums", None)
        t = time.monotonic()
        files = hash_files(s.path)
        s.timings["checksum_s"] = time.monotonic() - t
        manifest = Manifest(files=files, fingerprint=s.fingerprint, timings=s.timings, pages=PagesMode.LOCAL,
                            cell=CellInfo(engine=cell.engine, port=cell.port, launch=cell.launch,
                                          source_cell=cell.id, devices=cell.devices or {}))
        write_manifest(s.path, manifest)
        write_stamp(s.path, manifest)  # hashed just now: the store's commit need not hash again
    except BaseException:
        s.store.discard(s.path)
        raise
    return s.store.commit(s.key, s.path)


def capture(cell: Cell, store: ImageStore, progress: Progress = _noop) -> tuple[Entry, bool]:
    """File a warm image of `cell` (ready, not yet serving) in `store`, unless its kind already
    has one. Returns (the entry, whether this call dumped it). The cell runs on either way.
    Raises CellError (not running), CriuError (the dump failed; the cell still runs) or
    StoreFull / ImageError (nothing filed)."""
    staged = dump_staged(cell, store, progress)
    if isinstance(staged, Entry):
        return staged, False
    return file_staged(staged, progress), True
