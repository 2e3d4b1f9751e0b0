"""`relocator bench scheduling`: one scripted day with moves and with moves disabled (a stock
scheduler: place or wait), side by side (relocator.bench.scheduling)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import typer
from rich.table import Table

from adapters.base import Engine
from relocator.cli import bench_app
from relocator.cli.common import console, err, handle_errors, print_json

ROWS = ("launches", "launch_failures", "wait_s_p50", "wait_s_p99", "wait_s_max", "suspends", "resumes", "moves",
        "moves_failed", "blackout_max_s", "tokens_lost", "client_errors", "requests", "suspended_at_end", "seconds")


@bench_app.command("scheduling")
@handle_errors
def bench_scheduling(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    engine: Engine = typer.Option(Engine.REFERENCE, help="the workers' engine (reference: ready in ~1.5 s)"),
    scale: float = typer.Option(1.0, min=0.25, max=20.0, help="stretch the day's clock (1: a 140 s day)"),
    cluster_dir: str = typer.Option("/var/lib/relocator/bench-scheduling", "--cluster-dir",
                                    help="where the two local clusters live"),
) -> None:
    """Launch waits, failures, suspends, moves and blackouts on one scripted day, with live moves
    and without (multi-GPU waits are for launches of 2 or more GPUs)."""
    from relocator.bench.scheduling import run

    res = run(cluster_dir, engine.value, scale, log=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    if json_out:
        print_json(res)
        return
    t = Table(title="relocator bench scheduling")
    t.add_column("")
    t.add_column("with moves", justify="right")
    t.add_column("without moves (stock)", justify="right")
    for k in ROWS:
        t.add_row(k, str(res["with_moves"][k]), str(res["without_moves"][k]))
    console.print(t)
    console.print(f"multi-GPU waits, without / with moves: {res['ratio_wait_without_over_with']}", highlight=False)
