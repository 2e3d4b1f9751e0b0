"""Placement policies, registered by name: ``random``, ``best-fit``, ``dot-product``, ``fgd``.

They follow the FGD authors' simulator (hkust-adsl/kubernetes-scheduler-simulator,
``pkg/simulator/plugin/*_score.go``) exactly where it matters for the results:

- scores are integers 0..100 computed as there (Go's ``int64()`` truncation) and ties go to the
  node that comes first (the authors patched kube-scheduler's ``selectHost`` to take the smallest
  node name, for reproducibility);
- best-fit: ``100 * (1 - sum_i w_i (free_i - req_i) / maxspec_i)`` over (CPU, GPU), weights 0.5,
  max spec 128 cores / 8 GPUs; GPU choice "best" (fullest GPU that fits);
- dot-product: ``100 * (1 - (free . req) / 2)`` with both vectors normalised by the max spec
  ("merge" dimension, "max" normalisation); GPU choice "best";
- random: a uniformly random feasible node, random fitting GPU;
- FGD: ``100 * sigmoid((F(n) - F(n'))/1000)`` where F is the node's GPU fragmentation measured
  against the typical workload distribution and n' the node after placement; for GPU-sharing
  workloads each fitting GPU is tried and the best one is used.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable

import numpy as np

from relocator.choices import Choice
from relocator.planner.cluster import Cluster, Placement, PlannerError, Workload

MAX_SPEC_CPU = 128_000.0
MAX_SPEC_GPU = 8_000.0
MAX_NODE_SCORE = 100


# ---------------------------------------------------------------------------------- typical pods
@dataclass(frozen=True)
class TypicalPods:
    """The target workload distribution FGD measures fragmentation against: resource shapes
    ``(cpu_milli, num_gpu, gpu_milli, gpu_model)`` with their frequencies (summing to 1)."""

    cpu: np.ndarray
    num_gpu: np.ndarray
    gpu_milli: np.ndarray
    model: tuple[str, ...]
    freq: np.ndarray

    def __len__(self) -> int:
        return len(self.freq)

    @classmethod
    def from_workloads(
        cls,
        workloads: Iterable[Workload],
        popularity_threshold: float = 95.0,
        include_cpu_only: bool = True,
    ) -> "TypicalPods":
        """The authors' ``GetTypicalPods`` with the settings of their experiments
        (``isInvolvedCpuPods: true, podPopularityThreshold: 95, podIncreaseStep: 1``): the most
        common shapes that cover ``popularity_threshold`` % of the workloads, renormalised."""
        counts: Counter[tuple[int, int, int, str]] = Counter()
        for w in workloads:
            if not include_cpu_only and w.num_gpu == 0:
                continue
            counts[(w.cpu_milli, w.num_gpu, w.gpu_milli, w.gpu_model or "")] += 1
        if not counts:
            return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64), (), np.zeros(0))
        total = sum(counts.values())
        # decreasing count; ties in a fixed order (Go's map order is random there)
        ordered = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
        expected = popularity_threshold * total / 100.0
        chosen: list[tuple[tuple[int, int, int, str], int]] = []
        cum = 0
        for key, c in ordered:
            if cum >= expected:
                break
            chosen.append((key, c))
            cum += c
        freq = np.array([c / cum for _, c in chosen], dtype=np.float64)
        return cls(
            cpu=np.array([k[0] for k, _ in chosen], dtype=np.int64),
            num_gpu=np.array([k[1] for k, _ in chosen], dtype=np.int64),
            gpu_milli=np.array([k[2] for k, _ in chosen], dtype=np.int64),
            model=tuple(k[3] for k, _ in chosen),
            freq=freq,
        )


def fragmentation(
    cpu_left: np.ndarray, gpu_left: np.ndarray, model: np.ndarray, typical: TypicalPods, model_codes: dict[str, int]
) -> np.ndarray:
    """FGD's node fragmentation (``NodeGpuShareFragAmountScore``), vectorised over nodes and shapes.

    ``cpu_left`` (M,), ``gpu_left`` (M, G), ``model`` (M,) -> (M,) expected milli-GPU that the
    typical workload cannot use: for each typical shape, all free GPU if the shape does not fit
    the node (or needs no GPU), else the free milli-GPU on GPUs too small for it."""
    total = gpu_left.sum(axis=1).astype(np.float64)
    if len(typical) == 0:
        return np.zeros(len(cpu_left), dtype=np.float64)
    milli = typical.gpu_milli
    # the GPU side depends only on the share asked, and the shapes ask few distinct ones
    uniq, inv = _distinct_milli(milli.astype(np.int64, copy=False).tobytes())
    big = gpu_left[None, :, :] >= uniq[:, None, None]  # (U, M, G): GPUs large enough for share u
    small = np.where(big, 0, gpu_left[None, :, :]).sum(axis=2)[inv]  # (T, M) free milli on GPUs too small
    ok = (np.count_nonzero(big, axis=2)[inv] >= typical.num_gpu[:, None]) & (cpu_left[None, :] >= typical.cpu[:, None])
    ok &= (milli > 0)[:, None]  # a shape that needs no GPU cannot use any: all free GPU counts
    need = _needs_model(typical.model)
    if need.any():
        codes = np.array([model_codes.get(m, -1) for m in typical.model], dtype=np.int64)
        ok &= ~need[:, None] | (model[None, :] == codes[:, None])
    contrib = typical.freq[:, None] * np.where(ok, small, total[None, :])
    # cumsum adds the shapes one after the other, in their order: the same float sums as a loop
    # over shapes (a plain sum over axis 0 may add pairwise and differ in the last bits)
    return np.cumsum(contrib, axis=0)[-1]


@lru_cache(maxsize=64)
def _distinct_milli(milli: bytes) -> tuple[np.ndarray, np.ndarray]:
    """The distinct GPU shares of the typical shapes (``gpu_milli`` as bytes), and each shape's index in them."""
    uniq, inv = np.unique(np.frombuffer(milli, dtype=np.int64), return_inverse=True)
    return uniq, inv.reshape(-1)


