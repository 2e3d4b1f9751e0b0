"""Making room in a replay (relocator.sim.replay): the planner's moves for a blocked head, the
suspension of lower-priority pods when no plan exists, consolidation, and the flights (moves or
suspensions under way) they start. A mixin of `Replay`: it reads and updates the run's state."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from relocator.planner.cluster import MILLI, Placement, Plan, Workload
from relocator.planner.planners import consolidate, defragment
from relocator.sim.stream import Job, ReplayMode

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


class RoomMaker:
    """`Replay`'s moves and suspensions (its state lives on the `Replay`)."""

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
        choice = self._suspension_choice(self.jobs[hid], budget)
        if choice is None:
            return False
        nd, chosen = choice
        self._suspend(hid, nd, chosen)
        return True

    def _suspension_choice(self, head: Job, budget: int) -> tuple[int, list[int]] | None:
        """The node and the slots of the fewest (then least GPU) lower-priority pods to suspend
        there for `head` to fit, at most `budget` of them; None if no node works."""
        c = self.cluster
        w = head.workload
        sl = c._slots
        cands: list[int] = []
        for wid, s in c._slot_of.items():
            j = self.by_id.get(wid)
            if j is None or j.busy or j.priority >= head.priority:
                continue
            cands.append(s)
        if not cands:
            return None
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
            return None
        return best[1], best[2]

    def _suspend(self, hid: int, nd: int, chosen: list[int]) -> None:
        """Suspend the pods in slots `chosen` (node `nd`) for head `hid`: one flight."""
        c = self.cluster
        w = self.jobs[hid].workload
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

    def _consolidate(self) -> None:
        k = min(self.cfg.consolidate_moves, int(math.floor(self._tokens())))
        if k <= 0:
            return
        plan = consolidate(self.cluster, max_moves=k, policy="best-fit", rng=self.rng)
        plan = Plan(tuple(m for m in plan.moves if not self.by_id[m.workload].busy))
        if plan.num_moves:
            self._begin_moves(plan, None)
