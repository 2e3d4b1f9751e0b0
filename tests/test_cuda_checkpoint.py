"""cuda-checkpoint around CRIU: a fake tool that keeps each pid's CUDA state and can be told to
fail (call order, undo on failure, only processes with a context, the frozen-source check, the
dump's record and the rollback's resume), and the real tool on GPU hosts."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relocator.snapshot import criu, cuda
from relocator.snapshot.fingerprint import gpu_info

# A stand-in for NVIDIA's cuda-checkpoint with its documented CLI (--get-state / --action
# lock|checkpoint|restore|unlock --pid P [--timeout MS] [--device-map M]) and its state machine:
# running -lock-> locked -checkpoint-> checkpointed -restore-> locked -unlock-> running.
# FAKE_CC_NOCTX: pids without a CUDA context (the tool refuses them); FAKE_CC_FAIL: "action:pid"
# steps that fail. Every call is appended to DIR/calls.
FAKE_TOOL = r"""#!/bin/sh
d="$FAKE_CC_DIR"
echo "$*" >> "$d/calls"
pid=""; action=""; get=""
while [ $# -gt 0 ]; do
  case "$1" in --pid) pid="$2"; shift;; --action) action="$2"; shift;; --get-state) get=1;; esac
  shift
done
case ",$FAKE_CC_NOCTX," in *",$pid,"*) echo "Could not get state of process ID $pid: \"initialization error\"" >&2; exit 1;; esac
f="$d/state.$pid"; state=running; [ -f "$f" ] && state=$(cat "$f")
if [ -n "$get" ]; then echo "$state"; exit 0; fi
case ",$FAKE_CC_FAIL," in *",$action:$pid,"*) echo "Could not $action on process ID $pid: \"operation not permitted\"" >&2; exit 1;; esac
case "$action" in
  lock) src=running; dst=locked;; checkpoint) src=locked; dst=checkpointed;;
  restore) src=checkpointed; dst=locked;; unlock) src=locked; dst=running;;
  *) echo "unknown action $action" >&2; exit 2;;
esac
if [ "$state" != "$src" ]; then echo "Could not $action on process ID $pid: \"illegal state\" ($state)" >&2; exit 1; fi
printf %s "$dst" > "$f"
"""


class FakeTool:
    def __init__(self, d: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dir, self.mp = d, monkeypatch
        tool = d / "cuda-checkpoint"
        tool.write_text(FAKE_TOOL)
        tool.chmod(0o755)
        monkeypatch.setenv("RELOCATOR_CUDA_CHECKPOINT", str(tool))
        monkeypatch.setenv("FAKE_CC_DIR", str(d))

    def calls(self) -> list[str]:
        f = self.dir / "calls"
        return f.read_text().splitlines() if f.exists() else []

    def actions(self) -> list[str]:
        return [c for c in self.calls() if c.startswith("--action")]

    def state(self, pid: int) -> str:
        f = self.dir / f"state.{pid}"
        return f.read_text() if f.exists() else "running"

    def set_state(self, pid: int, state: str) -> None:
        (self.dir / f"state.{pid}").write_text(state)

    def fail(self, *steps: str) -> None:
        self.mp.setenv("FAKE_CC_FAIL", ",".join(steps))

    def no_context(self, *pids: int) -> None:
        self.mp.setenv("FAKE_CC_NOCTX", ",".join(map(str, pids)))


@pytest.fixture
def tool(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeTool:
    d = tmp_path / "cc"
    d.mkdir()
    return FakeTool(d, monkeypatch)


@pytest.fixture
def maps_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every pid 'maps the driver' (the /proc prefilter is tested on real processes below)."""
    monkeypatch.setattr(cuda, "_maps_driver", lambda pid: True)


