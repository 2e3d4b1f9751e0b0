"""`relocator bench splices`: continued streams' text, router-made vs engine-made, in one run."""

from __future__ import annotations

import asyncio

import typer
from rich.table import Table

from relocator.cli import bench_app
from relocator.cli.common import console, err, handle_errors, print_json


@bench_app.command("splices")
@handle_errors
def bench_splices(
    streams: int = typer.Option(1000, min=1, help="streams through the text-making router"),
    baseline_streams: int = typer.Option(200, min=0,
                                         help="streams through a router forwarding the "
                                              "engine's text (0: skip the baseline)"),
    concurrency: int = typer.Option(16, min=1, help="streams at once"),
    max_tokens: int = typer.Option(120, min=8, help="tokens per stream"),
    seed: int = typer.Option(0, help="seeds the request mix and where connections break"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Every stream cut and continued every few tokens on two vLLM CPU workers: text
    mismatches against direct runs, splices inside a character / a held-back stop string."""
    from relocator.bench.splices import run

    res = asyncio.run(run(streams, baseline_streams, concurrency, max_tokens, seed=seed,
                          log=lambda m: err.print(f"[dim]{m}[/]")))
    if json_out:
        print_json(res)
    else:
        t = Table(title="relocator bench splices")
        t.add_column("")
        t.add_column("router text", justify="right")
        t.add_column("engine text (baseline)", justify="right")
        a, b = res["router_text"], res["engine_text_baseline"] or {}
        for k in ("streams", "client_errors", "text_mismatched", "text_mismatched_with_stop",
                  "cuts", "seconds"):
            t.add_row(k, str(a[k]), str(b.get(k, "")))
        for k in ("char", "stop_buffer", "clean", "engine_text"):
            t.add_row(f"splices at {k} (streams)", f"{a['splices'][k]} ({a['streams_by_splice'][k]})",
                      f"{b['splices'][k]} ({b['streams_by_splice'][k]})" if b else "")
        console.print(t)
    if res["router_text"]["text_mismatched"] or res["router_text"]["client_errors"]:
        raise typer.Exit(1)
