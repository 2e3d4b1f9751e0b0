"""`relocator bench fractional`: eight 0.25-GPU workers scattered over 3 nodes, one
`consolidate` under streaming load, then a 4-GPU launch on the freed node (relocator.bench
.fractional; issue 31)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import typer
from rich.table import Table

from adapters.base import DEFAULT_ENGINE, Engine
from relocator.cli import bench_app
from relocator.cli.common import console, err, handle_errors, print_json, stdout_for_json

ROWS = ("gpus_in_use", "whole_nodes_free")


@bench_app.command("fractional")
@handle_errors
def bench_fractional(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    engine: Engine = typer.Option(Engine(DEFAULT_ENGINE), help="the workers' engine (reference: ready in ~1.5 s)"),
    max_moves: int = typer.Option(6, "--max-moves", min=1, help="the consolidation's move budget"),
    cluster_dir: str = typer.Option("/var/lib/relocator/bench-fractional", "--cluster-dir",
                                    help="where the bench's local cluster lives"),
) -> None:
    """GPUs in use and whole nodes free before and after one consolidation of eight 0.25-GPU
    workers, the 4-GPU launch without and with it, and the clients' token check."""
    from relocator.bench.fractional import run

    json_file = stdout_for_json() if json_out else None  # Ray's driver prints raylet errors there
    out = run(cluster_dir, engine.value, max_moves, say=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    if json_file is not None:
        print_json(out, json_file)
        return
    t = Table(title="relocator bench fractional: eight 0.25-GPU workers, 3 nodes x 4 GPUs")
    for c in ("", "before (no moves)", "after consolidate"):
        t.add_column(c, justify="right")
    for k in ROWS:
        t.add_row(k, str(out["before"][k]), str(out["after"][k]))
    t.add_row("4-GPU launch", out["big_launch_without_moves"][:60], f"on {out['big_launch']['node']} "
              f"({out['big_launch']['moves']} move(s))")
    console.print(t)
    for k in ("moves", "move_results", "blackout_s_max", "nodes_freed", "gpus_freed", "requests", "client_errors",
              "tokens_lost", "tokens_duplicated", "tokens_mismatched", "text_mismatched", "targets", "seconds"):
        console.print(f"{k:20} {out[k]}", highlight=False)
