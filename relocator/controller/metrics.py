"""The controller's Prometheus metrics, derived at scrape time from the facts it stores.

Counters and histograms are computed from the relocation records (one per relocation, kept in
the controller's sqlite store), gauges from the worker records and Ray's view of the nodes.
Nothing is counted in memory, so a restarted controller reports the same totals and a scrape
can be checked against `relocator status` exactly. Served on the controller's own endpoint
(`serve`, loopback by default); `status()["metrics"]` names it. The router serves its own
metrics, among them `relocator_relocation_blackout_seconds` (it is what measures the pause).

Labels are bounded: results, reasons, phases, transfer modes, engines, worker states and node
names (the cluster's size); never a worker or relocation id.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from typing import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from relocator.controller.inventory import NodeInfo
from relocator.controller.model import PHASES, RUNNING, Relocation, WorkerRecord, WorkerState
from relocator.controller.states import HOLDING_STATES
from relocator.controller.store import Store

log = logging.getLogger("relocator.controller")

PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
IMAGE_BUCKETS = tuple(float(1 << s) for s in range(24, 41, 2))  # 16 MiB .. 1 TiB, x4
#: every state a worker record takes (WorkerRecord.state), so each series exists, at 0 too
WORKER_STATES = WorkerState.values()


def _histogram(name: str, doc: str, label_names: list[str], series: dict[tuple, list[float]],
               buckets: Iterable[float]) -> HistogramMetricFamily:
    h = HistogramMetricFamily(name, doc, labels=label_names)
    bounds = list(buckets)
    for labels, values in sorted(series.items()):
        counts = []
        for b in bounds:
            counts.append((floatToGoString(b), sum(1 for v in values if v <= b)))
        counts.append(("+Inf", len(values)))
        h.add_metric(list(labels), counts, sum_value=sum(values))
    return h


class ControllerCollector:
    """A prometheus_client collector over the controller's store and node inventory."""

    def __init__(self, store: Store, nodes: Callable[[], dict[str, NodeInfo]]) -> None:
        self.store = store
        self.nodes = nodes

    def collect(self) -> Iterator[Metric]:
        rels = self.store.relocations()
        workers = self.store.workers()
        yield from self.relocation_metrics(rels)
        yield from self.policy_metrics(self.store)
        yield from self.warm_metrics(self.store)
        yield from self.worker_metrics(workers, {r.engine for r in rels if r.engine})
        yield from self.demand_metrics(self.store.demands(), workers)
        try:
            nodes = self.nodes()
        except Exception as exc:  # noqa: BLE001 - the other metrics still answer
            log.warning("metrics: node inventory failed: %s", exc)
            nodes = {}
        yield from self.node_metrics(nodes)

    @staticmethod
    def relocation_metrics(rels: list[Relocation]) -> Iterator[Metric]:
        total = CounterMetricFamily(
            "relocator_relocations", "Finished relocations by result (done, rolled_back, failed), "
            "reason (none or why it did not simply succeed), transfer mode and engine",
            labels=["result", "reason", "transfer", "engine"])
        by: dict[tuple, int] = defaultdict(int)
        rollbacks: dict[tuple, int] = defaultdict(int)
        phases: dict[tuple, list[float]] = {(p,): [] for p in PHASES}
        images: dict[tuple, list[float]] = {(): []}
        running = 0
        for r in rels:
            for p in r.phases:  # every phase that ended, also in a relocation still running
                if p.get("ended") is not None and (p["name"],) in phases:
                    phases[(p["name"],)].append(max(0.0, p["ended"] - p["started"]))
            if r.result == RUNNING:
                running += 1
                continue
            by[(r.result, r.reason.value, r.transfer.value, r.engine or "unknown")] += 1
            if r.rollback.get("from_phase"):
                rollbacks[(r.rollback["from_phase"],)] += 1
            if r.image_bytes:
                images[()].append(float(r.image_bytes))
        for labels, n in sorted(by.items()):
            total.add_metric(list(labels), n)
        yield total
        rb = CounterMetricFamily("relocator_rollbacks", "Relocations rolled back, by the phase that failed "
                                 "(or was interrupted)", labels=["from_phase"])
        for labels, n in sorted(rollbacks.items()):
            rb.add_metric(list(labels), n)
        yield rb
        yield _histogram("relocator_relocation_phase_seconds", "Time each relocation phase took",
                         ["phase"], phases, PHASE_BUCKETS)
        yield _histogram("relocator_image_bytes", "Size of each relocation's checkpoint image", [], images,
                         IMAGE_BUCKETS)
        g = GaugeMetricFamily("relocator_relocations_running", "Relocations in progress")
        g.add_metric([], running)
        yield g

    @staticmethod
    def demand_metrics(demands: list, workers: list[WorkerRecord]) -> Iterator[Metric]:
        """Demands waiting for GPUs (launches that did not fit, suspended workers to resume),
        by kind; workers suspended (an image, no GPUs)."""
        from relocator.controller.model import DemandKind, DemandState

        g = GaugeMetricFamily("relocator_pending_demands", "Demands waiting for capacity, by kind",
                              labels=["kind"])
        counts = {k: 0 for k in DemandKind.values()}
        for d in demands:
            if d.state == DemandState.PENDING:
                counts[str(d.kind)] = counts.get(str(d.kind), 0) + 1
        for kind, n in sorted(counts.items()):
            g.add_metric([kind], n)
        yield g
        s = GaugeMetricFamily("relocator_suspended_workers", "Workers suspended: checkpointed, "
                              "GPUs released")
        s.add_metric([], sum(1 for w in workers if w.state == WorkerState.SUSPENDED))
        yield s
        now = time.time()
        p = GaugeMetricFamily("relocator_preemptible_workers", "Workers past their time limit: suspended "
                              "only when a waiting demand or a drain needs their GPUs")
        p.add_metric([], sum(1 for w in workers if w.past_deadline(now)))
        yield p
        b = GaugeMetricFamily("relocator_suspend_backoff_workers", "Workers whose last suspend failed: no "
                              "automatic suspend before their back-off ends")
        b.add_metric([], sum(1 for w in workers if w.suspend_backing_off(now)))
        yield b

    @staticmethod
    def worker_metrics(workers: list[WorkerRecord], engines: set[str]) -> Iterator[Metric]:
        g = GaugeMetricFamily("relocator_workers", "Workers by state and engine", labels=["state", "engine"])
        counts: dict[tuple[str, str], int] = defaultdict(int)
        for w in workers:
            counts[(w.state, w.engine or "unknown")] += 1
        engines = engines | {e for _, e in counts}
        for e in sorted(engines):
            for s in WORKER_STATES:
                counts.setdefault((s, e), 0)
        for (state, engine), n in sorted(counts.items()):
            g.add_metric([state, engine], n)
        yield g
        held = GaugeMetricFamily("relocator_worker_gpus", "GPUs each worker holds: whole GPUs, or its share of "
                                 "one GPU (0.25)", labels=["worker", "node", "kind"])
        for w in sorted(workers, key=lambda w: w.id):
            if w.reservation and w.state in HOLDING_STATES:
                held.add_metric([w.id, w.node, "share" if 0 < w.gpus < 1 else "whole"], w.gpus)
        yield held

    @staticmethod
    def policy_metrics(store: Store) -> Iterator[Metric]:
        """Policies' steps by outcome, and GPUs by health state (relocator.policies, stored)."""
        acts = CounterMetricFamily("relocator_policy_actions", "Steps policies took, by policy, action and result",
                                   labels=["policy", "action", "result"])
        for row in store.all("policy_actions"):
            acts.add_metric([row["policy"], row["action"], row["result"]], row["n"])
        yield acts
        gpus = GaugeMetricFamily("relocator_gpu_health", "GPUs that are not healthy, by node, GPU and state "
                                 "(draining: no new placement; ready_for_reset; failed)",
                                 labels=["node", "gpu", "state"])
        for g in store.all("gpu_health"):
            gpus.add_metric([g["node"], str(g["gpu"]), g["state"]], 1)
        yield gpus

    @staticmethod
    def warm_metrics(store: Store) -> Iterator[Metric]:
        """Warm image copies ahead of need by outcome (relocator.controller.warmcopies, stored)."""
        copies = CounterMetricFamily("relocator_warm_copies", "Warm image copies ahead of need, by outcome "
                                     "(copied, failed, deferred: gave way to a relocation or a start)",
                                     labels=["outcome"])
        for row in store.all("warm_copies"):  # relocator.controller.warmcopies.COUNTS
            copies.add_metric([row["outcome"]], row["n"])
        yield copies

    @staticmethod
    def node_metrics(nodes: dict[str, NodeInfo]) -> Iterator[Metric]:
        gpus = GaugeMetricFamily("relocator_node_gpus", "GPUs per node: total, and free (not reserved)",
                                 labels=["node", "kind"])
        up = GaugeMetricFamily("relocator_node_up", "1 if Ray sees the node alive, 0 once it is lost",
                               labels=["node"])
        for name, n in sorted(nodes.items()):
            gpus.add_metric([name, "total"], n.gpus_total)
            gpus.add_metric([name, "free"], n.gpus_free)
            up.add_metric([name], 1 if n.alive else 0)
        yield gpus
        yield up


def registry(store: Store, nodes: Callable[[], dict[str, NodeInfo]]) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(ControllerCollector(store, nodes))
    return reg


class MetricsServer:
    """`/metrics` on host:port in a thread of the controller. The port is remembered in the store,
    so a restarted controller serves on the same one (Prometheus' target stays valid)."""

    def __init__(self, store: Store, nodes: Callable[[], dict[str, NodeInfo]], host: str = "127.0.0.1",
                 port: int | None = None) -> None:
        from prometheus_client import start_http_server

        self.host = host
        saved = (store.get("meta", "metrics") or {}).get("port")
        want = [p for p in (port, saved) if p] + [0]
        reg = registry(store, nodes)
        last: Exception | None = None
        for p in want:
            try:
                self._server, self._thread = start_http_server(int(p), addr=host, registry=reg)
                break
            except OSError as exc:  # taken (by another process): the next choice
                last = exc
        else:  # pragma: no cover - even port 0 failed
            raise RuntimeError(f"controller metrics: cannot listen on {host}: {last}")
        self.port = int(self._server.server_address[1])
        if self.port != saved:
            store.put("meta", "metrics", {"port": self.port})

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
