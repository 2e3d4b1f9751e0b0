"""The controller's configuration: a pydantic model of the dict its callers pass (the cluster's
`controller:` section plus where the router is, node names and credentials)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from relocator.controller.model import TransferMode
from relocator.vocab import PreemptionRule
from relocator.controller.scheduling import DEFAULT_MAX_MOVES
from relocator.planner.policies import PlacementPolicy


class ControllerConfig(BaseModel):
    # extra keys (e.g. a section's new field) are kept: the backend reads them by name
    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)

    base_dir: Path
    router_url: str | None = None
    router_control_url: str | None = None
    router_token: str | None = None
    node_names: dict[str, str] | None = None  # Ray node id -> name (deploy)
    credentials: dict[str, Any] | None = None  # per node (relocator.credentials)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None
    transfer: TransferMode = TransferMode.SHARED
    policy: PlacementPolicy = PlacementPolicy.BEST_FIT
    reconcile_interval_s: float = Field(2.0, gt=0)
    keep_images: bool = False
    keep_last_image: bool = True
    make_room_max_moves: int = Field(DEFAULT_MAX_MOVES, ge=0)
    preemption: PreemptionRule = PreemptionRule.MOVES  # what a demand that does not fit does (preemption.py)
    consolidate: Any = None  # periodic.PeriodicConsolidation validates it
    transient_images: Any = None  # backend validates it (TransientImages)
    handoff_window_s: float = Field(30.0, ge=0)  # docs/handoff.md

    @classmethod
    def of(cls, config: "ControllerConfig | dict[str, Any]") -> "ControllerConfig":
        return config if isinstance(config, cls) else cls.model_validate(dict(config))

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style reading, for collaborators that took the old dict (backend)."""
        value = getattr(self, key, None)
        if value is None:
            value = (self.model_extra or {}).get(key)
        return default if value is None else value

    def credentials_of(self, node: str) -> Any:
        return (self.credentials or {}).get(node)
