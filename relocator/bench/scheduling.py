"""`relocator bench scheduling`: one scripted day on the local cluster, once per preemption rule.

Each arm is the controller run with `controller.preemption` set to its rule
(relocator.controller.preemption), on a fresh local cluster, the same day, arrivals and streams:

- `place-or-wait`: a queue, no moves, no preemption;
- `evict-requeue`: a higher priority (or a demand meeting a worker past its time limit) kills
  the victim and requeues it as a launch that cold-starts later (Kubernetes / KAI, Slurm REQUEUE);
- `suspend-in-place`: the victim is stopped in place and continues there when its GPUs are free
  again (Slurm SUSPEND,GANG);
- `moves`: live moves make room, else the victim is suspended to the image store and resumed
  anywhere compatible.

Every arm queues a launch that does not fit (the controller's pending demands, retried by its
reconcile loop). The stock arms run the router as a stock gateway would (`continuation: false`:
it retries before the first byte only), so a stream whose worker is killed fails as its client
would see it; the moves arm runs the product's router (streams continued across a move).

The day (times are seconds of the compressed day, `scale` stretches them): 3 nodes x 4 GPUs,
a fragmented start (one 1-GPU worker on each node), then launches of 1, 2 and 4 GPUs at two
priorities, stops, and two time limits. A few greedy streams run through the router all day
and are checked token by token (relocator.cluster.streams).

A launch's wait: from its request to its worker serving. A launch that never serves before its
scripted stop is a launch failure; its wait counts up to that stop (a lower bound).

Warm images (issue 28, relocator/warm/) are on by default, as configs/images.yaml ships them:
every start of a kind a node has seen restores its image. `warm=False` runs every arm with
`RELOCATOR_WARM__ENABLED=0` (every start cold, nothing captured); each arm reports how its
starts went (`starts`, from the controller's `worker_started` events) and a `timeline` of the
events of its multi-GPU launches, so a wait can be taken apart (start, moves, queue).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from relocator import waits
from relocator.controller.controller import BLACKOUT_PHASES
from relocator.vocab import PreemptionRule

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
#: `--quick`: the day's first half (both 4-GPU launches, both priorities, one time limit), 70 s
QUICK: tuple[Step, ...] = (
    Step("a", 5, 2, 50),
    Step("b", 10, 4, 45),
    Step("c", 15, 1, 65, time_limit_s=15),
    Step("d", 20, 2, 55, priority=1),
    Step("e", 25, 4, 60, priority=1),
    Step("f", 30, 1, 60),
)
QUICK_END = 70.0
STREAMS = 2
MAX_TOKENS = 32
#: the arms, in the order they run: the stock rules, then ours
ARMS = (PreemptionRule.PLACE_OR_WAIT.value, PreemptionRule.EVICT_REQUEUE.value,
        PreemptionRule.SUSPEND_IN_PLACE.value, PreemptionRule.MOVES.value)
SAMPLE_S = 1.0  # how often the idle-GPU sampler reads the controller (seconds of the day)
#: the controller's events an arm reads after its day: its figures' and its timeline's
EVENT_KINDS = ("worker_suspended", "relocation_finished", "worker_resumed", "worker_evicted", "worker_started",
               "room_planned", "worker_preemptible", "warm_image_copied", "warm_copy_deferred", "demand_placed")
#: the fields a timeline entry keeps (the rest of an event is left out to keep the JSON short)
TIMELINE_FIELDS = ("worker", "worker_id", "node", "src", "dst", "demand", "how", "reason", "result", "seconds",
                   "by", "in_place", "moves", "suspends", "copied", "key")


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


def idle_while_waiting(samples: list[tuple[float, int, bool]]) -> float:
    """GPU-seconds idle while something waited: from (time, free GPUs, anything waiting)
    samples, each interval counted by its starting sample."""
    return round(sum(free * (b[0] - a_t) for (a_t, free, waiting), b in zip(samples, samples[1:]) if waiting), 3)


#: a failed request whose last event lies this close to a scripted stop (monotonic seconds,
#: before its call, after its return) is counted as the stop's, not the preemption rule's
STOP_SLACK_S = (0.5, 2.0)


def work_lost(results: list[Any], stops: list[tuple[float, float]] = ()) -> dict[str, int]:
    """Client-visible failed requests and the tokens they had already been sent (work lost);
    also split by cause: those that broke at a scripted stop (the day's jobs ending, the same in
    every arm: `stops` are the stop calls' monotonic intervals) and the rest (the rule's)."""
    bad = [r for r in results if r.error]
    lo, hi = STOP_SLACK_S
    at_stop = [r for r in bad if r.times and any(a - lo <= r.times[-1] <= b + hi for a, b in stops)]
    rest = [r for r in bad if r not in at_stop]
    return {"failed_requests": len(bad), "tokens_of_work_lost": sum(len(r.tokens) for r in bad),
            "failed_requests_at_scripted_stops": len(at_stop),
            "tokens_lost_at_scripted_stops": sum(len(r.tokens) for r in at_stop),
            "failed_requests_not_at_stops": len(rest),
            "tokens_of_work_lost_not_at_stops": sum(len(r.tokens) for r in rest)}


class Day:
    """One run of the day against a started cluster `ctl` whose controller has `rule`."""

    def __init__(self, ctl: Any, rule: str, engine: str, scale: float, log: Callable[[str], None],
                 day: tuple[Step, ...] = DAY, day_end: float = DAY_END) -> None:
        self.ctl, self.rule, self.engine, self.scale, self.log = ctl, PreemptionRule(rule), engine, scale, log
        self.day, self.day_end = day, day_end
        self.t0 = 0.0
        self.t0_wall = 0.0  # time.time() at t0: events carry wall-clock stamps
        self.out = {s.id: Outcome(s) for s in day}
        self.samples: list[tuple[float, int, bool]] = []
        self.stops: list[tuple[float, float]] = []  # scripted stops' calls (monotonic)
        self.stopped: dict[str, float] = {}  # worker -> when its scripted stop returned (monotonic)
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
        try:
            self._attempt(o)
        except Exception as exc:  # noqa: BLE001 - recorded as a launch failure
            o.error = str(exc)
        finally:
            o.done.set()

    def _attempt(self, o: Outcome) -> None:
        """One launch: it serves at once, or it is queued (a pending demand) and the controller
        seats it by its rule before the step's stop time, or it fails."""
        s = o.step
        o.attempts += 1
        res = self.ctl.launch(MODEL, s.gpus, make_room=True, worker_id=s.id, engine=self.engine,
                              priority=s.priority, time_limit=s.time_limit_s)
        if res.get("state") == "pending":  # queued: the reconcile loop seats it
            waits.settle(lambda: o.stopped or self.now() >= s.stop or self._state(s.id) == "running", None,
                         every=0.5)
            if self._state(s.id) != "running":
                o.error = "not seated before its stop"
                return
        o.served, o.error = time.monotonic(), ""
        self.log(f"{self.rule.value} t={self.now():.0f}: {s.id} ({s.gpus} GPU, p{s.priority}) serves after "
                 f"{(o.served - o.requested) / self.scale:.1f}s")

    def _stop_worker(self, o: Outcome) -> None:
        self._sleep_until(o.step.stop)
        o.stopped = True
        o.done.wait(120)
        waits.settle(lambda: self._try_stop(o.step.id), 120, every=1.0)

    def _try_stop(self, wid: str) -> bool:
        t = time.monotonic()
        try:
            self.ctl.stop_worker(wid)
            self.stops.append((t, time.monotonic()))
            self.stopped[wid] = time.monotonic()
        except KeyError:  # never launched (or its pending demand is gone)
            pass
        except RuntimeError:  # busy (a move, a suspend, a resume): again in a moment
            return False
        return True

    def _sample(self) -> None:
        """Free GPUs (Ray's view) and whether any demand waits, every SAMPLE_S of the day."""
        while not self._stop.is_set() and self.now() < self.day_end:
            try:
                st = self.ctl.status()
                free = sum(int(n.get("gpus_free", 0)) for n in st.get("nodes", []) if n.get("alive", True))
                self.samples.append((self.now(), free, bool(st.get("pending"))))
            except Exception as exc:  # noqa: BLE001 - a missed sample, not a failed day
                self.log(f"sample: {exc}")
            self._stop.wait(SAMPLE_S * self.scale)

    def run(self) -> dict:
        from relocator.cluster.streams import Load, reference

        ctl = self.ctl
        for wid, node in BASE:
            ctl.launch(MODEL, 1, node=node, worker_id=wid, engine=self.engine)
        ref = asyncio.run(reference(ctl.router_url, MODEL, MAX_TOKENS, STREAMS, STREAMS))
        cursor = ctl._call("events_cursor", timeout=60)
        load = Load(ctl.router_url, MODEL, ref, MAX_TOKENS, STREAMS).start()
        self.t0, self.t0_wall = time.monotonic(), time.time()
        threads = [threading.Thread(target=fn, args=(o,), daemon=True)
                   for o in self.out.values() for fn in (self._launch, self._stop_worker)]
        threads.append(threading.Thread(target=self._sample, daemon=True))
        for t in threads:
            t.start()
        self._sleep_until(self.day_end)
        for t in threads:
            t.join(300)
        t_end = time.monotonic()
        suspended_at_end = [w["id"] for w in ctl.status()["workers"] if w["state"] in ("suspended", "paused")]
        load.stop()
        rep = load.report(window=(self.t0, t_end))
        for wid, _ in BASE:
            try:
                ctl.stop_worker(wid)
            except Exception as exc:  # noqa: BLE001
                self.log(f"stopping {wid}: {exc}")
        events = list(ctl.events(since=cursor, kinds=list(EVENT_KINDS), idle_timeout=2.0, wait_s=1.0))
        return {**self.figures(events, rep, load.results), "suspended_at_end": suspended_at_end}

    def figures(self, events: list[dict], rep: dict, results: list[Any]) -> dict:
        """The arm's figures from its outcomes, the controller's events and the streams."""
        moves = [e for e in events if e["kind"] == "relocation_finished" and e.get("result") == "done"]
        phases = [sum(v for k, v in (e.get("phases") or {}).items() if k in BLACKOUT_PHASES) for e in moves]
        set_aside = [e for e in events if e["kind"] == "worker_evicted" or
                     (e["kind"] == "worker_suspended" and e.get("by"))]
        multi = [o for o in self.out.values() if o.step.gpus >= 2]
        wait = [((o.served if o.served is not None else o.requested + (o.step.stop - o.step.at) * self.scale)
                 - o.requested) / self.scale for o in multi]
        by_gpus: dict[int, list[float]] = {}
        for o, w in zip(multi, wait):
            by_gpus.setdefault(o.step.gpus, []).append(w)
        failures = [o for o in self.out.values() if o.served is None]
        return {
            "rule": self.rule.value,
            "launches": len(self.out),
            "launch_failures": len(failures),
            "wait_s_p50": _pct(wait, 50),
            "wait_s_p99": _pct(wait, 99),
            "wait_s_max": round(max(wait), 3) if wait else None,
            "waits_by_gpus": {g: {"launches": len(v), "served": sum(1 for o in multi if o.step.gpus == g
                                                                     and o.served is not None),
                                  "wait_s_p50": _pct(v, 50), "wait_s_max": round(max(v), 3)}
                              for g, v in sorted(by_gpus.items())},
            "preemptions": len(set_aside),
            "preemptions_by_reason": {r: sum(1 for e in set_aside if e.get("reason") == r)
                                      for r in sorted({e.get("reason") for e in set_aside})},
            "evictions": sum(1 for e in events if e["kind"] == "worker_evicted"),
            "suspends": sum(1 for e in events if e["kind"] == "worker_suspended" and not e.get("in_place")),
            "resumes": sum(1 for e in events if e["kind"] == "worker_resumed" and not e.get("in_place")),
            "pauses": sum(1 for e in events if e["kind"] == "worker_suspended" and e.get("in_place")),
            "continued_in_place": sum(1 for e in events if e["kind"] == "worker_resumed" and e.get("in_place")),
            "moves": len(moves),
            "moves_failed": sum(1 for e in events if e["kind"] == "relocation_finished" and e.get("result") != "done"),
            **work_lost(results, self.stops),
            "gpu_s_idle_while_waiting": idle_while_waiting(self.samples),
            "client_blackout_max_s": rep["blackout_max_s"],  # the longest gap any stream saw
            "move_blackout_phases_max_s": round(max(phases), 3) if phases else 0.0,
            "tokens_lost": rep["tokens_lost"],
            "tokens_duplicated": rep["tokens_duplicated"],
            "tokens_mismatched": rep["tokens_mismatched"],
            "text_mismatched": rep["text_mismatched"],
            "client_errors": rep["client_errors"],
            "requests": rep["requests"],
            "waits_s": {o.step.id: round((o.served - o.requested) / self.scale, 3) if o.served else None
                        for o in self.out.values()},
            "failures": {o.step.id: o.error[:200] for o in failures},
            "errors": rep["errors"],
            "starts": starts(events, {w for w, _ in BASE}),
            "timeline": self.timeline(events),
        }

    def timeline(self, events: list[dict]) -> list[dict]:
        """The events of the multi-GPU launches and of whatever made room for them, at seconds
        of the day, with each launch's request and serving: where each wait went."""
        multi = {o.step.id for o in self.out.values() if o.step.gpus >= 2}
        out: list[dict] = []
        for o in self.out.values():
            if o.step.id in multi:
                out.append({"t": round((o.requested - self.t0) / self.scale, 2), "kind": "requested",
                            "worker": o.step.id, "gpus": o.step.gpus})
                if o.served is not None:
                    out.append({"t": round((o.served - self.t0) / self.scale, 2), "kind": "serving",
                                "worker": o.step.id, "wait_s": round((o.served - o.requested) / self.scale, 2)})
        for wid, t in self.stopped.items():  # capacity given back (every worker's, not only theirs)
            out.append({"t": round((t - self.t0) / self.scale, 2), "kind": "stopped", "worker": wid})
        for e in events:
            if e["kind"] in ("worker_started", "demand_placed") and (e.get("worker") or e.get("worker_id")) not in multi:
                continue  # a 1-GPU start (a resume's fallback, a requeue) is its own wait, not theirs
            entry = {"t": round((float(e.get("ts", 0.0)) - self.t0_wall) / self.scale, 2), "kind": e["kind"]}
            entry.update({k: e[k] for k in TIMELINE_FIELDS if e.get(k) not in (None, "", [], {})})
            if e.get("phases"):
                entry["phases"] = {k: round(float(v), 2) for k, v in e["phases"].items()
                                   if isinstance(v, (int, float))}
            out.append(entry)
        return sorted(out, key=lambda x: x["t"])


