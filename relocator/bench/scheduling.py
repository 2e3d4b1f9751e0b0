"""`relocator bench scheduling`: one scripted day on the local cluster, run twice.

`with_moves`: the controller makes room (the planner's fewest live moves), preempts lower
priorities by suspending them, requeues at time limits and resumes when capacity returns.
`without_moves`: a stock scheduler on the same day (place or wait): the controller plans no
move (`make_room_max_moves: 0`) and launches never make room or preempt (`make_room=False`);
a launch that does not fit is retried every second until it fits.

The day (times are seconds of the compressed day, `scale` stretches them): 3 nodes x 4 GPUs,
a fragmented start (one 1-GPU worker on each node), then launches of 1, 2 and 4 GPUs at two
priorities, stops, and two time limits. A few greedy streams run through the router all day
and are checked token by token (relocator.cluster.streams).

A launch's wait: from its request to its worker serving. A launch that never serves before its
scripted stop is a launch failure; its wait counts up to that stop (a lower bound).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from relocator import waits
from relocator.controller.controller import BLACKOUT_PHASES

MODEL = "tiny-llama"


@dataclass(frozen=True)
class Step:
    """A launch at `at`, stopped at `stop` (seconds of the day)."""

    id: str
    at: float
    gpus: int
    stop: float
    priority: int = 0
    time_limit_s: float | None = None


#: the fragmented start: one 1-GPU worker on each node (3 free GPUs everywhere, no node has 4)
BASE = (("b1", "n1"), ("b2", "n2"), ("b3", "n3"))
#: the day's launches, in order of their requests
DAY: tuple[Step, ...] = (
    Step("a", 5, 2, 70),
    Step("b", 10, 4, 65),
    Step("c", 20, 1, 125, time_limit_s=30),
    Step("d", 30, 2, 75, priority=1),
    Step("e", 40, 4, 90, priority=1),
    Step("f", 50, 1, 90),
    Step("g", 60, 2, 135, time_limit_s=25),
    Step("h", 75, 4, 115),
    Step("i", 90, 2, 130, priority=1),
    Step("j", 100, 1, 125),
)
DAY_END = 140.0
STREAMS = 2
MAX_TOKENS = 32


@dataclass
class Outcome:
    step: Step
    requested: float = 0.0
    served: float | None = None
    error: str = ""
    attempts: int = 0
    stopped: bool = False
    done: threading.Event = field(default_factory=threading.Event)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    xs = sorted(values)
    k = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return round(xs[k], 3)


class Day:
    """One run of the day against a started cluster `ctl`."""

    def __init__(self, ctl: Any, moves: bool, engine: str, scale: float, log: Callable[[str], None]) -> None:
        self.ctl, self.moves, self.engine, self.scale, self.log = ctl, moves, engine, scale, log
        self.t0 = 0.0
        self.out = {s.id: Outcome(s) for s in DAY}
        self._stop = threading.Event()

    def now(self) -> float:
        return (time.monotonic() - self.t0) / self.scale

    def _sleep_until(self, t: float) -> None:
        self._stop.wait(max(0.0, (t - self.now()) * self.scale))  # early when the run stops

    def _state(self, wid: str) -> str | None:
        for w in self.ctl.status()["workers"]:
            if w["id"] == wid:
                return w["state"]
        return None

    def _launch(self, o: Outcome) -> None:
        s = o.step
        self._sleep_until(s.at)
        o.requested = time.monotonic()
        try:  # until it serves, is given up, or its stop time comes (a try a second)
            waits.settle(lambda: o.stopped or self.now() >= s.stop or self._attempt(o), None, every=1.0)
        except Exception as exc:  # noqa: BLE001 - recorded as a launch failure
            o.error = str(exc)
        finally:
            o.done.set()

    def _attempt(self, o: Outcome) -> bool:
        """One launch: True when done (it serves, or its pending demand was not seated in time),
        False to try again (the stock scheduler: nothing fits)."""
        s = o.step
        o.attempts += 1
        kw = dict(worker_id=s.id, engine=self.engine, priority=s.priority, time_limit=s.time_limit_s)
        try:
            res = self.ctl.launch(MODEL, s.gpus, make_room=self.moves, **kw)
        except RuntimeError as exc:
            if self.moves or "exists" in str(exc):
                raise
            o.error = str(exc)
            return False
        if res.get("state") == "pending":  # queued: the reconcile loop seats it
            waits.settle(lambda: o.stopped or self.now() >= s.stop or self._state(s.id) == "running", None,
                         every=0.5)
            if self._state(s.id) != "running":
                return True
        o.served, o.error = time.monotonic(), ""
        self.log(f"{'moves' if self.moves else 'stock'} t={self.now():.0f}: {s.id} ({s.gpus} GPU, "
                 f"p{s.priority}) serves after {o.served - o.requested:.1f}s")
        return True

    def _stop_worker(self, o: Outcome) -> None:
        self._sleep_until(o.step.stop)
        o.stopped = True
        o.done.wait(120)
        waits.settle(lambda: self._try_stop(o.step.id), 120, every=1.0)

    def _try_stop(self, wid: str) -> bool:
        try:
            self.ctl.stop_worker(wid)
        except KeyError:  # never launched (or its pending demand is gone)
            pass
        except RuntimeError:  # busy (a move, a suspend, a resume): again in a moment
            return False
        return True

    def run(self) -> dict:
        from relocator.cluster.streams import Load, reference

        ctl = self.ctl
        for wid, node in BASE:
            ctl.launch(MODEL, 1, node=node, worker_id=wid, engine=self.engine)
        ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, STREAMS, STREAMS))
        cursor = ctl._call("events_cursor", timeout=60)
        load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, STREAMS).start()
        self.t0 = time.monotonic()
        threads = [threading.Thread(target=fn, args=(o,), daemon=True)
                   for o in self.out.values() for fn in (self._launch, self._stop_worker)]
        for t in threads:
            t.start()
        self._sleep_until(DAY_END)
        for t in threads:
            t.join(300)
        suspended_at_end = [w["id"] for w in ctl.status()["workers"] if w["state"] == "suspended"]
        load.stop()
        rep = load.report()
        for wid, _ in BASE:
            try:
                ctl.stop_worker(wid)
            except Exception as exc:  # noqa: BLE001
                self.log(f"stopping {wid}: {exc}")
        events = list(ctl.events(since=cursor, kinds=["worker_suspended", "relocation_finished", "worker_resumed"],
                                 idle_timeout=2.0, wait_s=1.0))
        moves = [e for e in events if e["kind"] == "relocation_finished" and e.get("result") == "done"]
        blackouts = [sum(v for k, v in (e.get("phases") or {}).items() if k in BLACKOUT_PHASES) for e in moves]
        multi = [o for o in self.out.values() if o.step.gpus >= 2]
        waits = [((o.served if o.served is not None else o.requested + (o.step.stop - o.step.at) * self.scale)
                  - o.requested) / self.scale for o in multi]
        by_gpus: dict[int, list[float]] = {}
        for o, w in zip(multi, waits):
            by_gpus.setdefault(o.step.gpus, []).append(w)
        failures = [o for o in self.out.values() if o.served is None]
        return {
            "launches": len(self.out),
            "launch_failures": len(failures),
            "wait_s_p50": _pct(waits, 50),
            "wait_s_p99": _pct(waits, 99),
            "wait_s_max": round(max(waits), 3) if waits else None,
            "waits_by_gpus": {g: {"launches": len(v), "served": sum(1 for o in multi if o.step.gpus == g
                                                                     and o.served is not None),
                                  "wait_s_p50": _pct(v, 50), "wait_s_max": round(max(v), 3)}
                              for g, v in sorted(by_gpus.items())},
            "suspends": sum(1 for e in events if e["kind"] == "worker_suspended"),
            "resumes": sum(1 for e in events if e["kind"] == "worker_resumed"),
            "moves": len(moves),
            "moves_failed": sum(1 for e in events if e["kind"] == "relocation_finished" and e.get("result") != "done"),
            "blackout_max_s": round(max(blackouts), 3) if blackouts else 0.0,
            "tokens_lost": rep["tokens_lost"],
            "tokens_duplicated": rep["tokens_duplicated"],
            "tokens_mismatched": rep["tokens_mismatched"],
            "text_mismatched": rep["text_mismatched"],
            "client_errors": rep["client_errors"],
            "requests": rep["requests"],
            "suspended_at_end": suspended_at_end,
            "waits_s": {o.step.id: round(((o.served or 0) - o.requested) / self.scale, 3) if o.served else None
                        for o in self.out.values()},
            "failures": {o.step.id: o.error[:200] for o in failures},
            "errors": rep["errors"],
        }


RUNS = (("with_moves", True), ("without_moves", False))


def one_run(key: str, base_dir: str, engine: str, scale: str | float) -> dict:
    """One day (`key`: with_moves or without_moves) on a local cluster of its own; logs to stderr."""
    import relocator
    from relocator.cluster.config import LocalConfig

    moves = dict(RUNS)[key]
    cfg = LocalConfig.load(None, cluster={"nodes": 3, "gpus_per_node": 4, "base_dir": f"{base_dir}/{key}"},
                           controller={"make_room_max_moves": 4 if moves else 0})
    t = time.monotonic()
    ctl = relocator.start(cfg)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        say(f"{key}: cluster up in {time.monotonic() - t:.1f}s; the day starts")
        return Day(ctl, moves, engine, float(scale), say).run()
    finally:
        ctl.down()


def run(base_dir: str = "/var/lib/relocator/bench-scheduling", engine: str = "reference", scale: float = 1.0,
        log: Callable[[str], None] = print, runs: tuple[str, ...] = ("with_moves", "without_moves")) -> dict:
    """The day with moves, then without; each on a fresh local cluster (3 nodes x 4 GPUs)."""
    out: dict[str, Any] = {}
    t_all = time.monotonic()
    for key, _ in (r for r in RUNS if r[0] in runs):
        # each run in a process of its own: a fresh Ray driver per cluster (a second cluster
        # in the same driver was seen refusing its first call)
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", "import sys, json; from relocator.bench.scheduling import "
                               "one_run; print(json.dumps(one_run(*sys.argv[1:5])))", key, base_dir, engine,
                               str(scale)], stdout=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the {key} run failed (exit {proc.returncode}); see its log above")
        out[key] = json.loads(proc.stdout.strip().splitlines()[-1])
        out[key]["seconds"] = round(time.monotonic() - t, 1)
        log(f"{key}: {out[key]}")
    if len(out) == 2:
        a, b = out["with_moves"], out["without_moves"]
        out["ratio_wait_without_over_with"] = {
            k: (round(b[k] / a[k], 1) if a[k] and b[k] is not None else None)
            for k in ("wait_s_p50", "wait_s_p99", "wait_s_max")}
    out["day"] = {"nodes": 3, "gpus_per_node": 4, "engine": engine, "scale": scale, "day_s": DAY_END,
                  "base": [w for w, _ in BASE], "launches": [s.__dict__ for s in DAY], "streams": STREAMS,
                  "max_tokens": MAX_TOKENS}
    out["seconds"] = round(time.monotonic() - t_all, 1)
    return out
