"""Serving a replay's pending queue (relocator.sim.replay): FIFO, EASY backfill and the older
backfill without reservations; the same rules with and without moves. A mixin of `Replay`.

The head is the first pod in the queue (arrival order; suspended pods go back to their arrival
position). In every discipline only the head may make room (moves or suspensions), and a head
whose moves are under way is still the head: it blocks the queue as a head that fits nowhere
does, so moves never let a later pod past a waiting head unless the discipline's backfill would.

- ``fifo``: only the head may start.
- ``easy`` (EASY backfill, Lifka 1995; Slurm's ``sched/backfill`` with one reservation): a head
  that cannot start gets a reservation: the earliest time ``T`` it fits on some node ``R`` as the
  running pods end at their known end times (:func:`shadow`). A later pod (the next
  ``backfill_depth`` of the queue) may start now if it ends by ``T``, or if it starts on another
  node, or on ``R`` if the head still fits there at ``T`` with it. A head whose moves are under
  way has its reservation already: the node held for it (nobody else may start there) at the
  plan's end, so later pods may start on any other node.
- ``backfill``: later pods may start wherever they fit, with no reservation (large pods can starve).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from relocator.planner.cluster import Cluster, Workload
from relocator.sim.stream import QueueDiscipline, ReplayMode

_RESERVE = "~reserve:"  # the name prefix of a move's reservation on its destination


@dataclass
class Reservation:
    """The head's reservation: node ``node`` (an index) at time ``at``; ``cpu``, ``mem``, ``gpu``
    what that node will have free then (less what long backfilled pods there take)."""

    head: int
    key: tuple
    node: int | None
    at: float
    cpu: int = 0
    mem: int = 0
    gpu: np.ndarray | None = None

    def head_fits_with(self, head: Workload, w: Workload, gpus: tuple[int, ...]) -> bool:
        """Does the head still fit on the node at ``at`` if ``w`` runs there on ``gpus``?"""
        assert self.gpu is not None
        left = self.gpu.copy()
        for g in gpus:
            left[g] -= w.gpu_milli
        if self.cpu - w.cpu_milli < head.cpu_milli or self.mem - w.memory_mib < head.memory_mib:
            return False
        return head.num_gpu == 0 or int((left >= head.gpu_milli).sum()) >= head.num_gpu

    def take(self, w: Workload, gpus: tuple[int, ...]) -> None:
        assert self.gpu is not None
        self.cpu -= w.cpu_milli
        self.mem -= w.memory_mib
        for g in gpus:
            self.gpu[g] -= w.gpu_milli


def _group_cumsum(x: np.ndarray, first: np.ndarray) -> np.ndarray:
    """Running sums of ``x`` (rows) restarting where ``first`` is True."""
    cs = np.cumsum(x, axis=0)
    start = np.maximum.accumulate(np.where(first, np.arange(len(first)), 0))
    return cs - cs[start] + x[start]


def shadow(c: Cluster, w: Workload, end_of: Any, allowed: np.ndarray | None = None) -> tuple[int | None, float]:
    """The earliest time ``w`` fits on some node if the running pods end at ``end_of(id)``
    (``math.inf``: unknown) and nothing else starts, and that node (ties: the lowest index);
    ``(None, inf)`` if no such time. Only nodes in ``allowed`` (default all) count."""
    cand = (c.cpu_cap >= w.cpu_milli) & (c.mem_cap >= w.memory_mib)
    if w.num_gpu:
        cand &= (c.num_gpus >= w.num_gpu) & c.model_ok(w)
    if allowed is not None:
        cand &= allowed
    sl = c._slots
    live = c._live_slots()
    live = live[cand[sl.node[live]]]
    if len(live) == 0:
        return None, math.inf
    ends = np.fromiter((end_of(c._workloads[s].id) for s in live.tolist()), dtype=np.float64, count=len(live))  # type: ignore[union-attr]
    nd = sl.node[live]
    order = np.lexsort((ends, nd))
    live, nd, ends = live[order], nd[order], ends[order]
    first = np.r_[True, nd[1:] != nd[:-1]]
    cpu = c.cpu_left[nd] + _group_cumsum(sl.cpu[live], first)
    mem = c.mem_left[nd] + _group_cumsum(sl.mem[live], first)
    ok = (cpu >= w.cpu_milli) & (mem >= w.memory_mib) & np.isfinite(ends)
    if w.num_gpu:
        gpu = c.gpu_left[nd] + _group_cumsum(sl.use[live], first)
        ok &= (gpu >= w.gpu_milli).sum(axis=1) >= w.num_gpu
    if not ok.any():
        return None, math.inf
    k = int(np.flatnonzero(ok)[np.lexsort((nd[ok], ends[ok]))[0]])
    return int(nd[k]), float(ends[k])


class QueueServer:
    """`Replay`'s queue service (its state lives on the `Replay`)."""

    _res: Reservation | None = None  # the current head's reservation (EASY)

    def _serve(self) -> None:
        q = self.queue
        while q:
            hid = q[0]
            if hid in self.waiting:
                break  # its moves are under way: it is still the head
            if self._try_place(hid):
                q.popleft()
                continue
            if self.mode is not ReplayMode.NONE:
                self._make_room(hid)
                if not q or q[0] != hid:
                    continue  # it fitted after all
            break
        if len(q) < 2 or self.queue_kind is QueueDiscipline.FIFO:
            return
        res = self._reservation(q[0]) if self.queue_kind is QueueDiscipline.EASY else None
        i = 1
        while i < len(q) and i <= self.cfg.backfill_depth:
            jid = q[i]
            if jid not in self.waiting and (self._try_place(jid) if res is None else self._try_backfill(jid, res)):
                del q[i]
                continue
            i += 1

    def _try_place(self, jid: int, mask: np.ndarray | None = None, memo: Any = None) -> bool:
        """Start pod ``jid`` where the policy puts it, on the nodes of ``mask`` (default: all
        but held ones); False if it fits nowhere there."""
        j = self.jobs[jid]
        w = j.workload
        key = (w.cpu_milli, w.memory_mib, w.num_gpu, w.gpu_milli, w.gpu_model, memo)
        if self.fail_memo.get(key) == self.release_clock:
            return False  # nothing was freed since this shape last failed
        pl = self.pol.select(self.cluster, w, rng=self.rng, mask=self.mask if mask is None else mask)
        if pl is None:
            self.fail_memo[key] = self.release_clock
            return False
        self._start(j, pl.node, pl.gpus)
        return True

    # ------------------------------------------------------------------ EASY backfill
    def _end_of(self, wid: str) -> float:
        """When the running pod ``wid`` (or the moved pod a reservation stands for) ends."""
        if wid.startswith(_RESERVE):
            wid = wid.split(":", 2)[2]
        j = self.by_id.get(wid)
        return math.inf if j is None or j.end is None else float(j.end)

    def _reservation(self, hid: int) -> Reservation:
        """The head's reservation (kept while the head and the flights under way are the same)."""
        key = (self.fids, len(self.flights))
        res = self._res
        if res is not None and res.head == hid and res.key == key and self.now < res.at:
            return res
        if hid in self.waiting:  # its node is held until its moves are done
            res = Reservation(hid, key, None, math.inf)
        else:
            res = self._new_reservation(hid, key)
        self._res = res
        return res

    def _new_reservation(self, hid: int, key: tuple) -> Reservation:
        c = self.cluster
        node, at = shadow(c, self.jobs[hid].workload, self._end_of, self.mask)
        if node is None:
            return Reservation(hid, key, None, math.inf)
        cpu, mem, gpu = int(c.cpu_left[node]), int(c.mem_left[node]), c.gpu_left[node].copy()
        sl = c._slots
        for s in c._on_node[node]:
            if self._end_of(c._workloads[s].id) <= at:  # type: ignore[union-attr]
                cpu += int(sl.cpu[s])
                mem += int(sl.mem[s])
                gpu += sl.use[s]
        return Reservation(hid, key, node, at, cpu, mem, gpu)

    def _try_backfill(self, jid: int, res: Reservation) -> bool:
        """Start ``jid`` now if that does not delay the head's reservation ``res``."""
        if res.node is None:
            return self._try_place(jid)  # no reservation to keep, or the head's node is held
        j = self.jobs[jid]
        end = self.now + (j.duration if j.start is None else j.remaining)
        if end <= res.at:
            return self._try_place(jid)  # done before the head's time
        others = np.ones(self.cluster.num_nodes, dtype=bool) if self.mask is None else self.mask.copy()
        others[res.node] = False
        if self._try_place(jid, others, memo=res.node):
            return True
        return self._backfill_on_reserved(j, res)

    def _backfill_on_reserved(self, j: Any, res: Reservation) -> bool:
        """A pod running past the head's time may start on its node if the head still fits."""
        c = self.cluster
        w = j.workload
        node = res.node
        assert node is not None
        if (self.mask is not None and not self.mask[node]) or not c.fits_on(w, node):
            return False
        only = np.zeros(c.num_nodes, dtype=bool)
        only[node] = True
        pl = self.pol.select(c, w, rng=self.rng, mask=only)
        if pl is None or not res.head_fits_with(self.jobs[res.head].workload, w, pl.gpus):
            return False
        res.take(w, pl.gpus)
        self._start(j, pl.node, pl.gpus)
        return True
