"""`relocator preflight`'s GPU section against a faked NVML (pynvml) and a fake cuda-checkpoint:
one line without a driver, else each check with its fix when it fails."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from relocator import preflight
from relocator.snapshot import criu


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_nvml(driver: str = "580.159.04", names: tuple[str, ...] = ("NVIDIA H200",) * 2,
              persistence: tuple[int, ...] = (1, 1), init_error: int | None = None) -> types.ModuleType:
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_ERROR_LIBRARY_NOT_FOUND, m.NVML_ERROR_DRIVER_NOT_LOADED, m.NVML_FEATURE_ENABLED = 12, 9, 1

    def init() -> None:
        if init_error is not None:
            raise NVMLError(init_error)

    m.nvmlInit, m.nvmlShutdown = init, lambda: None
    m.nvmlDeviceGetCount = lambda: len(names)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlSystemGetDriverVersion = lambda: driver.encode()  # older pynvml returns bytes
    m.nvmlDeviceGetName = lambda h: names[h]
    m.nvmlDeviceGetPersistenceMode = lambda h: persistence[h]
    return m


@pytest.fixture
def gpu_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A host with a driver: fake pynvml, a fake cuda-checkpoint printing `version`, CRIU 4.2.1,
    libcuda on the root filesystem."""
    def setup(version: str = "580.159.04", actions: bool = True, **nvml) -> dict[str, preflight.Check]:
        monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(**nvml))
        tool = tmp_path / "cuda-checkpoint"
        usage = "--action lock | checkpoint | restore | unlock --pid <pid>" if actions else "--toggle --pid <pid>"
        tool.write_text(f"#!/bin/sh\necho 'CUDA checkpoint and restore utility.'\necho 'Version {version}. "
                        f"Copyright (C) 2025 NVIDIA Corporation.'\necho '{usage}'\n")
        tool.chmod(0o755)
        monkeypatch.setenv("RELOCATOR_CUDA_CHECKPOINT", str(tool))
        monkeypatch.setattr(criu, "criu_binary", lambda: "/usr/local/sbin/criu")
        monkeypatch.setattr(criu, "criu_version", lambda binary=None: "4.2.1")
        monkeypatch.setattr(preflight, "_libcuda", lambda: Path("/usr/lib/x86_64-linux-gnu/libcuda.so.580.159.04"))
        return {c.name: c for c in preflight.gpu_checks()}
    return setup


@pytest.mark.parametrize("error", [12, 9])
def test_no_driver_is_one_line(monkeypatch: pytest.MonkeyPatch, error: int) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error=error))
    checks = preflight.gpu_checks()
    assert [(c.name, c.ok, c.detail) for c in checks] == [("gpu", True, "no NVIDIA driver: GPU checks skipped")]


def test_this_machine_without_a_driver_skips_the_section() -> None:
    from relocator.snapshot.fingerprint import gpu_info

    if gpu_info().count == 0:
        assert [c.detail for c in preflight.gpu_checks()] == ["no NVIDIA driver: GPU checks skipped"]


def test_a_driver_that_fails_otherwise_is_a_failure_with_its_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error=999))
    (check,) = preflight.gpu_checks()
    assert (check.name, check.ok, check.detail) == ("gpu driver", False, "NVML: NVML error 999") and check.fix


def test_a_good_gpu_host_passes_every_check(gpu_host) -> None:
    checks = gpu_host()
    assert all(c.ok for c in checks.values()), [c for c in checks.values() if not c.ok]
    assert checks["gpu driver"].detail == "NVIDIA 580.159.04, 2 GPU(s)"
    assert checks["gpu cuda-checkpoint matches the driver"].detail == "cuda-checkpoint 580.159.04, driver 580.159.04"
    assert checks["gpu models identical (device map)"].detail == "GPU 0,1: NVIDIA H200"
    assert set(checks) == {"gpu driver", "gpu driver restores onto other GPUs", "gpu cuda-checkpoint",
                           "gpu cuda-checkpoint matches the driver", "gpu persistence mode", "gpu criu >= 4.2",
                           "gpu driver libraries visible in cells", "gpu models identical (device map)"}


