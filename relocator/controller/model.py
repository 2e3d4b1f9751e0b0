"""Records the controller keeps: workers, relocations and their phases (plain data, JSON-able)."""

from __future__ import annotations

import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from adapters.base import DEFAULT_ENGINE
from relocator.choices import Choice
from relocator.vocab import TransferMode  # noqa: F401 - re-exported: it lives low, in relocator.vocab


class Phase(Choice):
    """The eight phases of DESIGN.md, in order. Each is persisted before it starts."""

    PLAN = "PLAN"
    RESERVE = "RESERVE"
    HOLD = "HOLD"
    DUMP = "DUMP"
    TRANSFER = "TRANSFER"
    RESTORE = "RESTORE"
    SWITCH = "SWITCH"
    RELEASE = "RELEASE"


PHASES: tuple[Phase, ...] = tuple(Phase)
ROLLBACK_BEFORE = PHASES.index(Phase.SWITCH)  # a failure in a phase before SWITCH rolls back


class RelocationResult(Choice):
    """How a relocation ended (running: not yet)."""

    RUNNING = "running"
    DONE = "done"
    ROLLED_BACK = "rolled_back"
    FAILED = "failed"


RUNNING, DONE, ROLLED_BACK, FAILED = RelocationResult


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


class WorkerState(Choice):
    """Every state a worker record takes, written in one place (a metric label too)."""

    STARTING = "starting"  # launching: reserved, engine loading
    RUNNING = "running"
    RELOCATING = "relocating"  # a relocation owns it
    REPLACING = "replacing"  # its node or cell was lost: a new copy is starting
    LOST = "lost"
    FAILED = "failed"
    SUSPENDING = "suspending"  # being checkpointed to the image store
    SUSPENDED = "suspended"  # an image, no GPUs (a resume demand may be pending)
    RESUMING = "resuming"  # being restored from its image
    PAUSED = "paused"  # stopped in its cell on its node (preemption: suspend-in-place), GPUs lent


class SuspendReason(Choice):
    """Why a worker was set aside (a suspend keeps its work: it resumes from its image)."""

    OPERATOR = "operator"  # `relocator suspend`: resumed by `relocator resume`
    PREEMPTED = "preempted"  # a higher-priority demand needed its GPUs: resumed automatically
    # past its time limit, a demand (or a drain) needed its GPUs: requeued, resumed automatically
    TIME_LIMIT = "time_limit"
    DRAIN = "drain"  # its node was drained and nothing else fitted: resumed automatically


class DemandKind(Choice):
    """What a demand seats: a new worker, or a suspended one again."""

    LAUNCH = "launch"
    RESUME = "resume"


class DemandState(Choice):
    PENDING = "pending"  # waits for capacity; the reconcile loop retries it
    PLACING = "placing"  # moves / suspends / the start itself in progress
    PLACED = "placed"  # its worker serves (the record is then removed)


def parse_duration(value: str | float | int | None) -> float | None:
    """Seconds from `90`, `"90s"`, `"15m"`, `"2h"`, `"1d"` (None: no limit). ValueError otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, float)):
        secs = float(value)
    else:
        import re

        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(value))
        if not m:
            raise ValueError(f"bad duration {value!r}; use e.g. 90, 90s, 15m, 2h, 1d")
        secs = float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]
    if secs <= 0:
        raise ValueError(f"a duration must be > 0, not {value!r}")
    return secs


def phase_index(phase: str | None) -> int:
    return PHASES.index(phase) if phase in PHASES else -1


@dataclass
class WorkerRecord:
    id: str
    model: str
    node: str
    gpus: float  # whole GPUs (an int >= 1) or a share of one GPU in (0, 1): relocator.shares
    engine: str = DEFAULT_ENGINE
    cell_id: str = ""
    endpoint: str = ""
    state: WorkerState = WorkerState.STARTING  # written through states.transition
    reservation: str = ""  # name of the placement group holding its GPUs
    gpu_ids: list[int] = field(default_factory=list)  # the node's GPU indices Ray gave that reservation
    model_dir: str = ""
    launch_s: float = 0.0
    created_at: float = field(default_factory=time.time)
    error: str = ""
    replacements: int = 0  # fresh launches after its copy was lost
    last_image: str = ""  # its newest image (kept after a move on shared storage), for a warm restart
    last_image_node: str = ""
    priority: int = 0  # a demand of higher priority may suspend it (it resumes later)
    time_limit_s: float | None = None  # preemptible after running this long (see past_deadline)
    deadline: float | None = None  # when its current run reaches its time limit
    image: str = ""  # while suspended: the image it resumes from
    image_node: str = ""
    suspend_reason: str = ""  # a SuspendReason while suspended
    suspended_at: float | None = None
    suspensions: int = 0
    # a suspend that failed (the worker serves again): no automatic suspend before retry_at
    suspend_failures: int = 0  # in a row; reset by a suspend that works
    suspend_retry_at: float | None = None
    suspend_error: str = ""

    def __post_init__(self) -> None:
        self.state = WorkerState(self.state)  # a stored or passed string; unknown: ValueError

    def past_deadline(self, now: float) -> bool:
        """Running past its time limit: preemptible, i.e. any waiting demand (not only a
        higher priority) or a drain's deadline may suspend it; nothing else does."""
        return self.state == WorkerState.RUNNING and self.deadline is not None and now >= self.deadline

    def suspend_backing_off(self, now: float) -> bool:
        return self.suspend_retry_at is not None and now < self.suspend_retry_at

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "WorkerRecord":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


