"""The host part of a snapshot fingerprint, and the compatibility check against a target.

A restore is refused, before anything is touched, when the place it would run differs from the
place the image was taken in a way that breaks a restored process: another CPU model (the
process may use instructions the new CPU lacks), another GPU model or count, driver or CUDA
version, an older CRIU, another engine version or other weights.
"""

from __future__ import annotations

import platform
from functools import lru_cache

from pydantic import BaseModel

from adapters.base import EngineFingerprint
from relocator import procs
from relocator.snapshot import criu


class GpuInfo(BaseModel):
    model: str | None = None
    count: int = 0
    driver_version: str | None = None
    cuda_version: str | None = None


class HostFingerprint(BaseModel):
    arch: str
    cpu_model: str
    kernel: str
    criu_version: str
    gpu: GpuInfo = GpuInfo()


class Fingerprint(BaseModel):
    host: HostFingerprint
    engine: EngineFingerprint


class Mismatch(BaseModel):
    field: str
    expected: str
    found: str

    def __str__(self) -> str:
        return f"{self.field}: image has {self.expected!r}, target has {self.found!r}"


def cpu_model() -> str:
    model = procs.cpuinfo("model name")
    return model if model is not None else platform.processor() or "unknown"


@lru_cache(maxsize=1)
def gpu_info() -> GpuInfo:
    """NVIDIA GPUs through NVML (nvidia-ml-py); an empty GpuInfo where there are none."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return GpuInfo()
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return GpuInfo()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
        driver = pynvml.nvmlSystemGetDriverVersion()
        cuda = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        as_str = lambda v: v.decode() if isinstance(v, bytes) else str(v)  # noqa: E731
        return GpuInfo(model=as_str(name), count=count, driver_version=as_str(driver),
                       cuda_version=f"{cuda // 1000}.{(cuda % 1000) // 10}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def host_fingerprint() -> HostFingerprint:
    return HostFingerprint(
        arch=platform.machine(),
        cpu_model=cpu_model(),
        kernel=platform.release(),
        criu_version=criu.criu_version(),
        gpu=gpu_info(),
    )


def _flatten(prefix: str, model: BaseModel) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in model:
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, BaseModel):
            out.update(_flatten(name, value))
        else:
            out[name] = value
    return out


# Fields that must be equal between image and target. The kernel is recorded, not compared:
# CRIU restores across kernel versions as long as the features it needs exist (preflight).
_EQUAL_FIELDS = (
    "host.arch", "host.cpu_model", "host.gpu.model", "host.gpu.count", "host.gpu.driver_version",
    "host.gpu.cuda_version", "engine.engine", "engine.engine_version", "engine.model_id",
    "engine.weight_sha256", "engine.dtype", "engine.max_model_len",
    "engine.tensor_parallel_size", "engine.pipeline_parallel_size",
)


def compatibility(image: Fingerprint, target: Fingerprint) -> list[Mismatch]:
    """Every reason `image` cannot be restored on `target`; empty when it can."""
    a, b = _flatten("", image), _flatten("", target)
    problems = [Mismatch(field=f, expected=str(a[f]), found=str(b[f])) for f in _EQUAL_FIELDS if a[f] != b[f]]
    image_criu = criu.version_tuple(image.host.criu_version)
    target_criu = criu.version_tuple(target.host.criu_version)
    if target_criu[:2] < image_criu[:2]:
        problems.append(Mismatch(field="host.criu_version", expected=f">= {image.host.criu_version}",
                                 found=target.host.criu_version))
    return problems
