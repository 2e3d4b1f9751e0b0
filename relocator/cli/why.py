"""`relocator why DEMAND`: why a demand waits, the ordinary causes ruled out first (it can never
fit, nodes lost / not registered / cordoned, priority), then fragmentation: the free GPUs per
node as a picture and the plan that would seat it with its cost (relocator/controller/why.py)."""

from __future__ import annotations

import os
from typing import Optional

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported

import typer
from rich.table import Table

from relocator.cli import app
from relocator.cli.common import console, fail, handle_errors, print_json

STATE_STYLE = {"ready": "green", "lost": "red", "unregistered": "yellow", "cordoned": "magenta"}


def gpu_glyphs(free: list[float]) -> str:
    """One glyph a GPU: □ free, ■ in use, ◧ partly used (a share)."""
    out = []
    for f in free:
        if f >= 1.0 - 1e-6:
            out.append("[green]□[/]")
        elif f <= 1e-6:
            out.append("[red]■[/]")
        else:
            out.append("[yellow]◧[/]")
    return " ".join(out) or "-"


def free_map(nodes: list[dict]) -> Table:
    t = Table(title="free GPUs per node (□ free, ◧ partly used, ■ used)")
    for c in ("node", "state", "GPUs", "free", "free share"):
        t.add_column(c, justify="right" if c in ("free", "free share") else "left")
    for n in nodes:
        style = STATE_STYLE.get(n["state"], "white")
        partial = [f"{f:g}" for f in n["free"] if 1e-6 < f < 1.0 - 1e-6]
        total = "?" if n["gpus_total"] is None else str(n["gpus_total"])
        t.add_row(n["id"], f"[{style}]{n['state']}[/]", gpu_glyphs(n["free"]), f"{n['free_gpus']}/{total}",
                  f"{n['free_share']:g}" + (f" ({', '.join(partial)})" if partial else ""))
    return t


def plan_table(plan: dict) -> Table | None:
    if not plan or plan.get("node") is None or not (plan.get("moves") or plan.get("suspends")):
        return None
    t = Table(title=f"plan: then on {plan['node']}")
    for c in ("step", "worker", "from", "to", "GPUs", "GB", "expected blackout s"):
        t.add_column(c)
    for m in plan.get("moves", []):
        t.add_row("move", m["worker"], m["from"], m["to"], f"{m['gpus']:g}", f"{int(m.get('bytes') or 0) / 1e9:.2f}",
                  f"{m.get('blackout_s', 0.0):.1f}")
    for w in plan.get("suspends", []):
        t.add_row("suspend", w, "", "", "", "", "")
    return t


def print_why(why: dict) -> None:
    style = "green" if why["cause"] == "fits_now" else "yellow"
    console.print(f"[{style}]{why['line']}[/]", highlight=False)
    t = Table(title="checks, in order")
    for c in ("check", "", "evidence"):
        t.add_column(c)
    for ch in why["checks"]:
        t.add_row(ch["check"], "[green]ok[/]" if ch["ok"] else "[red]no[/]", ch["line"])
    console.print(t)
    console.print(free_map(why["nodes"]))
    p = plan_table(why.get("plan") or {})
    if p is not None:
        console.print(p)
        cost = why["plan"]["cost"]
        console.print(f"cost: {cost['moves']} move(s), {cost['bytes'] / 1e9:.2f} GB, expected blackout "
                      f"{cost['blackout_s_max']:.1f} s (longest move; moves run concurrently)")


@app.command("why")
@handle_errors
def why_cmd(demand: str = typer.Argument(..., help="the pending demand's id (`relocator status` lists them)"),
            cluster_dir: Optional[str] = typer.Option(None, "--cluster-dir", help="where the cluster runs from "
                                                      "(default $RELOCATOR_CLUSTER_DIR or /var/lib/relocator/cluster)"),
            json_out: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Why a demand waits: can it ever fit, nodes not ready, priority, then fragmentation with the
    free GPUs per node and the plan that would seat it (moves, bytes, expected blackout)."""
    from relocator.controller.api import connect

    try:
        why = connect(cluster_dir).why(demand)
    except KeyError as exc:
        fail(str(exc.args[0] if exc.args else exc), 2)
        return
    if json_out:
        print_json(why)
        return
    print_why(why)
