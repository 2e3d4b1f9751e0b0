"""NVIDIA cuda-checkpoint around a CRIU dump/restore, on hosts with GPUs.

Per NVIDIA's documentation (github.com/NVIDIA/cuda-checkpoint): before CRIU dumps a process
that holds CUDA state, `lock` it (no new CUDA calls), then `checkpoint` it (device memory is
copied to host memory and the GPU released); after CRIU restores it, `restore` (device
memory back on the GPU) then `unlock`. CRIU then sees an ordinary process. On hosts without a
GPU none of this runs.

What this module guarantees (docs/gpu.md, "Failures and the source's state"):
- only processes that hold a CUDA context are toggled: cuda-checkpoint is asked for each
  candidate's state (`--get-state`); a process that merely maps the driver's libraries and has
  no context is left alone;
- the pids about to be locked are handed to `record` before the first lock, so a rollback can
  find them even when this process or CRIU dies midway;
- when any lock or checkpoint fails, every process already locked or checkpointed is brought
  back to running (`resume`) before the error is raised: the source serves again;
- `frozen_problems` says whether a dumped source is still stopped and checkpointed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Callable, Iterable

from relocator import procs
from relocator.choices import Choice
from relocator.snapshot.fingerprint import gpu_info


class CudaCheckpointError(RuntimeError):
    pass


class CudaState(Choice):
    """What `cuda-checkpoint --get-state` prints (the driver's CUprocessState)."""

    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    FAILED = "failed"


#: seconds one cuda-checkpoint call may take (a checkpoint of a full H200 at the 1.56 GB/s
#: measured is ~90 s); past it the call is an error, never a hang of the agent
DEFAULT_TIMEOUT_S = 600.0


def binary() -> str | None:
    return os.environ.get("RELOCATOR_CUDA_CHECKPOINT") or shutil.which("cuda-checkpoint")


def available() -> bool:
    """True when this host has an NVIDIA GPU and the cuda-checkpoint tool."""
    return gpu_info().count > 0 and binary() is not None


def _timeout() -> float:
    return float(os.environ.get("RELOCATOR_CUDA_TIMEOUT_S") or DEFAULT_TIMEOUT_S)


def _call(args: list[str]) -> subprocess.CompletedProcess:
    cmd = [binary() or "cuda-checkpoint", *args]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=_timeout())
    except subprocess.TimeoutExpired:
        raise CudaCheckpointError(f"{' '.join(cmd[1:])}: no answer within {_timeout():.0f} s") from None
    except OSError as exc:
        raise CudaCheckpointError(f"cannot run {cmd[0]}: {exc}") from None


def _run(action: str, pid: int, timeout_ms: int | None = None, device_map: str | None = None) -> None:
    args = ["--action", action, "--pid", str(pid)]
    if timeout_ms is not None and action == "lock":
        args += ["--timeout", str(timeout_ms)]
    if device_map and action == "restore":
        args += ["--device-map", device_map]
    proc = _call(args)
    if proc.returncode != 0:
        raise CudaCheckpointError(f"cuda-checkpoint --action {action} --pid {pid}: "
                                  f"{proc.stderr.strip() or proc.stdout.strip() or f'exit {proc.returncode}'}")


def cuda_state(pid: int) -> CudaState | None:
    """The CUDA state of `pid`, or None when it holds no CUDA context (cuda-checkpoint refuses
    the pid) or is gone. A state the tool prints that is none of CudaState's: CudaCheckpointError."""
    proc = _call(["--get-state", "--pid", str(pid)])
    words = proc.stdout.split()
    if proc.returncode != 0 or not words:
        return None
    try:
        return CudaState(words[0].lower())
    except ValueError:
        raise CudaCheckpointError(f"cuda-checkpoint --get-state --pid {pid}: unknown state {proc.stdout.strip()!r}") from None


def _maps_driver(pid: int) -> bool:
    maps = procs.maps_text(pid)  # '' when gone
    return "/dev/nvidia" in maps or "libcuda.so" in maps


