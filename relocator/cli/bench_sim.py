"""`relocator bench sim`: the openb trace, seeds 42..51, checked against the FGD authors' own
results, then the same policies with relocation."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from relocator.cli import bench_app
from relocator.cli.simulate import POLICY_LIST, fail, load_inputs, parse_choices, print_table, run_with_progress

REF_NAMES = {"random": "01-Random", "dot-product": "02-DotProd", "best-fit": "05-BestFit", "fgd": "06-FGD"}
VALIDATED = ("fgd", "best-fit")
TOLERANCE = 0.05


def compare(results: list[dict], reference: list[dict]) -> list[dict]:
    ref = {r["sc_policy"]: r for r in reference}
    rows = []
    for r in results:
        if r["relocate"] or REF_NAMES.get(r["policy"]) not in ref:
            continue
        rr = ref[REF_NAMES[r["policy"]]]
        row = {"policy": r["policy"]}
        ok = True
        for at in ("100", "130"):
            ours, theirs = r[f"unalloc_gpus_at_{at}"], float(rr[f"unalloc_gpus_at_{at}"])
            dev = (ours - theirs) / theirs
            row[f"ours_at_{at}"], row[f"theirs_at_{at}"], row[f"dev_pct_at_{at}"] = ours, theirs, round(100 * dev, 2)
            ok &= abs(dev) <= TOLERANCE
        row["within_5pct"] = ok
        row["required"] = r["policy"] in VALIDATED
        rows.append(row)
    return rows


@bench_app.command("sim")
def bench_sim(
    trace: Optional[Path] = typer.Option(None, "--trace", help="openb folder (default ../shared/data/openb or $RELOCATOR_OPENB_DIR)."),
    policy: str = typer.Option("random,dot-product,best-fit,fgd", "--policy", callback=POLICY_LIST,
                               help="Policies, comma-separated."),
    seeds: str = typer.Option("42..51", "--seeds", help="Seeds (the reference uses 42..51)."),
    moves_per_pod: int = typer.Option(4, "--moves-per-pod", help="Most moves to make room for one pod."),
    min_gain: int = typer.Option(1500, "--min-gain", help="Milli-GPU a plan must be worth per move (its pod plus GPU share made usable)."),
    jobs: int = typer.Option(2, "--jobs", help="Runs in parallel (processes)."),
    plot: Path = typer.Option(Path("docs/img/sim_alloc.png"), "--plot", help="Where to write the PNG."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: results, validation."),
) -> None:
    """Validate the simulator against the FGD authors' numbers, then show what relocation wins."""
    from relocator.sim.plot import plot_allocation
    from relocator.sim.trace import REFERENCE_FILE, TraceError, load_reference

    policies, seed_list = parse_choices(policy, seeds)
    tdir, nodes, pods = load_inputs(trace, None)
    try:
        reference = load_reference(tdir / REFERENCE_FILE)
    except TraceError as exc:
        raise fail(str(exc)) from None
    out = run_with_progress(nodes, pods, policies, seed_list, True, 1.3, "shuffle", moves_per_pod, None, quiet=False, min_gain=min_gain, jobs=max(1, jobs))
    results = [agg for agg, _ in out]
    validation = compare(results, reference)
    plot_allocation(out, plot)
    passed = all(v["within_5pct"] for v in validation if v["required"])
    if as_json:
        sys.stdout.write(json.dumps({"results": results, "validation": validation, "validated": passed, "plot": str(plot)}, indent=2) + "\n")
    else:
        typer.echo("Validation against the FGD authors' simulator (unallocated GPUs, mean of seeds):")
        for v in validation:
            mark = "OK " if v["within_5pct"] else ("FAIL" if v["required"] else "off")
            typer.echo(
                f"  [{mark}] {v['policy']:<12} @100%: {v['ours_at_100']:7.1f} vs {v['theirs_at_100']:6.1f} ({v['dev_pct_at_100']:+.1f}%)"
                f"   @130%: {v['ours_at_130']:7.1f} vs {v['theirs_at_130']:6.1f} ({v['dev_pct_at_130']:+.1f}%)"
            )
        typer.echo("simulator validated (FGD and best-fit within 5%)" if passed else "simulator NOT validated")
        print_table(results, "with and without relocation (mean over seeds)")
        plain = {r["policy"]: r for r in results if not r["relocate"]}
        for r in results:
            if r["relocate"] and r["policy"] in plain:
                won = plain[r["policy"]]["unalloc_gpus_at_130"] - r["unalloc_gpus_at_130"]
                per = f"{r['moves'] / won:.2f} moves per GPU won back" if won > 0 else "no GPU won back"
                typer.echo(
                    f"  {r['policy']:<12} +moves: {won:+.1f} GPUs at 130% with {r['moves']:.1f} moves ({per});"
                    f" lower bound for any packing of its pods: {r['lower_bound_unalloc_gpus']:.1f} unallocated GPUs"
                )
        typer.echo(f"plot: {plot}")
    if not passed:
        raise typer.Exit(1)
