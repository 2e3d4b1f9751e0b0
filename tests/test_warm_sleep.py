"""The engine asleep around a warm capture of a GPU worker (issue 28; relocator/warm/sleep.py),
on CPU with fakes: a fake engine HTTP server that records what it is asked, fake cuda-checkpoint
and CRIU steps. Checks the order (sleep, cuda checkpoint, CRIU dump, cuda restore, wake), that
each engine is asked through its documented API, that CPU workers are never put to sleep, that a
failed sleep gives the capture up with the engine awake, and that a copy restored from an image
taken asleep is woken before it serves."""

from __future__ import annotations

import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterator

import pytest

from relocator.cell.cell import Cell
from relocator.warm import capture, sleep

GPU = {"gpus": [{"index": 0, "minor": 0, "uuid": "GPU-0", "model": "NVIDIA H200"}]}


class FakeEngine:
    """An HTTP server on loopback that answers every POST with `answers[path]` (default 200 {})
    and records (method, path with query, JSON body) in the shared `log`."""

    def __init__(self, log: list) -> None:
        self.log, self.answers = log, {}
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.log.append(("http", "POST", self.path, body))
                code, payload = fake.answers.get(self.path.split("?")[0], (200, {}))
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def log() -> list:
    return []


@pytest.fixture
def engine(log: list) -> Iterator[FakeEngine]:
    e = FakeEngine(log)
    yield e
    e.close()


def cell_of(engine: FakeEngine, name: str = "vllm", devices: dict | None = None, launch: dict | None = None) -> Cell:
    return Cell(id="c-test", netns="none", ip="127.0.0.1", port=engine.port, init_pid=os.getpid(),
                engine=name, launch=launch or {}, devices=GPU if devices is None else devices)


@pytest.fixture
def fake_dump(monkeypatch: pytest.MonkeyPatch, log: list) -> None:
    """cuda-checkpoint and CRIU as steps in the log (the real ones need a GPU and a cell)."""
    monkeypatch.setattr(capture.cuda, "available", lambda: True)
    monkeypatch.setattr(capture.cuda, "checkpoint", lambda pids: log.append(("cuda", "checkpoint")) or [4242])
    monkeypatch.setattr(capture.cuda, "restore", lambda pids: log.append(("cuda", "restore", tuple(pids))))
    monkeypatch.setattr(capture.procs, "ns_inode", lambda kind, pid: 1)
    monkeypatch.setattr(capture.devices, "criu_external_args", lambda profile: ([], []))
    monkeypatch.setattr(capture.criu, "dump", lambda *a, **kw: log.append(("criu", "dump", kw.get("leave_running"))))


