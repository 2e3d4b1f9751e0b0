"""A stand-in for the part of `pynvml` the health reader uses, driven by a JSON file: what the
tests and chaos faults use on machines without a GPU (the reader takes it when the node's
directory has `fake-nvml.json`; elsewhere it uses the real pynvml).

File: {"gpus": [{"index": 2, "remapped_rows_pending": true, "xids": [63], "sbe": 0,
"temperature_c": 50, "retired_pages_pending": false, "remapped_rows_failure": false}],
"count": 4}. Each Xid listed is delivered once as an event (as the driver raises it once).

`mark` and `reset` edit that file for the controller's `mark_gpus` / `clear_gpus` (the
`relocator gpus` command): a GPU marked bad, by index or N of them by count, and a GPU reset
(its entry gone, as a real reset clears a pending remap)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterable

nvmlEventTypeXidCriticalError = 8
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_NOT_SUPPORTED = 3


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNvml:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._delivered: dict[int, int] = {}  # gpu -> how many of its listed Xids were delivered

    def _doc(self) -> dict[str, Any]:
        try:
            return json.loads(self.path.read_text() or "{}")
        except (OSError, ValueError):
            return {}

    def _gpu(self, index: int) -> dict[str, Any]:
        for g in self._doc().get("gpus") or []:
            if int(g.get("index", -1)) == index:
                return g
        return {}

    # -- the pynvml subset ---------------------------------------------------------------------
    def nvmlInit(self) -> None:
        pass

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        doc = self._doc()
        return int(doc.get("count", 1 + max((int(g["index"]) for g in doc.get("gpus") or []), default=-1)))

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetRemappedRows(self, handle: int) -> tuple[int, int, int, int]:
        g = self._gpu(handle)
        return 0, 0, int(bool(g.get("remapped_rows_pending"))), int(bool(g.get("remapped_rows_failure")))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: int) -> int:
        return int(bool(self._gpu(handle).get("retired_pages_pending")))

    def nvmlDeviceGetTotalEccErrors(self, handle: int, error_type: int, counter_type: int) -> int:
        return int(self._gpu(handle).get("sbe") or 0)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        t = self._gpu(handle).get("temperature_c")
        if t is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return int(t)

    def nvmlEventSetCreate(self) -> str:
        return "events"

    def nvmlDeviceRegisterEvents(self, handle: int, types: int, event_set: str) -> None:
        pass

    def nvmlEventSetWait_v2(self, event_set: str, timeout_ms: int) -> SimpleNamespace:
        for g in self._doc().get("gpus") or []:
            idx, xids = int(g.get("index", -1)), list(g.get("xids") or [])
            n = self._delivered.get(idx, 0)
            if n > len(xids):  # the file was rewritten with fewer Xids: a new list, delivered anew
                n = 0
            if n < len(xids):
                self._delivered[idx] = n + 1
                return SimpleNamespace(device=idx, eventType=nvmlEventTypeXidCriticalError, eventData=int(xids[n]))
        raise NVMLError(NVML_ERROR_TIMEOUT)

    def forget(self, index: int) -> None:
        """GPU `index` was reset: Xids listed for it later are delivered again."""
        self._delivered.pop(int(index), None)


#: what `mark` writes for each kind of bad GPU (facts the health rules classify: docs/policies.md)
MARKS: dict[str, dict[str, Any]] = {
    "remap": {"remapped_rows_pending": True},  # drains: moved live, then ready for reset
    "xid79": {"xids": [79]},  # fallen off the bus: failed, its worker replaced
    "xid48": {"xids": [48]},  # double-bit ECC: failed
    "xid63": {"xids": [63]},  # page retirement / row remap recorded: drains
    "xid13": {"xids": [13]},  # the application's fault: nothing
    "xid31": {"xids": [31]},  # MMU fault, the application's: nothing
    "app": {"xids": [13, 31, 43]},  # the application's Xids, all three: nothing
}


def _read(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text() or "{}")
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write(path: Path, doc: dict[str, Any]) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)


def listed(path: Path) -> list[int]:
    """The GPU indexes the file reports facts for."""
    return sorted(int(g["index"]) for g in _read(path).get("gpus") or [] if "index" in g)


def mark(path: Path, total: int, kind: str, gpus: Iterable[int] = (), count: int = 0,
         avoid: Iterable[int] = ()) -> list[int]:
    """GPUs `gpus`, or `count` GPUs not in `avoid` (in use) nor already listed (highest index
    first), marked `kind` (MARKS) in the file, which is created for `total` GPUs if absent; the
    indexes marked. ValueError: an unknown kind, an index out of range, too few GPUs to pick."""
    if kind not in MARKS:
        raise ValueError(f"unknown GPU fault {kind!r}; known: {', '.join(MARKS)}")
    doc = _read(path)
    total = int(doc.get("count") or total)
    entries = {int(g["index"]): g for g in doc.get("gpus") or [] if "index" in g}
    chosen = sorted({int(g) for g in gpus})
    bad = [g for g in chosen if not 0 <= g < total]
    if bad:
        raise ValueError(f"no GPU {bad[0]} here: the node has GPUs 0-{total - 1}")
    if count:
        taken = set(avoid) | set(entries) | set(chosen)
        free = [i for i in range(total - 1, -1, -1) if i not in taken]
        if len(free) < count:
            raise ValueError(f"only {len(free)} GPU(s) free of workers and not already marked, {count} asked")
        chosen += sorted(free[:count])
    for i in chosen:
        entries[i] = {"index": i, **MARKS[kind]}  # a GPU marked again: the new fault replaces the old
    _write(path, {**doc, "count": total, "gpus": [entries[i] for i in sorted(entries)]})
    return sorted(chosen)


def reset(path: Path, gpus: Iterable[int] | None = None) -> list[int]:
    """GPUs `gpus` (None: all) reset: their entries dropped from the file; the indexes dropped."""
    doc = _read(path)
    entries = [g for g in doc.get("gpus") or [] if "index" in g]
    drop = {int(g["index"]) for g in entries} if gpus is None else {int(g) for g in gpus}
    gone = sorted(int(g["index"]) for g in entries if int(g["index"]) in drop)
    if gone:
        _write(path, {**doc, "gpus": [g for g in entries if int(g["index"]) not in drop]})
    return gone