def starts(events: list[dict], base: set[str] = frozenset()) -> dict:
    """How an arm's starts went (its `worker_started` events): warm (restored from its kind's
    image) or cold, the seconds each took, and why the cold ones were cold. `base`: the day's
    fragmented start, launched before the day and left out."""
    ev = [e for e in events if e["kind"] == "worker_started" and (e.get("worker") or e.get("worker_id")) not in base]
    out: dict[str, Any] = {}
    for how in ("warm", "cold"):
        secs = [float(e["seconds"]) for e in ev if e.get("how") == how and e.get("seconds") is not None]
        out[how] = sum(1 for e in ev if e.get("how") == how)
        out[f"{how}_s_p50"] = _pct(secs, 50)
        out[f"{how}_s_max"] = round(max(secs), 3) if secs else None
    reasons: dict[str, int] = {}
    for e in ev:
        if e.get("how") != "warm":
            r = str(e.get("reason") or "?")[:80]
            reasons[r] = reasons.get(r, 0) + 1
    out["cold_reasons"] = reasons
    return out


def warm_env(warm: bool) -> dict[str, str]:
    """The environment that switches warm images for an arm's cluster (its daemon, agents and
    controller read it through WarmConfig.load, over configs/images.yaml)."""
    return {"RELOCATOR_WARM__ENABLED": "1" if warm else "0"}


