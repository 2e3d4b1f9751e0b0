"""What every policy part shares: the context a round is evaluated on, a trigger's firing and
an action's step. Plain data: triggers, filters and actions are pure functions of them."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Context:
    """One round's view. `workers`: dicts with id, node, state, gpus, gpu_ids, engine, model,
    priority, labels. `nodes`: {node: {gpus_total, gpus_free, alive, cordoned}}. `health`:
    {node: the agent's health report (gpus, notice)}. `series`: our own metric values by name."""

    now: float
    workers: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    health: dict[str, dict[str, Any]] = field(default_factory=dict)
    series: dict[str, float] = field(default_factory=dict)
    move_s: float = 30.0  # what one live move takes here (from the relocation records)


@dataclass
class Firing:
    """A trigger's condition, now true. `key` names it across rounds (hysteresis, cooldown)."""

    key: str
    reason: str
    node: str | None = None
    gpu: int | None = None
    deadline: float | None = None  # the condition's time limit (a notice's, a window's start)
    severity: str = ""  # gpu-health: draining | failed
    until: float | None = None  # a window's end: the cordon lasts until then

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None and v != ""}


@dataclass
class Step:
    """One thing an action does: move | replace | suspend | consolidate | prefetch | cordon."""

    op: str
    worker: str | None = None
    node: str | None = None
    to: str | None = None
    priority: int = 0
    args: dict[str, Any] = field(default_factory=dict)
    fits_deadline: bool = True

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if v not in (None, {}, "")}
        return d
