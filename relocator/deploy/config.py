"""`relocator deploy`'s configuration: a YAML file (configs/deploy.yaml), validated, with
RELOCATOR_* overrides, like the local cluster's (relocator/cluster/config.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from relocator.cluster.config import REPO, ControllerSection
from relocator.vocab import TransferMode

DEFAULT_CONFIG = REPO / "configs" / "deploy.yaml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error, not a default


class NodesSection(_Section):
    #: a node gets an agent when Ray lists this custom resource on it (`ray start --resources
    #: '{"relocator": 1}'`, or rayStartParams on KubeRay)
    resource: str = "relocator"
    #: how a node is named: its hostname (the raylet's), or its node IP
    names: Literal["hostname", "ip"] = "hostname"
    #: Ray's GPU counts on hosts without real GPUs are accepted only when set (emulation, CI)
    fake_gpus: bool = False


class DeployControllerSection(ControllerSection):
    #: hosts share no filesystem unless told: images stream between agents
    transfer: TransferMode = TransferMode.STREAM
    #: the node (hostname, IP or Ray node id) the controller and router run on; default: the head
    node: str | None = None


class DeployRouterSection(_Section):
    #: the address the router listens on; default: its node's IP
    host: str | None = None
    port: int = Field(0, ge=0, le=65535)
    control_port: int = Field(0, ge=0, le=65535)
    control_token: str | None = None
    #: keys clients must send to the OpenAI API (`Authorization: Bearer KEY`); with
    #: api_key_file's (one a line, read by `deploy`) and RELOCATOR_API_KEY's. A router beyond
    #: loopback needs one unless `insecure`
    api_keys: list[str] = Field(default_factory=list)
    api_key_file: str | None = None
    #: /metrics without a key (a scraper on a trusted network)
    metrics_public: bool = False


class DeployConfig(_Section):
    #: each host's own state (cells, images) and the controller's store, under a directory per
    #: deployment; on every host, never assumed to be shared
    base_dir: str = "/var/lib/relocator/deploy"
    nodes: NodesSection = NodesSection()
    controller: DeployControllerSection = DeployControllerSection()
    router: DeployRouterSection = DeployRouterSection()
    #: a deployment whose preflight fails on a host stops there unless this is set
    allow_failed_preflight: bool = False
    #: deploy anyway on a Ray cluster without token authentication, and serve the router beyond
    #: loopback without an API key (`--insecure`; relocator/deploy/security.py)
    insecure: bool = False

    @model_validator(mode="after")
    def _absolute(self) -> "DeployConfig":
        if not Path(self.base_dir).is_absolute():
            raise ValueError(f"base_dir must be an absolute path, not {self.base_dir!r}")
        return self

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "DeployConfig":
        """The file (default configs/deploy.yaml if present), then `overrides` ({section: {key:
        value}} or {key: value}); None values are ignored."""
        import yaml

        data: dict[str, Any] = {}
        p = Path(path) if path else DEFAULT_CONFIG
        if path or p.exists():
            data = yaml.safe_load(p.read_text()) or {}
        for key, value in overrides.items():
            if isinstance(value, dict):
                data.setdefault(key, {}).update({k: v for k, v in value.items() if v is not None})
            elif value is not None:
                data[key] = value
        return cls(**data)
