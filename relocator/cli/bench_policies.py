"""`relocator bench policies`: the issue-33 target scenarios once (relocator.bench.policies)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import typer

from relocator.cli import bench_app
from relocator.cli.common import console, err, handle_errors, print_json


@bench_app.command("policies")
@handle_errors
def bench_policies(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    flap_s: float = typer.Option(60.0, "--flap-s", min=4, max=600, help="how long the health signal flaps"),
    cluster_dir: str = typer.Option("/var/tmp/relocator-bench-policies", "--cluster-dir"),
) -> None:
    """A pending row remap and an Xid 79 on a worker's GPU under 8 streams, a 60 s notice for a
    node with 4 workers, a flapping health signal: against the issue's targets."""
    from relocator.bench.policies import run

    res = run(cluster_dir, flap_s, log=lambda m: err.print(f"[dim]{m}[/]", highlight=False))
    if json_out:
        print_json(res)
        return
    one, four, flap = res["remap_and_xid79"], res["notice"], res["flapping"]
    console.print(f"row remap -> moved live in {one['row_remap_moved_s']} s (target 10 s); Xid 79 -> served again "
                  f"in {one['xid79_served_again_s']} s ({one['xid79_how']}; target 5 s); load {one['load']}")
    console.print(f"60 s notice, 4 workers: {four['moved']} moved, {four['suspended']} suspended in "
                  f"{four['seconds_used']} s; load {four['load']}")
    console.print(f"flapping {flap['flap_s']:.0f} s: {flap['moves']} move(s) (budget {flap['budget_per_hour']}/h)")
