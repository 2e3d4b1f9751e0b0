"""Records the controller keeps: workers, relocations and their phases (plain data, JSON-able)."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from adapters.base import DEFAULT_ENGINE
from relocator.choices import Choice

# The eight phases of DESIGN.md, in order. Each is persisted before it starts.
PHASES = ("PLAN", "RESERVE", "HOLD", "DUMP", "TRANSFER", "RESTORE", "SWITCH", "RELEASE")
ROLLBACK_BEFORE = PHASES.index("SWITCH")  # a failure in a phase before SWITCH rolls back

RUNNING, DONE, ROLLED_BACK, FAILED = "running", "done", "rolled_back", "failed"


class FailureReason(Choice):
    """Why a relocation did not simply succeed: a bounded set (it is a metric label)."""

    NONE = "none"  # nothing went wrong
    PLAN_REFUSED = "plan_refused"  # no target, incompatible, busy: nothing was touched
    FAULT_INJECTED = "fault_injected"
    NODE_LOST = "node_lost"  # a node (source or target) was declared dead
    TARGET_LOST = "target_lost"  # the restored copy died before the switch
    TIMEOUT = "timeout"
    CONTROLLER_RESTART = "controller_restart"  # finished by a restarted controller
    ERROR = "error"  # anything else (the record's `error` says what)


def failure_reason(exc: BaseException) -> FailureReason:
    """The reason an exception stands for: its `reason` attribute (the controller's own
    errors carry one), a timeout, or `error`."""
    reason = getattr(exc, "reason", None)
    if isinstance(reason, FailureReason):
        return reason
    if isinstance(exc, TimeoutError):
        return FailureReason.TIMEOUT
    return FailureReason.ERROR


class TransferMode(Choice):
    """How the TRANSFER phase gets the image to the target node."""

    SHARED = "shared"  # every node sees the image directory: nothing to copy
    STREAM = "stream"  # agent to agent, hashed as it arrives


def phase_index(phase: str | None) -> int:
    return PHASES.index(phase) if phase in PHASES else -1


@dataclass
class WorkerRecord:
    id: str
    model: str
    node: str
    gpus: int
    engine: str = DEFAULT_ENGINE
    cell_id: str = ""
    endpoint: str = ""
    state: str = "starting"  # starting | running | relocating | lost | failed | stopped
    reservation: str = ""  # name of the placement group holding its GPUs
    model_dir: str = ""
    launch_s: float = 0.0
    created_at: float = field(default_factory=time.time)
    error: str = ""
    replacements: int = 0  # fresh launches after its copy was lost
    last_image: str = ""  # its newest image (kept after a move on shared storage), for a warm restart
    last_image_node: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkerRecord":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class PhaseTiming:
    name: str
    started: float
    ended: float | None = None
    ok: bool | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def seconds(self) -> float | None:
        return None if self.ended is None else self.ended - self.started


@dataclass
class Relocation:
    id: str
    worker: str
    src: str
    dst: str | None = None
    phase: str | None = None
    result: str = RUNNING
    error: str = ""
    src_cell: str = ""
    src_endpoint: str = ""
    dst_cell: str = ""
    dst_endpoint: str = ""
    image_dir: str = ""
    dst_image_dir: str = ""
    image_bytes: int = 0
    transfer: TransferMode = TransferMode.SHARED
    engine: str = ""  # the worker's engine (a metric label)
    reason: FailureReason = FailureReason.NONE  # set when it finishes
    reservation: str = ""  # the target's reservation (placement group name)
    src_reservation: str = ""
    faults: dict[str, Any] = field(default_factory=dict)
    phases: list[dict[str, Any]] = field(default_factory=list)
    rollback: dict[str, Any] = field(default_factory=dict)
    recovered: bool = False
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None

    def __post_init__(self) -> None:
        self.transfer = TransferMode(self.transfer)  # a stored or passed string; unknown: ValueError
        self.reason = FailureReason(self.reason)

    @staticmethod
    def new_id() -> str:
        return "r" + uuid.uuid4().hex[:8]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Relocation":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def phase_seconds(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for p in self.phases:
            if p.get("ended") is not None:
                out[p["name"]] = round(p["ended"] - p["started"], 4)
        return out

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "worker": self.worker, "from": self.src, "to": self.dst,
                "phase": self.phase, "result": self.result, "error": self.error,
                "phases": self.phase_seconds(), "image_bytes": self.image_bytes,
                "transfer": self.transfer, "engine": self.engine, "reason": self.reason,
                "rollback": self.rollback, "recovered": self.recovered,
                "created_at": self.created_at, "finished_at": self.finished_at}


def tokenizer_of(w: WorkerRecord) -> str | None:
    """The worker's tokenizer for the router (text-exact continued streams), if its model
    directory has one."""
    from pathlib import Path

    if w.model_dir and (Path(w.model_dir) / "tokenizer.json").is_file():
        return w.model_dir
    return None