def test_lock_then_checkpoint_restore_then_unlock(tool: FakeTool, maps_all: None) -> None:
    recorded = []
    assert cuda.checkpoint([11, 12], lock_timeout_ms=500, record=recorded.append) == [11, 12]
    assert recorded == [[11, 12]]
    assert tool.state(11) == tool.state(12) == "checkpointed"
    cuda.restore([11, 12])
    assert tool.actions() == [
        "--action lock --pid 11 --timeout 500", "--action lock --pid 12 --timeout 500",
        "--action checkpoint --pid 11", "--action checkpoint --pid 12",
        "--action restore --pid 11", "--action restore --pid 12",
        "--action unlock --pid 11", "--action unlock --pid 12",
    ]
    assert tool.state(11) == tool.state(12) == "running"


def test_the_record_is_written_before_the_first_lock(tool: FakeTool, maps_all: None) -> None:
    seen = []
    cuda.checkpoint([11, 12], record=lambda pids: seen.append((list(pids), tool.actions())))
    assert seen == [([11, 12], [])]


@pytest.mark.parametrize("step", ["lock:11", "lock:13", "checkpoint:11", "checkpoint:13"])
def test_a_failing_step_undoes_every_process_already_toggled(tool: FakeTool, maps_all: None, step: str) -> None:
    tool.fail(step)
    with pytest.raises(cuda.CudaCheckpointError, match="operation not permitted.*undone: every process runs again"):
        cuda.checkpoint([11, 12, 13])
    assert [tool.state(p) for p in (11, 12, 13)] == ["running"] * 3
    action, pid = step.split(":")
    if action == "checkpoint":  # all were locked, some checkpointed: restored and unlocked
        assert "--action unlock --pid 13" in tool.actions()
    if step == "checkpoint:13":
        assert "--action restore --pid 11" in tool.actions() and "--action restore --pid 12" in tool.actions()


def test_an_undo_that_fails_says_which_process_may_hang(tool: FakeTool, maps_all: None) -> None:
    tool.fail("checkpoint:12", "unlock:11")
    with pytest.raises(cuda.CudaCheckpointError, match=r"UNDO FAILED.*unlock --pid 11"):
        cuda.checkpoint([11, 12])
    assert tool.state(11) == "locked" and tool.state(12) == "running"


def test_a_process_already_locked_is_refused_before_anything_is_touched(tool: FakeTool, maps_all: None) -> None:
    tool.set_state(12, "locked")
    with pytest.raises(cuda.CudaCheckpointError, match="pid 12 is locked already.*nothing was changed"):
        cuda.checkpoint([11, 12])
    assert tool.actions() == [] and tool.state(11) == "running"


def test_only_processes_with_a_cuda_context_are_toggled(tool: FakeTool, maps_all: None) -> None:
    tool.no_context(12)
    assert cuda.checkpoint([11, 12, 13]) == [11, 13]
    assert not any("--pid 12" in a for a in tool.actions())
    assert tool.state(12) == "running"


