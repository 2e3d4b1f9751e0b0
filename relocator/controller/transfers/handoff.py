"""`transfer: handoff` (make-before-break): the source is never frozen. RESTORE starts a second
copy on the target (from a warm image of the worker's kind when the target's store has one, else
cold: the agent's `launch`) while the source serves on, then warms it up: every stream in flight
on the source (the router lists their prompt and sent ids) is prefilled on the target, in rounds
while the source runs ahead, until each is within a few tokens. SWITCH points the router's entry
at the target, cutting each stream at a token boundary (the router continues it there, token-
and text-exact, its KV found in the prefix cache); streams whose continuation would be inexact
(seeded sampling) stay on the source. RELEASE waits for those up to a window, then continues them
anyway (the documented approximation), and stops the source. A failure before SWITCH only
removes the target copy: the source served throughout (docs/handoff.md)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from relocator.controller.errors import PlanError, TargetLost, TargetLostAfterSwitch
from relocator.controller.model import engine_extra, failure_reason
from relocator.controller.transfers.base import Context, TransferStrategy
from relocator.vocab import TransferMode
from relocator.waits import settle

if TYPE_CHECKING:
    from relocator.controller.model import Relocation, WorkerRecord

log = logging.getLogger(__name__)

#: a stream within this many tokens of its last prefill needs no further round
GAP_TOKENS = 4
#: at most this many warm-up rounds (the source may outrun a slow target: switch anyway)
MAX_ROUNDS = 6
#: the router's own last rounds right before its cut (relocator.router.catchup): the tokens the
#: source made since the last round here are prefilled by the router, not by 8 continuations at once
CATCH_UP_ROUNDS = 4
#: when `auto` picks a handoff (PLAN's reason, preflight; docs/handoff.md "What auto does")
AUTO_RULE = ("auto picks it when the target's store holds a warm image of the worker's kind, or a node on the "
             "target's host does (copied at the start, locally): the target then starts in seconds while the "
             "source serves; else the freezing modes (a cold second copy takes 34-69 s on the CPU reference, "
             "where a whole freeze-and-copy move takes 5-20 s)")
#: the source's nice value while the target copy starts and warms up next to it (where both share
#: CPUs, the target's start took the source's decoding time: the longest client gap fell there)
SOURCE_NICE = -10
#: the target copy's nice value while it starts (its CRIU restore and health next to the serving
#: source took the CPU from the source, the router and the clients: the move's longest gap fell
#: there); nice 19, not SCHED_IDLE: a copy starved outright would miss its ready wait. Normal
#: again for the warm-up: at 19 beside a busy source its prefills would barely run, the source
#: would run ahead round after round, and the switch would recompute it all. (Normal is the
#: agent's nice: Ray starts its workers, so every cell, at 15; the router and clients run at 0.)
TARGET_NICE = 19
#: the router's check that it reaches the target before the source stops: tries, each's limit
REACH_TRIES, REACH_TIMEOUT_S = 3, 2.0
#: engines whose streams a handoff cannot continue exactly, and why: `auto` never hands them off
#: (an explicit `transfer: handoff` still may, with the reason logged)
INEXACT_ENGINES = {
    "sglang": ("SGLang's continuation on a copy warmed up by prefill was not token-exact on the CPU "
               "reference (tests/test_sglang_relocation.py, 2026-12-04: 24 tokens and 3 texts differed "
               "in 81 requests, where its freezing moves, which keep the source's own KV, differed in none): "
               "the target's KV comes from SGLang's prefill kernels, the source's from decoding, and the "
               "tiny model's near-tie logits flip on the difference; an uncached continuation on one "
               "server, with no move, differed too (docs/handoff.md, Limits)"),
}
#: how long streams that cannot be continued exactly may finish on the source after SWITCH
#: (the default of config controller.handoff_window_s)
WINDOW_S = 30.0


class HandoffCalls:
    """The handoff's calls (RayBackend inherits them; relocator.agent.modes.handoff)."""

    def start_copy(self, node: str, cell_id: str, worker: "WorkerRecord", gpu_ids: list[int] | None,
                   nice: int | None = None) -> dict:
        """A second copy of `worker` on `node` (warm image of its kind, else cold), started and
        left at CPU priority `nice` (None: normal)."""
        return self.agents.launch(node, cell_id, worker.model_dir, worker.model,  # type: ignore[attr-defined]
                                  engine=worker.engine, gpu_ids=gpu_ids, extra=engine_extra(worker.gpus), nice=nice)

    def prioritize(self, node: str, cell_id: str, nice: int | None) -> int:
        """The cell's threads at `nice`; None: normal (the agent's own nice, what its copies get)."""
        return self.agents.call(node, lambda a: a.prioritize.remote(cell_id, nice),  # type: ignore[attr-defined]
                                "prioritize", timeout=30)

    def warm_image(self, worker: "WorkerRecord", node: str) -> dict:
        """Whether a start of `worker`'s kind on `node` would be warm (the controller's warm
        copies: WarmCopies.where), for `auto`."""
        return self.ports.warm_image(worker.id, node)  # type: ignore[attr-defined]

    def router_streams(self, worker_id: str) -> list[dict]:
        return self._router(worker_id, lambda rc: rc.streams(worker_id))  # type: ignore[attr-defined]

    def router_reaches(self, worker_id: str, timeout_s: float = REACH_TIMEOUT_S) -> dict:
        """Whether the router reaches the worker's endpoint now ({reachable, endpoint, seconds})."""
        return self._router(worker_id, lambda rc: rc.reach(worker_id, timeout_s))  # type: ignore[attr-defined]

    def prefill(self, node: str, endpoint: str, model: str, sequences: list[list[int]]) -> dict:
        return self.agents.call(node, lambda a: a.prefill.remote(endpoint, model, sequences),  # type: ignore[attr-defined]
                                "prefill", timeout=300)

    def handoff_switch(self, worker_id: str, endpoint: str, keep_inexact: bool = True,
                       cut_from: str | None = None, catch_up_rounds: int = 0, at_token: bool = False) -> dict:
        return self._router(worker_id, lambda rc: rc.switch(  # type: ignore[attr-defined]
            worker_id, endpoint, keep_inexact=keep_inexact, cut_from=cut_from,
            catch_up_rounds=catch_up_rounds, at_token=at_token), endpoint)


