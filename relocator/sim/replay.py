"""Event-driven replay of an openb pod list with departures, a pending queue, and optionally
relocation (moves of running pods) and suspension (checkpoint, requeue, resume).

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

Events: arrival (queued, FIFO), departure, plan done, suspension done, consolidation tick.
After every event the queue is served: the head is placed by the policy if it fits; if not,
``mode`` ``moves`` asks the planner for the fewest moves that seat it (``moves_per_pod`` at most,
within the budget, ``max_moves_per_hour`` and ``max_moved_gpus`` per plan), on nodes that no
other head's plan holds (a held node is neither a target nor a destination).

The budget is a bucket that cannot be saved up: every arrival adds ``budget_per_100 / 100``
tokens, up to ``budget_cap`` (default ``moves_per_pod``: one full plan); each move or suspension
spends one; a plan is only started with the tokens in hand. The bucket is emptied at the first
measured arrival, so within the measured window (first to last measured arrival) moves plus
suspensions never exceed ``budget_per_100`` per 100 measured arrivals, and over any run of
arrivals they never exceed ``budget_cap`` plus ``budget_per_100`` per 100 of them. Moved pods are frozen for their blackout
(:class:`BlackoutModel`); source and destination are both held until the plan is done, then
the head starts. ``moves+suspend`` also checkpoints lower-priority pods (QoS: LS/Guaranteed >
Burstable > BE) on one node to seat the head when no plan exists; they are requeued in their
original arrival order and resume with their remaining time plus a restore. With ``backfill``
the queue is scanned past a blocked head (``backfill_depth`` pods), without reservations.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Sequence

import numpy as np

from relocator.choices import Choice
from relocator.planner.cluster import MILLI, Cluster, NodeSpec, Placement, Plan, Workload
from relocator.planner.planners import consolidate, defragment
from relocator.planner.policies import TypicalPods, canonical_policy_name, cluster_fragmentation_milli, get_policy
from relocator.sim.trace import TracePod

GB = 1e9


class ReplayError(ValueError):
    """A replay that cannot be set up (no times in the pod list, a load out of reach, ...)."""


class QueueDiscipline(Choice):
    """How the pending queue is served."""

    FIFO = "fifo"  # only the head may start
    BACKFILL = "backfill"  # pods behind a blocked head may start (no reservation)


class ReplayMode(Choice):
    """What the scheduler may do to seat a queue head that fits nowhere."""

    NONE = "none"
    MOVES = "moves"
    MOVES_SUSPEND = "moves+suspend"


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
    if load <= 0:
        raise ReplayError(f"load must be > 0, found {load}")
    if passes < 1 or not 0 <= warmup_passes < passes:
        raise ReplayError("need passes >= 1 and 0 <= warmup_passes < passes")
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

    def offered(scale: float) -> float:
        a = base * scale
        return _offered(a, d_all, g_all, float(a[m0]), float(a[-1]), float(capacity_milli))

    lo, hi = 1e-9, 1e3
    if offered(lo) < load:
        raise ReplayError(
            f"offered load {load} is out of reach with {passes} passes of {n} pods (at most {offered(lo):.2f});"
            " use more passes"
        )
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
    a = base * scale
    jobs = []
    for k in range(passes):
        for i, (p, _, _) in enumerate(rows):
            w = p.workload if k == 0 else replace(p.workload, id=f"{p.workload.id}#{k}")
            j = k * n + i
            jobs.append(Job(j, w, float(a[j]), float(dur[i]), _priority(p.qos), k >= warmup_passes, demand_class(w)))
    return Stream(jobs, scale, (float(a[m0]), float(a[-1])), offered(scale))


# ---------------------------------------------------------------------------------- engine
@dataclass
class ReplayConfig:
    policy: str = "fgd"
    mode: str = "none"
    load: float = 1.3
    queue: str = "fifo"
    seed: int = 42
    passes: int = 2
    warmup_passes: int = 1
    moves_per_pod: int = 4
    budget_per_100: float = 1.0  # moves (and suspensions) per 100 arrivals
    budget_cap: float | None = None  # most tokens the bucket holds (None: moves_per_pod)
    max_moves_per_hour: float | None = None
    max_moved_gpus: float | None = None  # per plan
    min_gpus: float = 0.0  # only heads needing at least this many GPUs may trigger moves
    retry_s: float = 60.0  # a head that found no plan is not searched again for this long
    backfill_depth: int = 64
    consolidate_every_s: float | None = None
    consolidate_moves: int = 4
    samples: int = 400
    blackout: BlackoutModel = field(default_factory=BlackoutModel)


@dataclass
class _Flight:
    """Moves (or suspensions) under way for one head (or a consolidation: head None)."""

    fid: int
    head: int | None
    plan: Plan | None
    jobs: list[int]
    done: float
    reservations: list[str]
    suspend: bool = False


_ARRIVE, _DEPART, _DONE, _TICK = 1, 0, 2, 3  # departures before arrivals at the same instant


class Replay:
    """One replay run; :meth:`run` returns the result dict."""

    def __init__(self, nodes: Sequence[NodeSpec], stream: Stream, cfg: ReplayConfig, typical: TypicalPods) -> None:
        self.cfg = cfg
        self.mode = ReplayMode(cfg.mode)
        self.queue_kind = QueueDiscipline(cfg.queue)
        self.policy = canonical_policy_name(cfg.policy)
        self.pol = get_policy(self.policy, typical=typical) if self.policy == "fgd" else get_policy(self.policy)
        self.typical = typical
        self.cluster = Cluster(nodes)
        self.cap = self.cluster.gpu_capacity_milli
        self.stream = stream
        self.jobs = stream.jobs
        self.by_id = {j.workload.id: j for j in self.jobs}
        self.rng = np.random.default_rng(cfg.seed + 1_000_003)
        self.events: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.queue: deque[int] = deque()
        self.waiting: set[int] = set()  # heads with a flight under way
        self.flights: dict[int, _Flight] = {}
        self.fids = 0
        self.held: dict[int, int] = {}  # node -> flights seating a head there
        self.mask: np.ndarray | None = None  # nodes other pods may start on (None: all)
        self.used = 0  # GPU milli of running (real) pods
        self.arrived = 0
        self.release_clock = 0
        self.fail_memo: dict[tuple, int] = {}
        self.plan_memo: dict[int, tuple[int, float, int]] = {}  # head -> (cluster clock, retry at, moves allowed)
        self.move_times: deque[float] = deque()
        self.interventions = 0
        self.tokens = 0.0  # the budget bucket
        self.token_cap = float(cfg.budget_cap if cfg.budget_cap is not None else max(cfg.moves_per_pod, 1))
        self.in_window = False
        self.m_interventions = 0
        self.intervention_log: list[tuple[int, int]] = []  # (arrivals so far, moves or suspensions)
        self.moves = self.moved_milli = self.suspensions = self.plans = self.plans_wasted = 0
        self.blackout_s = self.kill_loss_s = self.suspended_s = 0.0
        self.rejected = 0
        self.now = 0.0
        self.static_ok_cache: dict[tuple, bool] = {}
        # time series
        w0, w1 = stream.window
        self.w0, self.w1 = w0, w1
        self.grid = np.linspace(0.0, max(j.arrival for j in self.jobs) if self.jobs else 1.0, cfg.samples)
        self.gi = 0
        self.series: dict[str, list[float]] = {"t": [], "alloc": [], "queue": [], "frag_gpus": []}
        self.acc_alloc = self.acc_queue = 0.0
        self.acc_t = 0.0
        self.last_t = 0.0
        self.m_moves = 0
        self.m_arrivals = 0

    # ------------------------------------------------------------------ events
    def _push(self, t: float, kind: int, a: int, b: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, kind, self.seq, a, b))

    def _advance(self, t: float) -> None:
        """Integrate the measured-window means up to ``t``; take the samples passed."""
        lo, hi = max(self.last_t, self.w0), min(t, self.w1)
        if hi > lo:
            dt = hi - lo
            self.acc_alloc += dt * self.used / self.cap
            self.acc_queue += dt * len(self.queue)
            self.acc_t += dt
        while self.gi < len(self.grid) and self.grid[self.gi] <= t:
            self.series["t"].append(float(self.grid[self.gi]))
            self.series["alloc"].append(self.used / self.cap)
            self.series["queue"].append(float(len(self.queue)))
            self.series["frag_gpus"].append(cluster_fragmentation_milli(self.cluster, self.typical) / MILLI)
            self.gi += 1
        self.last_t = t

    def run(self) -> dict:
        t0 = time.perf_counter()
        for j in self.jobs:
            self._push(j.arrival, _ARRIVE, j.idx)
        if self.cfg.consolidate_every_s and self.mode is not ReplayMode.NONE:
            self._push(self.cfg.consolidate_every_s, _TICK, 0)
        last_arrival = self.jobs[-1].arrival if self.jobs else 0.0
        while self.events:
            t, kind, _, a, b = heapq.heappop(self.events)
            self._advance(t)
            self.now = t
            if kind == _ARRIVE:
                self._arrive(self.jobs[a])
            elif kind == _DEPART:
                j = self.jobs[a]
                if j.token != b or j.end is None:
                    continue
                self._depart(j)
            elif kind == _DONE:
                self._flight_done(self.flights.pop(a))
            elif kind == _TICK:
                if t <= last_arrival:
                    self._consolidate()
                    self._push(t + float(self.cfg.consolidate_every_s or 0), _TICK, 0)
            self._serve()
        return self._result(time.perf_counter() - t0)

    # ------------------------------------------------------------------ pods
    def _static_ok(self, w: Workload) -> bool:
        key = (w.cpu_milli, w.memory_mib, w.num_gpu, w.gpu_milli, w.gpu_model)
        ok = self.static_ok_cache.get(key)
        if ok is None:
            c = self.cluster
            m = (c.cpu_cap >= w.cpu_milli) & (c.mem_cap >= w.memory_mib)
            if w.num_gpu:
                m &= (c.num_gpus >= w.num_gpu) & c.model_ok(w)
            ok = self.static_ok_cache[key] = bool(m.any())
        return ok

    def _arrive(self, j: Job) -> None:
        self.arrived += 1
        if j.measured:
            if not self.in_window:  # the measured window starts with an empty bucket
                self.in_window = True
                self.tokens = 0.0
            self.m_arrivals += 1
        self.tokens = min(self.token_cap, self.tokens + self.cfg.budget_per_100 / 100.0)
        if not self._static_ok(j.workload):
            self.rejected += 1
            return
        self.queue.append(j.idx)

    def _start(self, j: Job, node: str, gpus: tuple[int, ...]) -> None:
        self.cluster.add(j.workload, node, gpus)
        self.used += j.workload.total_gpu_milli
        run = j.duration if j.start is None else j.remaining
        if j.start is None:
            j.start = self.now
        elif j.suspended_at is not None:  # resumed after a suspension
            j.suspended_s += self.now - j.suspended_at
            self.suspended_s += self.now - j.suspended_at
            j.suspended_at = None
        j.end = self.now + run
        j.token += 1
        self._push(j.end, _DEPART, j.idx, j.token)

    def _depart(self, j: Job) -> None:
        self.cluster.remove(j.workload.id)
        self.used -= j.workload.total_gpu_milli
        j.end = None
        j.finished = self.now
        self.release_clock += 1

    # ------------------------------------------------------------------ queue
    def _serve(self) -> None:
        if not self.queue:
            return
        # FIFO: the first pod that is not already waiting for its moves is the head; a head
        # whose moves are under way has its node (nobody else may start there) and does not block
        q = self.queue
        i = 0
        while i < len(q):
            hid = q[i]
            if hid in self.waiting:
                i += 1
                continue
            if self._try_place(hid):
                del q[i]
                continue
            if self.mode is not ReplayMode.NONE:
                self._make_room(hid)
                if hid not in q:  # it fitted after all
                    continue
                if hid in self.waiting:
                    i += 1
                    continue
            break
        if self.queue_kind is not QueueDiscipline.BACKFILL:
            return
        depth = i + self.cfg.backfill_depth
        i += 1
        while i < len(q) and i <= depth:
            jid = q[i]
            if jid not in self.waiting and self._try_place(jid):
                del q[i]
                continue
            i += 1

    def _try_place(self, jid: int) -> bool:
        j = self.jobs[jid]
        w = j.workload
        key = (w.cpu_milli, w.memory_mib, w.num_gpu, w.gpu_milli, w.gpu_model)
        if self.fail_memo.get(key) == self.release_clock:
            return False  # nothing was freed since this shape last failed
        pl = self.pol.select(self.cluster, w, rng=self.rng, mask=self.mask)
        if pl is None:
            self.fail_memo[key] = self.release_clock
            return False
        self._start(j, pl.node, pl.gpus)
        return True

    # ------------------------------------------------------------------ relocation
    def _tokens(self) -> float:
        """Interventions (moves, suspensions) the budget still allows now."""
        left = self.tokens + 1e-9
        if self.cfg.max_moves_per_hour is not None:
            while self.move_times and self.move_times[0] <= self.now - 3600.0:
                self.move_times.popleft()
            left = min(left, self.cfg.max_moves_per_hour - len(self.move_times))
        return left

    def _measuring(self) -> bool:
        return self.in_window and self.now <= self.w1

    def _spend(self, n: int) -> None:
        """``n`` moves or suspensions start now: take their tokens from the bucket."""
        assert n <= self.tokens + 1e-6, (n, self.tokens)
        self.tokens = max(0.0, self.tokens - n)
        self.interventions += n
        self.intervention_log.append((self.arrived, n))
        if self._measuring():
            self.m_interventions += n

    def _make_room(self, hid: int) -> None:
        j = self.jobs[hid]
        w = j.workload
        if w.total_gpu_milli < self.cfg.min_gpus * MILLI:
            return
        budget = min(self.cfg.moves_per_pod, int(math.floor(self._tokens())))
        if budget <= 0:
            return
        memo = self.plan_memo.get(hid)
        if memo is not None and budget <= memo[2] and (memo[0] == self.cluster._clock or self.now < memo[1]):
            return  # nothing changed and no more moves allowed than when it last found no plan
        plan = defragment(self.cluster, w, max_moves=budget, policy=self.pol, rng=self.rng, allowed=self.mask)
        if plan is not None and plan.num_moves and self.cfg.max_moved_gpus is not None:
            if plan.moved_gpu_milli > self.cfg.max_moved_gpus * MILLI:
                plan = None
        if plan is not None and plan.placement is not None and plan.num_moves == 0:
            self._start(j, plan.placement.node, plan.placement.gpus)
            self.queue.remove(hid)
            return
        if plan is not None and plan.placement is not None:
            self._begin_moves(plan, hid)
            return
        if self.mode is ReplayMode.MOVES_SUSPEND and self._suspend_for(hid, budget):
            return
        self.plan_memo[hid] = (self.cluster._clock, self.now + self.cfg.retry_s, budget)

    def _pin(self, j: Job) -> tuple[str, tuple[int, ...]]:
        """Keep ``j`` where it is, not movable, while it is dumped; returns its placement."""
        c = self.cluster
        pl = c.placement_of(j.workload.id)
        c.remove(j.workload.id)
        c.add(replace(j.workload, relocatable=False), pl.node, pl.gpus)
        j.busy = True
        return pl.node, pl.gpus

    def _begin_moves(self, plan: Plan, head: int | None) -> None:
        c = self.cluster
        bm = self.cfg.blackout
        self.fids += 1
        fid = self.fids
        reservations: list[str] = []
        moved: list[int] = []
        done = self.now
        for mv in plan.moves:
            done = max(done, self.now + bm.move_s(self.by_id[mv.workload].workload))
        for mv in plan.moves:
            j = self.by_id[mv.workload]
            w = j.workload
            self._pin(j)
            rid = f"~reserve:{fid}:{w.id}"
            c.add(Workload(rid, w.cpu_milli, w.memory_mib, w.num_gpu, w.gpu_milli, w.gpu_model, False), mv.dst, mv.gpus)
            reservations.append(rid)
            moved.append(j.idx)
            b = bm.move_s(w)
            self.blackout_s += b
            self.kill_loss_s += (self.now - (j.start or self.now)) + bm.cold_start_s
            # frozen for its blackout; it runs on once the plan is done
            assert j.end is not None
            j.end = max(j.end + b, done) + 1e-3  # strictly after the plan is done
            j.token += 1
            self._push(j.end, _DEPART, j.idx, j.token)
            j.moves += 1
            self.move_times.append(self.now)
            if self._measuring():
                self.m_moves += 1
        self.moves += plan.num_moves
        self.moved_milli += plan.moved_gpu_milli
        self._spend(plan.num_moves)
        self.plans += 1
        if head is not None:
            self.waiting.add(head)
            assert plan.placement is not None
            self._hold(plan.placement.node, +1)
        self.flights[fid] = _Flight(fid, head, plan, moved, done, reservations)
        self._push(done, _DONE, fid)

    def _flight_done(self, f: _Flight) -> None:
        c = self.cluster
        for rid in f.reservations:
            c.remove(rid)
        if f.suspend:
            for jid in f.jobs:
                j = self.jobs[jid]
                c.remove(j.workload.id)
                self.used -= j.workload.total_gpu_milli
                j.busy = False
                j.token += 1
                j.remaining += self.cfg.blackout.resume_s(j.workload)
                j.suspended_at = self.now
                j.end = None
                self._requeue(jid)
        else:
            assert f.plan is not None
            for mv, jid in zip(f.plan.moves, f.jobs):
                j = self.jobs[jid]
                c.remove(j.workload.id)
                if j.end is not None and j.end > self.now:
                    c.add(j.workload, mv.dst, mv.gpus)
                else:  # ended while frozen (cannot happen: its end is pushed past the plan)
                    self.used -= j.workload.total_gpu_milli
                    j.end = None
                    j.finished = self.now
                j.busy = False
        self.release_clock += 1
        if f.head is None:
            return
        self.waiting.discard(f.head)
        if f.plan is not None and f.plan.placement is not None:
            self._hold(f.plan.placement.node, -1)
        h = self.jobs[f.head]
        placed = False
        if f.plan is not None and f.plan.placement is not None:
            pl = f.plan.placement
            ni = c.node_index(pl.node)
            if not pl.gpus and c.fits_on(h.workload, ni):
                only = np.zeros(c.num_nodes, dtype=bool)
                only[ni] = True
                sel = self.pol.select(c, h.workload, rng=self.rng, mask=only)
                if sel is not None:
                    self._start(h, sel.node, sel.gpus)
                    placed = True
            elif pl.gpus and c.fits_on(h.workload, ni, pl.gpus):
                self._start(h, pl.node, pl.gpus)
                placed = True
        if not placed:  # anywhere but on nodes held for other heads
            sel = self.pol.select(c, h.workload, rng=self.rng, mask=self.mask)
            if sel is not None:
                self._start(h, sel.node, sel.gpus)
                placed = True
        if placed:
            self.queue.remove(f.head)
        else:
            self.plans_wasted += 1

    def _hold(self, node: str, delta: int) -> None:
        """Keep other pods off a node where a head will start once its moves are done."""
        ni = self.cluster.node_index(node)
        n = self.held.get(ni, 0) + delta
        if n > 0:
            self.held[ni] = n
        else:
            self.held.pop(ni, None)
        if self.held:
            self.mask = np.ones(self.cluster.num_nodes, dtype=bool)
            self.mask[list(self.held)] = False
        else:
            self.mask = None

    def _requeue(self, jid: int) -> None:
        """Back into the queue at its original arrival position."""
        q = self.queue
        for i, other in enumerate(q):
            if other > jid:
                q.insert(i, jid)
                return
        q.append(jid)

    def _suspend_for(self, hid: int, budget: int) -> bool:
        """Checkpoint lower-priority pods on one node so the head fits there."""
        c = self.cluster
        head = self.jobs[hid]
        w = head.workload
        sl = c._slots
        cands: list[int] = []
        for wid, s in c._slot_of.items():
            j = self.by_id.get(wid)
            if j is None or j.busy or j.priority >= head.priority:
                continue
            cands.append(s)
        if not cands:
            return False
        slots = np.array(cands, dtype=np.int64)
        nodes = sl.node[slots]
        n = c.num_nodes
        static = (c.cpu_cap >= w.cpu_milli) & (c.mem_cap >= w.memory_mib)
        if w.num_gpu:
            static &= (c.num_gpus >= w.num_gpu) & c.model_ok(w)
        cpu_f = c.cpu_left + np.bincount(nodes, weights=sl.cpu[slots], minlength=n).astype(np.int64)
        mem_f = c.mem_left + np.bincount(nodes, weights=sl.mem[slots], minlength=n).astype(np.int64)
        ok = static & (cpu_f >= w.cpu_milli) & (mem_f >= w.memory_mib)
        if self.mask is not None:
            ok &= self.mask  # not on a node held for another head
        if w.num_gpu:
            free_f = c.gpu_left.copy()
            np.add.at(free_f, nodes, sl.use[slots])
            ok &= (free_f >= w.gpu_milli).sum(axis=1) >= w.num_gpu
        best: tuple | None = None
        by_node: dict[int, list[int]] = {}
        for s, nd in zip(slots.tolist(), nodes.tolist()):
            if ok[nd]:
                by_node.setdefault(nd, []).append(s)
        for nd in sorted(by_node, key=lambda x: (len(by_node[x]), x))[:64]:
            # lowest priority first, then the largest GPU share
            order = sorted(by_node[nd], key=lambda s: (self.by_id[c._workloads[s].id].priority, -int(sl.use[s].sum()), s))  # type: ignore[union-attr]
            chosen: list[int] = []
            cpu, mem, left = int(c.cpu_left[nd]), int(c.mem_left[nd]), c.gpu_left[nd].copy()
            for s in order:
                if cpu >= w.cpu_milli and mem >= w.memory_mib and (w.num_gpu == 0 or int((left >= w.gpu_milli).sum()) >= w.num_gpu):
                    break
                chosen.append(s)
                cpu += int(sl.cpu[s])
                mem += int(sl.mem[s])
                left = left + sl.use[s]
            fits = cpu >= w.cpu_milli and mem >= w.memory_mib and (w.num_gpu == 0 or int((left >= w.gpu_milli).sum()) >= w.num_gpu)
            if not fits or len(chosen) > budget:
                continue
            cost = (len(chosen), int(sum(int(sl.use[s].sum()) for s in chosen)), nd)
            if best is None or cost < best[0]:
                best = (cost, nd, chosen)
        if best is None:
            return False
        _, nd, chosen = best
        bm = self.cfg.blackout
        self.fids += 1
        fid = self.fids
        jobs: list[int] = []
        done = self.now
        for s in chosen:
            j = self.by_id[c._workloads[s].id]  # type: ignore[union-attr]
            jobs.append(j.idx)
        for jid in jobs:
            j = self.jobs[jid]
            self._pin(j)
            d = bm.suspend_s(j.workload)
            done = max(done, self.now + d)
            self.blackout_s += d + bm.resume_s(j.workload)
            self.kill_loss_s += (self.now - (j.start or self.now)) + bm.cold_start_s
            assert j.end is not None
            j.remaining = max(1e-3, j.end - self.now)  # frozen from now on
            j.token += 1  # its departure waits for the resume
        self.suspensions += len(jobs)
        self._spend(len(jobs))
        self.waiting.add(hid)
        target = c.node_ids[nd]
        self._hold(target, +1)
        self.flights[fid] = _Flight(fid, hid, Plan((), w.id, Placement(target)), jobs, done, [], suspend=True)
        self._push(done, _DONE, fid)
        return True

    def _consolidate(self) -> None:
        k = min(self.cfg.consolidate_moves, int(math.floor(self._tokens())))
        if k <= 0:
            return
        plan = consolidate(self.cluster, max_moves=k, policy="best-fit", rng=self.rng)
        plan = Plan(tuple(m for m in plan.moves if not self.by_id[m.workload].busy))
        if plan.num_moves:
            self._begin_moves(plan, None)

    # ------------------------------------------------------------------ result
    def _result(self, seconds: float) -> dict:
        cfg = self.cfg
        measured = [j for j in self.jobs if j.measured and j.start is not None]
        unstarted = sum(1 for j in self.jobs if j.measured and j.start is None)

        def stats(js: list[Job]) -> dict:
            if not js:
                return {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}
            w = np.array([j.start - j.arrival for j in js])  # type: ignore[operator]
            return {"n": len(js), "p50": round(float(np.percentile(w, 50)), 1), "p99": round(float(np.percentile(w, 99)), 1),
                    "max": round(float(w.max()), 1), "mean": round(float(w.mean()), 1)}

        by_class = {c: stats([j for j in measured if j.cls == c]) for c in CLASSES}
        big = stats([j for j in measured if j.cls in ("4", "8")])
        hours = max(self.w1 - self.w0, 1e-9) / 3600.0
        return {
            "policy": self.policy,
            "mode": self.mode.value,
            "load": cfg.load,
            "queue": self.queue_kind.value,
            "seed": cfg.seed,
            "wait_s_p50": big["p50"],
            "wait_s_p99": big["p99"],
            "wait_s_max": big["max"],
            "wait_s_p99_all": stats(measured)["p99"],
            "wait_by_class": by_class,
            "alloc_ratio_mean": round(self.acc_alloc / max(self.acc_t, 1e-9), 4),
            "queue_len_mean": round(self.acc_queue / max(self.acc_t, 1e-9), 1),
            "moves": self.moves,
            "moves_measured": self.m_moves,
            "moves_per_hour": round(self.m_moves / hours, 2),
            "moves_per_100_arrivals": round(100.0 * self.m_moves / max(self.m_arrivals, 1), 3),
            "interventions_measured": self.m_interventions,
            "interventions_per_100_arrivals": round(100.0 * self.m_interventions / max(self.m_arrivals, 1), 3),
            "budget_per_100": cfg.budget_per_100,
            "budget_cap": self.token_cap,
            "moved_gpus": round(self.moved_milli / MILLI, 2),
            "plans": self.plans,
            "plans_wasted": self.plans_wasted,
            "suspensions": self.suspensions,
            "suspended_pod_hours": round(self.suspended_s / 3600.0, 2),
            "blackout_s_total": round(self.blackout_s, 1),
            "pod_hours_lost": round(self.blackout_s / 3600.0, 2),
            "kill_restart_pod_hours_lost": round(self.kill_loss_s / 3600.0, 2),
            "arrivals": self.arrived,
            "measured_arrivals": self.m_arrivals,
            "rejected": self.rejected,
            "unstarted": unstarted,
            "window_h": round(hours, 2),
            "gap_scale": self.stream.scale,
            "offered_load": round(self.stream.offered_load, 3),
            "seconds": round(seconds, 2),
            "series": {k: [round(x, 4) for x in v] for k, v in self.series.items()},
        }


def replay(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    cfg: ReplayConfig,
    times_from: Sequence[TracePod] | None = None,
    typical: TypicalPods | None = None,
) -> dict:
    """One replay (the result dict of :meth:`Replay.run`)."""
    cap = sum(n.gpus for n in nodes) * MILLI
    stream = build_stream(pods, cfg.load, cap, cfg.seed, cfg.passes, cfg.warmup_passes, times_from=times_from)
    if typical is None:
        typical = TypicalPods.from_workloads([p.workload for p in pods])
    return Replay(nodes, stream, cfg, typical).run()


def _run_one(args: tuple) -> dict:
    nodes, pods, cfg, times_from, typical = args
    return replay(nodes, pods, cfg, times_from, typical)


def replay_many(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    cfgs: Sequence[ReplayConfig],
    times_from: Sequence[TracePod] | None = None,
    jobs: int = 1,
    on_done: Callable[[dict], None] | None = None,
) -> list[dict]:
    """Several replays (in ``jobs`` processes); results in the order of ``cfgs``."""
    typical = TypicalPods.from_workloads([p.workload for p in pods])
    if jobs <= 1:
        out = []
        for c in cfgs:
            r = replay(nodes, pods, c, times_from, typical)
            if on_done is not None:
                on_done(r)
            out.append(r)
        return out
    from concurrent.futures import ProcessPoolExecutor, as_completed

    res: dict[int, dict] = {}
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = {ex.submit(_run_one, (nodes, pods, c, times_from, typical)): i for i, c in enumerate(cfgs)}
        for f in as_completed(futs):
            res[futs[f]] = f.result()
            if on_done is not None:
                on_done(res[futs[f]])
    return [res[i] for i in range(len(cfgs))]