@pytest.mark.parametrize("name, sleep_call, wake_call", [
    ("vllm", ("POST", "/sleep?level=1", None), ("POST", "/wake_up", None)),
    ("sglang", ("POST", "/release_memory_occupation", {"tags": ["kv_cache"]}),
     ("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})),
])
def test_capture_of_a_gpu_worker_sleeps_around_cuda_checkpoint(engine: FakeEngine, log: list, fake_dump: None,
                                                               name: str, sleep_call: tuple, wake_call: tuple,
                                                               tmp_path: Path) -> None:
    timings: dict[str, float] = {}
    capture._dump_running(cell_of(engine, name), tmp_path, timings)
    assert log == [("http", *sleep_call), ("cuda", "checkpoint"), ("criu", "dump", True),
                   ("cuda", "restore", (4242,)), ("http", *wake_call)], log
    assert sleep.ASLEEP in timings and "engine_wake_s" in timings, timings  # the image says so


def test_cpu_workers_and_engines_without_a_sleep_mode_are_not_asked(engine: FakeEngine, log: list,
                                                                    fake_dump: None, tmp_path: Path) -> None:
    for cell in (cell_of(engine, "vllm", devices={}),          # no GPU: CRIU skips the untouched pool
                 cell_of(engine, "reference", launch={}),        # no device extras: no pool to free
                 cell_of(engine, "sglang", devices={"gpus": []})):
        timings: dict[str, float] = {}
        capture._dump_running(cell, tmp_path, timings)
        assert sleep.ASLEEP not in timings, timings
    assert [e for e in log if e[0] == "http"] == [], log
    # the reference engine with its device extras has one (scripts/gpu-check.sh's pool)
    ref = cell_of(engine, "reference", launch={"extra_args": ["--kv-pool-mb", "256"]})
    assert [c.path for c in sleep.calls_for(ref)] == ["/device/release", "/device/reserve"]


def test_a_failed_sleep_gives_the_capture_up_with_the_engine_awake(engine: FakeEngine, log: list,
                                                                   fake_dump: None, tmp_path: Path) -> None:
    engine.answers["/sleep"] = (400, {"error": "sleep mode is not enabled"})
    with pytest.raises(sleep.EngineSleepError, match="did not go to sleep: POST /sleep.level=1: HTTP 400: .*not enabled"):
        capture._dump_running(cell_of(engine), tmp_path, {})
    assert [e[:3] for e in log] == [("http", "POST", "/sleep?level=1"), ("http", "POST", "/wake_up")], log


def test_a_failed_dump_still_wakes_the_engine(engine: FakeEngine, log: list, fake_dump: None,
                                              monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def dump_fails(*_a, **_kw):
        raise RuntimeError("criu dump failed")

    monkeypatch.setattr(capture.criu, "dump", dump_fails)
    with pytest.raises(RuntimeError, match="criu dump failed"):
        capture._dump_running(cell_of(engine), tmp_path, {})
    assert log == [("http", "POST", "/sleep?level=1", None), ("cuda", "checkpoint"), ("cuda", "restore", (4242,)),
                   ("http", "POST", "/wake_up", None)], log


def test_a_copy_restored_from_an_image_taken_asleep_is_woken(engine: FakeEngine, log: list) -> None:
    cell = cell_of(engine, "sglang")
    assert sleep.wake_restored(cell, {"criu_dump_s": 1.0}) is None and log == []  # taken awake
    assert sleep.wake_restored(cell, {sleep.ASLEEP: 0.2}) is not None
    assert log == [("http", "POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})], log
    engine.answers["/resume_memory_occupation"] = (500, {"error": "out of memory"})
    with pytest.raises(sleep.EngineSleepError, match="restored asleep, did not wake: .*HTTP 500: .*out of memory"):
        sleep.wake_restored(cell, {sleep.ASLEEP: 0.2})


def test_a_server_not_listening_yet_is_retried_then_given_up(engine: FakeEngine) -> None:
    port = engine.port
    engine.close()  # nothing listens there now
    cell = Cell(id="c-gone", netns="none", ip="127.0.0.1", port=port, init_pid=os.getpid(), engine="vllm",
                devices=GPU)
    with pytest.raises(sleep.EngineSleepError, match=r"POST /wake_up: no answer in 0.3 s"):
        sleep.call(cell.endpoint, sleep.calls_for(cell)[1], timeout=0.3)


def test_gpu_launches_enable_the_calls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the sleep calls need at launch: vLLM's --enable-sleep-mode and its dev-mode routes
    on CUDA (never on its CPU build), SGLang's --enable-memory-saver (tests/test_sglang_gpu_args.py)."""
    from adapters.base import LaunchSpec, get_adapter

    spec = LaunchSpec(model_dir=tmp_path, served_model_name="m", env={"VLLM_TARGET_DEVICE": "cuda"})
    argv, env = get_adapter("vllm").command(spec)
    assert "--enable-sleep-mode" in argv and env["VLLM_SERVER_DEV_MODE"] == "1", (argv, env)
    argv, env = get_adapter("vllm").command(LaunchSpec(model_dir=tmp_path, served_model_name="m"))
    assert "--enable-sleep-mode" not in argv and "VLLM_SERVER_DEV_MODE" not in env, (argv, env)
