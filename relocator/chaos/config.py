"""What a chaos run is asked to do: `ChaosConfig` (the CLI's options, the report's `config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relocator.chaos.faults import SMOKE_FAULTS

MODEL = "tiny-llama"


@dataclass
class ChaosConfig:
    duration_s: float | None = None  # stop scheduling moves after this long (None: all moves)
    moves: int = 4  # plain forced moves (faults add one move each)
    suspends: int = 0  # suspend-then-resume steps
    make_rooms: int = 0  # make-room launches (a node-sized worker seated by the controller's moves)
    moves_per_minute: float = 0.0  # 0: back to back
    faults: list[str] = field(default_factory=list)
    triggers: list[str] = field(default_factory=list)  # trigger faults (relocator/chaos/triggers.py)
    flap_s: float = 12.0  # how long the gpu-flap trigger fault flaps
    warm_faults: list[str] = field(default_factory=list)  # warm image faults (relocator/chaos/warmsteps.py)
    streams: int = 4
    workers: int = 1
    gpus: int = 1
    output_tokens: tuple[int, ...] = (32, 96)
    seed: int = 0
    serve_target_s: float = 2.0
    move_timeout_s: float = 240.0
    png: str | None = None
    cluster_dir: str = "/var/lib/relocator/chaos"
    nodes: int = 3
    gpus_per_node: int = 4
    stop_workers: bool = True  # stop the workers it launched at the end
    engine: str | None = None  # the workers' engine (None: the default engine)
    transfer: str | None = None  # the moves' transfer mode where their fault forces none (None: the controller's)
    # budgets (relocator/chaos/budget.py): a step (a move and what follows its fault) and the
    # whole run (None: an hour, plus `duration_s`); past one, the run ends `stalled`
    step_budget_s: float = 480.0
    run_budget_s: float | None = None

    @classmethod
    def smoke(cls, **kw: Any) -> "ChaosConfig":
        # 15 min: with the clean-up after a stall (a few minutes at most), inside the 20 min a
        # caller's `timeout 1200` gives it
        base = dict(moves=3, faults=list(SMOKE_FAULTS), streams=4, workers=1, run_budget_s=900.0)
        base.update({k: v for k, v in kw.items() if v is not None})
        return cls(**base)

    def run_budget(self) -> float:
        return self.run_budget_s if self.run_budget_s is not None else 3600.0 + (self.duration_s or 0.0)
