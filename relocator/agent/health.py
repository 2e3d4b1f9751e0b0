"""What a node agent reports for the policies (relocator.policies): each GPU's health through
NVML (Xid events, pending row remaps / page retirements, single-bit ECC errors, temperature)
and a node notice ("this node goes away at T") from a file or an HTTP endpoint.

- NVML: the real `pynvml` (nvidia-ml-py); where the node's directory has `fake-nvml.json`,
  the file-driven stand-in of relocator.agent.fakenvml instead (tests, chaos). No NVML: no GPUs.
  Xid events are sticky: a GPU that raised one keeps it until `clear` (after its reset).
- Notice: `DIR/notice.json` ({"at": epoch | "time": ISO 8601, "reason": ...}), or the URL in
  `RELOCATOR_NOTICE_URL` (`{node}` is replaced; a 200 with such a JSON body is a notice, as a
  cloud's spot-interruption endpoint answers; 404 or anything else: none).
"""

from __future__ import annotations

import json
import logging
import time
import urllib.request
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger("relocator.agent")
NOTICE_FILE = "notice.json"
FAKE_NVML_FILE = "fake-nvml.json"
NOTICE_URL_ENV = "RELOCATOR_NOTICE_URL"
XID_EVENT = 8  # nvmlEventTypeXidCriticalError
EVENTS_PER_READ = 64


def _at(doc: dict[str, Any]) -> float | None:
    if doc.get("at") is not None:
        return float(doc["at"])
    if doc.get("time"):
        return datetime.fromisoformat(str(doc["time"]).replace("Z", "+00:00")).timestamp()
    return None