class WarmUp:
    """The warm-up's bookkeeping: how far each stream was prefilled on the target."""

    def __init__(self) -> None:
        self.prefilled: dict[tuple[int, ...], int] = {}  # prompt ids -> tokens prefilled
        self.rounds = 0
        self.prefix_hit_tokens = 0  # already in the target's cache when prefilled again
        self.recomputed_tokens = 0  # prefilled anew
        self.engine_cached_tokens = 0  # what the target's engine said it found cached

    def due(self, streams: list[dict], gap: int = GAP_TOKENS) -> list[list[int]]:
        """The sequences (prompt + sent) of the streams more than `gap` tokens ahead of their
        last prefill; counts what their prefill will find cached and what it recomputes."""
        out: list[list[int]] = []
        for s in streams:
            seq = list(s["prompt_ids"]) + list(s["sent_ids"])
            key = tuple(s["prompt_ids"])
            have = self.prefilled.get(key, 0)
            if key in self.prefilled and len(seq) - have <= gap:
                continue
            self.prefix_hit_tokens += min(have, len(seq))
            self.recomputed_tokens += max(0, len(seq) - have)
            self.prefilled[key] = len(seq)
            out.append(seq)
        return out

    def figures(self, seconds: float) -> dict[str, Any]:
        return {"warmup_s": round(seconds, 4), "warmup_rounds": self.rounds, "warmed_streams": len(self.prefilled),
                "prefix_hit_tokens": self.prefix_hit_tokens, "recomputed_tokens": self.recomputed_tokens,
                "engine_cached_tokens": self.engine_cached_tokens}


def warm_up(backend: Any, rel: "Relocation", worker: "WorkerRecord", rounds: int = MAX_ROUNDS) -> dict[str, Any]:
    """Prefill the target with the source's streams in flight, round after round, until every
    stream is within GAP_TOKENS of its last prefill (or `rounds` are done)."""
    t0 = time.monotonic()
    w = WarmUp()
    while w.rounds < rounds:  # bounded by rounds, not a deadline
        todo = w.due(backend.router_streams(worker.id))
        if not todo:
            break
        w.rounds += 1
        got = backend.prefill(rel.dst, rel.dst_endpoint, worker.model, todo)
        w.engine_cached_tokens += int(got.get("cached_tokens") or 0)
    return w.figures(time.monotonic() - t0)


def favour(backend: Any, rel: "Relocation", nice: int | None) -> None:
    """The source's threads at `nice`, None: normal again (best effort: a move never fails for it)."""
    try:
        backend.prioritize(rel.src, rel.src_cell, nice)
    except Exception as exc:  # noqa: BLE001
        log.warning("handoff %s: source priority not set to %s: %s", rel.id, nice, exc)


