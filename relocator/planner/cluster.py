"""Cluster model for the planner: nodes with CPU, memory and GPUs (milli-GPU per GPU), and the
workloads running on them.

Pure and synchronous: no Ray, no I/O. State is kept in numpy arrays so that a placement or a
defragmentation decision on a cluster of a few thousand nodes is a handful of vector operations.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

MILLI = 1000
"""One whole GPU, in milli-GPU."""


class PlannerError(ValueError):
    """A request the cluster model cannot honour (unknown node, overcommit, bad workload)."""


@dataclass(frozen=True)
class NodeSpec:
    """A node: its capacity. ``gpu_model`` is free text (``"A100"``, ``"T4"``...)."""

    id: str
    cpu_milli: int
    memory_mib: int
    gpus: int
    gpu_model: str = ""

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.gpus < 0:
            raise PlannerError(f"node {self.id!r}: capacities must be >= 0")


@dataclass(frozen=True)
class Workload:
    """A workload (an LLM serving worker, or a pod of the trace).

    ``num_gpu`` GPUs, each used at ``gpu_milli`` thousandths (a GPU-sharing workload has
    ``num_gpu=1, gpu_milli<1000``; multi-GPU workloads take whole GPUs). ``gpu_model`` restricts
    the nodes it may run on (``None`` or ``""``: any). ``move_cost_bytes`` is the state a
    relocation has to copy (weights, KV cache, process image)."""

    id: str
    cpu_milli: int = 0
    memory_mib: int = 0
    num_gpu: int = 0
    gpu_milli: int = 0
    gpu_model: str | None = None
    relocatable: bool = True
    move_cost_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "move_cost_bytes"):
            if getattr(self, name) < 0:
                raise PlannerError(f"workload {self.id!r}: {name} must be >= 0")
        if self.num_gpu > 0 and not 0 < self.gpu_milli <= MILLI:
            raise PlannerError(f"workload {self.id!r}: gpu_milli must be in 1..{MILLI} when num_gpu > 0")
        if self.num_gpu == 0 and self.gpu_milli != 0:
            raise PlannerError(f"workload {self.id!r}: gpu_milli must be 0 when num_gpu is 0")
        if self.num_gpu > 1 and self.gpu_milli != MILLI:
            raise PlannerError(f"workload {self.id!r}: multi-GPU workloads take whole GPUs (gpu_milli=1000)")

    @property
    def total_gpu_milli(self) -> int:
        return self.num_gpu * self.gpu_milli

    @property
    def is_gpu_share(self) -> bool:
        return self.num_gpu == 1 and self.gpu_milli < MILLI


@dataclass(frozen=True)
class Placement:
    """Where a workload runs: a node (by id) and the GPU indices on it."""

    node: str
    gpus: tuple[int, ...] = ()


@dataclass(frozen=True)
class Move:
    """Relocate running workload ``workload`` from node ``src`` to node ``dst`` (GPUs ``gpus``)."""

    workload: str
    src: str
    dst: str
    gpus: tuple[int, ...] = ()
    bytes: int = 0
    gpu_milli: int = 0


@dataclass(frozen=True)
class Plan:
    """Moves to apply in order; then, if ``placement`` is set, start ``workload`` there.

    Every prefix of ``moves`` leaves the cluster valid (no node over capacity)."""

    moves: tuple[Move, ...] = ()
    workload: str | None = None
    placement: Placement | None = None

    @property
    def num_moves(self) -> int:
        return len(self.moves)

    @property
    def bytes(self) -> int:
        return sum(m.bytes for m in self.moves)

    @property
    def moved_gpu_milli(self) -> int:
        return sum(m.gpu_milli for m in self.moves)


@dataclass
class _Slots:
    """Growable per-workload arrays (slot = row)."""

    cap: int
    n_gpu_cols: int
    node: np.ndarray = field(init=False)
    cpu: np.ndarray = field(init=False)
    mem: np.ndarray = field(init=False)
    use: np.ndarray = field(init=False)
    reloc: np.ndarray = field(init=False)
    nbytes: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.node = np.full(self.cap, -1, dtype=np.int64)
        self.cpu = np.zeros(self.cap, dtype=np.int64)
        self.mem = np.zeros(self.cap, dtype=np.int64)
        self.use = np.zeros((self.cap, self.n_gpu_cols), dtype=np.int64)
        self.reloc = np.zeros(self.cap, dtype=bool)
        self.nbytes = np.zeros(self.cap, dtype=np.int64)

    def grow(self) -> None:
        new = _Slots(self.cap * 2, self.n_gpu_cols)
        for name in ("node", "cpu", "mem", "use", "reloc", "nbytes"):
            getattr(new, name)[: self.cap] = getattr(self, name)
        self.cap = new.cap
        self.node, self.cpu, self.mem, self.use = new.node, new.cpu, new.mem, new.use
        self.reloc, self.nbytes = new.reloc, new.nbytes


class Cluster:
    """Nodes, their free resources, and the running workloads.

    Arrays (read them, do not write them; use :meth:`add`, :meth:`remove`, :meth:`move`):
    ``cpu_left``, ``mem_left`` (N,), ``gpu_left`` (N, G) free milli-GPU per GPU (0 for GPUs a
    node does not have), ``num_gpus`` (N,), ``model`` (N,) integer code of the GPU model.
    ``version`` (N,) changes whenever a node's free resources change (for caches).
    """

    def __init__(self, nodes: Sequence[NodeSpec]) -> None:
        if not nodes:
            raise PlannerError("a cluster needs at least one node")
        ids = [n.id for n in nodes]
        if len(set(ids)) != len(ids):
            raise PlannerError("node ids must be unique")
        self.nodes: tuple[NodeSpec, ...] = tuple(nodes)
        self.node_ids: tuple[str, ...] = tuple(ids)
        self._node_index = {nid: i for i, nid in enumerate(ids)}
        n = len(nodes)
        self.G = max(1, max(nd.gpus for nd in nodes))
        self.cpu_cap = np.array([nd.cpu_milli for nd in nodes], dtype=np.int64)
        self.mem_cap = np.array([nd.memory_mib for nd in nodes], dtype=np.int64)
        self.num_gpus = np.array([nd.gpus for nd in nodes], dtype=np.int64)
        models = sorted({nd.gpu_model for nd in nodes})
        self.model_codes = {m: i for i, m in enumerate(models)}
        self.model = np.array([self.model_codes[nd.gpu_model] for nd in nodes], dtype=np.int64)
        self.gpu_cap = np.zeros((n, self.G), dtype=np.int64)
        for i, nd in enumerate(nodes):
            self.gpu_cap[i, : nd.gpus] = MILLI
        self.cpu_left = self.cpu_cap.copy()
        self.mem_left = self.mem_cap.copy()
        self.gpu_left = self.gpu_cap.copy()
        self.version = np.zeros(n, dtype=np.int64)
        self._clock = 0
        self._slots = _Slots(64, self.G)
        self._slot_of: dict[str, int] = {}
        self._workloads: list[Workload | None] = []
        self._free_slots: list[int] = []
        self._on_node: list[set[int]] = [set() for _ in range(n)]

    # ----------------------------------------------------------------- introspection
    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    def node_index(self, node_id: str) -> int:
        try:
            return self._node_index[node_id]
        except KeyError:
            raise PlannerError(f"unknown node {node_id!r}") from None

    @property
    def gpu_capacity_milli(self) -> int:
        return int(self.gpu_cap.sum())

    @property
    def allocated_gpu_milli(self) -> int:
        return int((self.gpu_cap - self.gpu_left).sum())

    def workload(self, wid: str) -> Workload:
        return self._workloads[self._slot(wid)]  # type: ignore[return-value]

    def placement_of(self, wid: str) -> Placement:
        s = self._slot(wid)
        node = int(self._slots.node[s])
        gpus = tuple(int(g) for g in np.nonzero(self._slots.use[s])[0])
        return Placement(self.node_ids[node], gpus)

    def workloads_on(self, node_id: str) -> list[Workload]:
        i = self.node_index(node_id)
        return [self._workloads[s] for s in sorted(self._on_node[i])]  # type: ignore[misc]

    def running(self) -> list[Workload]:
        return [w for w in self._workloads if w is not None]

    def __contains__(self, wid: object) -> bool:
        return wid in self._slot_of

    def _slot(self, wid: str) -> int:
        try:
            return self._slot_of[wid]
        except KeyError:
            raise PlannerError(f"workload {wid!r} is not running in this cluster") from None

    # ----------------------------------------------------------------- feasibility
    def model_ok(self, w: Workload) -> np.ndarray:
        """(N,) bool: nodes whose GPU model the workload accepts."""
        if w.num_gpu == 0 or not w.gpu_model:
            return np.ones(self.num_nodes, dtype=bool)
        code = self.model_codes.get(w.gpu_model)
        if code is None:
            return np.zeros(self.num_nodes, dtype=bool)
        return self.model == code

    def feasible(self, w: Workload) -> np.ndarray:
        """(N,) bool: nodes where ``w`` fits now (CPU, memory, GPU count and share, model)."""
        ok = (self.cpu_left >= w.cpu_milli) & (self.mem_left >= w.memory_mib)
        if w.num_gpu > 0:
            ok &= (self.gpu_left >= w.gpu_milli).sum(axis=1) >= w.num_gpu
            ok &= self.model_ok(w)
        return ok

    def fits_on(self, w: Workload, node: int, gpus: Iterable[int] | None = None) -> bool:
        if self.cpu_left[node] < w.cpu_milli or self.mem_left[node] < w.memory_mib:
            return False
        if w.num_gpu == 0:
            return True
        if not self.model_ok(w)[node]:
            return False
        left = self.gpu_left[node]
        if gpus is None:
            return int((left >= w.gpu_milli).sum()) >= w.num_gpu
        g = tuple(gpus)
        if len(g) != w.num_gpu or len(set(g)) != len(g):
            return False
        return all(0 <= x < self.num_gpus[node] and left[x] >= w.gpu_milli for x in g)

    def default_gpus(self, w: Workload, node: int) -> tuple[int, ...]:
        """Best-fit GPU choice on ``node``: a sharing workload goes to the fullest GPU that still
        fits it; whole-GPU workloads take the lowest-numbered free GPUs."""
        if w.num_gpu == 0:
            return ()
        left = self.gpu_left[node]
        if w.gpu_milli < MILLI:
            cand = np.nonzero(left >= w.gpu_milli)[0]
            if len(cand) == 0:
                raise PlannerError(f"workload {w.id!r} does not fit on node {self.node_ids[node]!r}")
            return (int(cand[np.argmin(left[cand])]),)
        free = np.nonzero(left >= w.gpu_milli)[0]
        if len(free) < w.num_gpu:
            raise PlannerError(f"workload {w.id!r} does not fit on node {self.node_ids[node]!r}")
        return tuple(int(x) for x in free[: w.num_gpu])

    # ----------------------------------------------------------------- mutation
    def _touch(self, node: int) -> None:
        self._clock += 1
        self.version[node] = self._clock

    def add(self, w: Workload, node: str | int, gpus: Sequence[int] | None = None) -> Placement:
        """Start ``w`` on ``node``; raises :class:`PlannerError` if it does not fit."""
        if w.id in self._slot_of:
            raise PlannerError(f"workload {w.id!r} is already running")
        ni = node if isinstance(node, (int, np.integer)) else self.node_index(node)
        ni = int(ni)
        if gpus is None:
            if not self.fits_on(w, ni):
                raise PlannerError(f"workload {w.id!r} does not fit on node {self.node_ids[ni]!r}")
            gpus = self.default_gpus(w, ni)
        gpus = tuple(int(g) for g in gpus)
        if not self.fits_on(w, ni, gpus):
            raise PlannerError(f"workload {w.id!r} does not fit on node {self.node_ids[ni]!r} GPUs {gpus}")
        if self._free_slots:
            s = self._free_slots.pop()
        else:
            s = len(self._workloads)
            self._workloads.append(None)
            while s >= self._slots.cap:
                self._slots.grow()
        sl = self._slots
        sl.node[s] = ni
        sl.cpu[s] = w.cpu_milli
        sl.mem[s] = w.memory_mib
        sl.use[s] = 0
        for g in gpus:
            sl.use[s, g] = w.gpu_milli
        sl.reloc[s] = w.relocatable
        sl.nbytes[s] = w.move_cost_bytes
        self._workloads[s] = w
        self._slot_of[w.id] = s
        self._on_node[ni].add(s)
        self.cpu_left[ni] -= w.cpu_milli
        self.mem_left[ni] -= w.memory_mib
        self.gpu_left[ni] -= sl.use[s]
        self._touch(ni)
        return Placement(self.node_ids[ni], gpus)

    def remove(self, wid: str) -> Placement:
        """Stop workload ``wid``; returns where it was."""
        s = self._slot(wid)
        place = self.placement_of(wid)
        sl = self._slots
        ni = int(sl.node[s])
        self.cpu_left[ni] += sl.cpu[s]
        self.mem_left[ni] += sl.mem[s]
        self.gpu_left[ni] += sl.use[s]
        sl.node[s] = -1
        sl.use[s] = 0
        self._on_node[ni].discard(s)
        del self._slot_of[wid]
        self._workloads[s] = None
        self._free_slots.append(s)
        self._touch(ni)
        return place

    def move(self, wid: str, dst: str | int, gpus: Sequence[int] | None = None) -> Move:
        """Relocate a running workload; the cluster stays valid (raises and changes nothing if
        the workload does not fit on ``dst``)."""
        w = self.workload(wid)
        if not w.relocatable:
            raise PlannerError(f"workload {wid!r} is not relocatable")
        di = dst if isinstance(dst, (int, np.integer)) else self.node_index(dst)
        di = int(di)
        src = self.placement_of(wid)
        if self.node_ids[di] == src.node:
            raise PlannerError(f"workload {wid!r} already runs on {src.node!r}")
        if gpus is None:
            if not self.fits_on(w, di):
                raise PlannerError(f"workload {wid!r} does not fit on node {self.node_ids[di]!r}")
            gpus = self.default_gpus(w, di)
        if not self.fits_on(w, di, gpus):
            raise PlannerError(f"workload {wid!r} does not fit on node {self.node_ids[di]!r} GPUs {tuple(gpus)}")
        self.remove(wid)
        place = self.add(w, di, gpus)
        return Move(wid, src.node, place.node, place.gpus, w.move_cost_bytes, w.total_gpu_milli)

    def copy(self) -> "Cluster":
        new = Cluster.__new__(Cluster)
        new.__dict__.update(self.__dict__)
        for name in ("cpu_left", "mem_left", "gpu_left", "version"):
            setattr(new, name, getattr(self, name).copy())
        sl = _Slots(self._slots.cap, self.G)
        for name in ("node", "cpu", "mem", "use", "reloc", "nbytes"):
            getattr(sl, name)[:] = getattr(self._slots, name)
        new._slots = sl
        new._slot_of = dict(self._slot_of)
        new._workloads = list(self._workloads)
        new._free_slots = list(self._free_slots)
        new._on_node = [set(s) for s in self._on_node]
        return new

    def check(self) -> None:
        """Raise :class:`PlannerError` if any node is over capacity or the books disagree."""
        if (self.cpu_left < 0).any() or (self.mem_left < 0).any() or (self.gpu_left < 0).any():
            raise PlannerError("a node is over capacity")
        if (self.gpu_left > self.gpu_cap).any():
            raise PlannerError("a GPU has more free capacity than it has")
        sl = self._slots
        live = sl.node >= 0
        used_gpu = np.zeros_like(self.gpu_cap)
        np.add.at(used_gpu, sl.node[live], sl.use[live])
        used_cpu = np.bincount(sl.node[live], weights=sl.cpu[live], minlength=self.num_nodes)
        used_mem = np.bincount(sl.node[live], weights=sl.mem[live], minlength=self.num_nodes)
        if not np.array_equal(self.gpu_cap - used_gpu, self.gpu_left):
            raise PlannerError("GPU books disagree")
        if not np.allclose(self.cpu_cap - used_cpu, self.cpu_left) or not np.allclose(self.mem_cap - used_mem, self.mem_left):
            raise PlannerError("CPU/memory books disagree")

    # ----------------------------------------------------------------- slot views (planner use)
    def _live_slots(self) -> np.ndarray:
        return np.nonzero(self._slots.node >= 0)[0]
