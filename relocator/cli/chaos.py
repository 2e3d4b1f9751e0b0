"""`relocator chaos`: forced relocations and injected faults under streaming load (issue 6)."""

from __future__ import annotations

import os
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import typer
from rich.table import Table

from adapters.base import DEFAULT_ENGINE, Engine
from relocator.cli import app
from relocator.cli.common import choice_list, console, handle_errors, print_json, stdout_for_json
from relocator.vocab import TransferMode


def _faults(text: str) -> list[str]:
    from relocator.chaos.faults import parse_faults

    return parse_faults(text)


def _fault_names() -> list[str]:
    from relocator.chaos.faults import FAULTS

    return list(FAULTS)


def _fault_words() -> list[str]:
    from relocator.chaos.faults import ALL, NONE

    return [*ALL, *NONE]


def _triggers(text: str) -> list[str]:
    from relocator.chaos.triggers import parse_triggers

    return parse_triggers(text)


def _trigger_names() -> list[str]:
    from relocator.chaos.triggers import TRIGGER_FAULTS

    return list(TRIGGER_FAULTS)


@app.command("chaos")
@handle_errors
def chaos_cmd(duration: float = typer.Option(None, "--duration", help="stop starting moves after D seconds"),
              moves: int = typer.Option(None, "--moves", help="plain forced moves (default 100; smoke 3)"),
              suspends: int = typer.Option(0, "--suspends", min=0,
                                           help="suspend-then-resume steps (a worker checkpointed, its GPUs "
                                                "released, restored where the controller seats it)"),
              make_rooms: int = typer.Option(0, "--make-rooms", min=0,
                                             help="make-room launches: the cluster fragmented, a node-sized "
                                                  "worker launched, the controller's live moves seat it"),
              moves_per_minute: float = typer.Option(0.0, "--moves-per-minute", help="pace (0: back to back)"),
              faults: str = typer.Option(None, "--faults", callback=choice_list(_faults, _fault_names, _fault_words),
                                         help="comma list, 'all' or 'none' (default none; smoke all)"),
              triggers: str = typer.Option(None, "--triggers",
                                           callback=choice_list(_triggers, _trigger_names, _fault_words),
                                           help="trigger faults, comma list, 'all' or 'none' (default none): "
                                                "a GPU gone bad, a node notice, a flapping signal, GPUs held "
                                                "by count; the policies' actions checked (docs/policies.md)"),
              warm_faults: str = typer.Option(None, "--warm-faults",
                                              help="warm image faults, comma list, 'all' or 'none' (default none): "
                                                   "corrupt, truncate (a store full and the only holder lost are "
                                                   "unit-tested only); the start after each must be cold, the "
                                                   "fault named in its worker_started event (docs/images.md)"),
              flap_s: float = typer.Option(12.0, "--flap-s", min=2, max=600,
                                           help="how long the gpu-flap trigger fault flaps"),
              smoke: bool = typer.Option(False, "--smoke", help="a few minutes: a handful of moves, every fault once"),
              streams: int = typer.Option(None, "--streams", help="concurrent streams (default 8; smoke 4)"),
              workers: int = typer.Option(1, "--workers", help="workers to launch and move"),
              seed: int = typer.Option(0, "--seed"),
              png: str = typer.Option(None, "--png", help="timeline PNG with relocation phases"),
              out: str = typer.Option(None, "--out", help="write the full JSON report here"),
              cluster_dir: str = typer.Option(None, "--cluster-dir",
                                              help="a running cluster (else one is started here and stopped after)"),
              engine: Engine = typer.Option(Engine(DEFAULT_ENGINE), "--engine", help="the workers' engine"),
              transfer: TransferMode = typer.Option(None, "--transfer",
                                                    help="the moves' transfer mode where their fault forces "
                                                         "none (default: the controller's)"),
              budget: float = typer.Option(None, "--budget", min=1,
                                           help="whole-run budget in seconds (default 3600 + --duration; smoke 900); "
                                                "past it the run ends `stalled`"),
              step_budget: float = typer.Option(None, "--step-budget", min=1,
                                                help="budget of one step (a move and its fault's aftermath; default 480 s)"),
              json_out: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Random forced relocations under greedy streaming load, with injected faults; every outcome checked."""
    from relocator.chaos.faults import parse_faults
    from relocator.chaos.runner import ChaosConfig, run_chaos
    from relocator.cluster.config import cluster_dir as default_dir

    from relocator.chaos.triggers import parse_triggers
    from relocator.chaos.warmsteps import parse_warm_faults

    fl = parse_faults(faults) if faults is not None else None
    try:
        wf = parse_warm_faults(warm_faults)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--warm-faults") from None
    kw = dict(duration_s=duration, moves=moves, suspends=suspends, make_rooms=make_rooms,
              moves_per_minute=moves_per_minute, faults=fl, triggers=parse_triggers(triggers), flap_s=flap_s,
              warm_faults=wf,
              streams=streams,
              workers=workers, seed=seed, png=png, engine=engine.value, run_budget_s=budget,
              transfer=transfer.value if transfer else None,
              step_budget_s=step_budget,
              cluster_dir=cluster_dir or os.environ.get("RELOCATOR_CLUSTER_DIR") or str(default_dir()))
    if smoke:
        cfg = ChaosConfig.smoke(**kw)
    else:
        cfg = ChaosConfig(**{k: v for k, v in {**kw, "moves": 100 if moves is None else moves,
                                               "streams": 8 if streams is None else streams,
                                               "faults": fl or []}.items() if v is not None})
    say = (lambda *_: None) if json_out else (lambda m: console.print(m, highlight=False))
    json_file = stdout_for_json() if json_out else None  # `--json > x.json` gets JSON alone
    rep = run_chaos(cfg, say=say)
    _emit(rep, out, json_file if json_out else None)
    if rep.get("stalled"):  # 2: the run was cut short, its checks incomplete
        raise typer.Exit(2)
    if not rep["ok"]:
        raise typer.Exit(1)


def _emit(rep: dict, out: str | None, json_file: Any) -> None:
    """The report: in full to `out`, and as JSON (without phase times) to `json_file`, or as
    tables when that is None."""
    import json

    if out:
        with open(out, "w") as fh:
            json.dump(rep, fh, indent=1, default=str)
    if json_file is None:
        _print_report(rep)
        return
    rep = {k: v for k, v in rep.items() if k != "moves"} | {"moves": [
        {k: v for k, v in m.items() if k != "phase_times"} for m in rep.get("moves", [])]}
    print_json(rep, json_file)


def _print_report(rep: dict) -> None:
    """The chaos report as a table of faults and a few lines of totals."""
    t = Table(title=f"chaos: {rep.get('relocations')} relocations, {rep.get('faults_injected')} faults"
                    + (f", {rep['triggers_injected']} trigger faults" if rep.get("triggers_injected") else ""))
    for c in ("fault", "result", "ok", "serving again s", "problems"):
        t.add_column(c)
    for name, o in rep.get("faults", {}).items():
        t.add_row(name, str(o["result"]), "yes" if o["ok"] else "[red]NO[/]", str(o.get("serve_again_s")),
                  "; ".join(o["problems"])[:120])
    for name, why in rep.get("skipped_faults", {}).items():  # cannot apply on this cluster
        t.add_row(name, "skipped", "-", "-", why[:120])
    if rep.get("faults") or rep.get("skipped_faults") or not rep.get("triggers"):
        console.print(t)
    else:
        console.print(t.title)
    for name, o in rep.get("triggers", {}).items():  # what the controller did about each trigger fault
        console.print(f"trigger {name} (step {o['step']}): " + ("ok" if o["ok"] else "[red]NO[/] "
                      + "; ".join(o["problems"])[:200]), highlight=False)
        for line in o.get("controller") or ["the controller did nothing"]:
            console.print(f"    {line}", highlight=False)
    for name, o in rep.get("warm_faults", {}).items():  # how the start after each warm image fault went
        start = o.get("start") or {}
        console.print(f"warm image {name} (step {o['step']}): " + ("ok" if o["ok"] else "[red]NO[/] "
                      + "; ".join(o["problems"])[:200]) + f" - start {start.get('how')}: "
                      + str(start.get("reason") or "")[:160], highlight=False)
    for o in rep.get("scheduling_steps", []):
        if o.get("trigger") or o.get("warm"):
            continue
        if not o.get("fault"):
            console.print(f"{o['kind']} (step {o['step']}): {o['result']} "
                          + ("ok" if o["ok"] else "[red]NO[/] " + "; ".join(o["problems"])[:120]), highlight=False)
    console.print(f"plain moves {rep.get('plain_moves_done')}/{rep.get('plain_moves')} done; requests "
                  f"{rep.get('requests')}, failed {rep.get('failed_requests')} {rep.get('failed_requests_by_fault')}; "
                  f"tokens lost/dup/mismatched {rep.get('tokens_lost')}/{rep.get('tokens_duplicated')}/"
                  f"{rep.get('tokens_mismatched')}; texts differing {rep.get('text_mismatched')}; leaked {rep.get('leaked')}; {rep.get('seconds')}s")
    if rep.get("stalled"):
        s = rep["stalled"]
        console.print(f"[red]STALLED[/] in {s['step']} ({s['budget']} budget {s['budget_s']:g}s): waiting for "
                      f"{s['waiting_for']}; last seen {s['last_event']}; controller's last event "
                      f"{s.get('controller_event')}", highlight=False)
    for node, why in rep.get("spared_nodes", {}).items():
        console.print(f"spared {node}: {why}", highlight=False)
    console.print("[green]OK[/]" if rep["ok"] else "[red]FAILED[/]")
