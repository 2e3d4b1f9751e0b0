"""SGLang adapter: launch command, readiness, metrics and fingerprint, and the native
`/generate` body that continues a request from token ids.

SGLang runs from its own virtual environment (.venv-sglang, scripts/install-sglang.sh: its
pins conflict with vLLM's), so nothing here imports sglang: the server is started with that
environment's interpreter, and the version is read from its installed metadata.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

from adapters.base import EngineAdapter, EngineCall, LaunchSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = Path(__file__).resolve().parent / "stub_sgl_kernel"
DEVICES = ("cpu", "cuda")
#: what a GPU share's static memory must hold beyond the weights, at the least: this many full
#: contexts of KV cache (a pool for fewer cannot serve one request of max_model_len)
MIN_POOL_CONTEXTS = 1

#: sampling_params of SGLang's native /generate that carry over to a continuation unchanged
CARRY_SAMPLING = (
    "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "stop_regex", "ignore_eos",
    "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "logit_bias",
    "sampling_seed", "json_schema", "regex", "ebnf", "n",
)


def sglang_venv() -> Path:
    return Path(os.environ.get("RELOCATOR_SGLANG_VENV", REPO_ROOT / ".venv-sglang"))


def sglang_python() -> str:
    """The interpreter that runs the SGLang server (.venv-sglang's)."""
    return str(sglang_venv() / "bin" / "python")


def installed() -> bool:
    return os.access(sglang_python(), os.X_OK)


@lru_cache(maxsize=1)
def sglang_version() -> str:
    """sglang's version in .venv-sglang, from its dist-info folder name (no import)."""
    for d in sorted(sglang_venv().glob("lib/python*/site-packages/sglang-*.dist-info")):
        m = re.match(r"sglang-(.+)\.dist-info$", d.name)
        if m:
            return m.group(1)
    return "unknown"


def cuda_install() -> bool:
    """.venv-sglang holds SGLang's CUDA build (scripts/install-sglang.sh cuda stamps it so)."""
    try:
        return (sglang_venv() / ".relocator-deps").read_text().startswith("cuda-")
    except OSError:
        return False


def device_of(spec: LaunchSpec) -> str:
    """The device SGLang runs on for `spec`: RELOCATOR_SGLANG_DEVICE (the spec's env, then the
    process's), else cuda where .venv-sglang is the CUDA build, else cpu."""
    device = spec.env.get("RELOCATOR_SGLANG_DEVICE") or os.environ.get("RELOCATOR_SGLANG_DEVICE")
    if device is None:
        return "cuda" if cuda_install() else "cpu"
    if device not in DEVICES:
        raise ValueError(f"RELOCATOR_SGLANG_DEVICE must be cpu or cuda, not {device!r}")
    return device


def is_share(spec: LaunchSpec) -> bool:
    """A GPU share's spec: its memory fraction is the controller's share of the default
    (relocator.shares.engine_memory); whole-GPU workers keep LaunchSpec's default."""
    return spec.memory_fraction != LaunchSpec.memory_fraction


def weights_bytes(model_dir: Path) -> int:
    return sum(p.stat().st_size for pattern in ("*.safetensors", "*.bin") for p in Path(model_dir).glob(pattern))


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """K and V of every layer for one token, from the model's config.json (0: unknown)."""
    import json

    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        layers = int(cfg["num_hidden_layers"])
    except (OSError, ValueError, KeyError, ZeroDivisionError):
        return 0
    width = 4 if dtype in ("float32", "float") else 2
    return 2 * layers * kv_heads * head_dim * width


def gpu_memory_bytes() -> int | None:
    """The smallest GPU's memory on this host (NVML), or None without a driver."""
    from relocator.gpus import local_gpus

    gpus = local_gpus()
    return min(g.memory_mib for g in gpus) << 20 if gpus else None


def mem_fraction_static(spec: LaunchSpec, gpu_bytes: int | None) -> float:
    """SGLang's --mem-fraction-static for a GPU share: the share's memory fraction, the number
    vLLM gets as --gpu-memory-utilization (both are the engine's static share of the GPU:
    weights plus KV pool). ValueError, with the figures, for a share that cannot work: outside
    (0, 1), or (with the GPU's size known) too small for the weights and one full context."""
    f = float(spec.memory_fraction)
    if not 0 < f < 1:
        raise ValueError(f"a GPU share's SGLang memory fraction must be in (0, 1), not {f}")
    if gpu_bytes:
        weights = weights_bytes(spec.model_dir)
        pool = MIN_POOL_CONTEXTS * spec.max_model_len * kv_bytes_per_token(spec.model_dir, spec.dtype)
        if f * gpu_bytes < weights + pool:
            raise ValueError(
                f"this GPU share cannot hold the model: SGLang's mem_fraction_static {f:g} of a "
                f"{gpu_bytes / 2**30:.1f} GiB GPU is {f * gpu_bytes / 2**20:.0f} MiB, less than its "
                f"{weights / 2**20:.0f} MiB of weights plus {pool / 2**20:.0f} MiB of KV cache for one "
                f"{spec.max_model_len}-token context; take a bigger share")
    return round(f, 4)


class Adapter(EngineAdapter):
    name = "sglang"
    default_port = 30000
    # the launcher's command line and the venv path of every child (sglang::scheduler,
    # sglang::detokenizer set their titles; multiprocessing's resource tracker runs from the venv)
    process_markers = (b"sglang",)
    # what preflight can check from relocator's own environment: the server's interpreter
    requirements = ()

    def missing(self) -> str | None:
        return None if installed() else f"no SGLang environment at {sglang_venv()}"

    def command(self, spec: LaunchSpec) -> tuple[list[str], dict[str, str]]:
        device = device_of(spec)
        argv = [
            sglang_python(), "-m", "adapters.sglang.launcher",
            "--model-path", str(spec.model_dir),
            "--served-model-name", spec.served_model_name,
            "--host", spec.host,
            "--port", str(spec.port),
            "--device", device,
            "--dtype", spec.dtype,
            "--context-length", str(spec.max_model_len),
            "--tp-size", str(spec.tensor_parallel_size),
            "--enable-metrics",
            # cached_tokens in usage (the continuation's prefix served from the radix cache)
            "--enable-cache-report",
        ]
        if "--max-total-tokens" not in spec.extra_args:
            # The KV pool in tokens. Left to SGLang, the CPU path sizes it from free host memory
            # (mem_fraction_static of ~16 GB here): gigabytes of pool in every image. A few full
            # contexts are enough for a relocatable worker; extra_args overrides.
            argv += ["--max-total-tokens", str(max(8 * spec.max_model_len, 16384))]
        if device == "cuda":
            # torch_memory_saver's pools: release_memory_occupation frees the KV pool before a
            # warm capture's cuda-checkpoint (relocator/warm/sleep.py)
            argv.append("--enable-memory-saver")
            if is_share(spec) and "--mem-fraction-static" not in spec.extra_args:
                argv += ["--mem-fraction-static", str(mem_fraction_static(spec, gpu_memory_bytes()))]
        # On cpu a share keeps SGLang's own fraction: its CPU profile reserves (1 - fraction) of
        # the host's free memory, so a share's small fraction leaves no pool ("Not enough
        # memory"); the pool there is --max-total-tokens (docs/shares.md).
        env = {
            # the launcher (adapters/...) and, on cpu, the stand-in sgl_kernel; replaces the
            # cell's PYTHONPATH (the repository root), which it includes
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(STUB_DIR)] if device == "cpu" else [str(REPO_ROOT)]),
            "RELOCATOR_SGLANG_DEVICE": device,  # the launcher's choice of stand-ins
            "UV_USE_IO_URING": "0",
            "USE_LIBUV": "0",  # torch.distributed's TCPStore: libuv opens io_uring (launcher.py)
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "DO_NOT_TRACK": "1",
            **spec.env,
        }
        if device == "cpu":
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # else model loading imports vLLM's CUDA ops
        if spec.cache_dir:
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(spec.cache_dir) / "torchinductor"))
        argv += spec.extra_args
        return argv, env

    def engine_version(self) -> str:
        return sglang_version()

    def sleep_calls(self, launch: dict) -> tuple[EngineCall, EngineCall] | None:
        # the KV pool only (torch_memory_saver's "kv_cache" region, --enable-memory-saver): the
        # weights stay on the GPU and go through cuda-checkpoint with it
        tags = {"tags": ["kv_cache"]}
        return (EngineCall("POST", "/release_memory_occupation", tags),
                EngineCall("POST", "/resume_memory_occupation", tags))

    def continuation_request(self, body: dict[str, Any], prompt_ids: list[int],
                             sent_ids: list[int]) -> dict[str, Any]:
        """A native `/generate` body that continues `body` (a /generate body) after `sent_ids`:
        input_ids = prompt + sent, max_new_tokens and min_new_tokens reduced by what was sent.
        Greedy output is then token-identical to the uninterrupted run (docs/sglang.md)."""
        sp = dict(body.get("sampling_params") or {})
        if int(sp.get("n", 1) or 1) != 1:
            raise ValueError("a request with n > 1 cannot be continued")
        out_sp = {k: sp[k] for k in CARRY_SAMPLING if k in sp}
        n = len(sent_ids)
        if sp.get("max_new_tokens") is not None:
            out_sp["max_new_tokens"] = max(int(sp["max_new_tokens"]) - n, 1)
        if sp.get("min_new_tokens"):
            out_sp["min_new_tokens"] = max(int(sp["min_new_tokens"]) - n, 0)
        out: dict[str, Any] = {
            "input_ids": list(prompt_ids) + list(sent_ids),
            "sampling_params": out_sp,
            "stream": bool(body.get("stream", False)),
        }
        for key in ("return_logprob", "logprob_start_len", "top_logprobs_num", "rid"):
            if key in body:
                out[key] = body[key]
        if "logprob_start_len" not in out and out.get("return_logprob"):
            out["logprob_start_len"] = len(out["input_ids"])  # no logprobs for the prefix
        return out
