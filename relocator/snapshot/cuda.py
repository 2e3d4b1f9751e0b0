"""NVIDIA cuda-checkpoint around a CRIU dump/restore, on hosts with GPUs.

Per NVIDIA's documentation (github.com/NVIDIA/cuda-checkpoint): before CRIU dumps a process
that holds CUDA state, `lock` it (no new CUDA calls), then `checkpoint` it (device memory is
copied to host memory and the GPU released); after CRIU restores it, `restore` (device
memory back on the GPU) then `unlock`. CRIU then sees an ordinary process. Only processes
that hold a CUDA context are toggled; on hosts without a GPU none of this runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from relocator import procs
from relocator.snapshot.fingerprint import gpu_info


class CudaCheckpointError(RuntimeError):
    pass


def binary() -> str | None:
    return os.environ.get("RELOCATOR_CUDA_CHECKPOINT") or shutil.which("cuda-checkpoint")


def available() -> bool:
    """True when this host has an NVIDIA GPU and the cuda-checkpoint tool."""
    return gpu_info().count > 0 and binary() is not None


def _run(action: str, pid: int, timeout_ms: int | None = None, device_map: str | None = None) -> None:
    cmd = [binary() or "cuda-checkpoint", "--action", action, "--pid", str(pid)]
    if timeout_ms is not None and action == "lock":
        cmd += ["--timeout", str(timeout_ms)]
    if device_map and action == "restore":
        cmd += ["--device-map", device_map]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CudaCheckpointError(f"cuda-checkpoint --action {action} --pid {pid}: {proc.stderr.strip() or proc.stdout.strip()}")


def cuda_state(pid: int) -> str | None:
    """'running', 'locked', 'checkpointed' ... or None when the process holds no CUDA context."""
    proc = subprocess.run([binary() or "cuda-checkpoint", "--get-state", "--pid", str(pid)],
                          capture_output=True, text=True)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def cuda_pids(pids: list[int]) -> list[int]:
    """The processes of a tree that map the NVIDIA driver, i.e. hold CUDA state."""
    out = []
    for pid in pids:
        maps = procs.maps_text(pid)  # '' when gone
        if "/dev/nvidia" in maps or "libcuda.so" in maps:
            out.append(pid)
    return out


def checkpoint(pids: list[int], lock_timeout_ms: int = 10_000) -> list[int]:
    """Lock then checkpoint every CUDA process of the tree; returns those it toggled."""
    targets = cuda_pids(pids)
    for pid in targets:
        _run("lock", pid, lock_timeout_ms)
    for pid in targets:
        _run("checkpoint", pid)
    return targets


def restore(pids: list[int], device_map: str | None = None) -> None:
    """Restore then unlock processes checkpointed by `checkpoint` (after CRIU restored them).
    `device_map` ("oldUuid=newUuid,..." from devices.device_map, every checkpointed GPU
    mapped; driver >= 580) puts their memory back on other GPUs than the ones it left."""
    for pid in pids:
        _run("restore", pid, device_map=device_map)
    for pid in pids:
        _run("unlock", pid)