@lru_cache(maxsize=64)
def _needs_model(models: tuple[str, ...]) -> np.ndarray:
    """(T,) which typical shapes ask for one GPU model."""
    return np.array([bool(m) for m in models], dtype=bool)


def cluster_fragmentation_milli(cluster: Cluster, typical: TypicalPods) -> float:
    """Sum of node fragmentation over the cluster, in milli-GPU."""
    return float(fragmentation(cluster.cpu_left, cluster.gpu_left, cluster.model, typical, cluster.model_codes).sum())


# ---------------------------------------------------------------------------------- policies
class Policy:
    """A placement policy: integer scores 0..100 for the feasible nodes, highest wins, ties to
    the lowest node index. ``rng`` is used only by the random policy."""

    name: str = "?"
    gpu_select: str = "best"  # "best" | "random" | "self"

    def scores(self, cluster: Cluster, w: Workload, nodes: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """Scores for node indices ``nodes`` (all feasible); and, for policies that choose the GPU
        themselves, the GPU index per node (-1: default)."""
        raise NotImplementedError

    def select(
        self,
        cluster: Cluster,
        w: Workload,
        rng: np.random.Generator | None = None,
        mask: np.ndarray | None = None,
    ) -> Placement | None:
        """Where to start ``w`` now (``None``: it fits nowhere). ``mask`` (N,) limits the nodes."""
        feas = cluster.feasible(w)
        if mask is not None:
            feas &= mask
        nodes = np.nonzero(feas)[0]
        if len(nodes) == 0:
            return None
        sc, gpu_hint = self.scores(cluster, w, nodes)
        k = self._pick(sc, rng)
        node = int(nodes[k])
        gpus = self._gpus(cluster, w, node, None if gpu_hint is None else int(gpu_hint[k]), rng)
        return Placement(cluster.node_ids[node], gpus)

    def _pick(self, sc: np.ndarray, rng: np.random.Generator | None) -> int:
        # ties go to the lowest node index (the authors' simulator: smallest node name)
        return int(np.argmax(sc))

    def _gpus(self, cluster: Cluster, w: Workload, node: int, hint: int | None, rng: np.random.Generator | None) -> tuple[int, ...]:
        if w.num_gpu == 0:
            return ()
        if w.is_gpu_share:
            if hint is not None and hint >= 0:
                return (hint,)
            if self.gpu_select == "random" and rng is not None:
                cand = np.nonzero(cluster.gpu_left[node] >= w.gpu_milli)[0]
                return (int(cand[rng.integers(len(cand))]),)
        return cluster.default_gpus(w, node)


class RandomPolicy(Policy):
    name = "random"
    gpu_select = "random"

    def scores(self, cluster, w, nodes):
        return np.zeros(len(nodes), dtype=np.int64), None

    def _pick(self, sc: np.ndarray, rng: np.random.Generator | None) -> int:
        return int(rng.integers(len(sc))) if rng is not None else 0


class BestFitPolicy(Policy):
    name = "best-fit"

    def scores(self, cluster, w, nodes):
        cpu_free = cluster.cpu_left[nodes].astype(np.float64)
        gpu_free = cluster.gpu_left[nodes].sum(axis=1).astype(np.float64)
        s = (cpu_free - w.cpu_milli) / MAX_SPEC_CPU * 0.5
        s = s + (gpu_free - w.total_gpu_milli) / MAX_SPEC_GPU * 0.5
        return np.floor((1.0 - s) * MAX_NODE_SCORE).astype(np.int64), None


class DotProductPolicy(Policy):
    name = "dot-product"

    def scores(self, cluster, w, nodes):
        cpu_free = cluster.cpu_left[nodes].astype(np.float64) / MAX_SPEC_CPU
        gpu_free = cluster.gpu_left[nodes].sum(axis=1).astype(np.float64) / MAX_SPEC_GPU
        dot = cpu_free * (w.cpu_milli / MAX_SPEC_CPU) + gpu_free * (w.total_gpu_milli / MAX_SPEC_GPU)
        return np.floor((1.0 - dot / 2.0) * MAX_NODE_SCORE).astype(np.int64), None


def _sigmoid_score(delta: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-delta / 1000.0))
    return np.floor(s * MAX_NODE_SCORE).astype(np.int64)


