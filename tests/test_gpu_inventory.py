"""Real GPUs in the inventory: `local_gpus` through a faked pynvml module."""

from __future__ import annotations

import sys
import types

import pytest

from relocator.controller.inventory import GpuFact, NodeInfo, local_gpus


class NVMLError(Exception):
    pass


def fake_pynvml(gpus: list[tuple[str, str, int]], *, init_error: bool = False, fail_at: int | None = None):
    mod = types.ModuleType("pynvml")
    mod.NVMLError = NVMLError
    calls: list[str] = []

    def init():
        calls.append("init")
        if init_error:
            raise NVMLError("NVML Shared Library Not Found")

    def handle(i):
        if fail_at == i:
            raise NVMLError("GPU is lost")
        return i

    mod.nvmlInit = init
    mod.nvmlShutdown = lambda: calls.append("shutdown")
    mod.nvmlDeviceGetCount = lambda: len(gpus)
    mod.nvmlDeviceGetHandleByIndex = handle
    mod.nvmlDeviceGetUUID = lambda h: gpus[h][0]
    mod.nvmlDeviceGetName = lambda h: gpus[h][1].encode()  # older bindings return bytes
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=gpus[h][2], free=0, used=0)
    mod.calls = calls
    return mod


H200 = 143771 * (1 << 20)


def test_reports_index_uuid_model_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = fake_pynvml([("GPU-aaaa", "NVIDIA H200", H200), ("GPU-bbbb", "NVIDIA H200", H200)])
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    assert local_gpus() == [GpuFact(0, "GPU-aaaa", "NVIDIA H200", 143771), GpuFact(1, "GPU-bbbb", "NVIDIA H200", 143771)]
    assert mod.calls == ["init", "shutdown"]


def test_no_driver_means_fake_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([], init_error=True))
    assert local_gpus() == []


def test_nvml_error_while_listing_reports_none_and_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    mod = fake_pynvml([("GPU-a", "NVIDIA H200", H200), ("GPU-b", "NVIDIA H200", H200)], fail_at=1)
    monkeypatch.setitem(sys.modules, "pynvml", mod)
    assert local_gpus() == []
    assert mod.calls[-1] == "shutdown"


def test_no_pynvml_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert local_gpus() == []


def test_node_info_lists_gpus_only_when_real() -> None:
    fake = NodeInfo("n1", "ray1", 4, 4)
    assert "gpus" not in fake.to_dict() and fake.gpus == []
    real = NodeInfo("n2", "ray2", 1, 1, gpus=[GpuFact(0, "GPU-a", "NVIDIA H200", 143771)])
    assert real.to_dict()["gpus"] == [{"index": 0, "uuid": "GPU-a", "model": "NVIDIA H200", "memory_mib": 143771}]


def test_agent_reports_its_gpus_as_the_controller_reads_them(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """What an agent answers (`NodeAgent.gpus`) is what the controller keeps with the node and
    turns back into the node's GpuFacts."""
    from relocator.agent.agent import NodeAgent

    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([("GPU-aaaa", "NVIDIA H200", H200)]))
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path / "keep"))  # the agent sets it for its process
    agent = NodeAgent("n1", str(tmp_path / "state"), str(tmp_path / "images"))
    report = agent.gpus()
    assert report == [{"index": 0, "uuid": "GPU-aaaa", "model": "NVIDIA H200", "memory_mib": 143771}]
    node = NodeInfo("n1", "ray-1", 1, 1, gpus=[GpuFact(**g) for g in report])
    assert node.to_dict()["gpus"] == report