def to_normal(backend: Any, rel: "Relocation", tries: int = 2) -> bool:
    """The target copy back at normal priority, the nice every copy its agent starts has (it
    serves from SWITCH on); whether it is. Never raises: a copy left at nice 19 serves slowly, a
    failed move for it would be worse (logged)."""
    for attempt in range(1, tries + 1):
        try:
            backend.prioritize(rel.dst, rel.dst_cell, None)
            return True
        except Exception as exc:  # noqa: BLE001
            log.warning("handoff %s: target copy %s not set back to normal priority (try %d of %d): %s",
                        rel.id, rel.dst_cell, attempt, tries, exc)
    return False


def on_source(backend: Any, rel: "Relocation") -> int:
    """Streams still read from the source's endpoint (those kept at SWITCH)."""
    return sum(1 for s in backend.router_streams(rel.worker) if s.get("endpoint") == rel.src_endpoint)


def target_reached(backend: Any, rel: "Relocation", tries: int = REACH_TRIES) -> dict[str, Any]:
    """Raise TargetLostAfterSwitch if the router cannot reach the target copy (`tries` probes of
    its /health from the router, each within REACH_TIMEOUT_S): a copy alive to its agent may be
    cut off from where the clients' traffic goes, and stopping the source then would leave the
    worker unreachable. A router that cannot say (an older one, a failed call) is logged, not
    fatal: the agent's check stands. Returns the last answer."""
    ask = getattr(backend, "router_reaches", None)
    if ask is None:
        return {}
    got: dict[str, Any] = {}
    for _ in range(tries):
        try:
            got = ask(rel.worker) or {}
        except Exception as exc:  # noqa: BLE001
            log.warning("handoff %s: the router's reach of the target not checked: %s", rel.id, exc)
            return {}
        if got.get("reachable"):
            return got
    raise TargetLostAfterSwitch(
        f"the router cannot reach target copy {rel.dst_cell} at {rel.dst_endpoint} ({tries} health probes "
        f"of {REACH_TIMEOUT_S:g} s) before the source is stopped")


def target_serving(ctx: Context, rel: "Relocation", when: str) -> None:
    """Raise TargetLostAfterSwitch if the target copy is gone: between SWITCH and the source's
    stop the source still serves, so a target lost then rolls the move back to it."""
    try:
        ctx.target_alive(rel, when)
    except TargetLost as exc:
        raise TargetLostAfterSwitch(str(exc), failure_reason(exc)) from None