class FGDPolicy(Policy):
    """Fragmentation gradient descent (Weng et al., USENIX ATC'23).

    ``typical``: the workload distribution to measure fragmentation against; without it, the
    shapes of the workloads running in the cluster (plus the one being placed) are used.
    Scores are cached per node and workload shape and recomputed only for nodes that changed."""

    name = "fgd"
    gpu_select = "self"

    def __init__(self, typical: TypicalPods | None = None) -> None:
        self.typical = typical
        self._cache_key: object = None
        self._frag_ver: np.ndarray | None = None
        self._frag: np.ndarray | None = None
        self._shape_cache: dict[tuple[int, int, int], tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def _typical_for(self, cluster: Cluster, w: Workload) -> TypicalPods:
        if self.typical is not None:
            return self.typical
        return TypicalPods.from_workloads([*cluster.running(), w])

    def _reset_if_new(self, cluster: Cluster, typical: TypicalPods) -> None:
        key = (id(cluster), id(typical), cluster.num_nodes)
        if key != self._cache_key:
            self._cache_key = key
            self._frag_ver = None
            self._frag = None
            self._shape_cache = {}

    def node_frag(self, cluster: Cluster, typical: TypicalPods) -> np.ndarray:
        """(N,) current fragmentation of every node (cached by node version)."""
        self._reset_if_new(cluster, typical)
        if self._frag is None or self._frag_ver is None:
            self._frag = fragmentation(cluster.cpu_left, cluster.gpu_left, cluster.model, typical, cluster.model_codes)
            self._frag_ver = cluster.version.copy()
        else:
            stale = np.nonzero(self._frag_ver != cluster.version)[0]
            if len(stale):
                self._frag[stale] = fragmentation(
                    cluster.cpu_left[stale], cluster.gpu_left[stale], cluster.model[stale], typical, cluster.model_codes
                )
                self._frag_ver[stale] = cluster.version[stale]
        return self._frag

    def _score_nodes(self, cluster: Cluster, w: Workload, idx: np.ndarray, typical: TypicalPods, before: np.ndarray):
        """Scores (and GPU choice) of placing ``w`` on nodes ``idx`` (fit not assumed)."""
        cpu = cluster.cpu_left[idx] - w.cpu_milli
        left = cluster.gpu_left[idx]
        model = cluster.model[idx]
        M, G = left.shape
        if w.is_gpu_share:
            # try every GPU of every node: (M*G) candidate states
            cand = np.repeat(left[:, None, :], G, axis=1)  # (M, G, G)
            eye = np.eye(G, dtype=np.int64) * w.gpu_milli
            cand = cand - eye[None, :, :]
            after = fragmentation(
                np.repeat(cpu, G), cand.reshape(M * G, G), np.repeat(model, G), typical, cluster.model_codes
            ).reshape(M, G)
            sc = _sigmoid_score(before[:, None] - after)
            valid = left >= w.gpu_milli
            sc = np.where(valid, sc, -1)
            gpu = np.argmax(sc, axis=1)  # first GPU with the highest score
            return sc[np.arange(M), gpu], gpu
        new = left.copy()
        if w.num_gpu > 0:
            # the authors' NodeResource.Sub: ascending free GPUs, take the first that fit
            order = np.argsort(left, axis=1, kind="stable")
            sl = np.take_along_axis(left, order, axis=1)
            fit = sl >= w.gpu_milli
            take = fit & (np.cumsum(fit, axis=1) <= w.num_gpu)
            sl = sl - np.where(take, w.gpu_milli, 0)
            np.put_along_axis(new, order, sl, axis=1)
        after = fragmentation(cpu, new, model, typical, cluster.model_codes)
        return _sigmoid_score(before - after), np.full(M, -1, dtype=np.int64)

    def scores(self, cluster, w, nodes):
        typical = self._typical_for(cluster, w)
        before = self.node_frag(cluster, typical)
        if self.typical is None:
            # no fixed target distribution: compute directly (controller-sized clusters)
            sc, gpu = self._score_nodes(cluster, w, nodes, typical, before[nodes])
            return sc, gpu
        key = (w.cpu_milli, w.num_gpu, w.gpu_milli)
        ent = self._shape_cache.get(key)
        if ent is None:
            n = cluster.num_nodes
            ent = (np.full(n, -1, dtype=np.int64), np.zeros(n, dtype=np.int64), np.full(n, -1, dtype=np.int64))
            self._shape_cache[key] = ent
        ver, sc_all, gpu_all = ent
        stale = nodes[ver[nodes] != cluster.version[nodes]]
        if len(stale):
            sc, gpu = self._score_nodes(cluster, w, stale, typical, before[stale])
            sc_all[stale] = sc
            gpu_all[stale] = gpu
            ver[stale] = cluster.version[stale]
        return sc_all[nodes], gpu_all[nodes]


_REGISTRY: dict[str, Callable[..., Policy]] = {}
_ALIASES = {"bestfit": "best-fit", "best_fit": "best-fit", "dotprod": "dot-product", "dot_product": "dot-product",
            "dotproduct": "dot-product", "rand": "random"}


def register_policy(name: str, factory: Callable[..., Policy]) -> None:
    """Register a placement policy factory under ``name``."""
    _REGISTRY[name] = factory


def policy_names() -> list[str]:
    return list(_REGISTRY)


def policy_aliases() -> dict[str, str]:
    """Other spellings canonical_policy_name accepts, with the name each stands for."""
    return dict(_ALIASES)


def canonical_policy_name(name: str) -> str:
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in _REGISTRY:
        raise PlannerError(f"unknown policy {name!r}; known: {', '.join(_REGISTRY)}")
    return key


def get_policy(name: str | Policy, **kwargs) -> Policy:
    """A fresh policy by name (``random``, ``best-fit``, ``dot-product``, ``fgd``); FGD accepts
    ``typical=TypicalPods``."""
    if isinstance(name, Policy):
        return name
    key = canonical_policy_name(name)
    factory = _REGISTRY[key]
    if key == "fgd":
        return factory(**kwargs)
    return factory()


register_policy("random", RandomPolicy)
register_policy("best-fit", BestFitPolicy)
register_policy("dot-product", DotProductPolicy)
register_policy("fgd", FGDPolicy)


class _PolicyChoice(Choice):
    @classmethod
    def _missing_(cls, value: object) -> Choice:
        if isinstance(value, str):  # the names canonical_policy_name accepts
            key = _ALIASES.get(value.strip().lower(), value.strip().lower())
            if key != value and key in _REGISTRY:
                return cls(key)
        return super()._missing_(value)


#: the registered placement policies as a typed choice (config, CLI, controller); the aliases
#: above are accepted and become the canonical name
PlacementPolicy = _PolicyChoice("PlacementPolicy", {n.replace("-", "_").upper(): n for n in _REGISTRY},
                                module=__name__)
