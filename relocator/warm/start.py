"""Start a worker from a warm image: the key a launch would file its image under, and the
restore of a stored image into a fresh cell (the image stays in the store for the next one)."""

from __future__ import annotations

from adapters.base import DEFAULT_ENGINE, LaunchSpec
from relocator.cell import devices
from relocator.cell.cell import Cell
from relocator.snapshot.fingerprint import Fingerprint, host_fingerprint
from relocator.snapshot.manifest import ImageError, read_manifest
from relocator.snapshot.snapshot import RestoreTarget, engine_fingerprint_for, restore
from relocator.warm import sleep
from relocator.warm.key import key_of, kind_of
from relocator.warm.store import ImageStore
from relocator.worker import spec_to_dict


class NoWarmImage(LookupError):
    """The store holds no image of that kind (start cold)."""


def key_for_launch(spec: LaunchSpec, engine: str = DEFAULT_ENGINE, gpu_ids: list[int] | None = None) -> str:
    """The key a worker launched from `spec` here, on `gpu_ids`, would have: look it up before
    a cold start (equal to `capture.key_of_cell` of the launched cell)."""
    launch = spec_to_dict(spec)
    launch["host"] = "0.0.0.0"  # as launch_worker sets it (not part of the key either way)
    fingerprint = Fingerprint(host=host_fingerprint(), engine=engine_fingerprint_for(launch, engine))
    profile = devices.profile_for(gpu_ids) if gpu_ids else devices.DeviceProfile()
    return key_of(kind_of(fingerprint, launch, profile.to_dict() if profile.gpus else {}))


def restore_warm(store: ImageStore, key: str, target: RestoreTarget | None = None) -> Cell:
    """Restore the warm image of `key` into a new cell (RestoreTarget: its cell id, GPUs,
    verification). The image is held while it is read, so no eviction removes it meanwhile.
    Raises NoWarmImage, ImageError (damaged: removed from the store), IncompatibleImage,
    CriuError or EngineSleepError (taken asleep, the copy did not wake: killed); in every case
    nothing serves and the caller starts cold."""
    try:
        with store.use(key) as entry:
            if entry is None:
                raise NoWarmImage(f"no warm image {key} in {store.root}")
            timings = read_manifest(entry.path).timings
            cell = restore(entry.path, target)
    except ImageError as exc:  # a flipped byte the restore's checksums found: never again
        if store.path_of(key).is_dir():
            raise store.quarantine(key, exc) from None
        raise
    try:  # an image taken asleep (a GPU worker: relocator/warm/sleep.py) serves once awake
        sleep.wake_restored(cell, timings)
    except BaseException:
        cell.kill()
        raise
    return cell
