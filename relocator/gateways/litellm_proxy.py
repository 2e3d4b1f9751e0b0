"""One wrapper around the LiteLLM proxy process (tests, `relocator bench gateway`): write its
config, start it from .venv-gateway on loopback with nothing phoning home, wait for it, stop it.

Two configurations: `plugin_config` (models served through the relocator plugin) and
`plain_config` (LiteLLM's own OpenAI-compatible provider pointed at one endpoint: what users
have without the plugin)."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from relocator.gateways.childproc import ChildServer


#: the pinned release (requirements-gateway.lock), checked by tests against what is installed
LITELLM_VERSION = "1.108.5"

#: no network lookups, no telemetry, no DB, quiet: a proxy that only serves its config
QUIET_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_TELEMETRY": "False",
    "LITELLM_LOG": "ERROR",
    "LITELLM_MODE": "PRODUCTION",
    "DISABLE_SCHEMA_UPDATE": "True",
    "NO_DOCKER": "True",
}


def _root() -> Path:
    return Path(__file__).resolve().parents[2]


def gateway_python() -> Path:
    """The interpreter of .venv-gateway (scripts/install-gateway.sh)."""
    return Path(os.environ.get("RELOCATOR_GATEWAY_PYTHON",
                               _root() / ".venv-gateway" / "bin" / "python"))


def available() -> str | None:
    """None if the LiteLLM proxy can be started here, else why not."""
    py = gateway_python()
    if not py.exists():
        return f"{py} missing: run scripts/install-gateway.sh"
    return None


def plugin_config(models: list[str]) -> dict[str, Any]:
    return {"model_list": [{"model_name": m, "litellm_params": {"model": f"relocator/{m}"}}
                           for m in models],
            "litellm_settings": {
                "custom_provider_map": [{"provider": "relocator",
                                         "custom_handler": "relocator.gateways.litellm.handler"}],
                "num_retries": 0, "request_timeout": 600},
            # one LiteLLM deployment per model stands for all its workers: a failed request
            # (a hold that ran out, a worker that is gone) must not put the model in cooldown
            "router_settings": {"num_retries": 0, "disable_cooldowns": True}}


def plain_config(model: str, api_base: str) -> dict[str, Any]:
    """LiteLLM's hosted_vllm provider (vLLM's OpenAI server) at `api_base`."""
    return {"model_list": [{"model_name": model,
                            "litellm_params": {"model": f"hosted_vllm/{model}",
                                               "api_base": api_base + "/v1", "api_key": "x"}}],
            "litellm_settings": {"num_retries": 0, "request_timeout": 600},
            "router_settings": {"num_retries": 0}}


class LiteLLMProxy(ChildServer):
    """`with LiteLLMProxy(config, workdir, port) as p: p.url` - the proxy as a child process.
    `env` adds variables (e.g. RELOCATOR_GATEWAY_CONFIG for the plugin)."""

    name = "LiteLLM"
    poll_s = 0.3
    probe_timeout_s = 2.0
    stop_grace_s = 15.0

    def __init__(self, config: dict, workdir: Path, port: int,
                 env: dict[str, str] | None = None) -> None:
        self.config, self.workdir, self.port = config, Path(workdir), port
        self.env = env or {}
        #: the proxy's master key (LiteLLM refuses to start without one): clients' api_key
        self.key = "sk-" + secrets.token_hex(16)
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"litellm-{port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 180.0) -> "LiteLLMProxy":
        why = available()
        if why:
            raise RuntimeError(why)
        self.workdir.mkdir(parents=True, exist_ok=True)
        cfg = self.workdir / f"litellm-{self.port}.yaml"
        config = dict(self.config)
        config["general_settings"] = {**config.get("general_settings", {}), "master_key": self.key}
        cfg.write_text(yaml.safe_dump(config, sort_keys=False))
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("LITELLM_", "DATABASE_URL", "OPENAI_"))}
        env.update(QUIET_ENV)
        env.update(self.env)
        py = gateway_python()
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [str(py), "-m", "litellm.proxy.proxy_cli", "--config", str(cfg),
             "--host", "127.0.0.1", "--port", str(self.port), "--num_workers", "1"],
            cwd=self.workdir, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
        log.close()
        self._wait_ready(self.url + "/health/liveliness", timeout_s)
        return self


if __name__ == "__main__":  # pragma: no cover - manual use
    print(available() or f"ok: {gateway_python()}", file=sys.stderr)
