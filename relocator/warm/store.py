"""A node's store of warm images: content-addressed by kind (relocator.warm.key), bounded in
bytes, least recently used out, every entry checked through its signed manifest.

Layout under the root: `images/<key>/` (a CRIU image with its manifest, restorable in place),
`meta/<key>.json` (kind, bytes, last use), `tmp/` (staging on the same filesystem, so a put is
one rename), `locks/<key>` (held shared while an image is restored from: never evicted then)
and `.lock` (puts, removals and evictions one at a time, across processes).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from relocator.snapshot.manifest import ImageError, Manifest, PagesMode, read_manifest, stamp_is_fresh, verify_files
from relocator.warm.key import is_key, key_of_manifest, kind_of

#: staging directories older than this are what a crashed put left behind
STALE_STAGING_S = 3600.0
#: free space a copy or a capture leaves on the store's filesystem (a tmpfs is shared memory)
FS_HEADROOM_BYTES = 64 << 20


class StoreFull(RuntimeError):
    """The image does not fit under the store's bound, even with every unused image evicted."""


class ImageInUse(RuntimeError):
    """The image is being restored from (held through `ImageStore.use`)."""


@dataclass
class Entry:
    key: str
    path: Path  # the image directory (restore from it)
    bytes: int
    created: float
    last_used: float
    engine: str = ""
    model_id: str = ""

    def to_dict(self) -> dict:
        return {"key": self.key, "path": str(self.path), "bytes": self.bytes, "created": self.created,
                "last_used": self.last_used, "engine": self.engine, "model_id": self.model_id}


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _check_key(key: str) -> None:
    if not is_key(key):
        raise ValueError(f"not a warm image key: {key!r}")


@contextmanager
def held_image(image_dir: str | Path) -> Iterator[Path | None]:
    """A filed image of another store on this host (`<root>/images/<key>`: a peer node's, read in
    place by a local copy), held shared as `ImageStore.use` holds it, so neither its eviction nor
    an `rm` removes it while it is read; None when it is gone (removed since it was asked for).
    Opens nothing but its lock: the peer's store is not touched."""
    path = Path(image_dir)
    _check_key(path.name)
    locks = path.parent.parent / "locks"
    if path.parent.name != "images" or not locks.is_dir():
        raise ValueError(f"not an image of a store: {path}")
    with open(locks / path.name, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_SH)
        yield path if path.is_dir() else None


