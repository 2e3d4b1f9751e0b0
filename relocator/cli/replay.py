"""`relocator replay`: event-driven replay of an openb pod list with departures, a pending queue,
and optionally moves of running pods (and suspensions) to seat the queue head."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import typer

from relocator.cli import app
from relocator.cli.common import choice_list
from relocator.cli.replay_gpushare import PACK_EVERY, print_gpushare, set_pack_every, with_frag_ratio
from relocator.cli.simulate import POLICY_LIST, fail, load_inputs, parse_choices
from relocator.sim.arrivals import Arrivals
from relocator.sim.replay import QueueDiscipline, ReplayMode


def _mode_list(text: str) -> list[str]:
    modes = [ReplayMode(m.strip()).value for m in text.split(",") if m.strip()]  # ValueError naming the modes
    if not modes:
        raise ValueError(f"no mode given; valid: {', '.join(ReplayMode.values())}")
    return modes


def _load_list(text: str) -> list[float]:
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad load list {text!r} (use e.g. 1.0,1.3,1.6)") from None
    if not loads or any(x <= 0 for x in loads):
        raise ValueError(f"loads must be > 0, found {text!r}")
    return loads


#: `--mode`: replay modes, comma-separated
MODE_LIST = choice_list(_mode_list, ReplayMode.values)


def load_list_option(value: Optional[str]) -> Optional[str]:
    if value is not None:
        try:
            _load_list(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def load_donor(path: Optional[Path]):
    if path is None:
        return None
    from relocator.sim.trace import TraceError, load_pods

    try:
        return load_pods(path)
    except TraceError as exc:
        raise fail(str(exc)) from None


def make_configs(policies, modes, loads, seed, queue, passes, moves_per_pod, budget, max_moves_per_hour, max_moved_gpus,
                 min_gpus, consolidate_every, shared_storage, budget_cap=None):
    from relocator.sim.replay import BlackoutModel, ReplayConfig

    bm = BlackoutModel(shared_storage=shared_storage)
    return [
        ReplayConfig(policy=p, mode=m, load=L, queue=str(queue), seed=seed, passes=passes, moves_per_pod=moves_per_pod,
                     budget_per_100=budget, budget_cap=budget_cap, max_moves_per_hour=max_moves_per_hour, max_moved_gpus=max_moved_gpus,
                     min_gpus=min_gpus, consolidate_every_s=consolidate_every, blackout=bm)
        for L in loads for p in policies for m in modes
    ]


def run_configs(nodes, pods, cfgs, donor, jobs: int, quiet: bool = False, on_run: Optional[Callable] = None) -> list[dict]:
    from relocator.sim.replay import ReplayError, replay_many

    def done(r: dict) -> None:
        if not quiet:
            typer.echo(f"  {r['policy']:<11} {r['mode']:<14} load {r['load']:.1f} seed {r['seed']}: {r['seconds']:.0f} s", err=True)

    try:
        return replay_many(nodes, pods, cfgs, donor, jobs=jobs, on_done=done, on_run=on_run)
    except ReplayError as exc:
        raise fail(str(exc)) from None


def print_results(results: list[dict], title: str = "replay") -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = ("pods", "policy", "mode", "load", "wait p50 >=4 GPU s", "wait p99 >=4 GPU s", "wait p99 all s", "alloc mean",
            "queue mean", "moves/h", "moves/100 arr.", "suspended", "blackout s", "pod-h lost (kill)")
    for c in cols:
        t.add_column(c, justify="left" if c in ("pods", "policy", "mode") else "right")
    for r in results:
        t.add_row(r.get("pods", ""), r["policy"], r["mode"], f"{r['load']:.1f}", str(r["wait_s_p50"]), str(r["wait_s_p99"]),
                  str(r["wait_s_p99_all"]), f"{r['alloc_ratio_mean']:.3f}", f"{r['queue_len_mean']:.0f}", f"{r['moves_per_hour']:.1f}",
                  f"{r['moves_per_100_arrivals']:.2f}", str(r["suspensions"]), f"{r['blackout_s_total']:.0f}",
                  f"{r['pod_hours_lost']:.1f} ({r['kill_restart_pod_hours_lost']:.1f})")
    Console(width=200).print(t)


@app.command("replay")
def replay_cmd(
    trace: Optional[Path] = typer.Option(None, "--trace", help="Folder with openb_node_list_gpu_node.csv (default: ../shared/data/openb or $RELOCATOR_OPENB_DIR)."),
    pods: Optional[Path] = typer.Option(None, "--pods", help="Pod list CSV (default: openb_pod_list_default.csv in --trace)."),
    times_from: Optional[Path] = typer.Option(None, "--times-from", help="Pod list to take times from for pods without them (the multi-GPU lists have none): same name, else a random pod with as many GPUs."),
    policy: str = typer.Option("fgd", "--policy", callback=POLICY_LIST, help="Placement policies, comma-separated."),
    mode: str = typer.Option("none,moves", "--mode", callback=MODE_LIST, help=f"Modes, comma-separated: {', '.join(ReplayMode.values())}."),
    load: str = typer.Option("1.3", "--load", callback=load_list_option, help="Offered loads (x GPU capacity), comma-separated: 1.0,1.3,1.6."),
    queue: QueueDiscipline = typer.Option(QueueDiscipline.FIFO, "--queue", help="fifo: only the head starts; easy: EASY backfill (later pods may start if they do not delay the head's reservation); backfill: later pods start wherever they fit (no reservation)."),
    arrivals: str = typer.Option("trace", "--arrivals", help="trace: the list's creation order and gaps; poisson: each pass a seeded shuffle of the list with exponential gaps at the offered load."),
    seed: int = typer.Option(42, "--seed", help="Seed (policy ties, donor times)."),
    passes: int = typer.Option(4, "--passes", help="Times the pod list is replayed back to back; the first pass warms the cluster up and is not measured."),
    moves_per_pod: int = typer.Option(4, "--moves-per-pod", help="Most moves to seat one pod."),
    budget: float = typer.Option(1.0, "--budget", help="Moves (and suspensions) allowed per 100 arrivals: a bucket that each arrival fills by budget/100, capped at --budget-cap (unused allowance is not saved up)."),
    budget_cap: Optional[float] = typer.Option(None, "--budget-cap", help="Most moves the budget bucket holds (default: --moves-per-pod)."),
    max_moves_per_hour: Optional[float] = typer.Option(None, "--max-moves-per-hour", help="Most moves in any hour of simulated time."),
    max_moved_gpus: Optional[float] = typer.Option(None, "--max-moved-gpus", help="Most GPUs one plan may move."),
    min_gpus: float = typer.Option(0.0, "--min-gpus", help="Only heads needing at least this many GPUs may trigger moves."),
    consolidate_every: Optional[float] = typer.Option(None, "--consolidate-every", help="Also consolidate (free whole nodes) every this many simulated seconds, within the budget."),
    shared_storage: bool = typer.Option(False, "--shared-storage", help="Blackout without the agent-to-agent transfer (images on shared storage)."),
    pack_every: float = PACK_EVERY,
    jobs: int = typer.Option(1, "--jobs", help="Runs in parallel (processes)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of allocation and queue length over time, per mode."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object {results: [...]} (no time series)."),
) -> None:
    """Replay a pod list with arrivals and departures; compare placement with and without moves."""
    policies, _ = parse_choices(policy, "42")
    if passes < 2 or moves_per_pod < 0 or budget < 0 or min_gpus < 0 or (budget_cap is not None and budget_cap < 0):
        raise fail("--passes must be >= 2; --moves-per-pod, --budget, --budget-cap and --min-gpus must not be negative")
    _, nodes, pod_list = load_inputs(trace, pods)
    donor = load_donor(times_from)
    cfgs = make_configs(policies, _mode_list(mode), _load_list(load), seed, queue, passes, moves_per_pod, budget,
                        max_moves_per_hour, max_moved_gpus, min_gpus, consolidate_every, shared_storage, budget_cap)
    set_pack_every(cfgs, pack_every)
    try:
        cfgs = [replace(c, arrivals=Arrivals(arrivals).value) for c in cfgs]
    except ValueError as exc:
        raise fail(str(exc)) from None
    results = run_configs(nodes, pod_list, cfgs, donor, max(1, jobs), quiet=as_json)
    if plot is not None:
        from relocator.sim.plot import plot_replay

        plot_replay(results, plot)
    for r in results:
        r.pop("series", None)
    if as_json:
        with_frag_ratio(results)
        sys.stdout.write(json.dumps({"results": results}, indent=2) + "\n")
        return
    print_results(results)
    print_gpushare(results)
    if plot is not None:
        typer.echo(f"plot: {plot}")
