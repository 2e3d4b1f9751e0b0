"""Dump a cell into an image and restore an image into a new cell.

After a dump the source tree is *stopped*, not killed: if the restore fails anywhere, the
caller resumes it with `resume_source`. A restore first checks the manifest, every file's
checksum and the fingerprint against the target, and refuses with a specific reason before
anything is started.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Protocol

from adapters.base import EngineFingerprint, get_adapter
from relocator import procs
from relocator.choices import Choice
from relocator.cell import devices, netns
from relocator.cell.cell import Cell, CellError, CellFenced, cells_dir, new_cell_id, record_built, refuse_if_fenced
from relocator.worker import spec_from_dict
from relocator.snapshot import criu, cuda
from relocator.snapshot.fingerprint import Fingerprint, Mismatch, compatibility, host_fingerprint
from relocator.snapshot.manifest import (
    CellInfo,
    ImageError,
    Manifest,
    PagesMode,
    hash_files,
    read_manifest,
    stamp_is_fresh,
    verify_files,
    write_manifest,
    write_stamp,
)

Progress = Callable[[str, float | None], None]  # (step description, fraction done or None)


class SnapshotError(RuntimeError):
    pass


class IncompatibleImage(SnapshotError):
    def __init__(self, mismatches: list[Mismatch]):
        self.mismatches = mismatches
        super().__init__("image is not compatible with this target: " + "; ".join(str(m) for m in mismatches))


@dataclass
class Image:
    path: Path
    manifest: Manifest

    @property
    def bytes(self) -> int:
        return self.manifest.total_bytes


class VerifyMode(Choice):
    """How a restore checks the image's files (see `RestoreTarget`)."""

    AUTO = "auto"
    FULL = "full"
    NONE = "none"


@dataclass
class RestoreTarget:
    """Where to restore: the fingerprint expected there (default: this host + the image's
    engine as installed here) and options.

    verify: "full" hashes every file; "auto" (default) does too, unless this host already
    hashed these very files (dump, transfer or an earlier verify left a stamp and no file's
    inode, size, mtime or ctime changed since); "none" checks sizes only.
    """

    fingerprint: Fingerprint | None = None
    verify: VerifyMode = VerifyMode.AUTO
    cell_id: str | None = None
    # host GPU indices for a GPU image (as many as it held); None: the same indices as the source
    gpu_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self.verify = VerifyMode(self.verify)  # unknown: ValueError naming the modes


def _noop(_step: str, _frac: float | None) -> None:
    pass


def engine_fingerprint_for(cell_launch: dict, engine: str) -> EngineFingerprint:
    """The engine part of the fingerprint this host offers a worker launched from
    `cell_launch`. Cached per process by launch record: a move's PLAN asks the target agent
    for it (NodeAgent.compatible), so its restore finds it computed (the weights' hash and the
    engine's version, 0.1-0.27 s, otherwise inside the worker's freeze). The adapters already
    cache the weights' hash by path, so a cached answer is no staler than before."""
    key = json.dumps(cell_launch, sort_keys=True, default=str)
    return _engine_fingerprint(key, engine).model_copy(deep=True)


@lru_cache(maxsize=64)
def _engine_fingerprint(launch_json: str, engine: str) -> EngineFingerprint:
    return get_adapter(engine).fingerprint(spec_from_dict(json.loads(launch_json)))


def fingerprint_of(cell: Cell) -> Fingerprint:
    """This host and the cell's engine: what an image of `cell` taken here will carry."""
    return Fingerprint(host=host_fingerprint(), engine=engine_fingerprint_for(cell.launch, cell.engine))


def _shm_files(cell: Cell) -> set[str]:
    try:
        return set(os.listdir(procs.root(cell.init_pid) / "dev/shm"))
    except OSError:
        return set()