def one_run(rule: str, base_dir: str, engine: str, scale: str | float, quick: str = "0") -> dict:
    """One day under `rule` on a local cluster of its own; logs to stderr. A stock rule's router
    does not continue broken streams (RELOCATOR_ROUTER_CONTINUATION, set by `run`)."""
    import relocator
    from relocator.cluster.config import LocalConfig

    rule = PreemptionRule(rule).value
    moves = rule == PreemptionRule.MOVES
    cfg = LocalConfig.load(None, cluster={"nodes": 3, "gpus_per_node": 4, "base_dir": f"{base_dir}/{rule}"},
                           controller={"make_room_max_moves": 4 if moves else 0, "preemption": rule})
    t = time.monotonic()
    ctl = relocator.start(cfg)
    say = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    day, end = (QUICK, QUICK_END) if quick in ("1", "True", "true") else (DAY, DAY_END)
    try:
        say(f"{rule}: cluster up in {time.monotonic() - t:.1f}s; the day starts")
        return Day(ctl, rule, engine, float(scale), say, day, end).run()
    finally:
        ctl.down()


def compare(out: dict[str, dict]) -> dict:
    """The moves arm against the best stock arm (the lowest multi-GPU wait p99), and the targets."""
    stock = {k: v for k, v in out.items() if k != PreemptionRule.MOVES and v.get("wait_s_p99") is not None}
    m = out.get(PreemptionRule.MOVES.value)
    if not stock or m is None:
        return {}
    best = min(stock, key=lambda k: stock[k]["wait_s_p99"])
    ratio = round(stock[best]["wait_s_p99"] / m["wait_s_p99"], 2) if m.get("wait_s_p99") else None
    ev = out.get(PreemptionRule.EVICT_REQUEUE.value, {})
    # issue 28's "stock-scheduler arm": a queue, no preemption (what the issue-13 baseline became)
    pw = out.get(PreemptionRule.PLACE_OR_WAIT.value, {})
    pw_ratio = (round(pw["wait_s_p99"] / m["wait_s_p99"], 2)
                if pw.get("wait_s_p99") is not None and m.get("wait_s_p99") else None)
    return {"best_stock_arm": best, "p99_best_stock_over_moves": ratio,
            "target_p99_moves_le_third_of_best_stock": ratio is not None and ratio >= 3.0,
            "p99_place_or_wait_over_moves": pw_ratio,
            "target_p99_moves_5x_shorter_than_place_or_wait": pw_ratio is not None and pw_ratio >= 5.0,
            "target_moves_no_failed_requests_no_work_lost": m["failed_requests"] == 0
            and m["tokens_of_work_lost"] == 0,
            "evict_requeue_loses_work": bool(ev) and ev.get("tokens_of_work_lost", 0) > 0,
            "evict_requeue_loses_work_not_at_stops": bool(ev) and ev.get("tokens_of_work_lost_not_at_stops", 0) > 0}