class HandoffTransfer(TransferStrategy):
    mode = TransferMode.HANDOFF
    freezes_source = False
    # tried first by `auto`, taken only where the target starts warm (docs/handoff.md, "What auto does")
    auto_rank = -1
    blackout_phases = ("SWITCH",)  # the source serves until the router switches
    calls = HandoffCalls

    def available(self, backend: Any, worker: "WorkerRecord", dst: str) -> tuple[bool, str]:
        if not worker.model_dir:
            return False, "no handoff: no launch record (model_dir) to start a second copy from"
        if worker.engine in INEXACT_ENGINES:
            return False, f"no handoff for {worker.engine}: {INEXACT_ENGINES[worker.engine]}"
        ask = getattr(backend, "warm_image", None)
        if ask is None:
            return False, "no handoff: where warm images are is not known here"
        try:
            got = ask(worker, dst) or {}
        except Exception as exc:  # noqa: BLE001 - unknown: a freezing mode (always possible)
            return False, f"no handoff: where warm images are is not known ({type(exc).__name__}: {exc})"
        why = got.get("why") or "no warm image of its kind on the target"
        if got.get("warm") in ("here", "near"):
            return True, f"handoff (make-before-break): {why}; the second copy starts while the source serves"
        return False, f"no handoff: {why}"

    def check(self, backend: Any, worker: "WorkerRecord", dst: str) -> None:
        if not worker.model_dir:
            raise PlanError(f"worker {worker.id} has no launch record (model_dir): a handoff starts a second copy")
        if worker.engine in INEXACT_ENGINES:  # asked for by name: done, and said
            log.warning("handoff of %s worker %s: %s", worker.engine, worker.id, INEXACT_ENGINES[worker.engine])

    def target_image(self, backend: Any, rel: "Relocation", worker: "WorkerRecord") -> tuple[str, str, str]:
        rel.image_dir = ""  # nothing is dumped
        return "", "none", "a second copy starts on the target: no image moves"

    def dump(self, ctx: Context, rel: "Relocation") -> dict:
        return {"skipped": "the source serves on", "source_frozen_s": 0.0}

    def transfer(self, ctx: Context, rel: "Relocation") -> dict:
        return {"skipped": "no image moves"}

    def restore(self, ctx: Context, rel: "Relocation") -> dict:
        worker = ctx.store.worker(rel.worker)
        if worker is None:
            raise PlanError(f"unknown worker {rel.worker!r}")
        # the source keeps its CPUs while the target starts (again: RESERVE's before_reserve set
        # it, a controller restart may not have); a failure from here on rolls back, and
        # source_back puts its priority back
        favour(ctx.backend, rel, SOURCE_NICE)
        t0 = time.monotonic()
        # started at low priority: its start must not take the serving source's CPU
        info = ctx.backend.start_copy(rel.dst, rel.dst_cell, worker, rel.dst_gpu_ids or None, nice=TARGET_NICE)
        rel.dst_endpoint = info["endpoint"]
        ctx.save(rel)  # a failure from here on kills the target copy (rollback)
        how = info.get("warm") or {}  # the agent's launch: {how: warm|cold, key, reason, capture}
        start = {"start_s": round(time.monotonic() - t0, 4), "warm": how.get("how") == "warm",
                 "start_why": how.get("reason", ""), "start_cpu_cap": how.get("cpu_cap"),
                 # the on-demand copy of its warm image from a peer, first in the start (or None)
                 "start_copy": how.get("copied")}
        start["target_normal_priority"] = to_normal(ctx.backend, rel)  # it warms up, then serves
        warm = warm_up(ctx.backend, rel, worker)
        return {**info, **start, **warm, "source_frozen_s": 0.0, "source_nice": SOURCE_NICE,
                "target_nice": TARGET_NICE}

    def switch(self, ctx: Context, rel: "Relocation", worker: "WorkerRecord") -> dict:
        # each stream cut right after its next token: the source serves until then, so the
        # client's gap is the continuation's first token alone (docs/handoff.md, SWITCH)
        return ctx.backend.handoff_switch(worker.id, rel.dst_endpoint, keep_inexact=True,
                                          catch_up_rounds=CATCH_UP_ROUNDS, at_token=True)

    def release(self, ctx: Context, rel: "Relocation") -> dict[str, Any]:
        window = float(ctx.handoff_window_s)  # config controller.handoff_window_s
        # it serves now: normal priority again (RESTORE's may have failed, or a controller restart
        # resumed the move past it); never left at TARGET_NICE
        normal = to_normal(ctx.backend, rel)
        t0 = time.monotonic()

        def kept_done() -> bool:
            target_serving(ctx, rel, "while the kept streams finish on the source")
            return on_source(ctx.backend, rel) == 0

        left = settle(kept_done, window, every=0.5)
        out: dict[str, Any] = {"window_s": round(time.monotonic() - t0, 4), "target_normal_priority": normal}
        if not left:  # past the window: continued on the target anyway (inexact, reported)
            info = ctx.backend.handoff_switch(rel.worker, rel.dst_endpoint, keep_inexact=False,
                                              cut_from=rel.src_endpoint)
            out["continued_past_window"] = info.get("moved_streams", 0)
        # last, right before the machine stops the source: the worker's only other live copy,
        # alive to its agent and reached by the router
        target_serving(ctx, rel, "before the source is stopped")
        reach = target_reached(ctx.backend, rel)
        if reach:
            out["router_reach_s"] = reach.get("seconds")
        return out

    def before_reserve(self, ctx: Context, rel: "Relocation") -> None:
        # from RESERVE on: the reservation's own work on a shared host (Ray starts a worker
        # process for it, ~1 CPU-second) made a 0.7-1.0 s client gap before the target existed
        favour(ctx.backend, rel, SOURCE_NICE)

    def source_back(self, ctx: Context, rel: "Relocation") -> None:
        favour(ctx.backend, rel, None)  # rolled back: the source serves on at its own priority


__all__ = ["AUTO_RULE", "CATCH_UP_ROUNDS", "GAP_TOKENS", "HandoffCalls", "HandoffTransfer", "INEXACT_ENGINES", "MAX_ROUNDS", "SOURCE_NICE",
           "REACH_TIMEOUT_S", "REACH_TRIES", "TARGET_NICE", "WINDOW_S", "WarmUp", "favour", "target_reached",
           "target_serving", "to_normal", "warm_up"]
