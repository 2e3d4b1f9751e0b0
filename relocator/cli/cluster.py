"""`relocator up | down | status | launch | relocate | drain`: the local cluster and its controller."""

from __future__ import annotations

import os
from typing import Optional

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported

import typer
from rich.table import Table

from adapters.base import DEFAULT_ENGINE, Engine
from relocator.cli import app
from relocator.cli.common import console, handle_errors, print_json
from relocator.controller.machine import PhaseFault
from relocator.controller.model import TransferMode

JSON = typer.Option(False, "--json", help="print one JSON object")
CLUSTER_DIR = typer.Option(None, "--cluster-dir", help="where the cluster runs from "
                           "(default $RELOCATOR_CLUSTER_DIR or /var/lib/relocator/cluster)")


def _connect(cluster_dir: Optional[str]):
    from relocator.controller.api import connect

    return connect(cluster_dir)


def phases_table(rel: dict, title: str | None = None) -> Table:
    t = Table(title=title or f"relocation {rel['id']}: {rel['worker']} {rel['from']} → {rel['to']}  "
              f"[{'green' if rel['result'] == 'done' else 'red'}]{rel['result']}[/]")
    t.add_column("phase")
    t.add_column("seconds", justify="right")
    for name, secs in rel["phases"].items():
        t.add_row(name, f"{secs:.3f}")
    return t


@app.command("up")
@handle_errors
def up_cmd(config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML (default configs/local.yaml)"),
           nodes: Optional[int] = typer.Option(None, help="raylets (nodes) on this machine"),
           gpus: Optional[int] = typer.Option(None, "--gpus", help="fake GPUs per node"),
           cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Start a local Ray cluster of N nodes with G fake GPUs each, the controller and the router."""
    from relocator.cluster.config import LocalConfig, cluster_dir as default_dir
    from relocator.cluster.local import up

    cfg = LocalConfig.load(config, cluster={"nodes": nodes, "gpus_per_node": gpus,
                                            "base_dir": cluster_dir or str(default_dir())})
    info = up(cfg)
    if json_out:
        print_json(info)
        return
    console.print(f"[green]up[/] in {info['startup_s']:.1f}s: {len(info['nodes'])} nodes x "
                  f"{info['gpus_per_node']} GPUs, router {info['router_url']}, ray {info['address']}")


@app.command("down")
@handle_errors
def down_cmd(cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Stop everything `up` started: workers, controller, agents, router, raylets."""
    from relocator.cluster.local import down

    out = down(cluster_dir)
    if json_out:
        print_json(out)
    else:
        console.print("[green]down[/]" if out["stopped"] else out["reason"])


@app.command("status")
@handle_errors
def status_cmd(cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Nodes and free GPUs, workers, relocations."""
    st = _connect(cluster_dir).status()
    if json_out:
        print_json(st)
        return
    console.print(f"router: {st['router_url']}")
    metrics = st.get("metrics") or {}
    console.print(f"metrics: controller {metrics.get('controller')}, router {metrics.get('router')}; "
                  f"events: {(st.get('events') or {}).get('log')}")
    t = Table(title="nodes")
    for c in ("node", "GPUs", "free", "state"):
        t.add_column(c)
    for n in st["nodes"]:
        t.add_row(n["id"], str(n["gpus_total"]), str(n["gpus_free"]), "alive" if n.get("alive", True) else "[red]lost[/]")
    console.print(t)
    t = Table(title="workers")
    for c in ("worker", "model", "node", "GPUs", "state", "endpoint", "replaced"):
        t.add_column(c)
    for w in st["workers"]:
        t.add_row(w["id"], w["model"], w["node"], str(w["gpus"]), w["state"], w["endpoint"],
                  str(w.get("replacements", 0)))
    console.print(t)
    if st["relocations"]:
        t = Table(title="relocations")
        for c in ("id", "worker", "from", "to", "phase", "result"):
            t.add_column(c)
        for r in st["relocations"]:
            t.add_row(r["id"], r["worker"], r["from"], str(r["to"]), str(r["phase"]), r["result"])
        console.print(t)


@app.command("events")
@handle_errors
def events_cmd(since: Optional[int] = typer.Option(None, help="after this event number (0: the whole stored "
                                                          "history; default: from now)"),
               follow: bool = typer.Option(True, "--follow/--no-follow", help="keep waiting for new events"),
               cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """The controller's events as they happen: relocation phases, rollbacks, lost nodes and workers,
    replacements (docs/observability.md). One JSON object per line with --json."""
    import json

    from rich.markup import escape

    for ev in _connect(cluster_dir).events(since=since, idle_timeout=None if follow else 0):
        if json_out:
            typer.echo(json.dumps(ev, default=str))
        else:
            rest = {k: v for k, v in ev.items() if k not in ("seq", "ts", "kind")}
            console.print(f"{ev['seq']:>6} [bold]{ev['kind']}[/] " + escape(" ".join(f"{k}={v}" for k, v in rest.items())))


@app.command("launch")
@handle_errors
def launch_cmd(model: str = typer.Option("tiny-llama", "--model", "-m", help="tiny-llama or a model directory"),
               gpus: int = typer.Option(1, "--gpus", help="GPUs the worker takes"),
               node: Optional[str] = typer.Option(None, "--node", help="node (default: the planner places it)"),
               engine: Engine = typer.Option(Engine(DEFAULT_ENGINE), "--engine", help="the serving engine"),
               cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Start a worker and register it with the router; waits until it serves."""
    w = _connect(cluster_dir).launch(model, gpus, node, engine=engine.value)
    if json_out:
        print_json(w)
    else:
        console.print(f"[green]{w['id']}[/] {w['model']} ({w['engine']}) on {w['node']} ({w['gpus']} GPU) at {w['endpoint']}, "
                      f"ready in {w['launch_s']:.1f}s")


@app.command("relocate")
@handle_errors
def relocate_cmd(worker: str = typer.Argument(..., help="worker id"),
                 to: Optional[str] = typer.Option(None, "--to", help="target node (default: the planner picks)"),
                 transfer: Optional[TransferMode] = typer.Option(None, help="default: the cluster's config"),
                 fault: Optional[PhaseFault] = typer.Option(None, help="inject a failure at the end of that phase"),
                 cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Move a running worker, live, with its traffic; waits and prints phases with timings."""
    faults = {fault.value: True} if fault else None
    rel = _connect(cluster_dir).relocate(worker, to, transfer, faults)
    if json_out:
        print_json(rel)
    else:
        console.print(phases_table(rel))
        if rel["error"]:
            console.print(f"[red]{rel['error']}[/]; rollback: {rel['rollback']}")
    if rel["result"] != "done":
        raise typer.Exit(1)


@app.command("drain")
@handle_errors
def drain_cmd(node: str = typer.Argument(..., help="node to empty"),
              parallel: int = typer.Option(1, help="relocations at a time"),
              transfer: Optional[TransferMode] = typer.Option(None, help="default: the cluster's config"),
              cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Move every worker off NODE, live."""
    out = _connect(cluster_dir).drain(node, parallel, transfer)
    if json_out:
        print_json(out)
    else:
        for rel in out["relocations"]:
            console.print(phases_table(rel))
        console.print(f"{node}: {'[green]drained[/]' if out['drained'] else '[red]not drained[/]'} "
                      f"in {out['seconds']:.1f}s")
    if not out["drained"]:
        raise typer.Exit(1)
