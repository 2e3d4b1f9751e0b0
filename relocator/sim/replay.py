"""Event-driven replay of an openb pod list with departures, a pending queue, and optionally
relocation (moves of running pods) and suspension (checkpoint, requeue, resume).

Pure logic over :class:`relocator.planner.Cluster`: the same policies and the same
:func:`relocator.planner.defragment` the controller uses to make room.

The arrival stream (``arrivals``): ``trace`` (:func:`build_stream`, relocator/sim/stream.py,
described there): the pods in creation order, gaps clipped and scaled to the offered ``load``,
replayed ``passes`` times; ``poisson`` (relocator/sim/arrivals.py): each pass a seeded shuffle
of the list with exponential gaps, scaled to the same offered load.
Making room (moves, suspensions, consolidation) is relocator/sim/rooms.py; the result dict
relocator/sim/replay_result.py.

Events: arrival (queued, FIFO), departure, plan done, suspension done, consolidation tick.
After every event the queue is served (relocator/sim/baselines.py: ``queue`` ``fifo``, ``easy``
backfill, ``backfill`` without reservations): the head is placed by the policy if it fits; if
not, ``mode`` ``moves`` asks the planner for the fewest moves that seat it (``moves_per_pod`` at
most, within the budget, ``max_moves_per_hour`` and ``max_moved_gpus`` per plan), on nodes that
no other plan holds (a held node is neither a target nor a destination). Only the head makes
room, and a head whose moves are under way still blocks the queue as the discipline says.

The budget is a bucket that cannot be saved up: every arrival adds ``budget_per_100 / 100``
tokens, up to ``budget_cap`` (default ``moves_per_pod``: one full plan); each move or suspension
spends one; a plan is only started with the tokens in hand. The bucket is emptied at the first
measured arrival, so within the measured window (first to last measured arrival) moves plus
suspensions never exceed ``budget_per_100`` per 100 measured arrivals, and over any run of
arrivals they never exceed ``budget_cap`` plus ``budget_per_100`` per 100 of them. Moved pods are frozen for their blackout
(:class:`BlackoutModel`); source and destination are both held until the plan is done, then
the head starts. ``moves+suspend`` also checkpoints lower-priority pods (QoS: LS/Guaranteed >
Burstable > BE) on one node to seat the head when no plan exists; they are requeued in their
original arrival order and resume with their remaining time plus a restore. With ``easy`` or
``backfill`` the queue is scanned past a blocked head (``backfill_depth`` pods).
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from relocator.planner.cluster import MILLI, Cluster, NodeSpec, Workload
from relocator.planner.policies import TypicalPods, canonical_policy_name, cluster_fragmentation_milli, get_policy
from relocator.sim.arrivals import make_stream
from relocator.sim.baselines import QueueServer
from relocator.sim import gpushare
from relocator.sim.replay_result import replay_result
from relocator.sim.rooms import _ARRIVE, _DEPART, _DONE, _TICK, RoomMaker, _Flight  # noqa: F401
# the arrival stream, re-exported: replay's callers (cli, tests) import it from here
from relocator.sim.stream import (CLASSES, GB, QOS_PRIORITY, BlackoutModel, Job, QueueDiscipline,  # noqa: F401
                                  ReplayError, ReplayMode, Stream, build_stream, demand_class)
from relocator.sim.trace import TracePod

# ---------------------------------------------------------------------------------- engine
@dataclass
class ReplayConfig:
    policy: str = "fgd"
    mode: str = "none"
    load: float = 1.3
    queue: str = "fifo"
    seed: int = 42
    arrivals: str = "trace"  # or "poisson": resampled per seed (relocator/sim/arrivals.py)
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
    pack_every_s: float = 2.0  # mode moves+pack: a packing round this often (30 s overflowed the budget bucket)
    pack_moves: int = 4  # most moves of one packing round
    samples: int = 400
    blackout: BlackoutModel = field(default_factory=BlackoutModel)


class Replay(RoomMaker, QueueServer):
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
        self.pack_moves = 0  # moves of packing rounds (mode moves+pack)
        self.pack_seen = 0  # whole moves in the bucket after the last packing round (gpushare.on_arrival)

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
            for k, v in gpushare.sample(self).items():  # fragmented GPUs (the FGD authors' measure), free nodes
                self.series.setdefault(k, []).append(v)
            self.gi += 1
        self.last_t = t

    def run(self) -> dict:
        t0 = time.perf_counter()
        for j in self.jobs:
            self._push(j.arrival, _ARRIVE, j.idx)
        if self.cfg.consolidate_every_s and self.mode is not ReplayMode.NONE:
            self._push(self.cfg.consolidate_every_s, _TICK, 0)
        if self.mode is ReplayMode.MOVES_PACK:
            self._push(self.cfg.pack_every_s, _TICK, gpushare.PACK_TICK)
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
            elif kind == _TICK and a == gpushare.PACK_TICK:
                if t <= last_arrival:
                    gpushare.pack_tick(self)
                    self._push(t + self.cfg.pack_every_s, _TICK, gpushare.PACK_TICK)
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
        if self.mode is ReplayMode.MOVES_PACK:
            gpushare.on_arrival(self)  # a packing round each time the bucket gains a whole move
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

    def _result(self, seconds: float) -> dict:
        return replay_result(self, seconds)

def replay(
    nodes: Sequence[NodeSpec],
    pods: Sequence[TracePod],
    cfg: ReplayConfig,
    times_from: Sequence[TracePod] | None = None,
    typical: TypicalPods | None = None,
) -> dict:
    """One replay (the result dict of :meth:`Replay.run`)."""
    cap = sum(n.gpus for n in nodes) * MILLI
    stream = make_stream(cfg.arrivals, pods, cfg.load, cap, cfg.seed, cfg.passes, cfg.warmup_passes, times_from)
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
    on_run: Callable[[ReplayConfig, dict], None] | None = None,
) -> list[dict]:
    """Several replays (in ``jobs`` processes); results in the order of ``cfgs``. ``on_done``
    (result) and ``on_run`` (configuration, result) are called as each run ends."""
    typical = TypicalPods.from_workloads([p.workload for p in pods])

    def ended(c: ReplayConfig, r: dict) -> None:
        if on_done is not None:
            on_done(r)
        if on_run is not None:
            on_run(c, r)

    if jobs <= 1:
        out = []
        for c in cfgs:
            r = replay(nodes, pods, c, times_from, typical)
            ended(c, r)
            out.append(r)
        return out
    from concurrent.futures import ProcessPoolExecutor, as_completed

    res: dict[int, dict] = {}
    with ProcessPoolExecutor(max_workers=jobs) as ex:
        futs = {ex.submit(_run_one, (nodes, pods, c, times_from, typical)): i for i, c in enumerate(cfgs)}
        for f in as_completed(futs):
            i = futs[f]
            res[i] = f.result()
            ended(cfgs[i], res[i])
    return [res[i] for i in range(len(cfgs))]
