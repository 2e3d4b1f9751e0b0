"""`relocator policies` (list, dry-run, apply, validate) and `relocator notice` (docs/policies.md)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.table import Table

from relocator.cli import app
from relocator.cli.common import console, handle_errors, print_json

JSON = typer.Option(False, "--json", help="print one JSON object")
CLUSTER_DIR = typer.Option(None, "--cluster-dir", help="where the cluster runs from (default: $RELOCATOR_CLUSTER_DIR)")


def _connect(cluster_dir: Optional[str]):
    from relocator.controller.api import connect

    return connect(cluster_dir)


def _what(p: dict) -> tuple[str, str, str]:
    src = p.get("set") or p  # what the file says (defaults left out)
    t = {k: v for k, v in src["trigger"].items() if k != "kind"}
    f = dict(src.get("filter") or {})
    a = {k: v for k, v in src["action"].items() if k != "kind"}
    brief = lambda d: ", ".join(f"{k}={v}" for k, v in d.items())  # noqa: E731
    return (f"{p['trigger']['kind']} {brief(t)}".strip(), brief(f) or "all workers",
            f"{p['action']['kind']} {brief(a)}".strip())


def _print_listing(out: dict) -> None:
    table = Table("policy", "on", "trigger", "filter", "action", "limits", "budget left")
    for p in out["policies"]:
        trig, filt, act = _what(p)
        lim = p["limits"]
        table.add_row(p["name"], "yes" if p["enabled"] else "no", trig, filt, act,
                      f"hold {lim['hold_s']:g}s, cooldown {lim['cooldown_s']:g}s, {lim['max_moves_per_hour']}/h",
                      str(p.get("budget_left", "")))
    console.print(table)
    for g in out.get("gpus", []):
        console.print(f"GPU {g['gpu']} on {g['node']}: [yellow]{g['state']}[/] ({g['why']})")
    for e in out.get("errors", []):
        console.print(f"[red]invalid[/] {e['name'] or '(file)'}: {e['error']}")


def _print_dry_run(out: dict) -> None:
    console.print(f"one move takes about {out['move_s']:g} s here")
    for p in out["policies"]:
        if p.get("error"):
            console.print(f"[red]{p['name']}[/]: failed: {p['error']}")
        elif not p["firings"]:
            console.print(f"{p['name']}: nothing fires now" + ("" if p["enabled"] else " (disabled)"))
        for f in p.get("firings", []):
            console.print(f"[bold]{p['name']}[/]: {f['firing']['reason']}: would {f['would']}")
            for s in f["steps"]:
                where = f" → {s['to']}" if s.get("to") else ""
                late = "" if s.get("fits_deadline", True) else " (after the deadline)"
                console.print(f"  {s['op']} {s.get('worker') or s.get('node') or ''}{where}{late}")
    for e in out.get("errors", []):
        console.print(f"[red]invalid[/] {e['name'] or '(file)'}: {e['error']}")


@app.command("policies")
@handle_errors
def policies_cmd(dry_run: bool = typer.Option(False, "--dry-run", help="what each policy would do now"),
                 apply: Optional[Path] = typer.Option(None, "--apply", help="replace the cluster's policies "
                                                      "with this YAML file's"),
                 file: Optional[Path] = typer.Option(None, "--file", help="validate and list this file's "
                                                     "policies (no cluster needed)"),
                 cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """The policies that start moves: trigger, filter, action and limits of each; invalid ones
    with why (the others still run)."""
    if file is not None:
        from relocator.policies.spec import load_file

        specs, errors = load_file(file)
        out = {"file": str(file), "errors": errors, "policies": [
            {**s.model_dump(mode="json"), "set": s.model_dump(mode="json", exclude_defaults=True)} for s in specs]}
    elif apply is not None:
        import yaml

        try:
            doc = yaml.safe_load(apply.read_text()) or {}
        except (OSError, yaml.YAMLError) as exc:
            raise ValueError(f"{apply}: {str(exc).splitlines()[0]}") from None
        out = _connect(cluster_dir).apply_policies(doc)
    else:
        out = _connect(cluster_dir).policies(dry_run=dry_run)
    if json_out:
        print_json(out)
    elif dry_run and file is None and apply is None:
        _print_dry_run(out)
    else:
        _print_listing(out)
    if out.get("errors"):
        raise typer.Exit(2 if file is not None else 0)


@app.command("notice")
@handle_errors
def notice_cmd(node: str = typer.Argument(..., help="the node that goes away"),
               in_s: Optional[float] = typer.Option(None, "--in", min=0, help="seconds from now"),
               at: Optional[float] = typer.Option(None, "--at", help="epoch time"),
               clear: bool = typer.Option(False, "--clear", help="withdraw the node's notice"),
               reason: str = typer.Option("", "--reason"),
               cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Say that NODE goes away at a time (a spot notice, a maintenance): node-notice policies act."""
    if (in_s is not None) + (at is not None) + clear != 1:
        raise typer.BadParameter("give exactly one of --in, --at, --clear")
    when = None if clear else (at if at is not None else time.time() + float(in_s))
    out = _connect(cluster_dir).notice(node, when, reason)
    if json_out:
        print_json(out)
    else:
        console.print(f"{node}: " + ("notice withdrawn" if when is None else f"goes away at {when:.0f} "
                                     f"(in {when - time.time():.0f} s)"))
