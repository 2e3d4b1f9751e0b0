"""Prometheus metrics (`relocator_router_*`), one registry per router instance."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .transport import Hooks


class PromHooks(Hooks):
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("relocator_router_requests", "Requests by backend and status",
                                ["backend", "status"], registry=r)
        self.inflight = Gauge("relocator_router_in_flight", "Requests in flight by backend",
                              ["backend"], registry=r)
        self.ttfb_h = Histogram("relocator_router_ttfb_seconds",
                                "Time to first byte sent to the client",
                                buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5,
                                         1, 2.5, 5, 10, 30), registry=r)
        self.held = Gauge("relocator_router_held_requests",
                          "Requests waiting for a held worker", registry=r)
        self.cont = Counter("relocator_router_continued_streams",
                            "Streams continued after a break, by outcome", ["outcome"],
                            registry=r)
        self.splices = Counter("relocator_router_splices",
                               "Continued legs by where the splice fell: inside a character "
                               "(char), inside text held back for a stop string (stop_buffer), "
                               "clean, or engine_text (no tokenizer: the engine's text is sent)",
                               ["at"], registry=r)
        self.spliced_streams = Counter(
            "relocator_router_spliced_streams",
            "Continued streams (counted at their end), once for each kind of splice they had",
            ["at"], registry=r)
        self.inexact = Counter(
            "relocator_continuations_inexact",
            "Continued streams whose continuation may differ from the uninterrupted run, by "
            "reason (docs/router.md, \"What a continuation keeps\"), once per stream and reason",
            ["reason"], registry=r)
        self.retries = Counter("relocator_router_retries",
                               "Upstream attempts retried before the first byte", registry=r)
        self.engine_failures = Counter(
            "relocator_router_engine_failures",
            "Engine failures seen: an in-stream error event with code >= 500 (stream) or a "
            "500/502/503/504 answer before any byte (first); each continued or retried on "
            "another replica where one is left",
            ["where"], registry=r)
        self.suspects = Counter("relocator_router_suspect_holds",
                                "Workers held by the router because it could not reach them",
                                ["backend"], registry=r)
        self.suspect_ends = Counter("relocator_router_suspect_hold_ends",
                                    "Suspect holds ended, by outcome (control: switch, release, "
                                    "hold or remove; recovered: healthy probe; timeout)",
                                    ["outcome"], registry=r)
        self.errors = Counter("relocator_router_errors", "Requests refused by the router",
                              ["code"], registry=r)
        # not relocator_router_*: it is the relocation's figure (docs/observability.md), the
        # router is only where it can be measured
        self.blackout_h = Histogram(
            "relocator_relocation_blackout_seconds",
            "Per switch of a worker (a relocation, its rollback, or a replacement) that client "
            "requests were waiting on: the longest pause one of them saw, from its last bytes "
            "before (a stream cut over) or its arrival (a request held) to its first bytes after",
            buckets=(.05, .1, .25, .5, 1, 2, 3, 5, 10, 20, 30, 60, 120), registry=r)

    def request_done(self, worker: str, status: int) -> None:
        self.requests.labels(worker, str(status)).inc()

    def ttfb(self, seconds: float) -> None:
        self.ttfb_h.observe(seconds)

    def in_flight(self, worker: str, delta: int) -> None:
        self.inflight.labels(worker).inc(delta)

    def continued(self, outcome: str) -> None:
        self.cont.labels(outcome).inc()

    def splice(self, at: str) -> None:
        self.splices.labels(at).inc()

    def stream_spliced(self, kinds: list[str]) -> None:
        for at in kinds:
            self.spliced_streams.labels(at).inc()

    def continuation_inexact(self, reason: str) -> None:
        self.inexact.labels(reason).inc()

    def retried(self) -> None:
        self.retries.inc()

    def engine_failure(self, where: str) -> None:
        self.engine_failures.labels(where).inc()

    def suspect_hold(self, worker: str) -> None:
        self.suspects.labels(worker).inc()

    def suspect_end(self, worker: str, outcome: str) -> None:
        self.suspect_ends.labels(outcome).inc()

    def blackout(self, seconds: float) -> None:
        self.blackout_h.observe(seconds)

    def held_changed(self, n: int) -> None:
        self.held.set(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)
