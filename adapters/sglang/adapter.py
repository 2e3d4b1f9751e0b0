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

from adapters.base import EngineAdapter, LaunchSpec

REPO_ROOT = Path(__file__).resolve().parents[2]
STUB_DIR = Path(__file__).resolve().parent / "stub_sgl_kernel"

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
        argv = [
            sglang_python(), "-m", "adapters.sglang.launcher",
            "--model-path", str(spec.model_dir),
            "--served-model-name", spec.served_model_name,
            "--host", spec.host,
            "--port", str(spec.port),
            "--device", "cpu",
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
        env = {
            # the launcher (adapters/...) and the stand-in sgl_kernel; replaces the cell's
            # PYTHONPATH (the repository root), which it includes
            "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), str(STUB_DIR)]),
            "SGLANG_USE_CPU_ENGINE": "1",  # else model loading imports vLLM's CUDA ops
            "UV_USE_IO_URING": "0",
            "USE_LIBUV": "0",  # torch.distributed's TCPStore: libuv opens io_uring (launcher.py)
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1",
            "DO_NOT_TRACK": "1",
            **spec.env,
        }
        if spec.cache_dir:
            env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(spec.cache_dir) / "torchinductor"))
        argv += spec.extra_args
        return argv, env

    def engine_version(self) -> str:
        return sglang_version()

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
