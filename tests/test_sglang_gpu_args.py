"""SGLang's launch argv on a GPU (no SGLang, no GPU needed): the device it picks, a GPU share's
--mem-fraction-static (issue 31) and the refusal of a share that cannot hold the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.base import LaunchSpec
from adapters.sglang import adapter as sg
from relocator import shares

GiB = 1 << 30


@pytest.fixture
def venv(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in .venv-sglang (only its stamp is read), no device override, a 141 GiB GPU."""
    v = tmp_path / "venv-sglang"
    v.mkdir()
    monkeypatch.setenv("RELOCATOR_SGLANG_VENV", str(v))
    monkeypatch.delenv("RELOCATOR_SGLANG_DEVICE", raising=False)
    monkeypatch.setattr(sg, "gpu_memory_bytes", lambda: 141 * GiB)
    return v


def model(tmp_path: Path, weights: int, layers: int = 2) -> Path:
    d = tmp_path / "model"
    d.mkdir(exist_ok=True)
    (d / "model.safetensors").write_bytes(b"\0" * weights)
    (d / "config.json").write_text(json.dumps({
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 64, "num_hidden_layers": layers}))
    return d


def share_spec(model_dir: Path, gpus: float) -> LaunchSpec:
    """The spec a worker of `gpus` gets from the controller (controller.model.engine_extra)."""
    spec = LaunchSpec(model_dir=model_dir, served_model_name="m", port=9000)
    memory = shares.engine_memory(gpus, LaunchSpec.memory_fraction)
    if memory is not None:
        spec.memory_fraction = memory
    return spec


def arg(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_cpu_venv_launches_on_cpu_with_the_stand_ins(venv: Path, tmp_path: Path) -> None:
    (venv / ".relocator-deps").write_text("0123456789abcdef\n")
    argv, env = sg.Adapter().command(share_spec(model(tmp_path, 1000), 0.25))
    assert arg(argv, "--device") == "cpu", argv
    # a share on cpu keeps SGLang's own fraction (its CPU pool is --max-total-tokens)
    assert "--mem-fraction-static" not in argv and "--enable-memory-saver" not in argv, argv
    assert env["SGLANG_USE_CPU_ENGINE"] == "1" and env["RELOCATOR_SGLANG_DEVICE"] == "cpu", env
    assert env["PYTHONPATH"].endswith("stub_sgl_kernel"), env["PYTHONPATH"]


def test_cuda_venv_share_gets_its_mem_fraction_static(venv: Path, tmp_path: Path) -> None:
    (venv / ".relocator-deps").write_text("cuda-0123456789abcdef\n")
    m = model(tmp_path, 1000)
    argv, env = sg.Adapter().command(share_spec(m, 0.25))
    assert arg(argv, "--device") == "cuda", argv
    # the number vLLM gets as --gpu-memory-utilization for the same share
    assert arg(argv, "--mem-fraction-static") == "0.025", argv
    assert "--enable-memory-saver" in argv, argv  # release_memory_occupation before a capture
    assert "SGLANG_USE_CPU_ENGINE" not in env and env["RELOCATOR_SGLANG_DEVICE"] == "cuda", env
    assert "stub_sgl_kernel" not in env["PYTHONPATH"], env["PYTHONPATH"]
    # whole GPUs: SGLang's own fraction, as before
    argv, _ = sg.Adapter().command(share_spec(m, 1))
    assert "--mem-fraction-static" not in argv, argv
    # a fraction given by hand wins
    spec = share_spec(m, 0.5)
    spec.extra_args = ["--mem-fraction-static", "0.3"]
    argv, _ = sg.Adapter().command(spec)
    assert argv.count("--mem-fraction-static") == 1 and arg(argv, "--mem-fraction-static") == "0.3", argv


def test_device_override_and_its_bad_value(venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = share_spec(model(tmp_path, 1000), 0.5)
    spec.env = {"RELOCATOR_SGLANG_DEVICE": "cuda"}
    argv, _ = sg.Adapter().command(spec)
    assert arg(argv, "--device") == "cuda" and arg(argv, "--mem-fraction-static") == "0.05", argv
    monkeypatch.setenv("RELOCATOR_SGLANG_DEVICE", "tpu")
    with pytest.raises(ValueError, match="must be cpu or cuda, not 'tpu'"):
        sg.Adapter().command(share_spec(model(tmp_path, 1000), 0.5))


def test_a_share_too_small_for_the_model_is_refused_with_its_figures(venv: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    (venv / ".relocator-deps").write_text("cuda-0123456789abcdef\n")
    monkeypatch.setattr(sg, "gpu_memory_bytes", lambda: 1 * GiB)  # 0.01 share: 0.001 of 1 GiB = 1 MiB
    big = model(tmp_path, 2 << 20)  # 2 MiB of weights
    with pytest.raises(ValueError, match=r"cannot hold the model: SGLang's mem_fraction_static 0.001 of a "
                                         r"1.0 GiB GPU is 1 MiB, less than its 2 MiB of weights"):
        sg.Adapter().command(share_spec(big, 0.01))
    # the same share of a bigger GPU fits
    monkeypatch.setattr(sg, "gpu_memory_bytes", lambda: 80 * GiB)
    argv, _ = sg.Adapter().command(share_spec(big, 0.01))
    assert arg(argv, "--mem-fraction-static") == "0.001", argv


def test_kv_cache_counts_in_what_a_share_must_hold(tmp_path: Path) -> None:
    m = model(tmp_path, 0, layers=2)
    # K and V x 2 layers x 2 KV heads x 16 dims x 2 bytes (bfloat16)
    assert sg.kv_bytes_per_token(m, "bfloat16") == 2 * 2 * 2 * 16 * 2
    spec = LaunchSpec(model_dir=m, served_model_name="m", memory_fraction=0.5, max_model_len=2048)
    need = 2048 * sg.kv_bytes_per_token(m, "bfloat16")  # 512 KiB
    with pytest.raises(ValueError, match="KV cache for one 2048-token context"):
        sg.mem_fraction_static(spec, need)  # half of it: too small
    assert sg.mem_fraction_static(spec, 4 * need) == 0.5
    for bad in (0.0, 1.0, -0.1):
        spec.memory_fraction = bad
        with pytest.raises(ValueError, match=r"must be in \(0, 1\)"):
            sg.mem_fraction_static(spec, None)
