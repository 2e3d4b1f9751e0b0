"""The local cluster's configuration: configs/local.yaml, validated, with RELOCATOR_* overrides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from relocator.agent.transient import TransientImages
from relocator.vocab import PreemptionRule, TransferMode
from relocator.planner.policies import PlacementPolicy

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIG = REPO / "configs" / "local.yaml"


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")  # a misspelled key is an error, not a default


class ClusterSection(_Section):
    nodes: int = Field(3, ge=1, le=16)
    gpus_per_node: int = Field(4, ge=0, le=64)
    cpus_per_node: int = Field(1, ge=0, le=64)
    object_store_mb: int = Field(512, ge=78)
    base_dir: str = "/var/lib/relocator/cluster"
    # how fast Ray declares a node dead (Ray's defaults: 3 s x 5 failures); a lost node's
    # workers are replaced only then
    health_check_period_ms: int = Field(1000, ge=100)
    health_check_failure_threshold: int = Field(3, ge=1)
    # 0: every node a raylet on this machine's loopback (one filesystem); N: N emulated hosts,
    # each a raylet in its own network and mount namespaces, with relocator deployed on them
    # (relocator/cluster/emulate.py, docs/deploy.md)
    emulate_hosts: int = Field(0, ge=0, le=15)


class RouterSection(_Section):
    port: int = Field(0, ge=0, le=65535)
    control_port: int = Field(0, ge=0, le=65535)
    control_token: str | None = None
    # the router runs in a session of its own whose scheduler autogroup gets this nice (None: it
    # shares the daemon's session with Ray's processes): with autogroups on, the kernel shares the
    # CPU between sessions first, and on a small host the router, the data path, competed inside
    # one group with every Ray process of the control plane (issue 29's handoff gaps)
    session_nice: int | None = Field(-5, ge=-20, le=19)


class ConsolidateSection(_Section):
    """Periodic consolidation in the reconcile loop (off by default): pack running workers onto
    fewer nodes when a plan frees at least `min_gain_nodes` nodes, at most `max_moves_per_hour`
    live moves in any hour."""

    enabled: bool = False
    min_gain_nodes: int = Field(1, ge=1, le=64)
    max_moves_per_hour: int = Field(6, ge=1, le=3600)


class ControllerSection(_Section):
    transfer: TransferMode = TransferMode.SHARED
    policy: PlacementPolicy = PlacementPolicy.BEST_FIT  # planner policy for launch, drain, replacement
    reconcile_interval_s: float = Field(2.0, gt=0)
    keep_images: bool = False
    # keep each worker's newest image (shared storage only) so a lost worker restarts warm
    keep_last_image: bool = True
    # live moves a launch (or resume) may plan to make room; 0: a stock scheduler (place or wait)
    make_room_max_moves: int = Field(4, ge=0, le=64)
    # what a launch (or resume) that does not fit does (docs/scheduling.md, preemption rules):
    # moves (live moves, else suspend lower priorities to storage) | place-or-wait (queue only)
    # | evict-requeue (kill lower priorities, cold-start them later) | suspend-in-place (stop them
    # where they are; they continue there when their GPUs are free again)
    preemption: PreemptionRule = PreemptionRule.MOVES
    consolidate: ConsolidateSection = ConsolidateSection()
    # where a stream/postcopy target keeps its image until the restore (relocator.agent.transient):
    # auto = a tmpfs with room for it (/dev/shm/relocator/...), else disk; tmpfs = always (a move
    # is refused at PLAN without one); disk = the node's image directory
    transient_images: TransientImages = TransientImages.AUTO
    # transfer: handoff: how long streams that cannot be continued exactly may finish on the
    # source after the switch (docs/handoff.md)
    handoff_window_s: float = Field(30.0, ge=0, le=3600)


class LocalConfig(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RELOCATOR_", env_nested_delimiter="__", extra="ignore",
                                      env_parse_none_str="null")  # RELOCATOR_ROUTER__SESSION_NICE=null

    cluster: ClusterSection = ClusterSection()
    router: RouterSection = RouterSection()
    controller: ControllerSection = ControllerSection()

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "LocalConfig":
        import yaml

        data: dict[str, Any] = {}
        p = Path(path) if path else DEFAULT_CONFIG
        if path or p.exists():
            data = yaml.safe_load(p.read_text()) or {}
        # file < environment < explicit overrides (pydantic-settings would let init args beat
        # the environment, so merge by hand)
        env = cls()  # environment only
        for section in ("cluster", "router", "controller"):
            for key in getattr(env, section).model_fields_set:
                data.setdefault(section, {})[key] = getattr(getattr(env, section), key)
        for section, values in overrides.items():
            data.setdefault(section, {}).update({k: v for k, v in values.items() if v is not None})
        return cls(**data)


def cluster_dir() -> Path:
    """Where the running local cluster describes itself (cluster.json)."""
    return Path(os.environ.get("RELOCATOR_CLUSTER_DIR", "/var/lib/relocator/cluster"))
