"""`relocator gpus list|mark|clear`: the GPUs that are not healthy (draining, ready for reset,
failed; held or not), fake GPUs marked bad (by index or by count), and GPUs cleared after their
reset (docs/policies.md, "GPU health")."""

from __future__ import annotations

import time
from typing import Any, Optional

import typer
from rich.table import Table

from relocator.cli import app
from relocator.cli.common import choice_list, console, fail, handle_errors, print_json

gpus_app = typer.Typer(help="GPU health: unhealthy and held GPUs, fake faults, clearing after a reset "
                            "(docs/policies.md).", no_args_is_help=True)
app.add_typer(gpus_app, name="gpus")

JSON = typer.Option(False, "--json", help="print one JSON object")
CLUSTER_DIR = typer.Option(None, "--cluster-dir", help="where the cluster runs from (default: $RELOCATOR_CLUSTER_DIR)")
WAIT_S = 30.0  # a cleared GPU's hold goes on the reconcile round after it reads healthy (2 s)


def _connect(cluster_dir: Optional[str]) -> Any:
    from relocator.controller.api import connect

    return connect(cluster_dir)


def _kind(value: str) -> str:
    from relocator.agent.fakenvml import MARKS

    if value not in MARKS:
        raise ValueError(f"unknown GPU fault {value!r}; known: {', '.join(MARKS)}")
    return value


def _kinds() -> list[str]:
    from relocator.agent.fakenvml import MARKS

    return list(MARKS)


def _states(ctl: Any, node: str | None = None) -> list[dict]:
    return [g for g in ctl.status().get("gpu_health") or [] if node is None or g["node"] == node]


def _table(states: list[dict], title: str) -> Table:
    t = Table("node", "gpu", "state", "why", "for", "held", title=title)
    now = time.time()
    for g in states:
        held = "no"
        if g.get("held"):
            held = "yes" + (f" (Ray GPU {', '.join(map(str, g['held_as']))})" if g.get("held_as") else "")
        t.add_row(g["node"], str(g["gpu"]), g["state"], g.get("why") or "", f"{now - float(g.get('since') or now):.0f} s",
                  held)
    return t


@gpus_app.command("list")
@handle_errors
def gpus_list(node: Optional[str] = typer.Option(None, "--node", help="only this node's GPUs"),
              cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """The GPUs that are not healthy: state, why, since when, and whether a hold keeps new
    workers off them."""
    states = _states(_connect(cluster_dir), node)
    if json_out:
        print_json({"gpus": states})
    elif not states:
        console.print("every GPU reads healthy" + (f" on {node}" if node else ""))
    else:
        console.print(_table(states, "GPUs not healthy"))


@gpus_app.command("mark")
@handle_errors
def gpus_mark(node: str = typer.Argument(..., help="the node whose GPUs go bad"),
              gpu: list[int] = typer.Option([], "--gpu", min=0, help="a GPU index (repeatable)"),
              count: int = typer.Option(0, "--count", min=0, help="this many of the node's idle GPUs instead"),
              fault: str = typer.Option("remap", "--fault", callback=choice_list(_kind, _kinds),
                                        help="what they report: remap (drain), xid79 / xid48 (failed), "
                                             "xid63 (drain), xid13 / xid31 (the application's: nothing)"),
              cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """Fake GPUs only: GPUs of NODE report FAULT from now on (the agent's NVML stand-in), so the
    gpu-health policy's path runs without hardware. `--count N` picks N GPUs no worker uses:
    they are held by count (nothing new placed on N of the node's GPUs)."""
    if bool(gpu) == bool(count):
        fail("give --gpu (one or more) or --count, not both", 2)
    out = _connect(cluster_dir).mark_gpus(node, fault, list(gpu) or None, count)
    if json_out:
        print_json(out)
    else:
        console.print(f"{node}: GPU(s) {', '.join(map(str, out['gpus']))} report {fault}; the controller acts on "
                      f"its next round (`relocator gpus list`, `relocator events`)", highlight=False)


@gpus_app.command("clear")
@handle_errors
def gpus_clear(node: str = typer.Argument(..., help="the node whose GPUs were reset"),
               gpus: list[int] = typer.Argument(None, help="GPU indexes (default: every unhealthy GPU of NODE)"),
               wait: bool = typer.Option(True, "--wait/--no-wait", help=f"wait (up to {WAIT_S:g} s) for the "
                                         "GPUs to read healthy and their holds to go"),
               cluster_dir: Optional[str] = CLUSTER_DIR, json_out: bool = JSON) -> None:
    """GPUs of NODE were reset: forget their Xids (and, on fake GPUs, their marked faults); a
    held GPU is released once it reads healthy. A GPU whose NVML still reports a pending remap
    or a failure (not really reset) stays as it is, and is listed."""
    ctl = _connect(cluster_dir)
    out = ctl.clear_gpus(node, list(gpus) if gpus else None)
    left = _states(ctl, node)
    if wait and out["cleared"]:
        from relocator.waits import settle

        def gone() -> bool:
            left[:] = [g for g in _states(ctl, node) if g["gpu"] in out["cleared"]]
            return not left

        settle(gone, WAIT_S, every=0.5)
    out["still_unhealthy"] = [g for g in left if g["gpu"] in out["cleared"]] if wait else None
    if json_out:
        print_json(out)
        return
    if not out["cleared"]:
        console.print(f"{node}: no unhealthy GPU to clear")
        return
    console.print(f"{node}: cleared GPU(s) {', '.join(map(str, out['cleared']))}", highlight=False)
    if out["still_unhealthy"]:
        console.print(_table(out["still_unhealthy"], "still not healthy (NVML still reports it)"))
        raise typer.Exit(1)
