"""`relocator bench replay`: the replay with departures, per pod list x policy x mode x load, in
one table (docs/benchmarks.md, "Replay with departures")."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from relocator.cli import bench_app
from relocator.cli.replay import MODE_LIST, _load_list, _mode_list, load_list_option, make_configs, print_results, run_configs
from relocator.cli.simulate import POLICY_LIST, fail, load_inputs, parse_choices
from relocator.sim.replay import QueueDiscipline, ReplayMode


@bench_app.command("replay")
def bench_replay(
    trace: Optional[Path] = typer.Option(None, "--trace", help="openb folder (default ../shared/data/openb or $RELOCATOR_OPENB_DIR)."),
    variants: str = typer.Option("default", "--variants", help="Pod lists in --trace, comma-separated: default, multigpu50, gpushare80 ... (openb_pod_list_<name>.csv). Lists without times take them from the default list."),
    policy: str = typer.Option("fgd,best-fit", "--policy", callback=POLICY_LIST, help="Policies, comma-separated."),
    mode: str = typer.Option(",".join(ReplayMode.values()), "--mode", callback=MODE_LIST, help="Modes, comma-separated."),
    load: str = typer.Option("1.3", "--load", callback=load_list_option, help="Offered loads, comma-separated."),
    queue: QueueDiscipline = typer.Option(QueueDiscipline.FIFO, "--queue", help="fifo or backfill."),
    seed: int = typer.Option(42, "--seed", help="Seed."),
    passes: int = typer.Option(4, "--passes", help="Passes of the pod list (the first is warm-up)."),
    moves_per_pod: int = typer.Option(4, "--moves-per-pod", help="Most moves to seat one pod."),
    budget: float = typer.Option(1.0, "--budget", help="Moves (and suspensions) per 100 arrivals."),
    jobs: int = typer.Option(2, "--jobs", help="Runs in parallel (processes)."),
    plot: Optional[Path] = typer.Option(Path("docs/img/replay_default.png"), "--plot", help="PNG of the first pod list and policy, at the first load: allocation and queue over time per mode."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: {results: [...]}."),
) -> None:
    """Replay with departures: queueing delay, allocation and moves, with and without relocation."""
    from relocator.sim.trace import POD_FILE, TraceError, load_pods

    policies, _ = parse_choices(policy, "42")
    if passes < 2:
        raise fail("--passes must be >= 2")
    tdir, nodes, default_pods = load_inputs(trace, None)
    names = [v.strip() for v in variants.split(",") if v.strip()]
    if not names:
        raise fail("no pod list given in --variants")
    results: list[dict] = []
    first_series: list[dict] = []
    for name in names:
        path = tdir / (POD_FILE if name == "default" else f"openb_pod_list_{name}.csv")
        try:
            pods = default_pods if name == "default" else load_pods(path)
        except TraceError as exc:
            raise fail(str(exc)) from None
        cfgs = make_configs(policies, _mode_list(mode), _load_list(load), seed, queue, passes, moves_per_pod, budget,
                            None, None, 0.0, None, False)
        if not as_json:
            typer.echo(f"{name}: {len(cfgs)} runs", err=True)
        out = run_configs(nodes, pods, cfgs, default_pods, max(1, jobs), quiet=as_json)
        for r in out:
            r["pods"] = name
        if not first_series:
            first_series = [r for r in out if r["policy"] == policies[0] and r["load"] == _load_list(load)[0]]
            if plot is not None:
                from relocator.sim.plot import plot_replay

                plot_replay(first_series, plot, title=f"openb {name}, {policies[0]}, offered load {_load_list(load)[0]:.1f}x, {queue.value}")
        for r in out:
            r.pop("series", None)
        results.extend(out)
    if as_json:
        sys.stdout.write(json.dumps({"results": results, "plot": str(plot) if plot else None}, indent=2) + "\n")
        return
    print_results(results, "replay with departures")
    if plot is not None:
        typer.echo(f"plot: {plot}")