def _check_dumpable(cell: Cell, image_dir: Path) -> None:
    if image_dir.exists() and any(image_dir.iterdir()):
        raise SnapshotError(f"{image_dir} is not empty; choose a new image directory")
    if not cell.is_alive():
        raise CellError(f"cell {cell.id} is not running (init pid {cell.init_pid})")
    if not cell.launch:
        raise SnapshotError(f"cell {cell.id} has no launch record; cannot fingerprint its engine")


def _cuda_checkpoint(cell: Cell, progress: Progress, timings: dict[str, float]) -> list[int]:
    """Lock and checkpoint the cell's CUDA processes (GPU hosts only). Their pids are written to
    cuda_pids.json before the first lock, so `resume_source` finds them whatever fails later;
    a failing lock or checkpoint unlocks what it locked before it raises."""
    record = cell.dir / "cuda_pids.json"
    if not cuda.available():
        return []
    progress("cuda-checkpoint", None)
    t = time.monotonic()
    pids = cuda.checkpoint(cell.pids(), record=lambda found: record.write_text(json.dumps(found)))
    timings["cuda_checkpoint_s"] = time.monotonic() - t
    return pids


def _dump(cell: Cell, image_dir: Path, progress: Progress, run_criu: Callable[[int, list[str]], Any],
          pages: PagesMode) -> tuple[Image, Any]:
    """The dump around CRIU: fingerprint, CUDA checkpoint, `run_criu(netns_inode, extra_args)`,
    the records resume_source needs, checksums of the files written here, manifest."""
    image_dir = Path(image_dir)
    _check_dumpable(cell, image_dir)
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    progress("fingerprint", None)
    fingerprint = fingerprint_of(cell)
    timings["fingerprint_s"] = time.monotonic() - t0
    shm_before = _shm_files(cell)
    cuda_pids = _cuda_checkpoint(cell, progress, timings)
    progress("criu dump", None)
    try:
        netns_inode = procs.ns_inode("net", cell.init_pid)
        if netns_inode is None:
            raise CellError(f"cell {cell.id} is gone (no net namespace for init pid {cell.init_pid})")
        dump_args, _ = devices.criu_external_args(devices.DeviceProfile.from_dict(cell.devices))
        t = time.monotonic()
        result = run_criu(netns_inode, dump_args)
        timings["criu_dump_s"] = time.monotonic() - t
    except BaseException:
        # CRIU lets the tasks run again when it fails: so must their CUDA state
        if cuda_pids and cuda.resume(cuda_pids) == []:
            (cell.dir / "cuda_pids.json").unlink(missing_ok=True)
        raise
    # CRIU links unlinked files (semaphores) back under their names and, with --leave-stopped,
    # leaves those links behind; they must go before the source is resumed or dumped again.
    (cell.dir / "link_remaps.json").write_text(json.dumps(sorted(_shm_files(cell) - shm_before)))
    progress("checksums", 0.0)
    t = time.monotonic()
    total = sum(p.stat().st_size for p in image_dir.iterdir() if p.is_file())
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        progress("checksums", done / total if total else 1.0)

    files = hash_files(image_dir, tick)
    timings["checksum_s"] = time.monotonic() - t
    timings["total_s"] = time.monotonic() - t0
    manifest = Manifest(
        files=files,
        fingerprint=fingerprint,
        cell=CellInfo(engine=cell.engine, port=cell.port, launch=cell.launch, source_cell=cell.id,
                      devices=cell.devices or {}),
        timings=timings,
        pages=pages,
    )
    write_manifest(image_dir, manifest)
    write_stamp(image_dir, manifest)  # the hashes were just taken from these very files
    return Image(path=image_dir, manifest=manifest), result


