"""`run_chaos`: forced relocations and injected faults under streaming load, checked.

The load (loadtests.run_load, greedy requests checked token by token against a reference taken
directly from a worker) runs on its own thread and event loop for the whole scenario. Moves run
one at a time; a fault is injected from outside the controller with the real mechanism, while
the runner watches the relocation's persisted phase.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from relocator.chaos import report as R
from relocator.chaos import steps as S
from relocator.chaos.budget import Watch, guarded
from relocator.chaos.config import MODEL, ChaosConfig
from relocator.chaos.faults import FAULTS, Step, StepKind, make_schedule, plan_fault_move
from relocator.chaos.hosts import LocalView, host_view, split_faults
from relocator.chaos.load import _chat_fraction, _LoadThread, _reference
from relocator.chaos.probe import serving_again_at  # noqa: F401 - re-exported (tests, callers)
from relocator.chaos.steps import SCHEDULING_STEPS, _freeze_end, _status, one_move  # noqa: F401
from relocator.chaos.triggersteps import trigger_step
from relocator.chaos.warmsteps import warm_step

#: every step kind but the forced move: what runs it
STEPS = {**SCHEDULING_STEPS, StepKind.TRIGGER: trigger_step, StepKind.WARM: warm_step}

CONTROLLER_SPARED = ("hosts the controller, which is pinned there (the head node, or deploy's controller.node) "
                     "and does not survive its loss: a fault that kills a node never takes it")


def _own_node_id(_actor: Any) -> str:
    """Run inside an actor (`__ray_call__`): the Ray node id it runs on."""
    import ray

    return ray.get_runtime_context().get_node_id()


def _controller_ray_node(ctl: Any) -> str | None:
    """The Ray node id the controller actor runs on, asked of the actor itself."""
    import ray

    try:
        return ray.get(ctl.handle.__ray_call__.remote(_own_node_id), timeout=30)
    except Exception:  # noqa: BLE001 - a fake client, or the controller restarting
        return None


def _head_ray_node() -> str | None:
    import ray

    return next((n["NodeID"] for n in ray.nodes() if n.get("Alive")
                 and "node:__internal_head__" in n.get("Resources", {})), None)


def spared_nodes(st: dict, controller_ray_node: str | None, head_ray_node: str | None,
                 protected: set[str]) -> dict[str, str]:
    """{node: why} for the nodes a node-killing fault must spare: the controller's (from its
    actor; else the head's, where it is pinned), and the view's protected ones."""
    by_ray = {n.get("ray_node_id"): n["id"] for n in st["nodes"]}
    out = {p: "emulated hosts: the head (GCS) or the controller's host" for p in sorted(protected)}
    if controller_ray_node in by_ray:
        out[by_ray[controller_ray_node]] = CONTROLLER_SPARED
    elif head_ray_node in by_ray:
        out[by_ray[head_ray_node]] = CONTROLLER_SPARED + " (its node not known: the head's spared)"
    return out


def _fault_step(ctl, base: Path, step: Step, w: dict, cfg: ChaosConfig, say, view: LocalView,
                spared: dict[str, str], rng: random.Random) -> list[dict[str, Any]]:
    """One forced move (with its fault): to a target that spares `spared`, after a plain move
    off a spared node when the fault takes the move's source."""
    fault = FAULTS[step.fault] if step.fault else None
    out: list[dict[str, Any]] = []
    for _ in range(2):
        st = _status(ctl)
        w = next(x for x in st["workers"] if x["id"] == w["id"])
        alive = [n["id"] for n in st["nodes"] if n.get("alive", True)]
        free = {n["id"]: n["gpus_free"] for n in st["nodes"]}
        fm = plan_fault_move(fault, w["node"], w["gpus"], free, alive, sorted(spared), step.dst, rng)
        if fm.dst is None:
            return out + [{"step": step.index, "fault": step.fault, "result": "skipped", "error": fm.why}]
        if not fm.pre:
            return out + [one_move(ctl, base, step, w, fm.dst, cfg, say, view)]
        say(f"  step {step.index}: {w['id']} moved off spared {w['node']} first ({step.fault} takes its source)")
        pre = one_move(ctl, base, Step(step.index, w["id"], fm.pre), w, fm.pre, cfg, say, view)
        out.append({**pre, "setup_for": step.fault, "spared": w["node"]})
        if pre.get("result") != "done":
            return out + [{"step": step.index, "fault": step.fault, "result": "skipped",
                           "error": f"could not move {w['id']} off spared {w['node']}: {pre.get('result')}"}]
    return out + [{"step": step.index, "fault": step.fault, "result": "skipped",
                   "error": f"{w['id']} still on a spared node"}]


@dataclass
class _Run:
    """What a run's step thread builds up and its clean-up reads (a stalled run reports and
    cleans up what the abandoned thread had reached)."""

    cfg: ChaosConfig
    ctl: Any
    base: Path
    view: LocalView
    watch: Watch
    say: Callable[[str], None]
    report: dict[str, Any]
    rng: random.Random
    launched: list[str] = field(default_factory=list)
    seen_cells: set[str] = field(default_factory=set)  # every cell of our workers (netns check)
    load: Any = None
    before: dict = field(default_factory=dict)
    moves: list[dict] = field(default_factory=list)


