"""The baselines of `relocator bench replay` (issue 32, relocator/sim/baselines.py): the queue
disciplines as a comma list, the arrivals option, and each run with moves against the best
baseline (the lowest >= 4-GPU p99 wait without moves, over the disciplines) of the same pod
list, policy, load and seed."""

from __future__ import annotations

from typing import Optional

import typer

from relocator.cli.common import choice_list
from relocator.sim.arrivals import Arrivals
from relocator.sim.stream import QueueDiscipline, ReplayMode


def queue_list(text: str) -> list[str]:
    queues = [QueueDiscipline(q.strip()).value for q in text.split(",") if q.strip()]  # ValueError naming them
    if not queues:
        raise ValueError(f"no queue given; valid: {', '.join(QueueDiscipline.values())}")
    return list(dict.fromkeys(queues))


#: `--queue`: queue disciplines, comma-separated
QUEUE_LIST = choice_list(queue_list, QueueDiscipline.values)
QUEUE_HELP = ("Queue disciplines, comma-separated: fifo (only the head starts), easy (EASY backfill: the head has a "
              "reservation later pods must not delay), backfill (later pods start wherever they fit, no reservation).")
ARRIVALS_HELP = ("trace: the pod list's creation order and gaps (the seed changes nothing on a list with times); "
                 "poisson: each pass a seeded shuffle of the list with exponential gaps at the offered load.")

#: figures of the comparison with the best baseline that `bench replay` averages over seeds
BASELINE_KEYS = ("p99_vs_best_baseline", "p50_vs_best_baseline")


def with_best_baseline(runs: list[dict]) -> None:
    """Each run with moves: its >= 4-GPU p99 (and p50) wait over the lowest of the runs without
    moves (any discipline) of the same pod list, policy, load and seed, and which one that was."""
    best: dict[tuple, dict] = {}
    for r in runs:
        if r["mode"] != ReplayMode.NONE.value or r.get("wait_s_p99") is None:
            continue
        k = (r.get("pods"), r["policy"], r["load"], r["seed"])
        if k not in best or r["wait_s_p99"] < best[k]["wait_s_p99"]:
            best[k] = r
    for r in runs:
        b = best.get((r.get("pods"), r["policy"], r["load"], r["seed"]))
        if b is None or r["mode"] == ReplayMode.NONE.value or r.get("wait_s_p99") is None:
            continue
        r["best_baseline"] = b["queue"]
        if b["wait_s_p99"]:
            r["p99_vs_best_baseline"] = round(r["wait_s_p99"] / b["wait_s_p99"], 4)
        if b.get("wait_s_p50") and r.get("wait_s_p50") is not None:
            r["p50_vs_best_baseline"] = round(r["wait_s_p50"] / b["wait_s_p50"], 4)


def pm(e: dict, k: str, fmt: str) -> str:
    """An aggregate's mean of `k` and, over several seeds, its spread ("-" when absent)."""
    if e.get(k) is None:
        return "-"
    sd = e["spread"].get(k, {}).get("sd", 0.0)
    return f"{format(e[k], fmt)} ± {format(sd, fmt)}" if len(e["seeds"]) > 1 else format(e[k], fmt)


def print_baselines(results: list[dict], title: str) -> None:
    """One row per pod list x policy x load x discipline x mode: the >= 4-GPU waits, the p99 over
    the best baseline's, moves per 100 arrivals (the issue's target: <= 0.5 at <= 1)."""
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = ("pods", "policy", "load", "queue", "mode", "seeds", "wait p50 >=4 GPU s", "wait p99 >=4 GPU s",
            "p99 / best baseline", "alloc mean", "moves/100 arr.")
    for c in cols:
        t.add_column(c, justify="left" if c in ("pods", "policy", "queue", "mode") else "right")
    order = sorted(results, key=lambda e: (str(e["pods"]), e["policy"], e["load"], e["mode"] != "none", e["mode"], e["queue"]))
    for e in order:
        t.add_row(str(e["pods"] or ""), e["policy"], f"{e['load']:.1f}", e["queue"], e["mode"], str(len(e["seeds"])),
                  pm(e, "wait_s_p50", ".0f"), pm(e, "wait_s_p99", ".0f"), pm(e, "p99_vs_best_baseline", ".2f"),
                  pm(e, "alloc_ratio_mean", ".3f"), pm(e, "moves_per_100_arrivals", ".2f"))
    Console(width=200).print(t)


def arrivals_option(default: Arrivals) -> Optional[Arrivals]:
    return typer.Option(default, "--arrivals", help=ARRIVALS_HELP)