def dump(cell: Cell, image_dir: Path, progress: Progress = _noop,
         page_server: tuple[str, int] | int | None = None, tls_dir: str | None = None) -> Image:
    """Checkpoint `cell` into `image_dir` (must not exist or be empty). The cell stays stopped.

    `page_server` (address, port): the memory goes straight to that page server (the target's,
    relocator.agent.pagestream) while CRIU reads it; `image_dir` gets the other images only and
    a manifest marked `pages: remote` (the receiver completes it with the pages it hashed).
    `tls_dir`: the move's own credentials for that connection (criu.dump)."""
    image_dir = Path(image_dir)

    def run(ino: int, args: list[str]) -> Any:
        return criu.dump(cell.init_pid, image_dir, ino, leave_stopped=True, extra_args=args, page_server=page_server,
                         tls_dir=tls_dir)

    img, _ = _dump(cell, image_dir, progress, run, PagesMode.REMOTE if page_server else PagesMode.LOCAL)
    return img


def dump_lazy(cell: Cell, image_dir: Path, address: str, port: int = 0,
              progress: Progress = _noop, ps_socket: int | None = None) -> tuple[Image, criu.CriuProcess, int]:
    """The source of a post-copy: every image but the worker's anonymous memory into
    `image_dir` (manifest marked `pages: lazy`), the tree frozen, its memory served on
    address:port by the returned CRIU process until a lazy restore has all of it (then the
    process exits 0 and the tree is stopped, as after `dump`). Returns (image, process, port).
    `ps_socket`: served on that socket instead of a port (criu.lazy_dump; port 0 then)."""
    image_dir = Path(image_dir)

    def run(ino: int, args: list[str]) -> tuple[criu.CriuProcess, int]:
        return criu.lazy_dump(cell.init_pid, image_dir, ino, address, port, extra_args=args, ps_socket=ps_socket)

    img, (proc, bound) = _dump(cell, image_dir, progress, run, PagesMode.LAZY)
    return img, proc, bound


def resume_source(cell: Cell) -> None:
    """Bring a cell left stopped by `dump` back to serving (a restore elsewhere failed)."""
    remaps = cell.dir / "link_remaps.json"
    if remaps.exists():
        for name in json.loads(remaps.read_text()):
            try:
                os.unlink(procs.root(cell.init_pid) / "dev/shm" / name)
            except FileNotFoundError:
                pass
        remaps.unlink()
    criu.unlock_network(cell.netns)
    # SIGCONT before the CUDA restore: the driver does a restore with a thread of the process
    # itself, which cannot run while the process is stopped (CRIU's own CUDA plugin resumes
    # that thread for the same reason); a locked process that runs only waits in CUDA calls.
    cell.resume()
    cuda_file = cell.dir / "cuda_pids.json"
    if cuda_file.exists():
        left = cuda.resume(json.loads(cuda_file.read_text()))
        if left:
            raise SnapshotError(f"cell {cell.id} runs again but its CUDA state does not: " + "; ".join(left))
        cuda_file.unlink()


def source_frozen(cell: Cell) -> list[str]:
    """Why `cell`, left by a dump, is not frozen (empty: it is): each of its processes stopped,
    each CUDA process of the dump (cuda_pids.json) still checkpointed. A source must stay so
    from DUMP until RELEASE or the rollback's resume; one that fails this has run."""
    cuda_file = cell.dir / "cuda_pids.json"
    cuda_pids = json.loads(cuda_file.read_text()) if cuda_file.exists() else []
    return cuda.frozen_problems(cell.pids(), cuda_pids)


def released_source_ran(cell: Cell) -> list[str]:
    """At RELEASE (the source is about to be killed): what shows that a GPU source left by a
    dump ran meanwhile (`source_frozen`); empty when it did not, or when `cell` is not such a
    source (no cuda_pids.json: a CPU cell, never dumped, or resumed)."""
    if not (cell.dir / "cuda_pids.json").exists() or not cell.is_alive():
        return []
    return source_frozen(cell)


def inspect_image(image_dir: Path, verify: bool = False) -> Image:
    image_dir = Path(image_dir)
    if not image_dir.is_dir():
        raise ImageError(f"{image_dir}: no such image directory")
    manifest = read_manifest(image_dir)
    if verify:
        verify_files(image_dir, manifest)
    return Image(path=image_dir, manifest=manifest)