def _connect(cfg: ChaosConfig, say: Callable[[str], None]) -> tuple[Any, bool]:
    """The cluster at cfg.cluster_dir, or a new one (own: the run stops it at the end)."""
    import relocator
    from relocator.cluster.local import read_info

    info = read_info(cfg.cluster_dir)
    if info and info.get("address"):
        return relocator.connect(cfg.cluster_dir), False
    say(f"starting a {cfg.nodes}-node cluster in {cfg.cluster_dir}")
    return relocator.start(nodes=cfg.nodes, gpus_per_node=cfg.gpus_per_node, base_dir=cfg.cluster_dir), True


def _new_run(cfg: ChaosConfig, ctl: Any, say: Callable[[str], None], watch: Watch) -> _Run:
    base = Path(ctl.info["base_dir"])
    view = host_view(ctl, base)
    # faults that cannot apply on this cluster (emulated hosts) are skipped, each with its reason
    kept, skipped = split_faults(cfg.faults, view)
    if skipped:
        cfg = dataclasses.replace(cfg, faults=kept)
        for f, why in skipped.items():
            say(f"skipping {f}: {why}")
    report: dict[str, Any] = {"config": asdict(cfg), "cluster": "emulated hosts" if view.emulated else "local",
                              "skipped_faults": skipped}
    return _Run(cfg, ctl, base, view, watch, say, report, random.Random(cfg.seed))


def _launch(run: _Run) -> tuple[list[dict], list[str], Any]:
    """The run's workers, its load started and the greedy reference taken: (workers, nodes, ref)."""
    from loadtests import LoadConfig

    cfg, ctl = run.cfg, run.ctl
    run.watch.phase("launch")
    run.before = run.view.collect()
    st0 = ctl.status()
    run.report["events_log"] = (st0.get("events") or {}).get("log")
    t = time.monotonic()
    with ThreadPoolExecutor(cfg.workers) as pool:
        ws = list(pool.map(lambda _: ctl.launch(MODEL, gpus=cfg.gpus, engine=cfg.engine), range(cfg.workers)))
    run.launched.extend(w["id"] for w in ws)
    run.seen_cells.update(w["cell_id"] for w in ws)
    run.report["launch_s"] = round(time.monotonic() - t, 3)
    run.say(f"launched {', '.join(w['id'] + '@' + w['node'] for w in ws)} ({run.report['launch_s']:.0f}s)")
    lcfg = LoadConfig(url=ctl.router_url, model=MODEL, concurrency=cfg.streams, duration_s=1e9,
                      output_tokens=list(cfg.output_tokens), prompt_words=[8, 32], distinct=12,
                      greedy_fraction=0.75, seed=cfg.seed, request_timeout_s=300,
                      chat_fraction=_chat_fraction(cfg.engine))
    run.watch.waiting("the greedy reference from the worker")
    ref = _reference(lcfg, ws[0]["endpoint"], cfg.engine)
    run.load = _LoadThread(lcfg).start()
    time.sleep(1.0)
    return ws, [n["id"] for n in st0["nodes"]], ref


def _step(run: _Run, i: int, step: Step) -> None:
    """One scheduled step, its records appended to run.moves."""
    cfg, ctl = run.cfg, run.ctl
    run.watch.begin(f"step {i} ({step.fault or step.trigger or step.kind.value})", step.fault or step.trigger)
    st = _status(ctl)
    w = next(x for x in st["workers"] if x["id"] == step.worker)
    if step.kind is not StepKind.MOVE:  # the scheduling layer's steps
        if step.kind is StepKind.SUSPEND_RESUME and w["state"] != "running":
            run.moves.append({"step": i, "kind": step.kind.value, "fault": step.fault, "result": "skipped",
                              "error": f"worker {w['id']} is {w['state']}"})
            return
        m = STEPS[step.kind](ctl, run.base, step, w, cfg, run.say)
        run.seen_cells.update(m.get("cells", []))
        run.moves.append(m)
        return
    if w["state"] != "running":
        run.moves.append({"step": i, "fault": step.fault, "result": "skipped",
                          "error": f"worker {w['id']} is {w['state']}"})
        return
    spared: dict[str, str] = {}
    if step.fault and FAULTS[step.fault].destructive:  # where the controller is now
        spared = spared_nodes(st, _controller_ray_node(ctl), _head_ray_node(), run.view.protected)
        run.report.setdefault("spared_nodes", {}).update(spared)
    run.moves.extend(_fault_step(ctl, run.base, step, w, cfg, run.say, run.view, spared, run.rng))


