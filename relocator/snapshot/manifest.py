"""An image's manifest: what is in the directory, where it came from, and how long it took."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from enum import StrEnum
from pathlib import Path
from typing import Any, Callable

from pydantic import BaseModel, Field, ValidationError

from relocator import procs
from relocator.snapshot.fingerprint import Fingerprint

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
# CRIU's own logs and statistics are written after the fact and are not part of what is restored.
STAMP = ".verified.json"
# The page server's and a lazy dump's logs likewise (relocator.snapshot.criu.CriuProcess).
_NOT_CHECKSUMMED = {MANIFEST, STAMP, "dump.log", "restore.log", "stats-restore", "dump.out", "page-server.log",
                    "page-server.out"}


class ImageError(RuntimeError):
    """The image cannot be used: missing, unreadable, corrupt, truncated or tampered with."""


class FileEntry(BaseModel):
    sha256: str
    size: int


class CellInfo(BaseModel):
    """What is needed to bring the worker back as a cell: where it listens and how it was made."""

    engine: str
    port: int
    launch: dict[str, Any] = Field(default_factory=dict)
    source_cell: str
    # the GPUs it held when dumped (relocator.cell.devices.DeviceProfile as data; empty: none):
    # a restore onto other GPUs maps each of them to one of the target's
    devices: dict[str, Any] = Field(default_factory=dict)


class PagesMode(StrEnum):
    """Where an image's memory pages are."""

    LOCAL = "local"  # in this directory (pagemap-*.img, pages-*.img)
    REMOTE = "remote"  # sent to a page server while dumping: this directory alone is incomplete
    LAZY = "lazy"  # left in the frozen source, served to a post-copy restore on demand


class Manifest(BaseModel):
    schema_version: int = SCHEMA_VERSION
    created_at: float = Field(default_factory=time.time)
    files: dict[str, FileEntry]
    fingerprint: Fingerprint
    cell: CellInfo
    timings: dict[str, float] = Field(default_factory=dict)
    pages: PagesMode = PagesMode.LOCAL
    # HMAC-SHA256 with the cluster's image key (relocator.credentials.image_key) of everything
    # above: a manifest edited by hand, or signed by another cluster, no longer matches it.
    digest: str = ""

    def compute_digest(self) -> str:
        # `pages` counts only when it is not the default, so manifests written before it existed
        # keep their digest
        exclude = {"digest"} | ({"pages"} if self.pages == PagesMode.LOCAL else set())
        body = json.dumps(self.model_dump(exclude=exclude), sort_keys=True, separators=(",", ":")).encode()
        return _mac(body)

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())


def _mac(body: bytes) -> str:
    """HMAC-SHA256 of `body` with the cluster's image key (CredentialsError without one: there
    is no unkeyed digest that anyone could recompute)."""
    from relocator.credentials import image_key

    return hmac.new(image_key(), body, hashlib.sha256).hexdigest()


def _stamp_mac(stamp: dict) -> str:
    return _mac(json.dumps({k: stamp[k] for k in ("digest", "boot_id", "stats")}, sort_keys=True).encode())


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _image_files(image_dir: Path) -> list[Path]:
    return sorted(p for p in image_dir.iterdir() if p.is_file() and p.name not in _NOT_CHECKSUMMED)


def hash_files(image_dir: Path, progress: Callable[[int], None] | None = None) -> dict[str, FileEntry]:
    """sha256 and size of every image file; hashing runs on threads (hashlib frees the GIL)."""
    files = _image_files(image_dir)

    def one(path: Path) -> tuple[str, FileEntry]:
        entry = FileEntry(sha256=_sha256(path), size=path.stat().st_size)
        if progress:
            progress(entry.size)
        return path.name, entry

    with ThreadPoolExecutor(max_workers=min(4, (os.cpu_count() or 2))) as pool:
        return dict(pool.map(one, files))


def write_manifest(image_dir: Path, manifest: Manifest) -> None:
    manifest.digest = manifest.compute_digest()
    tmp = image_dir / (MANIFEST + ".tmp")
    tmp.write_text(manifest.model_dump_json(indent=2))
    os.replace(tmp, image_dir / MANIFEST)


def read_manifest(image_dir: Path) -> Manifest:
    path = Path(image_dir) / MANIFEST
    if not path.exists():
        raise ImageError(f"{image_dir} is not an image: {MANIFEST} is missing")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ImageError(f"{path}: unreadable manifest ({exc})") from exc
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        found = data.get("schema_version") if isinstance(data, dict) else type(data).__name__
        raise ImageError(f"{path}: schema_version is {found!r}, this relocator reads {SCHEMA_VERSION}")
    try:
        manifest = Manifest.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise ImageError(f"{path}: invalid manifest at {where}: {first['msg']}") from exc
    if not hmac.compare_digest(manifest.digest, manifest.compute_digest()):
        raise ImageError(f"{path}: manifest digest does not match its content (edited or damaged)")
    return manifest


def _boot_id() -> str:
    return procs.boot_id()


def _file_stats(image_dir: Path, names: list[str]) -> dict[str, list[int]]:
    # ctime and inode change on any write or metadata change and cannot be set by a user
    # (utimes sets mtime, not ctime), so equal stats mean the bytes hashed are still there.
    out = {}
    for name in names:
        st = (image_dir / name).stat()
        out[name] = [st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]
    return out


def write_stamp(image_dir: Path, manifest: Manifest) -> None:
    """Record that the files on disk were hashed and match `manifest` (this boot, this host)."""
    stamp = {"digest": manifest.digest, "boot_id": _boot_id(),
             "stats": _file_stats(image_dir, sorted(manifest.files))}
    stamp["mac"] = _stamp_mac(stamp)  # a stamp rewritten without the key does not count
    tmp = image_dir / (STAMP + ".tmp")
    tmp.write_text(json.dumps(stamp))
    os.replace(tmp, image_dir / STAMP)


def stamp_is_fresh(image_dir: Path, manifest: Manifest) -> bool:
    """True when this host hashed exactly these files, unchanged since, against this manifest."""
    try:
        stamp = json.loads((image_dir / STAMP).read_text())
        return (hmac.compare_digest(str(stamp["mac"]), _stamp_mac(stamp))
                and stamp["digest"] == manifest.digest and stamp["boot_id"] == _boot_id()
                and stamp["stats"] == _file_stats(image_dir, sorted(manifest.files)))
    except (OSError, ValueError, KeyError, TypeError):
        return False


def verify_files(image_dir: Path, manifest: Manifest, progress: Callable[[int], None] | None = None) -> None:
    """Raise ImageError on the first missing, extra, truncated or altered file."""
    image_dir = Path(image_dir)
    present = {p.name for p in _image_files(image_dir)}
    missing = sorted(set(manifest.files) - present)
    if missing:
        raise ImageError(f"image {image_dir} is incomplete: missing {', '.join(missing[:5])}")
    extra = sorted(present - set(manifest.files))
    if extra:
        raise ImageError(f"image {image_dir} has files the manifest does not list: {', '.join(extra[:5])}")
    for name, entry in manifest.files.items():
        size = (image_dir / name).stat().st_size
        if size != entry.size:
            raise ImageError(f"image file {name} is truncated or altered: {size} bytes, manifest says {entry.size}")
    found = hash_files(image_dir, progress)
    for name, entry in sorted(manifest.files.items()):
        if found[name].sha256 != entry.sha256:
            raise ImageError(f"image file {name} is corrupt: sha256 {found[name].sha256[:16]}..., "
                             f"manifest says {entry.sha256[:16]}...")
    write_stamp(image_dir, manifest)