def test_persistence_mode_off_fails_with_nvidia_smi_pm_1(gpu_host) -> None:
    check = gpu_host(persistence=(1, 0))["gpu persistence mode"]
    assert (check.ok, check.warning, check.detail) == (False, False, "off on GPU 1")
    assert "nvidia-smi -pm 1" in check.fix


def test_cuda_checkpoint_of_another_driver_release_fails(gpu_host) -> None:
    check = gpu_host(version="570.86.10")["gpu cuda-checkpoint matches the driver"]
    assert (check.ok, check.warning) == (False, False) and "driver's release" in check.fix
    same_branch = gpu_host(version="580.95.05")["gpu cuda-checkpoint matches the driver"]
    assert (same_branch.ok, same_branch.warning) == (True, True)


def test_a_tool_without_action_and_an_old_driver_fail(gpu_host) -> None:
    checks = gpu_host(version="535.104.05", driver="535.104.05", actions=False)
    assert not checks["gpu cuda-checkpoint"].ok and "no --action" in checks["gpu cuda-checkpoint"].detail
    assert not checks["gpu driver"].ok and ">= 550" in checks["gpu driver"].fix
    assert not checks["gpu driver restores onto other GPUs"].ok and checks["gpu driver restores onto other GPUs"].warning


def test_missing_cuda_checkpoint_says_where_to_get_it(gpu_host, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gpu_host()
    monkeypatch.setenv("RELOCATOR_CUDA_CHECKPOINT", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    checks = {c.name: c for c in preflight.gpu_checks()}
    assert checks["gpu cuda-checkpoint"].detail == "not found"
    assert "NVIDIA/cuda-checkpoint" in checks["gpu cuda-checkpoint"].fix


def test_old_criu_fails(gpu_host, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu_host()
    monkeypatch.setattr(criu, "criu_version", lambda binary=None: "4.1")
    check = {c.name: c for c in preflight.gpu_checks()}["gpu criu >= 4.2"]
    assert (check.ok, check.detail) == (False, "criu 4.1") and "install-criu.sh" in check.fix


def test_mixed_gpu_models_are_a_warning(gpu_host) -> None:
    check = gpu_host(names=("NVIDIA H100", "NVIDIA A100", "NVIDIA H100"), persistence=(1, 1, 1))[
        "gpu models identical (device map)"]
    assert (check.ok, check.warning) == (False, True)
    assert check.detail == "GPU 0,2: NVIDIA H100; GPU 1: NVIDIA A100"


@pytest.mark.parametrize("lib, mounts, cell_mounts, ok, holder", [
    ("/usr/lib/x86_64-linux-gnu/libcuda.so.1", ["/", "/proc", "/dev"], [], True, "/"),
    ("/usr/local/nvidia/lib64/libcuda.so.1", ["/", "/usr/local/nvidia"], ["/usr/local/nvidia"], True, "/usr/local/nvidia"),
    ("/opt/drv/lib/libcuda.so.1", ["/", "/opt/drv"], [], False, "/opt/drv"),  # a cell binds / only
    ("/usr/lib64/libcuda.so.1", ["/", "/usr"], ["/usr/local/nvidia"], False, "/usr"),
])
def test_driver_libraries_must_be_on_a_mount_cells_bind(lib, mounts, cell_mounts, ok, holder) -> None:
    check = preflight.driver_libs_check(Path(lib), mounts, cell_mounts)
    assert check.ok is ok and f"on mount {holder}" in check.detail
    assert "names nvidia" in check.fix


def test_no_libcuda_fails() -> None:
    check = preflight.driver_libs_check(None, ["/"], [])
    assert not check.ok and "libcuda.so.1 not found" in check.detail


def test_the_cli_prints_the_gpu_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    from typer.testing import CliRunner

    from relocator.cli import _register, app

    _register()
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error=12))
    monkeypatch.setattr(preflight, "run_checks", lambda: preflight.gpu_checks())
    out = CliRunner().invoke(app, ["preflight", "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.output)["checks"] == [
        {"name": "gpu", "ok": True, "detail": "no NVIDIA driver: GPU checks skipped", "fix": "", "warning": False}]