def contexts(pids: Iterable[int]) -> dict[int, CudaState]:
    """The processes of `pids` that hold a CUDA context, with their states, in `pids` order.
    Only those that map the driver are asked (each call of the tool attaches to the driver)."""
    out: dict[int, CudaState] = {}
    for pid in pids:
        if _maps_driver(pid):
            state = cuda_state(pid)
            if state is not None:
                out[pid] = state
    return out


def cuda_pids(pids: list[int]) -> list[int]:
    """The processes of a tree that hold a CUDA context (whatever their state)."""
    return list(contexts(pids))


def checkpoint(pids: list[int], lock_timeout_ms: int = 10_000,
               record: Callable[[list[int]], None] | None = None) -> list[int]:
    """Lock then checkpoint every CUDA process of the tree; returns those it toggled.

    `record(pids)` is called with them before the first lock (the rollback's record). A process
    found locked, checkpointed or failed already is refused before anything is touched. If a
    lock or checkpoint fails, every process of the list is brought back to running first; the
    error says so, or what could not be undone."""
    states = contexts(pids)
    busy = {p: s for p, s in states.items() if s != CudaState.RUNNING}
    if busy:
        raise CudaCheckpointError("cannot checkpoint: " + ", ".join(f"pid {p} is {s}" for p, s in busy.items())
                                  + " already (another checkpoint, or one not undone); nothing was changed")
    targets = list(states)
    if record is not None:
        record(targets)
    try:
        for pid in targets:
            _run("lock", pid, lock_timeout_ms)
        for pid in targets:
            _run("checkpoint", pid)
    except CudaCheckpointError as exc:
        left = resume(targets)
        undo = ("; undone: every process runs again" if not left else
                "; UNDO FAILED, the worker may hang: " + "; ".join(left))
        raise CudaCheckpointError(f"{exc}{undo}") from None
    return targets


def restore(pids: list[int], device_map: str | None = None) -> None:
    """Restore then unlock processes checkpointed by `checkpoint` (after CRIU restored them).
    `device_map` ("oldUuid=newUuid,..." from devices.device_map, every checkpointed GPU
    mapped; driver >= 580) puts their memory back on other GPUs than the ones it left."""
    for pid in pids:
        _run("restore", pid, device_map=device_map)
    for pid in pids:
        _run("unlock", pid)


def resume(pids: list[int]) -> list[str]:
    """Bring each of `pids` back to a running CUDA state from wherever it is (checkpointed:
    restore then unlock; locked: unlock; running, gone or without a context: nothing). Goes on
    past a failing process; returns what could not be undone (empty: all run)."""
    problems: list[str] = []
    states: dict[int, CudaState | None] = {}
    for pid in pids:
        try:
            states[pid] = cuda_state(pid)
        except CudaCheckpointError as exc:
            problems.append(str(exc))
    for step, wanted in (("restore", (CudaState.CHECKPOINTED,)), ("unlock", (CudaState.CHECKPOINTED, CudaState.LOCKED))):
        for pid, state in list(states.items()):
            if state == CudaState.FAILED:
                problems.append(f"pid {pid}: CUDA state failed (the driver cannot restore it; kill it)")
                del states[pid]
            elif state in wanted:
                try:
                    _run(step, pid)
                except CudaCheckpointError as exc:
                    problems.append(str(exc))
                    del states[pid]
    return problems


def frozen_problems(pids: list[int], cuda_pids: list[int]) -> list[str]:
    """Why a source left by a dump is not frozen (empty: it is): every process of `pids` still
    there must be stopped (psutil status, i.e. /proc/PID/stat's T or t), and every process of
    `cuda_pids` must still be CUDA-checkpointed. A source that fails this ran after its dump:
    a second live copy of the worker."""
    problems = []
    present = 0
    for pid in pids:
        status = procs.status(pid)
        if status is None:
            continue
        present += 1
        if not procs.stopped(pid):
            problems.append(f"pid {pid} is {status}, not stopped")
    if pids and not present:
        problems.append("no process of the source is left")
    for pid in cuda_pids:
        if procs.status(pid) is None:
            continue
        try:
            state = cuda_state(pid)
        except CudaCheckpointError as exc:
            problems.append(str(exc))
            continue
        if state != CudaState.CHECKPOINTED:
            problems.append(f"pid {pid}'s CUDA state is {state or 'gone (no context)'}, not checkpointed")
    return problems