def test_the_driver_prefilter_asks_only_processes_that_map_libcuda(tool: FakeTool, tmp_path: Path) -> None:
    """Real processes: one maps a file named libcuda.so.1 and has a context, one maps it and has
    none (left alone), one maps nothing of the driver (the tool is never asked about it)."""
    lib = tmp_path / "libcuda.so.1"
    lib.write_bytes(b"\0" * 4096)
    mapper = ("import mmap, sys; f = open(sys.argv[1], 'rb'); m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ); "
              "print('ready', flush=True); sys.stdin.read()")
    plain = "import sys; print('ready', flush=True); sys.stdin.read()"
    procs_ = [subprocess.Popen([sys.executable, "-c", code, str(lib)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True) for code in (mapper, mapper, plain)]
    try:
        for p in procs_:
            assert p.stdout.readline().strip() == "ready"
        with_ctx, without_ctx, no_driver = (p.pid for p in procs_)
        tool.no_context(without_ctx)
        assert cuda.contexts([with_ctx, without_ctx, no_driver]) == {with_ctx: cuda.CudaState.RUNNING}
        asked = {c.split("--pid ")[1] for c in tool.calls()}
        assert asked == {str(with_ctx), str(without_ctx)}
    finally:
        for p in procs_:
            p.kill()
            p.wait()


def test_resume_brings_each_process_back_from_where_it_is(tool: FakeTool) -> None:
    tool.set_state(11, "checkpointed")
    tool.set_state(12, "locked")
    tool.no_context(14)
    assert cuda.resume([11, 12, 13, 14]) == []
    assert [tool.state(p) for p in (11, 12, 13)] == ["running"] * 3
    assert tool.actions() == ["--action restore --pid 11", "--action unlock --pid 11", "--action unlock --pid 12"]


def test_failure_is_reported_with_the_tool_message(tool: FakeTool, maps_all: None) -> None:
    tool.fail("lock:11")
    with pytest.raises(cuda.CudaCheckpointError, match="lock --pid 11.*operation not permitted"):
        cuda.checkpoint([11])


def test_a_hung_tool_is_an_error_not_a_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hung = tmp_path / "cuda-checkpoint"
    hung.write_text("#!/bin/sh\nexec sleep 30\n")
    hung.chmod(0o755)
    monkeypatch.setenv("RELOCATOR_CUDA_CHECKPOINT", str(hung))
    monkeypatch.setenv("RELOCATOR_CUDA_TIMEOUT_S", "0.2")
    with pytest.raises(cuda.CudaCheckpointError, match="no answer within"):
        cuda.restore([11])


# ---------------------------------------------------------------- the frozen source's check
@pytest.fixture
def sleeper():
    p = subprocess.Popen(["sleep", "60"])
    yield p.pid
    p.kill()
    p.wait()


def _wait_status(pid: int, want: bool) -> None:
    from relocator import procs, waits

    waits.until(lambda: procs.stopped(pid) is want, 5, every=0.02, what=f"pid {pid} stopped={want}")


def test_a_stopped_checkpointed_source_is_frozen_and_one_that_runs_is_not(tool: FakeTool, sleeper: int) -> None:
    os.kill(sleeper, signal.SIGSTOP)
    _wait_status(sleeper, True)
    tool.set_state(sleeper, "checkpointed")
    assert cuda.frozen_problems([sleeper], [sleeper]) == []
    tool.set_state(sleeper, "running")  # its CUDA state restored behind our back
    assert cuda.frozen_problems([sleeper], [sleeper]) == [f"pid {sleeper}'s CUDA state is running, not checkpointed"]
    tool.set_state(sleeper, "checkpointed")
    os.kill(sleeper, signal.SIGCONT)  # woken up
    _wait_status(sleeper, False)
    problems = cuda.frozen_problems([sleeper], [sleeper])
    assert len(problems) == 1 and problems[0].startswith(f"pid {sleeper} is ") and "not stopped" in problems[0]
    assert cuda.frozen_problems([2**22 + 7], []) == ["no process of the source is left"]


# ---------------------------------------------- snapshot's GPU hooks: record, undo, resume order
class _Cell:
    """What snapshot's CUDA hooks use of a cell (pure ordering test; real cells: test_snapshot_integration)."""

    def __init__(self, d: Path, pids: list[int], tool: FakeTool) -> None:
        self.dir, self._pids, self.tool = d, pids, tool
        self.id, self.netns, self.init_pid, self.devices = "c1", "rl-c1", pids[0], {}

    def pids(self) -> list[int]:
        return list(self._pids)

    def resume(self) -> None:
        with open(self.tool.dir / "calls", "a") as f:
            f.write("SIGCONT\n")


def _dump_with(monkeypatch, tmp_path: Path, tool: FakeTool, run_criu):
    from relocator.snapshot import snapshot
    from relocator.snapshot.manifest import PagesMode

    monkeypatch.setattr(cuda, "available", lambda: True)
    monkeypatch.setattr(snapshot, "_check_dumpable", lambda cell, image_dir: None)
    monkeypatch.setattr(snapshot, "fingerprint_of", lambda cell: None)
    monkeypatch.setattr(snapshot, "_shm_files", lambda cell: set())
    monkeypatch.setattr(snapshot.procs, "ns_inode", lambda kind, pid: 4026531992)
    cell = _Cell(tmp_path, [11, 12], tool)
    return cell, lambda: snapshot._dump(cell, tmp_path / "img", lambda s, f: None, run_criu, PagesMode.LOCAL)


def test_the_locked_pids_are_recorded_before_criu_and_undone_when_it_fails(
        tool: FakeTool, maps_all: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = {}

    def failing_criu(ino, args):
        seen["record"] = json.loads((tmp_path / "cuda_pids.json").read_text())
        seen["states"] = [tool.state(11), tool.state(12)]
        raise criu.CriuError("criu dump failed")

    cell, dump = _dump_with(monkeypatch, tmp_path, tool, failing_criu)
    with pytest.raises(criu.CriuError):
        dump()
    assert seen == {"record": [11, 12], "states": ["checkpointed", "checkpointed"]}
    assert [tool.state(11), tool.state(12)] == ["running", "running"]  # the source serves again
    assert not (tmp_path / "cuda_pids.json").exists()  # nothing left to undo


def test_a_failed_cuda_checkpoint_leaves_the_record_and_a_running_source(
        tool: FakeTool, maps_all: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cell, dump = _dump_with(monkeypatch, tmp_path, tool, lambda ino, args: pytest.fail("CRIU must not run"))
    tool.fail("checkpoint:12")
    with pytest.raises(cuda.CudaCheckpointError, match="undone"):
        dump()
    assert [tool.state(11), tool.state(12)] == ["running", "running"]
    assert json.loads((tmp_path / "cuda_pids.json").read_text()) == [11, 12]  # resume_source: a no-op now


def test_resume_source_continues_the_tree_then_restores_and_unlocks_its_cuda_state(
        tool: FakeTool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relocator.snapshot import snapshot

    monkeypatch.setattr(criu, "unlock_network", lambda netns: None)
    cell = _Cell(tmp_path, [11, 12], tool)
    (tmp_path / "cuda_pids.json").write_text(json.dumps([11, 12]))
    tool.set_state(11, "checkpointed")
    tool.set_state(12, "locked")  # CRIU died between the lock and the checkpoint of 12
    snapshot.resume_source(cell)  # type: ignore[arg-type]
    calls = [c for c in tool.calls() if not c.startswith("--get-state")]
    assert calls == ["SIGCONT", "--action restore --pid 11", "--action unlock --pid 11", "--action unlock --pid 12"]
    assert [tool.state(11), tool.state(12)] == ["running", "running"]
    assert not (tmp_path / "cuda_pids.json").exists()


def test_resume_source_says_when_a_cuda_state_cannot_be_undone(
        tool: FakeTool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relocator.snapshot import snapshot

    monkeypatch.setattr(criu, "unlock_network", lambda netns: None)
    cell = _Cell(tmp_path, [11], tool)
    (tmp_path / "cuda_pids.json").write_text("[11]")
    tool.set_state(11, "failed")
    with pytest.raises(snapshot.SnapshotError, match="runs again but its CUDA state does not.*pid 11"):
        snapshot.resume_source(cell)  # type: ignore[arg-type]
    assert (tmp_path / "cuda_pids.json").exists()  # a later resume can try again


def test_release_reports_a_gpu_source_that_ran_after_its_dump(tool: FakeTool, sleeper: int, tmp_path: Path) -> None:
    from relocator.snapshot import snapshot

    class Source(_Cell):
        def is_alive(self) -> bool:
            return True

    cell = Source(tmp_path, [sleeper], tool)
    assert snapshot.released_source_ran(cell) == []  # no cuda_pids.json: not a dumped GPU source
    (tmp_path / "cuda_pids.json").write_text(json.dumps([sleeper]))
    os.kill(sleeper, signal.SIGSTOP)
    _wait_status(sleeper, True)
    tool.set_state(sleeper, "checkpointed")
    assert snapshot.released_source_ran(cell) == []
    os.kill(sleeper, signal.SIGCONT)
    tool.set_state(sleeper, "running")
    _wait_status(sleeper, False)
    ran = snapshot.released_source_ran(cell)
    assert len(ran) == 2 and "not stopped" in ran[0] and "CUDA state is running" in ran[1]


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
