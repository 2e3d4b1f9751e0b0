"""`relocator up | down | status | launch | relocate | drain | suspend | resume | consolidate`: the local
cluster and its controller."""

from __future__ import annotations

import os
import time
from typing import Optional

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before Ray is imported

import typer
from rich.table import Table

from adapters.base import DEFAULT_ENGINE, Engine
from relocator.cli import app
from relocator.cli.common import console, handle_errors, print_json
from relocator.controller.machine import PhaseFault
from relocator.vocab import TransferMode

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


def transfer_line(rel: dict) -> str:
    """The mode a relocation moved by, and why PLAN chose it (`auto`)."""
    why = rel.get("transfer_why") or ""
    return f"transfer {rel.get('transfer', '?')}" + (f": {why}" if why else "")


@app.command("up")
@handle_errors
def up_cmd(config: Optional[str] = typer.Option(None, "--config", "-c", help="YAML (default configs/local.yaml)"),
           nodes: Optional[int] = typer.Option(None, help="raylets (nodes) on this machine"),
           gpus: Optional[int] = typer.Option(None, "--gpus", help="fake GPUs per node"),
           emulate_hosts: Optional[int] = typer.Option(None, "--emulate-hosts", min=1, max=15,
                                                       help="N emulated hosts (own network and mount namespaces "
                                                       "each), with relocator deployed on them"),
           cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Start a local Ray cluster of N nodes with G fake GPUs each, the controller and the router;
    with --emulate-hosts, N emulated hosts and `relocator deploy` on them (docs/deploy.md)."""
    from relocator.cluster.config import LocalConfig, cluster_dir as default_dir
    from relocator.cluster.local import up

    cfg = LocalConfig.load(config, cluster={"nodes": nodes, "gpus_per_node": gpus, "emulate_hosts": emulate_hosts,
                                            "base_dir": cluster_dir or str(default_dir())})
    info = up(cfg)
    if json_out:
        print_json(info)
        return
    if info.get("emulated"):
        hosts = info["emulated"]["hosts"]
        console.print(f"[green]up[/] in {info['startup_s']:.1f}s: {len(hosts)} emulated hosts "
                      f"({', '.join(h['name'] + ' ' + h['ip'] for h in hosts)}) x {info['gpus_per_node']} GPUs, "
                      f"router {info['router_url']}, ray {info['address']}")
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
    if st.get("pending"):
        t = Table(title="pending")
        for c in ("id", "kind", "model", "GPUs", "priority", "waiting s", "reason"):
            t.add_column(c)
        for d in st["pending"]:
            t.add_row(d["id"], d["kind"], d["model"], str(d["gpus"]), str(d["priority"]),
                      f"{time.time() - d['since']:.0f}", d["reason"])
        console.print(t)
    if st["relocations"]:
        t = Table(title="relocations")
        for c in ("id", "worker", "from", "to", "transfer", "phase", "result"):
            t.add_column(c)
        for r in st["relocations"]:
            t.add_row(r["id"], r["worker"], r["from"], str(r["to"]), str(r.get("transfer", "")), str(r["phase"]),
                      r["result"])
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


def _duration(value: Optional[str]) -> Optional[str]:
    """A typer callback: a wrong duration is a usage error (exit 2) before anything starts."""
    if value is not None:
        from relocator.controller.model import parse_duration

        try:
            parse_duration(value)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    return value


def _gpus(value: Optional[str]) -> Optional[str]:
    """A typer callback: GPUs as relocator.shares reads them (whole >= 1, or a share in (0, 1)
    in steps of 0.01); anything else is a usage error (exit 2) before anything starts."""
    if value is None:
        return None
    from relocator.shares import parse_gpus

    try:
        return parse_gpus(value)  # type: ignore[return-value]
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def _plan_lines(plan: dict) -> list[str]:
    lines = [f"  move {m['worker']} {m['from']} → {m['to']} ({m['gpus']} GPU)" for m in plan.get("moves", [])]
    lines += [f"  suspend {w}" for w in plan.get("suspends", [])]
    return lines


def _labels(values: list[str]) -> list[tuple[str, str]]:
    """`--label k=v`: (k, v) pairs; anything else is a bad parameter (exit 2)."""
    out = []
    for v in values or []:
        k, eq, val = v.partition("=")
        if not eq or not k.strip():
            raise typer.BadParameter(f"--label wants k=v, not {v!r}")
        out.append((k.strip(), val.strip()))
    return out


@app.command("launch")
@handle_errors
def launch_cmd(model: str = typer.Option("tiny-llama", "--model", "-m", help="tiny-llama or a model directory"),
               gpus: str = typer.Option("1", "--gpus", callback=_gpus, help="GPUs the worker takes: a whole number "
                                        ">= 1, or a share of one GPU in (0, 1) in steps of 0.01 (0.25: a "
                                        "quarter of one GPU's memory; several share one GPU)"),
               node: Optional[str] = typer.Option(None, "--node", help="node (default: the planner places it)"),
               engine: Engine = typer.Option(Engine(DEFAULT_ENGINE), "--engine", help="the serving engine"),
               priority: int = typer.Option(0, "--priority", help="a launch that cannot fit even with moves "
                                            "suspends the fewest workers of lower priority"),
               time_limit: Optional[str] = typer.Option(None, "--time-limit", callback=_duration, help="after running this long it is "
                                                        "preemptible: suspended and requeued only when a waiting "
                                                        "demand or a drain needs its GPUs: 90, 90s, 15m, 2h, 1d"),
               make_room: bool = typer.Option(True, "--make-room/--no-make-room", help="make room with live moves "
                                              "when no node has the GPUs free (--no-make-room: fail instead)"),
               dry_run: bool = typer.Option(False, "--dry-run", help="print the plan, change nothing"),
               label: list[str] = typer.Option([], "--label", callback=_labels, help="k=v, what a policy's "
                                               "filter matches (repeatable)"),
               cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Start a worker and register it with the router; waits until it serves. No node with the GPUs
    free: the fewest live moves make room; a demand that cannot be met waits in `pending`."""
    w = _connect(cluster_dir).launch(model, _gpus(gpus), node, engine=engine.value, priority=priority, time_limit=time_limit,
                                     make_room=make_room, dry_run=dry_run, labels=dict(label) or None)
    if json_out:
        print_json(w)
        return
    if w.get("dry_run"):
        plan = w["plan"]
        where = plan["node"] or "nowhere now (it would wait in pending)"
        console.print(f"plan for {w['demand']['id']} ({gpus} GPU): {plan['how']}, on {where}")
        for line in _plan_lines(plan):
            console.print(line)
        if plan["reason"]:
            console.print(f"  {plan['reason']}")
    elif w.get("state") == "pending":
        console.print(f"[yellow]{w['id']} pending[/]: {w['demand']['reason']} (the controller starts it when "
                      "capacity returns; `relocator status` lists it)")
    else:
        how = "".join(f"; made room: {m['worker']} {m['from']}→{m['to']}" for m in w.get("moves", []))
        how += "".join(f"; suspended {s}" for s in w.get("suspended", []))
        console.print(f"[green]{w['id']}[/] {w['model']} ({w['engine']}) on {w['node']} ({w['gpus']} GPU) at "
                      f"{w['endpoint']}, ready in {w['launch_s']:.1f}s{how}")


@app.command("suspend")
@handle_errors
def suspend_cmd(worker: str = typer.Argument(..., help="worker id"),
                cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Checkpoint a worker to the image store and free its GPUs; its requests go to a sibling or
    wait in the router's hold queue until `resume`."""
    out = _connect(cluster_dir).suspend(worker)
    if json_out:
        print_json(out)
    else:
        console.print(f"[green]{worker} suspended[/] from {out['node']} in {out['seconds']:.1f}s "
                      f"({out['image_bytes'] / 2**20:.0f} MiB image); traffic: "
                      f"{out['sibling'] or 'held until it resumes'}")


@app.command("resume")
@handle_errors
def resume_cmd(worker: str = typer.Argument(..., help="worker id"),
               node: Optional[str] = typer.Option(None, "--node", help="target node (default: the planner seats it)"),
               cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Restore a suspended worker on any compatible node and switch its traffic back."""
    out = _connect(cluster_dir).resume(worker, node)
    if json_out:
        print_json(out)
    elif out.get("state") == "pending":
        console.print(f"[yellow]{worker} pending[/]: {out['demand']['reason']}")
    else:
        console.print(f"[green]{worker} resumed[/] on {out['node']} in {out['seconds']:.1f}s")


@app.command("consolidate")
@handle_errors
def consolidate_cmd(dry_run: bool = typer.Option(False, "--dry-run", help="print the plan, move nothing"),
                    max_moves: int = typer.Option(10, "--max-moves", min=1, help="at most this many moves"),
                    transfer: Optional[TransferMode] = typer.Option(None, help="default: the cluster's config"),
                    cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Pack running workers onto the fewest nodes with live moves."""
    out = _connect(cluster_dir).consolidate(dry_run, max_moves, transfer.value if transfer else None)
    if json_out:
        print_json(out)
        return
    t = Table(title=f"{'plan: ' if dry_run else ''}nodes freed: {', '.join(out['nodes_freed']) or 'none'}; "
              f"{len(out['moves'])} move(s), {out['gpus_moved']} GPU(s); whole GPUs freed: "
              f"{out.get('gpus_freed', 0)}")
    for c in ("worker", "from", "to", "GPUs", "result", "blackout s"):
        t.add_column(c)
    for m in out["moves"]:
        t.add_row(m["worker"], m["from"], m["to"], str(m["gpus"]), m.get("result", "planned"),
                  f"{m['blackout_s']:.2f}" if "blackout_s" in m else "")
    console.print(t)
    if any(m.get("result", "done") != "done" for m in out["moves"]):
        raise typer.Exit(1)


@app.command("uncordon")
@handle_errors
def uncordon_cmd(node: str = typer.Argument(..., help="node drained with --by"),
                 cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Let the planner place and resume workers on NODE again."""
    out = _connect(cluster_dir).uncordon(node)
    print_json(out) if json_out else console.print(f"{node} uncordoned")


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
        console.print(transfer_line(rel), highlight=False)
        if rel["error"]:
            console.print(f"[red]{rel['error']}[/]; rollback: {rel['rollback']}")
    if rel["result"] != "done":
        raise typer.Exit(1)


@app.command("drain")
@handle_errors
def drain_cmd(node: str = typer.Argument(..., help="node to empty"),
              parallel: int = typer.Option(1, help="relocations at a time"),
              transfer: Optional[TransferMode] = typer.Option(None, help="default: the cluster's config"),
              by: Optional[str] = typer.Option(None, "--by", callback=_duration, help="deadline: a duration from now (600, 10m) or "
                                               "an epoch time; the node is cordoned, workers that fit nowhere "
                                               "(or not moved by then) are suspended and requeued"),
              cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Move every worker off NODE, live."""
    out = _connect(cluster_dir).drain(node, parallel, transfer, by)
    if json_out:
        print_json(out)
    else:
        for rel in out["relocations"]:
            console.print(phases_table(rel))
            console.print(transfer_line(rel), highlight=False)
        for sus in out.get("suspended", []):
            console.print(f"suspended {sus['worker']}: {sus.get('error') or 'requeued'}")
        console.print(f"{node}: {'[green]drained[/]' if out['drained'] else '[red]not drained[/]'} "
                      f"in {out['seconds']:.1f}s")
    if not out["drained"]:
        raise typer.Exit(1)