def expected_fingerprint(manifest: Manifest) -> Fingerprint:
    """What this host would offer the image: its own host part, the engine as installed here."""
    return Fingerprint(host=host_fingerprint(),
                       engine=engine_fingerprint_for(manifest.cell.launch, manifest.cell.engine))


def compatibility_report(image: Image) -> list[Mismatch]:
    return compatibility(image.manifest.fingerprint, expected_fingerprint(image.manifest))


def _target_devices(source: devices.DeviceProfile, gpu_ids: list[int] | None) -> devices.DeviceProfile:
    """The GPUs a restored copy gets: `gpu_ids` (host indices, as many as the image held) or,
    when None, the indices the source had. A CPU image gets none."""
    if not source.gpus:
        return devices.DeviceProfile()
    ids = source.gpu_ids if gpu_ids is None else list(gpu_ids)
    if len(ids) != len(source.gpus):
        raise SnapshotError(f"the image holds {len(source.gpus)} GPU(s); the target was given {len(ids)} ({ids})")
    try:
        return devices.profile_for(ids)
    except devices.DeviceError as exc:
        raise SnapshotError(f"cannot give the restored copy GPUs {ids}: {exc}") from None


class LazySource(Protocol):
    """Post-copy: started in the new cell's directory before `criu restore --lazy-pages`
    (relocator.agent.postcopy.TargetSession: the lazy-pages daemon and its keeper)."""

    def start(self, image_dir: Path, cell_dir: Path) -> None: ...

    def abort(self) -> None: ...


def _read_for_restore(image: Image | Path, lazy: LazySource | None) -> Image:
    """The image on disk, refused before anything starts if it cannot be restored here so."""
    path = Path(image) if isinstance(image, (str, Path)) else image.path
    if not path.is_dir():
        raise ImageError(f"{path}: no such image directory")
    manifest = read_manifest(path)  # (re)read: the files on disk are what gets restored
    if manifest.pages == PagesMode.REMOTE:
        raise ImageError(f"{path}: its memory pages were sent to a page server when it was dumped; "
                         "restore the image where they arrived")
    if manifest.pages == PagesMode.LAZY and lazy is None:
        raise ImageError(f"{path}: a post-copy image (its memory stayed in the source); it can only be "
                         "restored with the source's page server (transfer postcopy)")
    if lazy is not None and manifest.pages != PagesMode.LAZY:
        raise ImageError(f"{path}: not a post-copy image (pages: {manifest.pages})")
    return Image(path=path, manifest=manifest)


def _verify_for_restore(image: Image, verify: VerifyMode | str, progress: Progress) -> str:
    """Check the image's files as `verify` asks; returns how they were checked (stamp: this host
    hashed these very files already; none: sizes only; full: every checksum)."""
    manifest = image.manifest
    mode = VerifyMode(verify)
    verified_by = {VerifyMode.FULL: "full", VerifyMode.NONE: "none"}.get(mode) or (
        "stamp" if stamp_is_fresh(image.path, manifest) else "full")
    if verified_by == "stamp":
        progress("checksums verified earlier on this host", None)
    elif verified_by == "none":
        for name, entry in manifest.files.items():
            path = image.path / name
            if not path.is_file() or path.stat().st_size != entry.size:
                raise ImageError(f"image file {name} is missing or truncated")
    else:
        progress("verify checksums", 0.0)
        total, done = manifest.total_bytes, 0

        def tick(n: int) -> None:
            nonlocal done
            done += n
            progress("verify checksums", done / total if total else 1.0)

        verify_files(image.path, manifest, tick)
    return verified_by