@dataclass
class Demand:
    """GPUs wanted and not yet held: a launch that did not fit, or a suspended worker to resume.
    Its id is the worker's id. Stored while it waits; removed once its worker serves."""

    id: str
    kind: DemandKind
    model: str
    gpus: float  # as WorkerRecord.gpus (relocator.shares)
    priority: int = 0
    engine: str = DEFAULT_ENGINE
    model_dir: str = ""
    time_limit_s: float | None = None
    state: DemandState = DemandState.PENDING
    reason: str = ""  # why it still waits
    since: float = field(default_factory=time.time)
    attempts: int = 0
    last_try: float | None = None

    def __post_init__(self) -> None:
        self.kind = DemandKind(self.kind)
        self.state = DemandState(self.state)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Demand":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "kind": self.kind.value, "model": self.model, "gpus": self.gpus,
                "priority": self.priority, "since": self.since, "reason": self.reason, "state": self.state.value,
                "attempts": self.attempts}


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
    phase: Phase | None = None
    result: RelocationResult = RelocationResult.RUNNING
    error: str = ""
    src_cell: str = ""
    src_endpoint: str = ""
    dst_cell: str = ""
    dst_endpoint: str = ""
    image_dir: str = ""
    dst_image_dir: str = ""
    image_bytes: int = 0
    transfer: TransferMode = TransferMode.SHARED
    # transfer: postcopy: the source's page server, page bytes at the switch and at the end,
    # how long the target depended on the source (postcopy_s), why it failed
    postcopy: dict[str, Any] = field(default_factory=dict)
    engine: str = ""  # the worker's engine (a metric label)
    reason: FailureReason = FailureReason.NONE  # set when it finishes
    reservation: str = ""  # the target's reservation (placement group name)
    dst_gpu_ids: list[int] = field(default_factory=list)  # the target's GPU indices in it
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
        self.result = RelocationResult(self.result)
        if self.phase in Phase.values():  # a stored string; anything else is kept (recover rolls it back)
            self.phase = Phase(self.phase)

    @staticmethod
    def new_id() -> str:
        return "r" + uuid.uuid4().hex[:8]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Relocation":
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})

    def transfer_why(self) -> str:
        """Why PLAN chose the mode it did when `auto` was asked for ("" for an explicit mode)."""
        plan = next((p for p in self.phases if p.get("name") == Phase.PLAN), None)
        return str(((plan or {}).get("info") or {}).get("why") or "")

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
                "transfer": self.transfer, "transfer_why": self.transfer_why(), "engine": self.engine,
                "reason": self.reason, "postcopy": self.postcopy,
                "rollback": self.rollback, "recovered": self.recovered,
                "created_at": self.created_at, "finished_at": self.finished_at}


def tokenizer_of(w: WorkerRecord) -> str | None:
    """The worker's tokenizer for the router (text-exact continued streams), if its model
    directory has one."""
    from pathlib import Path

    if w.model_dir and (Path(w.model_dir) / "tokenizer.json").is_file():
        return w.model_dir
    return None


def engine_extra(gpus: float) -> dict[str, Any] | None:
    """The launch options of a worker of `gpus`: a share's engine gets its memory share (vLLM's
    --gpu-memory-utilization, the CPU build's KV pool share of host memory: LaunchSpec's
    memory_fraction scaled by the share, relocator.shares.engine_memory); whole GPUs: None."""
    from adapters.base import LaunchSpec
    from relocator import shares

    memory = shares.engine_memory(gpus, LaunchSpec.memory_fraction)
    return None if memory is None else {"memory_fraction": memory}
