"""The warm images' configuration: configs/images.yaml, validated, with RELOCATOR_WARM__* overrides."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from relocator.choices import Choice

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "images.yaml"


class StoreRoot(Choice):
    """Where a node's warm images live."""

    AUTO = "auto"  # the tmpfs when it has room for the whole bound, else disk
    TMPFS = "tmpfs"
    DISK = "disk"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error, not a default


class StoreSection(_Section):
    root: StoreRoot = StoreRoot.AUTO
    tmpfs_dir: str = "/dev/shm/relocator/warm"
    disk_dir: str = "/var/lib/relocator/warm"
    max_gb: float = Field(4.0, gt=0)

    @property
    def max_bytes(self) -> int:
        return int(self.max_gb * (1 << 30))


class CaptureSection(_Section):
    enabled: bool = True


class YieldScope(Choice):
    """Which operations a copy ahead of need gives way to (it is cancelled and retried later)."""

    CLUSTER = "cluster"  # any relocation, suspend, resume or start anywhere (emulated hosts share CPUs)
    HOSTS = "hosts"  # one on a node of the copy's source's or target's host


class PrefetchSection(_Section):
    #: other nodes (other hosts first) that get a copy of every image ahead of need
    copies: int = Field(1, ge=0, le=15)
    #: a start that finds no image of its kind on its node copies one from a peer first
    on_demand: bool = True
    #: how often the controller looks for images held by too few nodes (seconds)
    interval_s: float = Field(10.0, gt=0)
    #: a copy ahead of need starts only after this long with no operation under way (moves come
    #: in bursts: one that starts right after a copy began would pay for it)
    quiet_s: float = Field(5.0, ge=0)
    #: which operations cancel a running copy ahead of need (and keep new ones from starting)
    yield_to: YieldScope = YieldScope.CLUSTER


class WarmConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RELOCATOR_WARM__", env_nested_delimiter="__", extra="ignore")

    #: the one switch: off, every start is cold and nothing is captured (RELOCATOR_WARM__ENABLED=0)
    enabled: bool = True
    store: StoreSection = StoreSection()
    capture: CaptureSection = CaptureSection()
    prefetch: PrefetchSection = PrefetchSection()

    @classmethod
    def load(cls, path: str | Path | None = None) -> "WarmConfig":
        """The file (default configs/images.yaml), then the environment over it."""
        import yaml

        p = Path(path) if path else DEFAULT_CONFIG
        data: dict[str, Any] = {}
        if path or p.exists():
            data = yaml.safe_load(p.read_text()) or {}
        env = cls()  # environment only
        if "enabled" in env.model_fields_set:
            data["enabled"] = env.enabled
        for section in ("store", "capture", "prefetch"):
            for key in getattr(env, section).model_fields_set:
                data.setdefault(section, {})[key] = getattr(getattr(env, section), key)
        return cls(**data)
