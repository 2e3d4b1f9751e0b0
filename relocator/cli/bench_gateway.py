"""`relocator bench gateway`: LiteLLM alone vs LiteLLM + the relocator plugin vs the relocator
router, same fake backend: TTFB and req/s at concurrency 1 and 64, one move under load each."""

from __future__ import annotations

import asyncio

import typer
from rich.table import Table

from relocator.cli import bench_app
from relocator.cli.common import console, err, handle_errors, print_json


@bench_app.command("gateway")
@handle_errors
def bench_gateway(
    duration: float = typer.Option(8.0, min=1.0, help="seconds measured per side and "
                                   "concurrency (in alternating rounds)"),
    rounds: int = typer.Option(4, min=1, help="alternating measurement windows per side"),
    tokens: int = typer.Option(16, min=1, help="tokens per stream (load)"),
    move_tokens: int = typer.Option(200, min=10, help="tokens per stream (the move)"),
    move_concurrency: int = typer.Option(16, min=1, help="streams at once during the move"),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """The LiteLLM plugin's overhead and what a move does to clients through each gateway."""
    from relocator.bench.gateway import run

    res = asyncio.run(run(duration, tokens, move_tokens, move_concurrency, rounds,
                          log=lambda m: err.print(f"[dim]{m}[/]")))
    if json_out:
        print_json(res)
        return
    t = Table(title="relocator bench gateway (fake backend)")
    for c in ("side", "c=1 ttfb p50/p99 ms", "c=1 req/s", "c=64 ttfb p50/p99 ms", "c=64 req/s",
              "move: client errors", "tokens lost", "mismatched"):
        t.add_column(c)
    for side in ("litellm", "litellm_plugin", "router", "envoy_epp"):
        v = res.get(side, {})
        if "c1" not in v:
            continue
        m = v["move"]
        t.add_row(side, f"{v['c1']['ttfb_p50_ms']}/{v['c1']['ttfb_p99_ms']}",
                  str(v["c1"]["req_per_s"]),
                  f"{v['c64']['ttfb_p50_ms']}/{v['c64']['ttfb_p99_ms']}",
                  str(v["c64"]["req_per_s"]), f"{m['client_errors']}/{m['streams']}",
                  str(m["tokens_lost"]), str(m["tokens_mismatched_or_duplicated"]))
    console.print(t)
    console.print(res["plugin_vs_litellm"])
    console.print(res["targets"])
