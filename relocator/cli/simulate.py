"""`relocator simulate`: the trace simulator (placement with and without relocation)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Optional

import typer

from relocator.cli import app
from relocator.cli.common import choice_list
from relocator.planner.policies import PlacementPolicy, canonical_policy_name, policy_aliases
from relocator.sim.engine import ArrivalOrder


def _policy_list(text: str) -> list[str]:
    names = [canonical_policy_name(p) for p in text.split(",") if p.strip()]
    if not names:
        raise ValueError(f"no policy given; valid: {', '.join(PlacementPolicy.values())}")
    return names


#: `--policy` of `simulate` and `bench sim`: placement policies, comma-separated
POLICY_LIST = choice_list(_policy_list, PlacementPolicy.values, policy_aliases)


def parse_seeds(text: str) -> list[int]:
    """``42..51`` (inclusive), ``42,43,50`` or ``42``."""
    seeds: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)\s*(?:\.\.|-)\s*(\d+)", part)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            if b < a:
                raise ValueError(f"empty seed range {part!r}")
            seeds.extend(range(a, b + 1))
        elif part.isdigit():
            seeds.append(int(part))
        else:
            raise ValueError(f"bad seed {part!r} (use e.g. 42..51 or 42,43)")
    if not seeds:
        raise ValueError("no seeds")
    return seeds


def fail(msg: str, code: int = 2) -> "typer.Exit":
    typer.secho(f"error: {msg}", err=True, fg=typer.colors.RED)
    return typer.Exit(code)


def parse_choices(policy: str, seeds: str) -> tuple[list[str], list[int]]:
    """Policy names (canonical) and seeds from their option strings, or a CLI error."""
    try:
        seed_list = parse_seeds(seeds)
        policies = _policy_list(policy)
    except ValueError as exc:  # PlannerError too
        raise fail(str(exc)) from None
    return policies, seed_list


def load_inputs(trace: Optional[Path], pods: Optional[Path]):
    from relocator.sim.trace import NODE_FILE, POD_FILE, TraceError, default_trace_dir, load_nodes, load_pods

    tdir = trace if trace is not None else default_trace_dir()
    if not tdir.is_dir():
        raise fail(f"trace directory {tdir} does not exist (use --trace DIR or set RELOCATOR_OPENB_DIR)")
    pfile = pods if pods is not None else tdir / POD_FILE
    try:
        return tdir, load_nodes(tdir / NODE_FILE), load_pods(pfile)
    except TraceError as exc:
        raise fail(str(exc)) from None


def run_with_progress(nodes, pods, policies, seeds, relocate, tune, order, moves_per_pod, max_moves, quiet: bool, min_gain: int = 0, jobs: int = 1):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from relocator.sim.engine import run_many

    console = Console(stderr=True)
    variants = 2 if relocate else 1
    total_runs = len(policies) * len(seeds) * variants
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
        transient=False,
    ) as prog:
        runs = prog.add_task("runs", total=total_runs)
        pods_task = prog.add_task("pods", total=1)
        state = {"n": 0}

        def on_run(pol: str, rel: bool, seed: int) -> None:
            if state["n"]:
                prog.advance(runs)
            state["n"] += 1
            prog.update(runs, description=f"{pol}{' +moves' if rel else ''} seed {seed}")
            prog.reset(pods_task)

        def progress(done: int, total: int) -> None:
            prog.update(pods_task, completed=done, total=total)

        out = run_many(nodes, pods, policies, seeds, relocate, tune, order, moves_per_pod, max_moves, on_run, None if jobs > 1 else progress, min_gain, jobs)
        prog.advance(runs)
    return out


@app.command("simulate")
def simulate_cmd(
    trace: Optional[Path] = typer.Option(None, "--trace", help="Folder with openb_node_list_gpu_node.csv (default: ../shared/data/openb or $RELOCATOR_OPENB_DIR)."),
    pods: Optional[Path] = typer.Option(None, "--pods", help="Pod list CSV in the openb format (default: openb_pod_list_default.csv in --trace)."),
    policy: str = typer.Option("fgd", "--policy", callback=POLICY_LIST,
                               help=f"Policies, comma-separated: {', '.join(PlacementPolicy.values())}."),
    relocate: bool = typer.Option(False, "--relocate", help="Also run each policy with relocation (moves running pods for pods that fit nowhere)."),
    seeds: str = typer.Option("42", "--seeds", help="Seeds: 42..51, 42,43 or 42."),
    tune: float = typer.Option(1.3, "--tune", help="Workload tuning ratio (arrived GPU demand / capacity)."),
    order: ArrivalOrder = typer.Option(ArrivalOrder.SHUFFLE, "--order", help="Arrival order: shuffle (the authors' runs) or submission (creation_time)."),
    moves_per_pod: int = typer.Option(4, "--moves-per-pod", help="Relocation: most moves to make room for one pod."),
    max_moves: Optional[int] = typer.Option(None, "--max-moves", help="Relocation: most moves in one run (default: no limit)."),
    min_gain: int = typer.Option(1500, "--min-gain", help="Relocation: milli-GPU a plan must be worth per move (its pod plus GPU share made usable; 0: every plan)."),
    jobs: int = typer.Option(1, "--jobs", help="Runs in parallel (processes)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of allocation vs arrived load (seed means)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object with means over the seeds."),
) -> None:
    """Replay the openb trace under placement policies, with and without relocation."""
    policies, seed_list = parse_choices(policy, seeds)
    if tune < 0 or moves_per_pod < 0 or min_gain < 0 or (max_moves is not None and max_moves < 0):
        raise fail("--tune, --moves-per-pod, --min-gain and --max-moves must not be negative")
    _, nodes, pod_list = load_inputs(trace, pods)
    out = run_with_progress(nodes, pod_list, policies, seed_list, relocate, tune, order, moves_per_pod, max_moves, quiet=False, min_gain=min_gain, jobs=max(1, jobs))
    results = [agg for agg, _ in out]
    if plot is not None:
        from relocator.sim.plot import plot_allocation

        plot_allocation(out, plot)
    if as_json:
        sys.stdout.write(json.dumps({"results": results}, indent=2) + "\n")
        return
    print_table(results)
    if plot is not None:
        typer.echo(f"plot: {plot}")


def print_table(results: list[dict], title: str = "unallocated GPUs (mean over seeds)") -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for col in ("policy", "moves?", "unalloc@100%", "unalloc@130%", "alloc%@100", "alloc%@130", "frag%", "bound@end", "moves", "GPUs moved", "failed pods"):
        t.add_column(col, justify="right" if col not in ("policy", "moves?") else "left")
    for r in results:
        t.add_row(
            r["policy"],
            "yes" if r["relocate"] else "no",
            f"{r['unalloc_gpus_at_100']:.1f}",
            f"{r['unalloc_gpus_at_130']:.1f}",
            f"{r['alloc_pct_at_100']:.2f}",
            f"{r['alloc_pct_at_130']:.2f}",
            f"{r['frag_pct_at_end']:.2f}",
            f"{r.get('lower_bound_unalloc_gpus', 0.0):.1f}",
            f"{r['moves']:.0f}",
            f"{r['moved_gpus']:.1f}",
            f"{r['failed_pods']:.0f}",
        )
    Console(width=160).print(t)