def _steps(run: _Run, ws: list[dict], nodes: list[str]) -> None:
    cfg = run.cfg
    steps = make_schedule(cfg.moves, cfg.faults, {w["id"]: w["node"] for w in ws}, nodes, cfg.seed,
                          suspends=cfg.suspends, make_rooms=cfg.make_rooms, triggers=cfg.triggers,
                          warm=cfg.warm_faults)
    run.say(f"{len(steps)} steps ({cfg.moves} plain moves, {cfg.suspends} suspend+resume, {cfg.make_rooms} "
            f"make-room, faults: {', '.join(cfg.faults) or 'none'}, triggers: {', '.join(cfg.triggers) or 'none'}, "
            f"warm image faults: {', '.join(cfg.warm_faults) or 'none'}), "
            f"{cfg.streams} streams")
    interval = 60.0 / cfg.moves_per_minute if cfg.moves_per_minute > 0 else 0.0
    t_moves = time.monotonic()
    for i, step in enumerate(steps):
        if cfg.duration_s and time.monotonic() - t_moves > cfg.duration_s:
            run.say(f"duration reached after {i} moves")
            break
        if interval:
            wait = t_moves + i * interval - time.monotonic()
            if wait > 0:
                time.sleep(wait)
        _step(run, i, step)


def _body(run: _Run) -> None:
    """The run on its step thread: launch, the steps, then the checks (guarded by the budgets)."""
    S._LOCAL.watch = run.watch
    ws, nodes, ref = _launch(run)
    _steps(run, ws, nodes)
    run.watch.phase("checks after the steps")
    time.sleep(1.0)
    run.watch.waiting("the load's streams to end")
    rep = run.load.stop()
    run.load = None
    run.watch.waiting("the cluster's status and the leak check")
    st = _status(run.ctl)
    run.seen_cells.update(w["cell"] for w in st["workers"] if w["id"] in run.launched)
    leaked = R._leak_settle(run.view, run.before, R._expected(st, run.moves), R._our_netns(run.seen_cells, run.moves))
    run.report.update(R.figures(run.cfg, rep, ref, run.moves, leaked))


def _clean_up(run: _Run, stalled: dict | None, own: bool) -> None:
    """Load stopped, the run's workers stopped, what they left checked, an own cluster down."""
    if run.load is not None:
        try:
            run.load.stop(30 if stalled else 60)
        except Exception:  # noqa: BLE001
            pass
    if run.cfg.stop_workers:
        for wid in run.launched:
            _stop_worker(run.ctl, wid, run.say, bounded=stalled is not None)
    if run.cfg.stop_workers and "leaked" in run.report:
        final = R._leak_settle(run.view, run.before, {}, R._our_netns(run.seen_cells, run.report.get("moves", [])))
        run.report["leaked_after_stop"] = final
        for k, v in final.items():
            run.report["leaked"][k] = sorted(set(run.report["leaked"].get(k, [])) | set(v))
    if own:
        run.ctl.down()


def _report_stall(run: _Run, stalled: dict) -> None:
    stalled["controller_event"] = S._last_controller_event(run.view, run.report.get("events_log"))
    run.report.update(stalled=stalled, moves=run.moves)
    run.say(f"STALLED in {stalled['step']} after {stalled['elapsed_s']}s (the {stalled['budget']}'s budget, "
            f"{stalled['budget_s']:g}s): waiting for {stalled['waiting_for']}; last seen "
            f"{stalled['last_event']}; the controller's last event {stalled['controller_event']}")


def run_chaos(cfg: ChaosConfig, ctl: Any = None, say: Callable[[str], None] = lambda *_: None) -> dict[str, Any]:
    own = ctl is None
    t_all = time.monotonic()
    watch = Watch(cfg.run_budget(), cfg.step_budget_s)  # the run's budget counts a cluster's start too
    if own:
        ctl, own = _connect(cfg, say)
    run = _new_run(cfg, ctl, say, watch)
    stalled: dict[str, Any] | None = None
    try:
        stalled = guarded(lambda: _body(run), run.watch)
        if stalled:
            _report_stall(run, stalled)
    finally:
        _clean_up(run, stalled, own)
    report = run.report
    if run.view.emulated:  # what a dead host left on this machine (gone with a real host; `down` removes it)
        report["dead_hosts"] = {"hosts": sorted(run.view.dead), "netns_removed": run.view.remove_dead_netns()}
    report["seconds"] = round(time.monotonic() - t_all, 1)
    report["ok"] = R.run_ok(report, stalled)
    report["verdict"] = "stalled" if stalled else ("ok" if report["ok"] else "failed")
    return report


def _stop_worker(ctl, wid: str, say, bounded: bool, timeout_s: float = 60.0) -> None:
    """Stop one of the run's workers; after a stall, give up on it after `timeout_s` (the
    controller may be gone: `down` then removes what is left of an own cluster)."""
    try:
        if not bounded:
            ctl.stop_worker(wid)
        elif guarded(lambda: ctl.stop_worker(wid), Watch(timeout_s, timeout_s)) is not None:
            say(f"could not stop {wid}: no answer in {timeout_s:g}s")
    except Exception as exc:  # noqa: BLE001
        say(f"could not stop {wid}: {exc}")
