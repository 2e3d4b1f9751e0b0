"""Read the few CRIU image files relocator needs to understand, without CRIT.

A CRIU image is a magic header (two u32) followed by entries,
each a u32 length and a protobuf message. Only varints and length-delimited fields are decoded
(every field of the messages read here is one of those):

- `pagemap-<id>.img` (`pagemap_head`, then `pagemap_entry` per run of pages): which pages of a
  process are in the image (`PE_PRESENT`), left to be fetched by post-copy (`PE_LAZY`) or in
  a parent image (`PE_PARENT`); used to tell how many bytes a post-copy will still move and to
  check a streamed image's page files against the maps that describe them;
- `stats-dump` / `stats-restore` (`stats_entry`): CRIU's own timings and page counts (the
  restore throughput study, docs/benchmarks.md).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

PAGE_SIZE = 4096
IMG_COMMON_MAGIC = 0x54564319
IMG_SERVICE_MAGIC = 0x55105940
PE_PARENT, PE_LAZY, PE_PRESENT = 1 << 0, 1 << 1, 1 << 2


class ImageFormatError(ValueError):
    pass


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    out = shift = 0
    while True:
        if pos >= len(buf):
            raise ImageFormatError("truncated varint")
        b = buf[pos]
        pos += 1
        out |= (b & 0x7F) << shift
        if not b & 0x80:
            return out, pos
        shift += 7


def decode(msg: bytes) -> dict[int, list]:
    """{field number: [values]} of one protobuf message (varints as int, fixed as int,
    length-delimited as bytes)."""
    out: dict[int, list] = {}
    pos = 0
    while pos < len(msg):
        key, pos = _varint(msg, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            val, pos = _varint(msg, pos)
        elif wire == 1:
            val = struct.unpack_from("<Q", msg, pos)[0]
            pos += 8
        elif wire == 2:
            n, pos = _varint(msg, pos)
            val = msg[pos:pos + n]
            pos += n
        elif wire == 5:
            val = struct.unpack_from("<I", msg, pos)[0]
            pos += 4
        else:
            raise ImageFormatError(f"unsupported protobuf wire type {wire}")
        out.setdefault(field, []).append(val)
    return out


def entries(path: str | Path, service: bool = False) -> Iterator[bytes]:
    """The raw protobuf entries of a CRIU image file (after its two magic numbers: the common
    or service one, then the image type's)."""
    data = Path(path).read_bytes()
    head = 8
    if len(data) < head:
        raise ImageFormatError(f"{path}: too short for a CRIU image")
    magic = struct.unpack_from("<I", data, 0)[0]
    if magic != (IMG_SERVICE_MAGIC if service else IMG_COMMON_MAGIC):
        raise ImageFormatError(f"{path}: not a CRIU image (magic {magic:#x})")
    pos = head
    while pos < len(data):
        if pos + 4 > len(data):
            raise ImageFormatError(f"{path}: truncated entry header")
        n = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        if pos + n > len(data):
            raise ImageFormatError(f"{path}: truncated entry")
        yield data[pos:pos + n]
        pos += n


def _first(d: dict[int, list], field: int, default: int = 0) -> int:
    return d.get(field, [default])[0]


@dataclass
class PagemapSummary:
    pages_id: int
    present_pages: int = 0  # in this image's pages file
    lazy_pages: int = 0  # to be fetched from a page server (post-copy)
    parent_pages: int = 0  # in a parent image (pre-copy)

    @property
    def present_bytes(self) -> int:
        return self.present_pages * PAGE_SIZE

    @property
    def lazy_bytes(self) -> int:
        return self.lazy_pages * PAGE_SIZE


def pagemap(path: str | Path) -> PagemapSummary:
    """Page counts of one `pagemap-<id>.img`."""
    it = entries(path)
    try:
        head = decode(next(it))
    except StopIteration:
        raise ImageFormatError(f"{path}: no pagemap head") from None
    out = PagemapSummary(pages_id=_first(head, 1))
    for raw in it:
        e = decode(raw)
        n = _first(e, 5, _first(e, 2))
        flags = _first(e, 4, PE_PRESENT)  # an entry without flags is an old-style present one
        if _first(e, 3) or flags & PE_PARENT:
            out.parent_pages += n
        elif flags & PE_PRESENT:  # may be PE_LAZY too: lazily restorable, but in this image
            out.present_pages += n
        elif flags & PE_LAZY:
            out.lazy_pages += n
    return out


def lazy_runs(path: str | Path) -> list[tuple[int, int]]:
    """(vaddr, pages) of each run a pagemap leaves in the source (lazy, not in the image)."""
    it = entries(path)
    next(it, None)  # the head
    out = []
    for raw in it:
        e = decode(raw)
        flags = _first(e, 4, PE_PRESENT)
        if flags & PE_LAZY and not flags & (PE_PRESENT | PE_PARENT) and not _first(e, 3):
            out.append((_first(e, 1), _first(e, 5, _first(e, 2))))
    return out


def pagemaps(image_dir: str | Path) -> dict[str, PagemapSummary]:
    """Every pagemap of an image directory, by file name."""
    return {p.name: pagemap(p) for p in sorted(Path(image_dir).glob("pagemap-*.img"))}


def lazy_bytes(image_dir: str | Path) -> int:
    """Bytes a post-copy restore of this image will fetch from the source's page server."""
    return sum(s.lazy_bytes for s in pagemaps(image_dir).values())


def check_pages(image_dir: str | Path) -> list[str]:
    """Problems with the page files of an image: each pagemap's present pages must be exactly
    its pages file (a streamed image's pages arrive separately from its maps)."""
    image_dir = Path(image_dir)
    problems = []
    for name, s in pagemaps(image_dir).items():
        pages = image_dir / f"pages-{s.pages_id}.img"
        size = pages.stat().st_size if pages.exists() else None
        if size is None and s.present_pages:
            problems.append(f"{name}: {pages.name} is missing ({s.present_bytes} bytes expected)")
        elif size is not None and size != s.present_bytes:
            problems.append(f"{name}: {pages.name} has {size} bytes, its map says {s.present_bytes}")
    return problems


DUMP_STATS = {1: "freezing_time_us", 2: "frozen_time_us", 3: "memdump_time_us", 4: "memwrite_time_us",
              5: "pages_scanned", 6: "pages_skipped_parent", 7: "pages_written", 8: "irmap_resolve_us",
              9: "pages_lazy", 10: "page_pipes", 11: "page_pipe_bufs"}
RESTORE_STATS = {1: "pages_compared", 2: "pages_skipped_cow", 3: "forking_time_us", 4: "restore_time_us",
                 5: "pages_restored"}


def stats(path: str | Path) -> dict[str, int]:
    """CRIU's `stats-dump` or `stats-restore` as {name: value} (times in microseconds)."""
    for raw in entries(path, service=True):
        top = decode(raw)
        for field, names in ((1, DUMP_STATS), (2, RESTORE_STATS)):
            if field in top:
                inner = decode(top[field][0])
                return {names[k]: v[0] for k, v in inner.items() if k in names}
    return {}
