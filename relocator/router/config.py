"""Router configuration: YAML file and/or RELOCATOR_ROUTER_* environment variables
(environment wins), validated by pydantic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from adapters.base import DEFAULT_ENGINE, engine_names
from relocator.choices import registry_choice

from . import auth
from .policies import RouterPolicy

#: the engines a replica can run (adapters' registry), and "none": streams not continued
RouterEngine = registry_choice("RouterEngine", [*engine_names(), "none"], __name__)


class BackendConfig(BaseModel):
    model: str
    url: str
    worker_id: str | None = None
    #: the model's tokenizer (its directory, holding tokenizer.json, or the file): the router
    #: makes the text of continued streams from token ids with it; unset = engine's text
    tokenizer: str | None = None
    #: the replica's engine; unset = the router's `engine`
    engine: RouterEngine | None = None

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"backend url must start with http:// or https://: {v!r}")
        return v.rstrip("/")


class RouterSettings(BaseSettings):
    """Every field can be overridden as RELOCATOR_ROUTER_<FIELD> (nested: `__`)."""

    model_config = SettingsConfigDict(env_prefix="RELOCATOR_ROUTER_", env_nested_delimiter="__",
                                      extra="forbid")

    #: the OpenAI API's listen address: loopback unless told (beyond it, with api keys or
    #: `insecure`)
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    #: keys a client must send (`Authorization: Bearer <key>`) on /v1/* (and /metrics unless
    #: metrics_public); with api_key_file's and RELOCATOR_API_KEY's; none = no authentication
    api_keys: list[str] = Field(default_factory=list)
    #: a file of further keys, one a line
    api_key_file: Path | None = None
    #: /metrics without a key even when keys are set (a scraper on a trusted network)
    metrics_public: bool = False
    #: serve the OpenAI API beyond loopback with no key (anyone who reaches it may use it)
    insecure: bool = False
    control_host: str = "127.0.0.1"
    control_port: int = Field(8001, ge=0, le=65535)
    #: bearer token for the control API; unset = control API bound to loopback only
    control_token: str | None = None
    policy: RouterPolicy = RouterPolicy.LEAST_IN_FLIGHT
    policy_args: dict[str, Any] = Field(default_factory=dict)
    #: the engine of replicas that name none (their streams' continuation codec)
    engine: RouterEngine = RouterEngine(DEFAULT_ENGINE)
    backends: list[BackendConfig] = Field(default_factory=list)
    hold_queue_max: int = Field(1024, ge=0)
    hold_timeout_s: float = Field(60.0, gt=0)
    prefer_sibling_when_held: bool = True
    max_body_bytes: int = Field(4 << 20, gt=0)
    retries: int = Field(2, ge=0)
    max_continuations: int = Field(8, ge=0)
    continuation: bool = True
    connect_timeout_s: float = Field(5.0, gt=0)
    #: an upstream connection whose peer stops acknowledging for this long is dropped
    #: (TCP keepalive + TCP_USER_TIMEOUT): a worker whose node vanished sends no FIN, and its
    #: streams would otherwise hang; they break, and are continued where the worker went
    upstream_dead_peer_s: float = Field(15.0, gt=0)
    #: a worker that cannot be reached, with no other active replica of its model, is held by
    #: the router itself for up to this long (its requests and streams wait as for a
    #: relocation) so the control plane can replace it; ended early by a switch/release or a
    #: healthy GET /health; 0 = off (such requests fail at once)
    unreachable_hold_s: float = Field(30.0, ge=0)
    #: per upstream connection pool limit (0 = unlimited)
    pool_limit: int = Field(0, ge=0)
    #: routing table persisted here (atomically, after every control-API change) and loaded
    #: at start, so a restarted router serves at once; unset = not persisted
    state_file: Path | None = None
    #: serve the OpenAI API on this inherited, already listening socket instead of binding
    #: host:port (a supervisor owns the socket, so connections wait in its backlog while the
    #: router restarts); RELOCATOR_ROUTER_LISTEN_FD or `--fd`
    listen_fd: int | None = Field(None, ge=0)
    #: run under a supervisor (the cluster daemon): on SIGTERM stop accepting, signal the
    #: parent (SIGUSR1) to start a replacement, finish the requests in flight, then exit
    supervised: bool = False
    #: longest a SIGTERMed supervised router keeps serving what it has
    drain_timeout_s: float = Field(120.0, gt=0)
    #: while draining, a keep-alive connection idle this long is closed (busy ones are
    #: answered with `Connection: close`)
    drain_idle_close_s: float = Field(2.0, ge=0)
    #: every accepted key (api_keys, api_key_file, RELOCATOR_API_KEY), read once at load
    _keys: tuple[bytes, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _loopback(self) -> "RouterSettings":
        if not self.control_token and self.control_host not in ("127.0.0.1", "::1", "localhost"):
            raise ValueError("the control API without control_token may only listen on loopback "
                             f"(control_host={self.control_host!r})")
        keys = [*self.api_keys, *auth.env_keys()]
        if self.api_key_file is not None:
            try:
                keys += auth.read_key_file(self.api_key_file)
            except OSError as e:
                raise ValueError(f"api_key_file: {e}") from None
        if any(not k.strip() or any(c.isspace() for c in k) for k in keys):
            raise ValueError("an API key may not be empty or hold whitespace")
        self._keys = tuple(dict.fromkeys(k.encode() for k in keys))
        if not self._keys and not self.insecure and not auth.is_loopback(self.host):
            raise ValueError(f"the OpenAI API beyond loopback (host={self.host!r}) needs an API "
                             "key (api_keys, api_key_file or RELOCATOR_API_KEY) or insecure: true")
        return self

    @property
    def keys(self) -> tuple[bytes, ...]:
        """The accepted API keys (empty: no authentication)."""
        return self._keys

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings],
                                   init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource,
                                   dotenv_settings: PydanticBaseSettingsSource,
                                   file_secret_settings: PydanticBaseSettingsSource):
        # environment overrides the file (passed as init kwargs)
        return env_settings, init_settings, dotenv_settings, file_secret_settings

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "RouterSettings":
        data: dict[str, Any] = {}
        if path is not None:
            import yaml

            raw = yaml.safe_load(Path(path).read_text()) or {}
            data = raw.get("router", raw) if isinstance(raw, dict) else {}
        data.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**data)


def parse_backend(spec: str) -> BackendConfig:
    """`model=url` or `worker@model=url`."""
    if "=" not in spec:
        raise ValueError(f"backend must be MODEL=URL or WORKER@MODEL=URL: {spec!r}")
    left, url = spec.split("=", 1)
    worker, _, model = left.rpartition("@")
    return BackendConfig(model=model, url=url, worker_id=worker or None)
