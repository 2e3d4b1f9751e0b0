"""The arrival stream of a replay (relocator.sim.replay): jobs from an openb pod list, their
times, classes, priorities, and the blackout a move or suspension costs.

Pure logic over :class:`relocator.planner.Cluster`: the same policies and the same
:func:`relocator.planner.defragment` the controller uses to make room.

The arrival stream (:func:`build_stream`):

1. pods in ``creation_time`` order (ties by name); duration = ``deletion_time - creation_time``
   (at least 1 s). A list without times borrows them from a donor list (``times_from``): the
   pod of the same name, else (seeded) a random donor pod with the same GPU count;
2. the gaps between consecutive creation times are clipped at their ``gap_quantile`` (the
   trace's first pods are spread over months before its busy weeks) and the list is replayed
   ``passes`` times back to back (copies renamed ``name#k``); the first ``warmup_passes`` fill
   the cluster and are not measured;
3. offered load: all gaps are multiplied by one factor, found by bisection, so that the GPU
   demand an infinitely large cluster would carry, averaged over the measured window (first to
   last measured arrival), is ``load`` x the cluster's GPU capacity. Durations are not scaled.
   (openb's own times give about 1% of the 6,212 GPUs: it is a sample of a larger cluster's
   pods, so some compression is needed before any queue forms.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from relocator.choices import Choice
from relocator.planner.cluster import MILLI, Workload
from relocator.sim.trace import TracePod

GB = 1e9


class ReplayError(ValueError):
    """A replay that cannot be set up (no times in the pod list, a load out of reach, ...)."""


class QueueDiscipline(Choice):
    """How the pending queue is served."""

    FIFO = "fifo"  # only the head may start
    BACKFILL = "backfill"  # pods behind a blocked head may start (no reservation)
    EASY = "easy"  # EASY backfill: the head has a reservation that later pods must not delay


class ReplayMode(Choice):
    """What the scheduler may do to seat a queue head that fits nowhere."""

    NONE = "none"
    MOVES = "moves"
    MOVES_SUSPEND = "moves+suspend"
    MOVES_PACK = "moves+pack"  # moves, and rounds of moves of shares onto fewer GPUs (sim/gpushare.py)


#: priority by the trace's qos (higher wins a suspension)
QOS_PRIORITY = {"LS": 2, "Guaranteed": 2, "Burstable": 1, "BE": 0, "": 1}

#: demand classes for waiting times
CLASSES = ("cpu", "frac", "1", "2", "4", "8")


def demand_class(w: Workload) -> str:
    if w.num_gpu == 0:
        return "cpu"
    if w.gpu_milli < MILLI:
        return "frac"
    if w.num_gpu >= 8:
        return "8"
    if w.num_gpu >= 4:
        return "4"
    if w.num_gpu >= 2:
        return "2"
    return "1"


@dataclass(frozen=True)
class BlackoutModel:
    """How long a moved or suspended pod is unavailable, from its state size (``Workload.
    move_cost_bytes``: memory request + 16 GiB per whole GPU for trace pods).

    Fitted to the project's measured figures (docs/benchmarks.md): ``bench relocation`` dumps a
    1.02 GB image in 0.99 s (1.03 GB/s) and restores it in 0.60 s (1.7 GB/s), blackout 1.57 s
    = DUMP + RESTORE with shared storage; the agent-to-agent stream moves 1 GB in 1.05 s on an
    idle machine (0.95 GB/s; 5.4 s under load); SWITCH 0.004 s. A cold start to first token
    took 23.2 s (what a kill and restart costs on top of the lost work). ``image_ratio``: the
    measured image is 0.63 x the worker's RSS; the memory request is taken as the RSS."""

    dump_bps: float = 1.03 * GB
    transfer_bps: float = 0.95 * GB
    restore_bps: float = 1.7 * GB
    switch_s: float = 0.004
    image_ratio: float = 0.63
    cold_start_s: float = 23.2
    shared_storage: bool = False

    def image_bytes(self, w: Workload) -> float:
        gpu_state = w.move_cost_bytes - w.memory_mib * (1 << 20)
        return self.image_ratio * w.memory_mib * (1 << 20) + max(0, gpu_state)

    def move_s(self, w: Workload) -> float:
        b = self.image_bytes(w)
        xfer = 0.0 if self.shared_storage else b / self.transfer_bps
        return b / self.dump_bps + xfer + b / self.restore_bps + self.switch_s

    def suspend_s(self, w: Workload) -> float:
        """Checkpoint to storage (the node is held while it runs)."""
        return self.image_bytes(w) / self.dump_bps

    def resume_s(self, w: Workload) -> float:
        """Restore from storage, added to the remaining run time when the pod starts again."""
        return self.image_bytes(w) / self.restore_bps


@dataclass
class Job:
    idx: int
    workload: Workload
    arrival: float
    duration: float
    priority: int
    measured: bool
    cls: str
    start: float | None = None  # first start
    end: float | None = None  # scheduled end of the current run
    remaining: float = 0.0  # run time left (set while suspended)
    token: int = 0  # invalidates stale departure events
    busy: bool = False  # pinned: in a move or a suspension
    suspended_s: float = 0.0  # time spent checkpointed in the queue
    suspended_at: float | None = None
    moves: int = 0
    finished: float | None = None


