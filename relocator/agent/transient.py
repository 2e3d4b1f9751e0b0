"""Where a target node keeps a transient image: one that lives only until it is restored
(the target side of `stream` and `postcopy` moves; it is removed after the move).

Written to disk, a multi-GB image hits the kernel's dirty-page throttling (stream with a 2 GB
KV pool: DUMP 21.8 s on disk, 5.4 s on tmpfs), so by default such an image goes to a tmpfs
(`<root>/<cluster key>/<node>/images/<name>`, root /dev/shm/relocator) when it has room.
The cluster key is a hash of the cluster's base directory, so `relocator down`, the leak check
and the agents all find the same root from the base directory alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from relocator import procs
from relocator.choices import Choice

DEFAULT_ROOT = "/dev/shm/relocator"
BASE_FILE = "base"  # in a cluster's tmpfs root: its base dir, as written
HEADROOM_BYTES = 256 << 20
#: the image size assumed when the source cannot tell (no cell processes to read): a tiny CPU
#: worker's image is ~0.3-3 GB, so 4 GiB errs on the side of disk
FALLBACK_IMAGE_BYTES = 4 << 30


class TransientImages(Choice):
    """Where a target keeps an image that lives only until it is restored (stream, postcopy)."""

    AUTO = "auto"  # tmpfs when it has room for the image twice over (+ headroom), else disk
    TMPFS = "tmpfs"  # always; a move whose target has no tmpfs with room is refused at PLAN
    DISK = "disk"  # the node's image directory, like shared images


class TransientRefused(RuntimeError):
    """`transient_images: tmpfs` and the target cannot hold the image on a tmpfs."""


def cluster_key(base_dir: str | Path) -> str:
    """A short stable name for the cluster of `base_dir` (the path as written, normalised: the
    same string gives the same key on every host and in `relocator down`)."""
    norm = os.path.normpath(os.path.abspath(str(base_dir)))
    return hashlib.sha256(norm.encode()).hexdigest()[:12]


def transient_root(base_dir: str | Path) -> Path:
    """The cluster's tmpfs root (RELOCATOR_TRANSIENT_ROOT overrides /dev/shm/relocator)."""
    return Path(os.environ.get("RELOCATOR_TRANSIENT_ROOT") or DEFAULT_ROOT) / cluster_key(base_dir)


def node_images(base_dir: str | Path, node: str) -> Path:
    return transient_root(base_dir) / node / "images"


def make_node_images(base_dir: str | Path, node: str) -> Path:
    """Create `node_images`, with the base dir written beside it (BASE_FILE): the key is a hash,
    and `relocator down` of emulated hosts finds the roots of every deployment it ran by it."""
    path = node_images(base_dir, node)
    path.mkdir(parents=True, exist_ok=True)
    marker = transient_root(base_dir) / BASE_FILE
    if not marker.exists():
        marker.write_text(os.path.normpath(os.path.abspath(str(base_dir))))
    return path


def roots_under(parent: str | Path) -> list[Path]:
    """The tmpfs roots of the clusters whose base dir is `parent` or below it."""
    top = os.path.normpath(os.path.abspath(str(parent)))
    rootdir = transient_root(parent).parent
    out = []
    for marker in sorted(rootdir.glob(f"*/{BASE_FILE}")):
        try:
            base = marker.read_text().strip()
        except OSError:
            continue
        if base == top or base.startswith(top.rstrip("/") + "/"):
            out.append(marker.parent)
    return out


def remove_roots(base: str | Path, below: bool = False) -> list[str]:
    """Remove the tmpfs root (images of moves still in flight when the cluster stopped, and the
    empty per-node directories) of the cluster of `base`, or with `below`
    of every cluster whose base dir is under `base` (a deployment's is <base_dir>/<id>);
    returns the roots removed."""
    roots = roots_under(base) if below else [transient_root(base)]
    removed = []
    for root in roots:
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)
            removed.append(str(root))
    try:
        transient_root(base).parent.rmdir()  # /dev/shm/relocator, once no cluster uses it
    except OSError:
        pass
    return removed


@dataclass
class Space:
    """What the filesystem under a path offers."""

    fstype: str | None  # None: unknown
    free_bytes: int
    mem_available: int | None = None  # MemAvailable: tmpfs pages are RAM


def _existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def fstype_of(path: Path) -> str | None:
    """The type of the filesystem `path` (or its nearest existing parent) lives on."""
    return procs.fs_type(_existing(Path(path)))


def mem_available() -> int | None:
    return procs.mem_available()


def probe(path: Path) -> Space:
    p = _existing(Path(path))
    try:
        st = os.statvfs(p)
        free = st.f_bavail * st.f_frsize
    except OSError:
        free = 0
    return Space(fstype=fstype_of(p), free_bytes=free, mem_available=mem_available())


def decide(mode: TransientImages | str, size_hint: int | None, space: Space) -> tuple[str, str]:
    """("tmpfs" | "disk", why) for an image of about `size_hint` bytes; raises TransientRefused
    when `mode` is tmpfs and `space` cannot take it. The image and the restored copy are both in
    memory until the move releases the image, hence room for it twice over."""
    mode = TransientImages(mode)
    if mode is TransientImages.DISK:
        return "disk", "transient_images: disk"
    size = size_hint if size_hint and size_hint > 0 else FALLBACK_IMAGE_BYTES
    need = 2 * size + HEADROOM_BYTES
    gib = lambda n: f"{n / (1 << 30):.2f} GiB"  # noqa: E731
    problem = None
    if space.fstype != "tmpfs":
        problem = f"not a tmpfs ({space.fstype or 'unknown filesystem'})"
    elif space.free_bytes < need:
        problem = f"{gib(space.free_bytes)} free, needs {gib(need)} (2 x {gib(size)} + {gib(HEADROOM_BYTES)})"
    elif (mode is TransientImages.AUTO and space.mem_available is not None
          and space.mem_available < size + HEADROOM_BYTES):
        # tmpfs pages are RAM: a tmpfs larger than the memory left would swap or OOM the node
        problem = f"only {gib(space.mem_available)} of memory available for {gib(size)}"
    if problem is None:
        return "tmpfs", f"tmpfs has room ({gib(space.free_bytes)} free for ~{gib(size)})"
    if mode is TransientImages.TMPFS:
        raise TransientRefused(problem)
    return "disk", f"tmpfs: {problem}"
