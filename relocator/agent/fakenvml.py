"""A stand-in for the part of `pynvml` the health reader uses, driven by a JSON file: what the
tests and chaos faults use on machines without a GPU (the reader takes it when the node's
directory has `fake-nvml.json`; elsewhere it uses the real pynvml).

File: {"gpus": [{"index": 2, "remapped_rows_pending": true, "xids": [63], "sbe": 0,
"temperature_c": 50, "retired_pages_pending": false, "remapped_rows_failure": false}],
"count": 4}. Each Xid listed is delivered once as an event (as the driver raises it once)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

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
            if n < len(xids):
                self._delivered[idx] = n + 1
                return SimpleNamespace(device=idx, eventType=nvmlEventTypeXidCriticalError, eventData=int(xids[n]))
        raise NVMLError(NVML_ERROR_TIMEOUT)
