"""GPU facts of this host (NVML): what an agent reports and the controller's inventory keeps.
Low level (imports nothing of ours), so the agent, deploy's preflight and the controller all
read it without importing each other."""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("relocator.controller")


@dataclass(frozen=True)
class GpuFact:
    """One real GPU of a node: NVML's index (PCI bus order, the index a cell's `gpu_ids` and
    Ray's GPU ids use), UUID (what cuda-checkpoint's --device-map pairs), model and memory."""

    index: int
    uuid: str
    model: str
    memory_mib: int

    def to_dict(self) -> dict:
        return {"index": self.index, "uuid": self.uuid, "model": self.model, "memory_mib": self.memory_mib}


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def local_gpus() -> list[GpuFact]:
    """This host's NVIDIA GPUs through NVML (nvidia-ml-py's `pynvml`). No pynvml, no driver or
    any NVML error: [] (the node then runs with Ray's fake GPU counts, the default)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - NVMLError_LibraryNotFound, DriverNotLoaded ...
        log.debug("no NVML here (%s): fake GPUs", exc)
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            out.append(GpuFact(index=i, uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
                               model=_text(pynvml.nvmlDeviceGetName(handle)),
                               memory_mib=int(memory.total) // (1 << 20)))
        return out
    except Exception as exc:  # noqa: BLE001 - a GPU fell off the bus mid-listing: report none
        log.warning("NVML failed while listing GPUs (%s): reporting none", exc)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass
