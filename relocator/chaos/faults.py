"""The fault catalogue, the move schedule and the outcome checks: pure, tested with fakes.

Each fault says at which relocation phase it is injected, how (the runner does it with the
real mechanism: a killed actor or process, a corrupted file, a stopped raylet) and what must
follow: the relocation's result, the worker serving again (within `serve_target_s` of the
fault being detected), and nothing left behind.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from relocator.choices import ALL_WORDS, NONE_WORDS, Choice, parse_names
from relocator.vocab import TransferMode


class StepKind(Choice):
    """What one chaos step does to the cluster (the runner's handler table has one per kind)."""

    MOVE = "move"  # a forced live relocation of one worker to another node
    SUSPEND_RESUME = "suspend-resume"  # suspend a worker (image, GPUs released), then resume it
    MAKE_ROOM = "make-room"  # fragment the cluster, launch a node-sized worker: the controller moves to seat it
    WARM = "warm-image"  # damage a kind's warm image, launch one of that kind: cold, the fault said (warmsteps.py)
    TRIGGER = "trigger"  # fire a policy trigger (relocator/chaos/triggers.py): the controller's policies act


@dataclass(frozen=True)
class Fault:
    name: str
    phase: str  # the relocation phase during which it is injected
    expect: tuple[str, ...]  # acceptable relocation results
    how: str
    transfer: TransferMode | None = None  # forces the transfer mode of its relocation
    controller_faults: tuple[tuple[str, Any], ...] = ()  # passed to relocate(faults=...)
    destructive: bool = False  # leaves the cluster smaller (node taken away)
    requests_may_fail: bool = False  # the fault itself cuts client connections
    # the fault leaves the worker alone (a router restart): "serving again" counts from the end
    # of the move's own freeze, which is the relocation's blackout, not the fault's
    spares_worker: bool = False
    # the step it rides on: a forced move, or the first move of a make-room launch (its
    # controller faults then go to launch(faults=...), which injects them into that move)
    step: StepKind = StepKind.MOVE
    # a destructive fault's lost node: the move's target (dst) or its source (src)
    lost_node: str = "dst"
    # "serving again" target for this fault when not the run's (a worker lost for good is
    # replaced: from its last kept image in seconds, cold in tens of seconds)
    serve_target_s: float | None = None
    # it acts on what only a freezing move has (its DUMP, its image, CRIU's restore of it): under
    # a run's `--transfer handoff` its move is `shared` (steps.move_transfer), else it would ride
    # on a handoff and never be injected (the first `--transfer handoff --faults all` run: 3 not
    # injected, and a target killed in its start counted as the worker not serving)
    freezing: bool = False
    # in `--smoke` (CI's chaos smoke): the handoff's are not (each starts a second copy: 20-60 s
    # more per fault on the CPU reference); `--faults all` and by name run them
    smoke: bool = True

    def relocate_faults(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, tuple) else v) for k, v in self.controller_faults}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["controller_faults"] = self.relocate_faults()
        return d


FAULTS: dict[str, Fault] = {f.name: f for f in (
    Fault("kill-source-agent", "DUMP", ("rolled_back",),
          "SIGKILL the source node's agent actor (ray.kill) while CRIU dumps its cell", freezing=True),
    Fault("cut-transfer", "DUMP", ("rolled_back",),
          "streamed transfer: SIGKILL the target's page server (criu page-server) while the dump "
          "streams the worker's memory into it; the dump fails, the source runs on",
          transfer=TransferMode.STREAM),
    Fault("flip-byte", "RESTORE", ("rolled_back",),
          "flip one byte in the middle of the largest image file after DUMP, before RESTORE "
          "verifies it (the controller pauses 1 s before RESTORE: `pause` fault hook)",
          controller_faults=(("pause", (("phase", "RESTORE"), ("s", 1.0))),), freezing=True),
    Fault("kill-target-cell", "RESTORE", ("rolled_back", "done"),
          "SIGKILL the cell being restored on the target (the tasks under `criu restore`, or "
          "the restored cell's init) while RESTORE runs. Usually rolled back; a kill that lands "
          "while CRIU is still building the tree was seen to leave a restore that succeeds and a "
          "move that completes (not investigated further). Either way the worker must serve "
          "(checked), and the controller re-checks the target before and after SWITCH", freezing=True),
    # serving again: the source stays frozen until its dump has ended (CRIU holds its tasks until
    # it finishes, and the agent's resume waits for it: killing a dump mid-way is not safe for
    # them), so the worker serves again when the move's own freeze would have ended. The restarted
    # controller recovers in ~0.5 s; a ~1 GB dump takes 3-8 s on the CPU reference (2026-12-06's
    # handoff chaos run: recovered 0.47 s after the kill, serving again 3.29 s, the dump's end)
    Fault("kill-controller", "DUMP", ("rolled_back",),
          "SIGKILL the controller actor's process during DUMP; Ray restarts it and it recovers "
          "the open relocation (the source resumes once its dump has ended)", freezing=True,
          serve_target_s=8.0),
    Fault("kill-controller-switch", "SWITCH", ("done",),
          "SIGKILL the controller actor's process when SWITCH starts (pause 0.5 s before "
          "SWITCH); the restarted controller completes the move",
          controller_faults=(("pause", (("phase", "SWITCH"), ("s", 0.5))),)),
    Fault("restart-router", "DUMP", ("done", "rolled_back"),
          "SIGTERM the router during DUMP (streams are held). The cluster daemon owns the "
          "listening socket and starts a new router at once, which loads the persisted routing "
          "table; the old one finishes its streams, following the new one's switches. No request "
          "may fail; serving again is counted from the end of the move's own freeze",
          # a handoff has no DUMP to hold in (5 ms, passed before the fault could act: not
          # injected in 2026-12-06's handoff chaos run): it rides on a freezing move
          spares_worker=True, freezing=True),
    Fault("node-loss", "RESTORE", ("rolled_back", "done"),
          "SIGKILL the target node's raylet during RESTORE: the node is gone for good (its "
          "processes keep running on this host, as behind a network partition, until the "
          "controller fences them). Rolled back if Ray declares the node dead before SWITCH; "
          "otherwise the move completes and the controller replaces the lost worker from its "
          "last image. Either way it must end up serving on a live node",
          destructive=True),
    # post-copy (issue 14): the keeper on the target paces the background transfer (throttle:
    # 1 GB takes ~10 s) so that the fault lands while the memory is still on its way
    Fault("postcopy-kill-target", "RELEASE", ("rolled_back",),
          "post-copy: SIGKILL the restored copy (its cell's init) after the switch while its memory "
          "still arrives; the frozen source resumes and the router goes back to it",
          # paced so that the memory still arrives when the kill lands (at 1e8 B/s CI's post-copy
          # was over by then once: the move done, then its copy killed)
          transfer=TransferMode.POSTCOPY, controller_faults=(("postcopy", (("throttle_bps", 3e7),)),)),
    Fault("postcopy-network-cut", "RELEASE", ("rolled_back",),
          "post-copy: drop every packet of the page-server connection (iptables on its two ports) "
          "after the switch; the target's keeper hears nothing for stall_s and kills the copy before "
          "it can run on without its memory; the source's lazy dump is cut loose (ss -K) and the "
          "source resumes; the rule is removed afterwards",
          transfer=TransferMode.POSTCOPY,
          controller_faults=(("postcopy", (("throttle_bps", 3e7), ("stall_s", 1.5))),)),
    Fault("postcopy-source-loss", "RELEASE", ("failed", "rolled_back"),
          "post-copy: the source node dies after the switch (its lazy dump, the page server, and its "
          "raylet SIGKILLed): the copy on the target cannot get the rest of its memory and its keeper "
          "kills it at once; the worker is lost and replaced, from its last kept image or cold "
          "(post-copy's known risk, docs/snapshots.md). On this one-host emulation the source's agent "
          "may still answer for a moment after its raylet died: the move then rolls back to the "
          "source (resumed, its lazy dump gone) and the worker is replaced once Ray declares the node "
          "dead. Either way it must end up serving on a live node",
          transfer=TransferMode.POSTCOPY, controller_faults=(("postcopy", (("throttle_bps", 1e8),)),),
          destructive=True, lost_node="src", serve_target_s=180.0),
    Fault("fail-make-room-move", "DUMP", ("rolled_back",),
          "a make-room launch (a node-sized worker on a fragmented cluster) whose first live move "
          "fails at the end of DUMP (controller fault hook `dump`): the move rolls back, the plan "
          "stops there, every worker serves, and the demand stays pending",
          controller_faults=(("dump", True),), step=StepKind.MAKE_ROOM),
    # handoff (issue 29): the source is never frozen; the pause before SWITCH keeps the target's
    # short warm-up window open for the kill (relocator.chaos.injector.handoff_window)
    Fault("handoff-kill-target-warmup", "RESTORE", ("rolled_back",),
          "handoff: SIGKILL the target copy (its cell's init) once it has started, while it warms up next "
          "to the serving source (or in the 2 s pause before SWITCH, still before the router switches); "
          "the move rolls back, the target's cell is removed, the source serves throughout: no request fails",
          transfer=TransferMode.HANDOFF, controller_faults=(("pause", (("phase", "SWITCH"), ("s", 2.0))),),
          smoke=False),
    Fault("handoff-kill-target-switch", "SWITCH", ("rolled_back", "done"),
          "handoff: SIGKILL the target copy as the router switches to it (right after the 0.5 s pause "
          "before SWITCH, when the controller's check of the target has passed: the router's catch-up or "
          "cut meets a dead copy). Rolled back to the source, which served throughout: from SWITCH, or "
          "from RELEASE, which checks the target before it stops the source (done only where the kill "
          "lands after that last check); the streams cut towards the dead copy continue on the source: "
          "no request fails",
          transfer=TransferMode.HANDOFF, controller_faults=(("pause", (("phase", "SWITCH"), ("s", 0.5))),),
          smoke=False),
    Fault("handoff-network-cut-switch", "SWITCH", ("rolled_back",),
          "handoff: drop every packet between the router and the target copy (iptables, both ways, on the "
          "target's address and port) in the 0.5 s pause before SWITCH, after the controller's check of the "
          "target (alive to its agent, cut off from the router): the router's catch-up and the streams it "
          "continues there get no answer; RELEASE's check from the router (its /health probes of the "
          "target) fails, so the move rolls back to the source, which served throughout, and the streams cut "
          "towards the target continue there; the rules are removed once the move has ended: no request fails",
          transfer=TransferMode.HANDOFF, controller_faults=(("pause", (("phase", "SWITCH"), ("s", 0.5))),),
          smoke=False),
    Fault("handoff-kill-source-warmup", "RESTORE", ("done", "rolled_back", "failed"),
          "handoff: SIGKILL the source (its cell's init) while the started target copy warms up (or in the "
          "2 s pause before SWITCH). The issue's aim: its streams continue on the target from the ids sent, "
          "as after a node loss; else the worker is lost and replaced. Either way it must end up serving",
          transfer=TransferMode.HANDOFF, controller_faults=(("pause", (("phase", "SWITCH"), ("s", 2.0))),),
          serve_target_s=180.0, smoke=False),
)}

SMOKE_FAULTS = tuple(name for name, f in FAULTS.items() if f.smoke)
ALL, NONE = ALL_WORDS, NONE_WORDS  # words parse_faults takes for every fault / for none


def parse_faults(spec: str | Sequence[str] | None) -> list[str]:
    """"all", "none", "" or a comma list of names from FAULTS."""
    return parse_names(spec, list(FAULTS), "fault")


@dataclass
class Step:
    index: int
    worker: str
    dst: str
    fault: str | None = None
    kind: StepKind = StepKind.MOVE
    trigger: str | None = None  # a trigger step's fault (relocator.chaos.triggers.TRIGGER_FAULTS)
    warm: str | None = None  # a warm image step's fault (relocator.warm.faults.WARM_FAULTS)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def make_schedule(moves: int, faults: Sequence[str], workers: dict[str, str], nodes: Sequence[str],
                  seed: int = 0, suspends: int = 0, make_rooms: int = 0, triggers: Sequence[str] = (),
                  warm: Sequence[str] = ()) -> list[Step]:
    """`moves` plain forced moves, `suspends` suspend-then-resume steps and `make_rooms`
    make-room launches, plus one step per fault (of the fault's kind), one per trigger fault and
    one per warm image fault, in a seeded random order (destructive faults last). Targets are chosen later (`pick_target`)
    because the cluster changes; the `dst` here is a seeded preference. `workers`: {worker: node}."""
    rng = random.Random(seed)
    kinds: list[tuple[StepKind, str | None, str | None]] = (
        [(StepKind.MOVE, None, None)] * moves + [(StepKind.SUSPEND_RESUME, None, None)] * suspends
        + [(StepKind.MAKE_ROOM, None, None)] * make_rooms
        + [(FAULTS[f].step, f, None) for f in faults if not FAULTS[f].destructive]
        + [(StepKind.TRIGGER, None, t) for t in triggers] + [(StepKind.WARM, None, f) for f in warm])
    rng.shuffle(kinds)
    kinds += [(FAULTS[f].step, f, None) for f in faults if FAULTS[f].destructive]
    wids = sorted(workers)
    steps = []
    for i, (kind, k, t) in enumerate(kinds):
        w = wids[rng.randrange(len(wids))] if wids else ""
        others = [n for n in nodes if n != workers.get(w)]
        dst = rng.choice(others) if others else ""
        if kind is StepKind.WARM:  # its name rides in the trigger's slot above
            steps.append(Step(i, w, dst, k, kind, warm=t))
        else:
            steps.append(Step(i, w, dst, k, kind, t))
    return steps


def pick_target(worker_node: str, gpus: int, free: dict[str, int], alive: Sequence[str],
                preferred: str, rng: random.Random) -> str | None:
    """The preferred node if it is another live node with room, else a random one that fits."""
    fits = [n for n in alive if n != worker_node and free.get(n, 0) >= gpus]
    if preferred in fits:
        return preferred
    return rng.choice(sorted(fits)) if fits else None


@dataclass
class Outcome:
    fault: str | None
    result: str | None
    ok: bool
    problems: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_outcome(fault: Fault | None, rel: dict[str, Any] | None, *, injected: bool,
                  serving: bool, serve_again_s: float | None, failed_requests: int,
                  leaked: dict[str, list] | None, serve_target_s: float = 2.0,
                  worker_node_alive: bool = True) -> Outcome:
    """Compare what happened with what `fault` (None: a plain move) must lead to."""
    problems: list[str] = []
    result = rel.get("result") if rel else None
    if rel is None:
        problems.append("relocation record missing")
    elif fault is None:
        if result != "done":
            problems.append(f"plain move ended {result}: {rel.get('error', '')[:200]}")
    else:
        if not injected:
            problems.append(f"fault not injected (phase {fault.phase} passed before it could act)")
        elif result not in fault.expect:
            problems.append(f"expected {'/'.join(fault.expect)}, got {result}: {rel.get('error', '')[:200]}")
        rb = (rel or {}).get("rollback") or {}
        if rb.get("errors"):
            problems.append("rollback errors: " + "; ".join(map(str, rb["errors"]))[:300])
    if not serving:
        problems.append("worker not serving afterwards")
    if not worker_node_alive:
        problems.append("worker is recorded on a node Ray declared dead")
    elif fault is not None and injected and serve_again_s is not None and serve_again_s > serve_target_s:
        problems.append(f"serving again after {serve_again_s:.2f}s > {serve_target_s:g}s")
    if failed_requests and not (fault is not None and fault.requests_may_fail):
        problems.append(f"{failed_requests} request(s) failed")
    for kind, items in (leaked or {}).items():
        if items:
            problems.append(f"leaked {kind}: {', '.join(map(str, items))[:200]}")
    return Outcome(fault.name if fault else None, result, not problems, problems)


def check_scheduling_outcome(step: dict[str, Any], fault: Fault | None) -> Outcome:
    """A suspend-resume or make-room step (runner.run_chaos) against what it must lead to.

    suspend-resume: suspended, resumed, serving. make-room without a fault: the node-sized
    launch serves after its moves, every move done. make-room with a fault in its first move:
    that move rolled back, the plan stopped (nothing seated), the launch left pending, and
    every worker still serving."""
    problems: list[str] = []
    kind = StepKind(step["kind"])
    if step.get("error"):
        problems.append(f"{kind.value} step failed: {step['error'][:200]}")
    if kind is StepKind.SUSPEND_RESUME:
        if not step.get("suspended"):
            problems.append("not suspended")
        if not step.get("resumed"):
            problems.append("not resumed")
    elif kind is StepKind.TRIGGER:
        from relocator.chaos.triggers import TRIGGER_FAULTS, check

        problems += check(step, TRIGGER_FAULTS[step["trigger"]])
    elif kind is StepKind.WARM:  # what the step itself found wrong (relocator.chaos.warmsteps)
        problems += list(step.get("problems") or [])
    elif kind is StepKind.MAKE_ROOM:
        results = [m.get("result") for m in step.get("moves", [])]
        if fault is None:
            if step.get("launch_state") != "running":
                problems.append(f"make-room launch is {step.get('launch_state')}, not running")
            if not results or any(r != "done" for r in results):
                problems.append(f"make-room moves {results or 'none'}, not all done")
        else:
            if step.get("launch_state") != "pending":
                problems.append(f"make-room launch is {step.get('launch_state')}, not pending")
            if not step.get("demand_pending"):
                problems.append("the demand is not in pending")
            if not results or results[0] not in fault.expect:
                problems.append(f"the failed move ended {results[0] if results else 'missing'}, expected "
                                f"{'/'.join(fault.expect)}")
    not_serving = step.get("not_serving") or []
    if not_serving:
        problems.append(f"not serving afterwards: {', '.join(not_serving)}")
    if not step.get("serving", False) and not not_serving:
        problems.append("worker not serving afterwards")
    if step.get("failed_requests"):
        problems.append(f"{step['failed_requests']} request(s) failed")
    return Outcome(fault.name if fault else None, step.get("result"), not problems, problems)


@dataclass(frozen=True)
class FaultMove:
    """Where a step's move goes: `dst`, after a plain move to `pre` first when the fault would
    otherwise take a spared node; `dst` None: no such move (`why`)."""

    dst: str | None
    pre: str | None = None
    why: str = ""


def _moved(free: dict[str, int], src: str, dst: str, gpus: int) -> dict[str, int]:
    return {**free, src: free.get(src, 0) + gpus, dst: free.get(dst, 0) - gpus}


def plan_fault_move(fault: Fault | None, worker_node: str, gpus: int, free: dict[str, int],
                    alive: Sequence[str], spared: Sequence[str], preferred: str,
                    rng: random.Random) -> FaultMove:
    """The move for a step whose fault may kill a node: that node (the move's target, or its
    source for `lost_node="src"`) is never one of `spared` (the controller's node, which the
    controller does not survive: docs/loadtests.md). A worker sitting on a spared node is first
    moved off it (plain move to `pre`) when its source is the one to lose."""
    if fault is None or not fault.destructive:
        dst = pick_target(worker_node, gpus, free, alive, preferred, rng)
        return FaultMove(dst, why="" if dst else "no target with room")
    expendable = [n for n in alive if n not in spared]
    if fault.lost_node == "dst":
        dst = pick_target(worker_node, gpus, free, expendable, preferred, rng)
        return FaultMove(dst, why="" if dst else f"no target with room outside the spared {', '.join(spared)}")
    src, pre = worker_node, None
    if worker_node in spared:  # the source is lost: move the worker off the spared node first
        pre = pick_target(worker_node, gpus, free, expendable, preferred, rng)
        if pre is None:
            return FaultMove(None, why=f"worker on spared {worker_node} and no other node with room to move it to")
        free, src = _moved(free, worker_node, pre, gpus), pre
    dst = pick_target(src, gpus, free, alive, preferred, rng)
    return FaultMove(dst, pre, "" if dst else "no target with room")
