"""The GPU-sharing figures of `relocator replay` and `relocator bench replay` (issue 31,
relocator/sim/gpushare.py): fragmented GPUs (the FGD authors' measure) and nodes with all GPUs
free, each run beside the run without moves of the same pod list, policy, load and seed."""

from __future__ import annotations

from typing import Optional

import typer

#: `--pack-every`: the packing rounds of mode moves+pack
PACK_EVERY = typer.Option(2.0, "--pack-every", min=1.0, help="Mode moves+pack: a round of moves of fractional pods onto "
                          "fewer GPUs every this many simulated seconds, within the budget.")
#: figures of sim/gpushare.py that `bench replay` averages over seeds
GPUSHARE_KEYS = ("frag_gpus_mean", "frag_gpus_gpu_mean", "free_nodes_mean", "pack_moves", "frag_ratio")


def with_frag_ratio(results: list[dict]) -> None:
    """Each run's `frag_ratio`: its mean fragmented GPUs over those of the run without moves of
    the same pod list, policy, queue, load and seed (1.0 for that run itself)."""
    base = {(r.get("pods"), r["policy"], r.get("queue"), r["load"], r["seed"]): r for r in results if r["mode"] == "none"}
    for r in results:
        b = base.get((r.get("pods"), r["policy"], r.get("queue"), r["load"], r["seed"]))
        if b is not None and b.get("frag_gpus_mean") and r.get("frag_gpus_mean") is not None:
            r["frag_ratio"] = round(r["frag_gpus_mean"] / b["frag_gpus_mean"], 4)


def set_pack_every(cfgs: list, pack_every: Optional[float]) -> list:
    for c in cfgs:
        if pack_every is not None:
            c.pack_every_s = float(pack_every)
    return cfgs


def print_gpushare(results: list[dict], title: str = "GPU sharing: fragmented GPUs and free nodes") -> None:
    from rich.console import Console
    from rich.table import Table

    with_frag_ratio(results)

    def f(r: dict, k: str, fmt: str) -> str:
        v = r.get(k)
        return "-" if v is None else format(v, fmt)

    t = Table(title=title)
    cols = ("pods", "policy", "mode", "load", "seed", "fragmented GPUs (mean)", "vs none", "of them not CPU-only",
            "nodes all free (mean)", "alloc mean", "moves/100 arr.", "pack moves")
    for c in cols:
        t.add_column(c, justify="left" if c in ("pods", "policy", "mode") else "right")
    for r in results:
        t.add_row(str(r.get("pods", "")), r["policy"], r["mode"], f"{r['load']:.1f}", str(r["seed"]),
                  f(r, "frag_gpus_mean", ".1f"), f(r, "frag_ratio", ".1%"), f(r, "frag_gpus_gpu_mean", ".1f"),
                  f(r, "free_nodes_mean", ".1f"), f(r, "alloc_ratio_mean", ".3f"), f(r, "moves_per_100_arrivals", ".2f"),
                  str(r.get("pack_moves", 0)))
    Console(width=200).print(t)
