"""Chunked, checksummed image streaming between agents.

The sender yields `(name, offset, data, file_sha256_or_None)` chunks, file by file, manifest
last; the receiver writes them into a fresh directory, hashes every file as it arrives and
checks it against the sender's manifest before the image counts as received. Transport
agnostic: agents pass the chunks through Ray (a streaming generator) but any iterator works.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator

from relocator.snapshot.manifest import MANIFEST, ImageError, read_manifest, write_stamp

CHUNK = 16 << 20

Chunk = tuple[str, int, bytes, "str | None"]


def iter_chunks(image_dir: str | Path, chunk_bytes: int = CHUNK, rehash: bool = False) -> Iterator[Chunk]:
    """Every file of the image in chunks; the manifest comes last. The final chunk of each
    file carries that file's sha256: the manifest's (the receiver checks the bytes it got
    against it), or with `rehash` the one computed while reading (catches a file changed on
    the sender's disk since the dump, at the cost of hashing on both sides)."""
    image_dir = Path(image_dir)
    manifest = read_manifest(image_dir)
    names = sorted(manifest.files) + [MANIFEST]
    for name in names:
        path = image_dir / name
        h = hashlib.sha256() if (rehash or name == MANIFEST) else None
        offset = 0
        with open(path, "rb") as fh:
            while True:
                data = fh.read(chunk_bytes)
                if h is not None:
                    h.update(data)
                last = len(data) < chunk_bytes
                if not data or last:
                    yield (name, offset, data, h.hexdigest() if h is not None else manifest.files[name].sha256)
                    break
                yield (name, offset, data, None)
                offset += len(data)


class TransferError(ImageError):
    pass


def receive_chunks(chunks: Iterable[Chunk], dst_dir: str | Path,
                   progress: Callable[[int], None] | None = None,
                   present: Callable[[str], bool] | None = None) -> dict:
    """Write an image from `chunks` into `dst_dir` (created; must be empty) and verify it:
    each file's sha256 as received == the sender's == the manifest's. Returns figures.
    `present(name)`: files already in `dst_dir` that the stream must not bring (the memory a
    page server received there); anything else there is refused."""
    dst_dir = Path(dst_dir)
    dst_dir.mkdir(parents=True, exist_ok=True)
    there = {p.name for p in dst_dir.iterdir()}
    if any(not (present and present(n)) for n in there):
        raise TransferError(f"{dst_dir} is not empty")
    t0 = time.monotonic()
    received: dict[str, str] = {}
    total = n_chunks = 0
    cur_name: str | None = None
    fh = None
    h = hashlib.sha256()
    try:
        for name, offset, data, digest in chunks:
            n_chunks += 1
            if name != cur_name:
                if fh is not None:
                    raise TransferError(f"{cur_name}: stream moved on before the file ended")
                if "/" in name or name.startswith(".") or name in there:
                    raise TransferError(f"refusing file name {name!r}")
                cur_name, h = name, hashlib.sha256()
                fh = open(dst_dir / name, "wb")
            if fh.tell() != offset:
                raise TransferError(f"{name}: chunk at offset {offset}, expected {fh.tell()}")
            fh.write(data)
            h.update(data)
            total += len(data)
            if progress:
                progress(len(data))
            if digest is not None:
                fh.close()
                fh = None
                if h.hexdigest() != digest:
                    raise TransferError(f"{name}: sha256 of the received data differs from the sender's "
                                        "(damaged in transit or on the sender's disk)")
                received[name] = digest
                cur_name = None
        if fh is not None:
            raise TransferError(f"{cur_name}: stream ended inside the file")
        if MANIFEST not in received:
            raise TransferError("stream ended before the manifest arrived")
        manifest = read_manifest(dst_dir)
        missing = sorted(set(manifest.files) - set(received))
        if missing:
            raise TransferError(f"image incomplete after transfer: missing {', '.join(missing[:5])}")
        for name, entry in manifest.files.items():
            if received[name] != entry.sha256:
                raise TransferError(f"{name}: received sha256 differs from the manifest")
        write_stamp(dst_dir, manifest)  # every byte was hashed here: restore need not re-hash
    except BaseException:
        if fh is not None:
            fh.close()
        for p in dst_dir.iterdir():
            p.unlink(missing_ok=True)
        os.rmdir(dst_dir)
        raise
    secs = time.monotonic() - t0
    return {"bytes": total, "chunks": n_chunks, "files": len(received) - 1, "seconds": round(secs, 3),
            "gb_per_s": round(total / secs / 1e9, 3) if secs > 0 else None, "verified": True}
