"""`relocator bench scheduling`: one scripted day once per preemption rule (place-or-wait,
evict-requeue, suspend-in-place, moves), side by side (relocator.bench.scheduling)."""

from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import typer
from rich.table import Table

from adapters.base import Engine
from relocator.cli import bench_app
from relocator.cli.common import choice_list, console, err, handle_errors, print_json

ROWS = ("launches", "launch_failures", "wait_s_p50", "wait_s_p99", "wait_s_max", "preemptions", "evictions",
        "suspends", "resumes", "pauses", "moves", "moves_failed", "failed_requests", "tokens_of_work_lost", "failed_requests_not_at_stops",
        "tokens_of_work_lost_not_at_stops",
        "gpu_s_idle_while_waiting", "client_blackout_max_s", "tokens_lost", "requests", "suspended_at_end",
        "seconds", "starts")
ALL_ARMS = "place-or-wait,evict-requeue,suspend-in-place,moves"
WARM = ("on", "off")


def _warm(value: str) -> bool:
    """`--warm on|off` as a bool (ValueError naming the valid values)."""
    if value not in WARM:
        raise ValueError(f"{value!r}: valid: {', '.join(WARM)}")
    return value == "on"


def _arms(value: str) -> tuple[str, ...]:
    """The rules of `--arms` (ValueError naming the valid ones; none named: ValueError)."""
    from relocator.vocab import PreemptionRule

    arms = tuple(PreemptionRule(a.strip()).value for a in value.split(",") if a.strip())
    if not arms:
        raise ValueError(f"--arms names no rule; valid: {ALL_ARMS}")
    return arms


def _rules() -> tuple[str, ...]:
    from relocator.vocab import PreemptionRule

    return PreemptionRule.values()


@bench_app.command("scheduling")
@handle_errors
def bench_scheduling(
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
    engine: Engine = typer.Option(Engine.REFERENCE, help="the workers' engine (reference: ready in ~1.5 s)"),
    scale: float = typer.Option(1.0, min=0.25, max=20.0, help="stretch the day's clock (1: a 140 s day)"),
    arms: str = typer.Option(ALL_ARMS, "--arms", help="the preemption rules to run, comma-separated",
                             callback=choice_list(_arms, _rules)),
    quick: bool = typer.Option(False, "--quick", help="the day's first half (70 s): 6 launches"),
    warm: str = typer.Option("on", "--warm", callback=choice_list(_warm, lambda: WARM),
                             help="warm images in every arm: on (the default, as configs/images.yaml ships: "
                                  "a start of a kind its node has seen restores its image) or off (every "
                                  "start cold, nothing captured)"),
    cluster_dir: str = typer.Option("/var/lib/relocator/bench-scheduling", "--cluster-dir",
                                    help="where each arm's local cluster lives"),
) -> None:
    """Launch waits, failures, preemptions, failed requests, work lost, idle GPUs and the
    blackout clients saw, on one scripted day, once per preemption rule (the controller's
    `preemption` setting; multi-GPU waits are for launches of 2 or more GPUs)."""
    from relocator.bench.scheduling import run

    chosen = _arms(arms)
    res = run(cluster_dir, engine.value, scale, log=lambda m: err.print(f"[dim]{m}[/]", highlight=False),
              arms=chosen, quick=quick, warm=_warm(warm))
    if json_out:
        print_json(res)
        return
    t = Table(title="relocator bench scheduling")
    t.add_column("")
    for a in chosen:
        t.add_column(a, justify="right")
    for k in ROWS:
        t.add_row(k, *(str(res[a].get(k)) for a in chosen))
    console.print(t)
    console.print(f"warm images: {res['day']['warm_images']}; moves vs the stock arms: {res['comparison']}",
                  highlight=False)
