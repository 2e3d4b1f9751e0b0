"""Chaos faults for warm images (issue 28): damage a node's store the way a bad disk, a crashed
copy, a full tmpfs or a lost host would, and the verdict on the start that follows.

- `corrupt`: one byte flipped in the middle of the image's largest file, its size unchanged
  (only the manifest's checksums find it: the restore verifies them; the store quarantines it);
- `truncate`: the largest file cut to half (the store's size check finds it before a restore);
- `full`: the store's bound taken by images in use (`hold`; the store's room check refuses a
  capture or a copy before a byte is written);
- `holder-lost`: the only node holding the image is gone (a start elsewhere finds no peer).

Every one must end in a start that serves: warm where an intact image is left, else cold with
the reason in the start's answer (the controller's `worker_started` event), never a crashed
launch or a hang (`check_start`). Pure file operations, usable on a live cluster's stores.
"""

from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from relocator.snapshot.manifest import MANIFEST
from relocator.warm.store import ImageStore


@dataclass(frozen=True)
class WarmFault:
    name: str
    how: str
    #: words one of which the cold start's reason must hold (how the fault was detected)
    detected_by: tuple[str, ...]


WARM_FAULTS: dict[str, WarmFault] = {f.name: f for f in (
    WarmFault("corrupt", "flip one byte in the middle of the largest file of the image (size kept)",
              ("ImageError",)),
    WarmFault("truncate", "cut the largest file of the image to half its size", ("ImageError", "truncated")),
    WarmFault("full", "hold the store's images in use and the bound below them: nothing new fits",
              ("StoreFull",)),
    WarmFault("holder-lost", "the only node holding the image is lost", ("NoWarmImage",)),
)}


def largest_file(image_dir: str | Path) -> Path:
    """The image's largest file (its memory pages), the manifest left out."""
    files = [p for p in Path(image_dir).iterdir() if p.is_file() and p.name != MANIFEST]
    if not files:
        raise FileNotFoundError(f"{image_dir} holds no image files")
    return max(files, key=lambda p: (p.stat().st_size, p.name))


def corrupt(image_dir: str | Path) -> dict[str, Any]:
    """Flip one byte in the middle of the largest file; its size (and mtime) kept, so only the
    checksums tell. Returns {file, offset}."""
    path = largest_file(image_dir)
    st = path.stat()
    offset = st.st_size // 2
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1) or b"\0"
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0xFF]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # what a silent disk error looks like
    return {"file": path.name, "offset": offset}


def truncate(image_dir: str | Path) -> dict[str, Any]:
    """Cut the largest file to half its size (a copy or a dump that stopped). {file, bytes}."""
    path = largest_file(image_dir)
    size = path.stat().st_size // 2
    os.truncate(path, size)
    return {"file": path.name, "bytes": size}


@contextmanager
def hold(store: ImageStore) -> Iterator[list[str]]:
    """Every image of `store` held in use (the shared lock a restore takes) for the block: none
    can be evicted, so with the bound at or below their bytes nothing new fits."""
    held = []
    try:
        for entry in store.list():
            fh = open(store.root / "locks" / entry.key, "a")
            fcntl.flock(fh, fcntl.LOCK_SH)
            held.append(fh)
        yield [e.key for e in store.list()]
    finally:
        for fh in held:
            fh.close()


def check_start(fault: WarmFault | str, answer: dict[str, Any] | None, error: str | None = None) -> list[str]:
    """What went wrong with the start after `fault` ([] = as it must be). `answer`: how it
    started ({how, key, reason}: the launch's answer or its `worker_started` event); `error`:
    the launch's failure, if it failed (a crashed launch is always wrong)."""
    fault = WARM_FAULTS[fault] if isinstance(fault, str) else fault
    if error:
        return [f"the launch failed after the {fault.name} fault (it must start cold): {error}"]
    if not answer:
        return [f"no record of how the start after the {fault.name} fault went"]
    problems = []
    if answer.get("how") != "cold":
        problems.append(f"after the {fault.name} fault the start was {answer.get('how')!r}, not cold "
                        f"(a damaged or missing image was used?): {answer}")
    reason = str(answer.get("reason") or "")
    if not any(word in reason for word in fault.detected_by):
        problems.append(f"the cold start's reason does not say the {fault.name} fault was found "
                        f"(one of {', '.join(fault.detected_by)}): {reason!r}")
    return problems
