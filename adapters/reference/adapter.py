"""Reference engine adapter: launch command, readiness, metrics and fingerprint (the router's
side is codec.py)."""

from __future__ import annotations

import sys
from functools import lru_cache

from adapters.base import EngineAdapter, EngineCall, LaunchSpec
from adapters.reference import __version__


@lru_cache(maxsize=1)
def torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch")
    except PackageNotFoundError:
        return "unknown"


class Adapter(EngineAdapter):
    name = "reference"
    default_port = 8000
    process_markers = (b"adapters.reference.server",)
    requirements = (("torch", "torch"), ("tokenizers", "tokenizers"), ("aiohttp", "aiohttp"))

    def command(self, spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
        argv = [
            sys.executable, "-m", "adapters.reference.server",
            "--model", str(spec.model_dir),
            "--served-model-name", spec.served_model_name,
            "--host", spec.host,
            "--port", str(spec.port),
            "--max-model-len", str(spec.max_model_len),
        ]
        if spec.memory_fraction != LaunchSpec.memory_fraction:  # a GPU share's (relocator.shares)
            argv += ["--memory-fraction", str(spec.memory_fraction)]
        # cpu unless the spec asks otherwise (`extra_args`: --device cuda, or the environment)
        if "--device" not in spec.extra_args:
            argv += ["--device", spec.env.get("RELOCATOR_REFERENCE_DEVICE", "cpu")]
        env = {
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            **spec.env,
        }
        return argv + list(spec.extra_args), env

    def engine_version(self) -> str:
        return f"{__version__}+torch{torch_version()}"

    def sleep_calls(self, launch: dict) -> tuple[EngineCall, EngineCall] | None:
        # its device extras (--kv-pool-mb, adapters/reference/device.py): the pool tensor dropped
        # and torch's cache emptied, then reserved again; without them it holds no pool
        if "--kv-pool-mb" not in (launch.get("extra_args") or []):
            return None
        return EngineCall("POST", "/device/release"), EngineCall("POST", "/device/reserve")

    def compute_dtype(self, spec: LaunchSpec) -> str:
        return "float32"  # bf16 weights, computed in float32