class HealthReader:
    def __init__(self, node: str, node_dir: Path, env: dict[str, str] | None = None) -> None:
        import os

        self.node, self.node_dir = node, Path(node_dir)
        self.env = os.environ if env is None else env
        self.xids: dict[int, list[int]] = {}  # sticky, per GPU index
        self._nvml: Any = None
        self._kind = ""
        self._events: Any = None

    # -- NVML ---------------------------------------------------------------------------------
    def _module(self) -> tuple[Any, str]:
        fake = self.node_dir / FAKE_NVML_FILE
        if fake.is_file():
            if self._kind != "fake":
                from relocator.agent.fakenvml import FakeNvml

                self._nvml, self._kind, self._events = FakeNvml(fake), "fake", None
            return self._nvml, "fake"
        if self._kind != "real":
            try:
                import pynvml

                pynvml.nvmlInit()
                self._nvml, self._kind, self._events = pynvml, "real", None
            except Exception as exc:  # noqa: BLE001 - no library, no driver: fake GPUs
                log.debug("no NVML on %s: %s", self.node, exc)
                return None, "none"
        return self._nvml, "real"

    def _drain_events(self, nvml: Any, count: int) -> None:
        if self._events is None:
            self._events = nvml.nvmlEventSetCreate()
            for i in range(count):
                try:
                    nvml.nvmlDeviceRegisterEvents(nvml.nvmlDeviceGetHandleByIndex(i), XID_EVENT, self._events)
                except Exception as exc:  # noqa: BLE001 - a GPU without Xid events
                    log.debug("no Xid events from GPU %d: %s", i, exc)
        for _ in range(EVENTS_PER_READ):
            try:
                ev = nvml.nvmlEventSetWait_v2(self._events, 0)
            except Exception:  # noqa: BLE001 - NVML_ERROR_TIMEOUT: none pending
                return
            idx = nvml.nvmlDeviceGetIndex(ev.device)
            self.xids.setdefault(int(idx), []).append(int(ev.eventData))

    @staticmethod
    def _gpu(nvml: Any, i: int) -> dict[str, Any]:
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        out: dict[str, Any] = {"index": i}
        reads = {"remapped": lambda: nvml.nvmlDeviceGetRemappedRows(h),
                 "retired_pages_pending": lambda: bool(nvml.nvmlDeviceGetRetiredPagesPendingStatus(h)),
                 "sbe": lambda: int(nvml.nvmlDeviceGetTotalEccErrors(h, 0, 0)),  # corrected, volatile
                 "temperature_c": lambda: int(nvml.nvmlDeviceGetTemperature(h, 0))}
        for name, read in reads.items():
            try:
                value = read()
            except Exception:  # noqa: BLE001 - not supported on this GPU
                continue
            if name == "remapped":
                out["remapped_rows_pending"], out["remapped_rows_failure"] = bool(value[2]), bool(value[3])
            else:
                out[name] = value
        return out

    def gpus(self) -> tuple[list[dict[str, Any]], str]:
        nvml, kind = self._module()
        if nvml is None:
            return [], kind
        try:
            count = int(nvml.nvmlDeviceGetCount())
            self._drain_events(nvml, count)
            gpus = [self._gpu(nvml, i) for i in range(count)]
        except Exception as exc:  # noqa: BLE001 - NVML failing as a whole: report it, no GPU facts
            return [], f"{kind}: {exc}"
        for g in gpus:
            g["xids"] = list(self.xids.get(g["index"], []))
        return gpus, kind

    def clear(self, index: int) -> None:
        """A GPU was reset: its Xids are forgotten (on the NVML stand-in, its faults too: the
        file's entry goes, as a reset clears a pending remap)."""
        self.xids.pop(int(index), None)
        fake = self.node_dir / FAKE_NVML_FILE
        if fake.is_file():
            from relocator.agent.fakenvml import reset

            reset(fake, [int(index)])
            if self._kind == "fake":
                self._nvml.forget(int(index))

    def mark(self, total: int, kind: str, gpus: list[int], count: int, avoid: list[int]) -> list[int]:
        """GPUs marked bad on the NVML stand-in (relocator.agent.fakenvml.mark): for fake GPUs
        only; ValueError on a node whose NVML is real (its facts are the driver's)."""
        from relocator.agent.fakenvml import mark

        if self._module()[1] == "real":
            raise ValueError(f"{self.node} has real GPUs (NVML): their health is the driver's, not markable")
        return mark(self.node_dir / FAKE_NVML_FILE, total, kind, gpus, count, avoid)

    # -- notices ------------------------------------------------------------------------------
    def notice(self) -> dict[str, Any] | None:
        doc = self._notice_file() or self._notice_url()
        if not doc:
            return None
        try:
            at = _at(doc)
        except (TypeError, ValueError):
            return {"error": f"unreadable notice {doc!r}"}
        return None if at is None else {"at": at, "reason": str(doc.get("reason") or doc.get("action") or "")}

    def _notice_file(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.node_dir / NOTICE_FILE).read_text() or "null")
        except (OSError, ValueError):
            return None

    def _notice_url(self) -> dict[str, Any] | None:
        url = self.env.get(NOTICE_URL_ENV)
        if not url:
            return None
        try:
            with urllib.request.urlopen(url.replace("{node}", self.node), timeout=1.0) as resp:  # noqa: S310
                return json.loads(resp.read() or b"null") if resp.status == 200 else None
        except Exception:  # noqa: BLE001 - 404 (no notice), unreachable: none
            return None

    def read(self) -> dict[str, Any]:
        gpus, kind = self.gpus()
        return {"node": self.node, "at": time.time(), "nvml": kind, "gpus": gpus, "notice": self.notice()}


def write_notice(node_dir: Path, at: float, reason: str = "") -> dict[str, Any]:
    """An operator's notice for this node (what `relocator notice` writes through the agent)."""
    doc = {"at": float(at), "reason": reason}
    path = Path(node_dir) / NOTICE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)
    return doc


def clear_notice(node_dir: Path) -> None:
    (Path(node_dir) / NOTICE_FILE).unlink(missing_ok=True)