class ImageStore:
    def __init__(self, root: str | Path, max_bytes: int) -> None:
        self.root, self.max_bytes = Path(root), int(max_bytes)
        for sub in ("images", "meta", "tmp", "locks"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._clean_staging()

    # -- paths and locks -----------------------------------------------------------------------
    def path_of(self, key: str) -> Path:
        _check_key(key)
        return self.root / "images" / key

    def _meta_path(self, key: str) -> Path:
        return self.root / "meta" / f"{key}.json"

    @contextmanager
    def _store_lock(self) -> Iterator[None]:
        with open(self.root / ".lock", "a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            yield

    def _key_lock(self, key: str, mode: int) -> IO[str] | None:
        fh = open(self.root / "locks" / key, "a")
        try:
            fcntl.flock(fh, mode)
        except BlockingIOError:
            fh.close()
            return None
        return fh

    # -- staging and put -------------------------------------------------------------------------
    def staging(self, key: str) -> Path:
        """A new empty directory on the store's filesystem to write an image of `key` into;
        `commit` files it (or `discard` drops it)."""
        _check_key(key)
        return Path(tempfile.mkdtemp(prefix=f"{key}.", dir=self.root / "tmp"))

    def discard(self, staged: Path) -> None:
        shutil.rmtree(staged, ignore_errors=True)

    def put(self, key: str, source: Path) -> Entry:
        """Copy the image at `source` into the store under `key` (see `commit`)."""
        staged = self.staging(key)
        try:
            for item in Path(source).iterdir():
                if item.is_file():
                    shutil.copy2(item, staged / item.name)
        except BaseException:
            self.discard(staged)
            raise
        return self.commit(key, staged)

    def commit(self, key: str, staged: Path) -> Entry:
        """Verify the image in `staged` (signed manifest, its key, every file) and rename it into
        place, evicting least recently used images to stay under the bound. An image already
        filed under `key` wins (same kind, same content for a restore): `staged` is dropped.
        Raises ImageError (bad image) or StoreFull; either way `staged` is removed."""
        try:
            manifest = self._verified(key, staged)
            size = _dir_bytes(staged)
            with self._store_lock():
                if self.path_of(key).is_dir():
                    self.discard(staged)
                    return self.touch(key)
                self._make_room(size)
                os.rename(staged, self.path_of(key))
                now = time.time()
                self._write_meta(key, manifest, size, created=now, last_used=now)
        except BaseException:
            self.discard(staged)
            raise
        return self._entry(key)

    def _verified(self, key: str, image_dir: Path) -> Manifest:
        manifest = read_manifest(image_dir)  # the HMAC with the cluster's image key
        if manifest.pages != PagesMode.LOCAL:
            raise ImageError(f"{image_dir}: a warm image must hold its memory pages (pages: {manifest.pages})")
        found = key_of_manifest(manifest)
        if found != key:
            raise ImageError(f"{image_dir}: the image is of kind {found}, not {key}")
        if not stamp_is_fresh(image_dir, manifest):  # a capture on this host just hashed them
            verify_files(image_dir, manifest)
        return manifest

    def _make_room(self, size: int) -> None:
        """Evict unused images, least recently used first, until `size` more bytes fit."""
        if size > self.max_bytes:
            raise StoreFull(f"an image of {size} bytes exceeds the store's bound of {self.max_bytes} bytes")
        entries = sorted(self.list(), key=lambda e: e.last_used)
        used = sum(e.bytes for e in entries)
        for entry in entries:
            if used + size <= self.max_bytes:
                return
            if self._remove(entry.key, wait=False):
                used -= entry.bytes
        if used + size > self.max_bytes:
            raise StoreFull(f"no room for {size} bytes: {used} of {self.max_bytes} used by images in use")

    def check_room(self, size: int) -> None:
        """StoreFull unless an image of `size` bytes can be filed now: under the bound once every
        unused image is evicted, and free on the store's filesystem (the staging is written
        before anything is evicted; on a tmpfs that is memory). Checked before a copy or a
        capture writes a byte, so a full store never costs a transfer or fills the tmpfs."""
        if size > self.max_bytes:
            raise StoreFull(f"an image of {size} bytes exceeds the store's bound of {self.max_bytes} bytes")
        pinned = sum(e.bytes for e in self.list() if self._in_use(e.key))
        if pinned + size > self.max_bytes:
            raise StoreFull(f"no room for {size} bytes: {pinned} of {self.max_bytes} used by images in use")
        free = shutil.disk_usage(self.root).free
        if free < size + FS_HEADROOM_BYTES:
            raise StoreFull(f"no room for {size} bytes: the store's filesystem ({self.root}) has {free} bytes free "
                            f"(needs {FS_HEADROOM_BYTES} spare)")

    def _in_use(self, key: str) -> bool:
        lock = self._key_lock(key, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if lock is None:
            return True
        lock.close()
        return False

    # -- reading -------------------------------------------------------------------------------
    def get(self, key: str) -> Entry | None:
        """The image filed under `key`, its use recorded, or None. Its manifest is checked
        (signature, kind, every file present at its size; the restore hashes the files). A
        damaged image is removed and ImageError says why (the caller starts cold)."""
        if not self.path_of(key).is_dir():
            return None
        try:
            self._check(key)
        except ImageError as exc:
            raise self.quarantine(key, exc) from None
        return self.touch(key)

    @contextmanager
    def use(self, key: str) -> Iterator[Entry | None]:
        """`get(key)`, held so that no eviction or `rm` removes it until the block ends."""
        lock = self._key_lock(key, fcntl.LOCK_SH)
        assert lock is not None  # a blocking lock
        try:
            if self.path_of(key).is_dir():
                self._check(key)
        except ImageError as exc:
            lock.close()  # our own shared lock would block the removal
            raise self.quarantine(key, exc) from None
        try:
            yield self.touch(key) if self.path_of(key).is_dir() else None
        finally:
            lock.close()

    def _check(self, key: str) -> None:
        path = self.path_of(key)
        manifest = read_manifest(path)
        if key_of_manifest(manifest) != key:
            raise ImageError(f"{path}: filed under {key} but of another kind")
        for name, entry in manifest.files.items():
            f = path / name
            if not f.is_file() or f.stat().st_size != entry.size:
                raise ImageError(f"{path}: image file {name} is missing or truncated")

    def quarantine(self, key: str, why: Exception) -> ImageError:
        """Remove a damaged image (waiting for its other users) and say so: the error to raise."""
        self._remove(key, wait=True)
        return ImageError(f"warm image {key} removed: {why}")

    def touch(self, key: str) -> Entry:
        entry = self._entry(key)
        entry.last_used = time.time()
        meta = {**self._read_meta(key), "key": key, "bytes": entry.bytes, "created": entry.created,
                "last_used": entry.last_used}
        self._write_json(self._meta_path(key), meta)
        return entry

    def list(self) -> list[Entry]:
        """Every image filed, most recently used first."""
        keys = [p.name for p in (self.root / "images").iterdir() if p.is_dir() and is_key(p.name)]
        return sorted((self._entry(k) for k in keys), key=lambda e: -e.last_used)

    def used_bytes(self) -> int:
        return sum(e.bytes for e in self.list())

    def rm(self, key: str) -> bool:
        """Remove the image of `key`; False when there is none. ImageInUse while restored from."""
        if not self.path_of(key).is_dir():
            return False
        with self._store_lock():
            if not self._remove(key, wait=False):
                raise ImageInUse(f"warm image {key} is being restored from")
        return True

    # -- internals -------------------------------------------------------------------------------
    def _remove(self, key: str, wait: bool) -> bool:
        """Rename the image out of `images/` (gone at once for readers), then delete it.
        False when it is in use and `wait` is False."""
        lock = self._key_lock(key, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        if lock is None:
            return False
        try:
            path = self.path_of(key)
            if path.is_dir():
                trash = Path(tempfile.mkdtemp(prefix=f"{key}.rm.", dir=self.root / "tmp"))
                os.rename(path, trash / "image")
                shutil.rmtree(trash, ignore_errors=True)
            self._meta_path(key).unlink(missing_ok=True)
        finally:
            lock.close()
        return True

    def _entry(self, key: str) -> Entry:
        meta = self._read_meta(key)
        path = self.path_of(key)
        if "bytes" not in meta:  # no meta (written by hand, or lost): from the directory
            try:
                mtime = path.stat().st_mtime
                meta = {"bytes": _dir_bytes(path), "created": mtime, "last_used": mtime}
            except OSError:  # removed meanwhile
                meta = {"bytes": 0, "created": 0.0, "last_used": 0.0}
        return Entry(key=key, path=path, bytes=int(meta["bytes"]), created=float(meta.get("created", 0)),
                     last_used=float(meta.get("last_used", 0)), engine=meta.get("kind", {}).get("engine", ""),
                     model_id=meta.get("kind", {}).get("model_id", ""))

    def _read_meta(self, key: str) -> dict:
        try:
            data = json.loads(self._meta_path(key).read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write_meta(self, key: str, manifest: Manifest, size: int, created: float, last_used: float) -> None:
        kind = kind_of(manifest.fingerprint, manifest.cell.launch, manifest.cell.devices)
        self._write_json(self._meta_path(key), {"key": key, "bytes": size, "created": created,
                                                "last_used": last_used, "kind": kind.model_dump()})

    @staticmethod
    def _write_json(path: Path, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(prefix=path.name, dir=path.parent)
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)

    def _clean_staging(self) -> None:
        cutoff = time.time() - STALE_STAGING_S
        for item in (self.root / "tmp").iterdir():
            try:
                if ".rm." in item.name or item.stat().st_mtime < cutoff:
                    shutil.rmtree(item, ignore_errors=True)
            except OSError:
                pass
