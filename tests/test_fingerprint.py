"""Compatibility rules between an image's fingerprint and a target's."""

from __future__ import annotations

from adapters.base import EngineFingerprint
from relocator.snapshot.fingerprint import Fingerprint, GpuInfo, HostFingerprint, compatibility, host_fingerprint


def _fp(**host_changes) -> Fingerprint:
    gpu = host_changes.pop("gpu", GpuInfo())
    engine_changes = host_changes.pop("engine", {})
    host = HostFingerprint(**{"arch": "x86_64", "cpu_model": "Xeon", "kernel": "6.18.0", "criu_version": "4.2.1",
                              "gpu": gpu, **host_changes})
    engine = EngineFingerprint(**{"engine": "vllm", "engine_version": "0.32.0", "model_id": "tiny",
                                  "weight_sha256": "aa", "dtype": "bfloat16", "max_model_len": 2048, **engine_changes})
    return Fingerprint(host=host, engine=engine)


def test_identical_is_compatible() -> None:
    assert compatibility(_fp(), _fp()) == []


def test_kernel_difference_is_allowed() -> None:
    assert compatibility(_fp(kernel="6.18.0"), _fp(kernel="6.19.2")) == []


def test_each_mismatch_names_field_expected_found() -> None:
    problems = compatibility(_fp(), _fp(cpu_model="EPYC", engine={"weight_sha256": "bb", "engine_version": "0.33.0"}))
    by_field = {p.field: p for p in problems}
    assert set(by_field) == {"host.cpu_model", "engine.weight_sha256", "engine.engine_version"}
    assert by_field["host.cpu_model"].expected == "Xeon" and by_field["host.cpu_model"].found == "EPYC"
    assert "image has 'aa', target has 'bb'" in str(by_field["engine.weight_sha256"])


def test_gpu_mismatch() -> None:
    image = _fp(gpu=GpuInfo(model="NVIDIA H100", count=8, driver_version="570.1", cuda_version="12.8"))
    target = _fp(gpu=GpuInfo(model="NVIDIA H100", count=4, driver_version="570.1", cuda_version="12.8"))
    assert [p.field for p in compatibility(image, target)] == ["host.gpu.count"]


def test_older_criu_on_target_is_refused_newer_is_fine() -> None:
    assert [p.field for p in compatibility(_fp(criu_version="4.2.1"), _fp(criu_version="4.1"))] == ["host.criu_version"]
    assert compatibility(_fp(criu_version="4.2.1"), _fp(criu_version="4.3")) == []


def test_host_fingerprint_reads_this_machine() -> None:
    fp = host_fingerprint()
    assert fp.arch and fp.cpu_model and fp.kernel
    assert fp.criu_version.startswith("4.")
