"""cuda-checkpoint around CRIU: call order with a recording stand-in, and the real tool on GPU hosts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relocator.snapshot import cuda
from relocator.snapshot.fingerprint import gpu_info


def test_lock_then_checkpoint_restore_then_unlock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = tmp_path / "calls"
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    tool.chmod(0o755)
    monkeypatch.setenv("RELOCATOR_CUDA_CHECKPOINT", str(tool))
    monkeypatch.setattr(cuda, "cuda_pids", lambda pids: list(pids))
    assert cuda.checkpoint([11, 12], lock_timeout_ms=500) == [11, 12]
    cuda.restore([11, 12])
    lines = calls.read_text().splitlines()
    assert lines == [
        "--action lock --pid 11 --timeout 500", "--action lock --pid 12 --timeout 500",
        "--action checkpoint --pid 11", "--action checkpoint --pid 12",
        "--action restore --pid 11", "--action restore --pid 12",
        "--action unlock --pid 11", "--action unlock --pid 12",
    ]


def test_failure_is_reported_with_the_tool_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = tmp_path / "cuda-checkpoint"
    tool.write_text('#!/bin/sh\necho "process 11 is not a CUDA process" >&2\nexit 1\n')
    tool.chmod(0o755)
    monkeypatch.setenv("RELOCATOR_CUDA_CHECKPOINT", str(tool))
    monkeypatch.setattr(cuda, "cuda_pids", lambda pids: list(pids))
    with pytest.raises(cuda.CudaCheckpointError, match="not a CUDA process"):
        cuda.checkpoint([11])


def test_no_gpu_means_not_available_here() -> None:
    if gpu_info().count == 0:
        assert cuda.available() is False


_GPU_REASON = "needs an NVIDIA GPU, its driver and NVIDIA's cuda-checkpoint tool; this machine has none"


@pytest.mark.gpu
@pytest.mark.skipif(gpu_info().count == 0 or shutil.which("cuda-checkpoint") is None, reason=_GPU_REASON)
def test_real_cuda_checkpoint_roundtrip(tmp_path: Path) -> None:
    """A process holding device memory is checkpointed (GPU released) and restored intact."""
    # Talks to the driver API directly (libcuda), so it needs no CUDA build of torch.
    script = (
        "import ctypes, sys\n"
        "cu = ctypes.CDLL('libcuda.so.1')\n"
        "assert cu.cuInit(0) == 0\n"
        "dev = ctypes.c_int(); assert cu.cuDeviceGet(ctypes.byref(dev), 0) == 0\n"
        "ctx = ctypes.c_void_p(); assert cu.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0\n"
        "n = 1 << 20; ptr = ctypes.c_uint64(); assert cu.cuMemAlloc_v2(ctypes.byref(ptr), n) == 0\n"
        "src = ctypes.create_string_buffer(bytes(range(256)) * (n // 256), n)\n"
        "assert cu.cuMemcpyHtoD_v2(ptr, src, ctypes.c_size_t(n)) == 0\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "dst = ctypes.create_string_buffer(n)\n"
        "assert cu.cuMemcpyDtoH_v2(dst, ptr, ctypes.c_size_t(n)) == 0\n"
        "print('same' if dst.raw == src.raw else 'different', flush=True)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        toggled = cuda.checkpoint([proc.pid])
        assert toggled == [proc.pid]
        assert cuda.cuda_state(proc.pid) == "checkpointed"
        time.sleep(0.5)
        cuda.restore(toggled)
        assert cuda.cuda_state(proc.pid) == "running"
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "same"
    finally:
        proc.kill()