@dataclass
class Stream:
    jobs: list[Job]
    scale: float  # gap multiplier
    window: tuple[float, float]  # measured window (first, last measured arrival)
    offered_load: float


def _priority(qos: str) -> int:
    return QOS_PRIORITY.get(qos, 1)


def _fill_times(pods: Sequence[TracePod], donor: Sequence[TracePod] | None, seed: int) -> list[tuple[TracePod, int, int]]:
    """(pod, creation, duration) for every pod; times from ``donor`` where the pod has none."""
    out = []
    by_name = {p.workload.id: p for p in donor} if donor else {}
    by_gpus: dict[int, list[TracePod]] = {}
    for p in donor or ():
        if p.deletion_time is not None:
            by_gpus.setdefault(min(p.workload.num_gpu, 8), []).append(p)
    rng = np.random.default_rng(seed + 7_000_001)
    for p in pods:
        if p.deletion_time is not None:
            out.append((p, p.creation_time, max(1, p.deletion_time - p.creation_time)))
            continue
        src = by_name.get(p.workload.id)
        if src is None or src.deletion_time is None:
            pool = by_gpus.get(min(p.workload.num_gpu, 8)) or [q for v in by_gpus.values() for q in v]
            if not pool:
                raise ReplayError(
                    f"pod {p.workload.id!r} has no deletion_time and there is no donor list with times"
                    " (give the default pod list as --times-from)"
                )
            src = pool[int(rng.integers(len(pool)))]
        out.append((p, src.creation_time, max(1, int(src.deletion_time) - src.creation_time)))  # type: ignore[arg-type]
    return out


def _offered(a: np.ndarray, d: np.ndarray, g: np.ndarray, w0: float, w1: float, cap_milli: float) -> float:
    lo = np.maximum(a, w0)
    hi = np.minimum(a + d, w1)
    return float((g * np.clip(hi - lo, 0, None)).sum() / (cap_milli * max(w1 - w0, 1e-9)))


def scale_to_load(base: np.ndarray, dur: np.ndarray, gpu: np.ndarray, m0: int, load: float, capacity_milli: int,
                  what: str) -> tuple[float, float]:
    """The factor for arrival times ``base`` (sorted) that makes the GPU demand averaged over the
    measured window (arrival ``m0`` to the last) ``load`` x capacity, by bisection; and the load
    it reaches. ``what`` names the stream in the error when the load is out of reach."""

    def offered(scale: float) -> float:
        a = base * scale
        return _offered(a, dur, gpu, float(a[m0]), float(a[-1]), float(capacity_milli))

    lo, hi = 1e-9, 1e3
    if offered(lo) < load:
        raise ReplayError(f"offered load {load} is out of reach with {what} (at most {offered(lo):.2f}); use more passes")
    if offered(hi) > load:
        hi = 1e6
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        if offered(mid) > load:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-6:
            break
    scale = math.sqrt(lo * hi)
    return scale, offered(scale)


def check_stream_args(load: float, passes: int, warmup_passes: int) -> None:
    """What every arrival stream needs of its load and passes (ReplayError otherwise)."""
    if load <= 0:
        raise ReplayError(f"load must be > 0, found {load}")
    if passes < 1 or not 0 <= warmup_passes < passes:
        raise ReplayError("need passes >= 1 and 0 <= warmup_passes < passes")


def build_stream(
    pods: Sequence[TracePod],
    load: float,
    capacity_milli: int,
    seed: int = 42,
    passes: int = 2,
    warmup_passes: int = 1,
    gap_quantile: float = 0.99,
    times_from: Sequence[TracePod] | None = None,
) -> Stream:
    """The arrival stream for one load (see the module docstring)."""
    check_stream_args(load, passes, warmup_passes)
    rows = _fill_times(pods, times_from, seed)
    rows.sort(key=lambda r: (r[1], r[0].workload.id))
    ct = np.array([r[1] for r in rows], dtype=np.float64)
    dur = np.array([r[2] for r in rows], dtype=np.float64)
    gpu = np.array([r[0].workload.total_gpu_milli for r in rows], dtype=np.float64)
    gaps = np.diff(ct, prepend=ct[0])
    pos = gaps[gaps > 0]
    cap_gap = float(np.quantile(pos, gap_quantile)) if len(pos) else 1.0
    gaps = np.minimum(gaps, cap_gap)
    one = np.cumsum(gaps)
    period = float(one[-1] + max(float(np.mean(gaps)), 1e-3))
    n = len(rows)
    base = np.concatenate([one + k * period for k in range(passes)])
    d_all = np.tile(dur, passes)
    g_all = np.tile(gpu, passes)
    m0 = warmup_passes * n

    scale, reached = scale_to_load(base, d_all, g_all, m0, load, capacity_milli, f"{passes} passes of {n} pods")
    a = base * scale
    jobs = []
    for k in range(passes):
        for i, (p, _, _) in enumerate(rows):
            w = p.workload if k == 0 else replace(p.workload, id=f"{p.workload.id}#{k}")
            j = k * n + i
            jobs.append(Job(j, w, float(a[j]), float(dur[i]), _priority(p.qos), k >= warmup_passes, demand_class(w)))
    return Stream(jobs, scale, (float(a[m0]), float(a[-1])), reached)