def run(base_dir: str = "/var/lib/relocator/bench-scheduling", engine: str = "reference", scale: float = 1.0,
        log: Callable[[str], None] = print, arms: tuple[str, ...] = ARMS, quick: bool = False,
        warm: bool = True) -> dict:
    """The day once per rule in `arms`; each on a fresh local cluster (3 nodes x 4 GPUs), with
    warm images on (`warm`, the default) or off in every arm."""
    arms = tuple(PreemptionRule(a).value for a in arms)  # an unknown rule: ValueError naming them
    out: dict[str, Any] = {}
    t_all = time.monotonic()
    for rule in (a for a in ARMS if a in arms):
        # each arm in a process of its own: a fresh Ray driver per cluster (a second cluster
        # in the same driver was seen refusing its first call)
        env = {**os.environ, **warm_env(warm),
               "RELOCATOR_ROUTER_CONTINUATION": "true" if rule == PreemptionRule.MOVES else "false"}
        t = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", "import sys, json; from relocator.bench.scheduling import "
                               "one_run; print(json.dumps(one_run(*sys.argv[1:6])))", rule, base_dir, engine,
                               str(scale), "1" if quick else "0"], stdout=subprocess.PIPE, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"the {rule} run failed (exit {proc.returncode}); see its log above")
        out[rule] = json.loads(proc.stdout.strip().splitlines()[-1])
        out[rule]["router_continuation"] = rule == PreemptionRule.MOVES
        out[rule]["warm_images"] = "on" if warm else "off"
        out[rule]["seconds"] = round(time.monotonic() - t, 1)
        log(f"{rule}: {out[rule]}")
    out["comparison"] = compare(out)
    day, end = (QUICK, QUICK_END) if quick else (DAY, DAY_END)
    out["day"] = {"nodes": 3, "gpus_per_node": 4, "engine": engine, "scale": scale, "day_s": end, "quick": quick,
                  "base": [w for w, _ in BASE], "launches": [s.__dict__ for s in day], "streams": STREAMS,
                  "max_tokens": MAX_TOKENS, "arms": list(arms), "warm_images": "on" if warm else "off"}
    out["seconds"] = round(time.monotonic() - t_all, 1)
    return out