def _criu_restore(image: Image, link: Any, cdir: Path, restore_args: list[str], lazy: LazySource | None,
                  marks: dict[str, float]) -> int:
    """`criu restore` into the new cell's namespace (post-copy: its lazy-pages daemon first);
    on failure the namespace and the cell directory are removed again. Returns the init pid."""
    t = time.monotonic()
    try:
        if lazy is not None:
            lazy.start(image.path, cdir)
            marks["lazy_start_s"] = time.monotonic() - t
        t1 = time.monotonic()
        pid = criu.restore(image.path, link.path, cdir / "init.pid", log_dir=cdir, extra_args=restore_args,
                           lazy=lazy is not None)
    except BaseException:
        if lazy is not None:
            lazy.abort()
        netns.delete(link.name)
        shutil.rmtree(cdir, ignore_errors=True)
        raise
    marks["criu_s"] = time.monotonic() - t1
    return pid


def restore(image: Image | Path, target: RestoreTarget | None = None, progress: Progress = _noop,
            lazy: LazySource | None = None) -> Cell:
    """Verify `image` against this host and restore it into a new cell; returns the cell.

    Raises ImageError (corrupt, truncated or tampered image) or IncompatibleImage (with every
    mismatch) before anything is started; CriuError if CRIU fails. The source is never touched.
    `lazy`: a post-copy restore of an image dumped with `dump_lazy` (required for one): the
    tree runs at once and its memory keeps arriving after this returns.
    """
    target = target or RestoreTarget()
    image = _read_for_restore(image, lazy)
    manifest = image.manifest
    t0 = time.monotonic()
    verified_by = _verify_for_restore(image, target.verify, progress)
    progress("compatibility", None)
    marks = {"verify_s": time.monotonic() - t0}  # where the restore's time goes (docs/benchmarks.md)
    t = time.monotonic()
    expected = target.fingerprint or expected_fingerprint(manifest)
    mismatches = compatibility(manifest.fingerprint, expected)
    if mismatches:
        raise IncompatibleImage(mismatches)
    source_gpus = devices.DeviceProfile.from_dict(manifest.cell.devices or manifest.cell.launch.get("devices"))
    target_gpus = _target_devices(source_gpus, target.gpu_ids)
    _, restore_args = devices.criu_external_args(target_gpus)
    cell_id = target.cell_id or new_cell_id("r")
    marks["compatibility_s"] = time.monotonic() - t
    t = time.monotonic()
    refuse_if_fenced(cell_id)  # its node was declared lost while the image was checked
    link = netns.create(f"rl-{cell_id}")
    cdir = cells_dir() / cell_id
    cdir.mkdir(parents=True, exist_ok=True)
    marks["netns_s"] = time.monotonic() - t
    progress("criu restore", None)
    t = time.monotonic()
    pid = _criu_restore(image, link, cdir, restore_args, lazy, marks)
    cell = Cell(id=cell_id, netns=link.name, ip=link.cell_ip, port=manifest.cell.port, init_pid=pid,
                engine=manifest.cell.engine, launch=manifest.cell.launch, origin=f"restore:{image.path}",
                devices=target_gpus.to_dict() if target_gpus.gpus else {})
    try:
        record_built(cell)  # fenced during CRIU's restore: killed again
    except CellFenced:
        if lazy is not None:
            lazy.abort()
        raise
    if target_gpus.gpus:
        # the image holds the source's device nodes and driver view: give the cell the target's
        devices.retarget(pid, target_gpus)
    if cuda.available():
        progress("cuda restore", None)
        moved = [g.uuid for g in source_gpus.gpus] != [g.uuid for g in target_gpus.gpus]
        cuda.restore([p for p, s in cuda.contexts(cell.pids()).items() if s == cuda.CudaState.CHECKPOINTED],
                     device_map=devices.device_map(source_gpus, target_gpus) if moved else None)
    (cdir / "restore_timings.json").write_text(json.dumps(
        {**marks, "verified_by": verified_by, "criu_restore_s": time.monotonic() - t, "total_s": time.monotonic() - t0}))
    return cell
