"""`relocator demo`: the README's main job, end to end on this machine.

A 2-node cluster with 4 fake GPUs each; two 2-GPU workers, one per node, so no node has a whole
set of GPUs free and a 4-GPU job cannot start. Greedy streams flow through the router; one
worker is relocated live to the other node; the report shows the phases, the longest pause each
client saw and the token check; then a 4-GPU job fits, and everything is shut down.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import typer
from rich.table import Table

from relocator.cli import app
from relocator.cli.common import console, handle_errors, print_json
from relocator.vocab import TransferMode

MODEL = "tiny-llama"


def run_demo(nodes: int = 2, gpus: int = 4, streams: int = 8, max_tokens: int = 256,
             base_dir: str = "/var/lib/relocator/demo", transfer: TransferMode = TransferMode.SHARED, keep: bool = False,
             say=lambda *_: None) -> dict:
    import relocator
    from relocator.cluster.scenario import relocate_under_load
    from relocator.controller.inventory import best_fit

    t_all = time.monotonic()
    timings: dict[str, float] = {}
    t = time.monotonic()
    ctl = relocator.start(nodes=nodes, gpus_per_node=gpus, base_dir=base_dir)
    timings["up_s"] = round(time.monotonic() - t, 3)
    say(f"cluster up: {nodes} nodes x {gpus} fake GPUs, router {ctl.router_url} ({timings['up_s']:.1f}s)")
    try:
        half = max(1, gpus // 2)
        t = time.monotonic()
        with ThreadPoolExecutor(2) as pool:  # one worker per node, started together
            futs = [pool.submit(ctl.launch, MODEL, half, f"n{i + 1}") for i in range(2)]
            workers = [f.result() for f in futs]
        timings["launch_s"] = round(time.monotonic() - t, 3)
        say(f"launched {', '.join(w['id'] + '@' + w['node'] for w in workers)} with {half} GPUs each "
            f"({timings['launch_s']:.1f}s)")
        st = ctl.status()
        free = {n["id"]: n["gpus_free"] for n in st["nodes"]}
        blocked = best_fit(free, gpus) is None
        say(f"free GPUs per node {free}: a {gpus}-GPU job {'cannot start' if blocked else 'fits'}")
        mover, target = workers[1], workers[0]["node"]

        def on_phase(p: dict) -> None:
            say(f"  {p['name']:<8} {p['ended'] - p['started']:7.3f}s {'ok' if p['ok'] else 'FAILED'}")

        say(f"streaming {streams} greedy clients through the router; relocating {mover['id']} "
            f"{mover['node']} → {target} live")
        res = relocate_under_load(ctl, mover["id"], target, MODEL, concurrency=streams, max_tokens=max_tokens,
                                  transfer=transfer, on_phase=on_phase)
        res.pop("reference", None)
        st = ctl.status()
        free_after = {n["id"]: n["gpus_free"] for n in st["nodes"]}
        fits = best_fit(free_after, gpus)
        say(f"free GPUs per node {free_after}: a {gpus}-GPU job now fits on {fits}")
        report = {"timings": timings, "free_before": free, "blocked_before": blocked, "free_after": free_after,
                  "whole_node_free_after": fits, **res}
    finally:
        if keep:
            say(f"cluster left running (relocator down --cluster-dir {base_dir})")
        else:
            t = time.monotonic()
            down = ctl.down()
            timings["down_s"] = round(time.monotonic() - t, 3)
            say(f"shut down in {timings['down_s']:.1f}s (cells killed by the fallback: {down.get('cells_killed')})")
    report["total_s"] = round(time.monotonic() - t_all, 3)
    load = report["load"]
    report["ok"] = (report["relocation"]["result"] == "done" and load["client_errors"] == 0
                    and load["tokens_lost"] == load["tokens_duplicated"] == load["tokens_mismatched"] == 0
                    and load["text_mismatched"] == 0 and fits is not None)
    return report


@app.command("demo")
@handle_errors
def demo_cmd(nodes: int = typer.Option(2, help="nodes (2-3)"), gpus: int = typer.Option(4, help="fake GPUs per node"),
             streams: int = typer.Option(8, help="concurrent greedy streams"),
             max_tokens: int = typer.Option(256, help="tokens per request"),
             transfer: TransferMode = typer.Option(TransferMode.SHARED, help="how the image moves"),
             cluster_dir: str = typer.Option("/var/lib/relocator/demo", "--cluster-dir"),
             keep: bool = typer.Option(False, help="leave the cluster running"),
             json_out: bool = typer.Option(False, "--json", help="print one JSON object")) -> None:
    """Fragmented cluster → live relocation under streaming load → a whole node free, verified."""
    say = (lambda *_: None) if json_out else (lambda m: console.print(m, highlight=False))
    rep = run_demo(nodes, gpus, streams, max_tokens, cluster_dir, transfer, keep, say)
    if json_out:
        print_json(rep)
    else:
        rel, load = rep["relocation"], rep["load"]
        t = Table(title=f"relocation {rel['worker']} {rel['from']} → {rel['to']}: {rel['result']}")
        t.add_column("phase")
        t.add_column("seconds", justify="right")
        for k, v in rel["phases"].items():
            t.add_row(k, f"{v:.3f}")
        console.print(t)
        t = Table(title="clients (longest pause any request saw, requests verified token by token and by text)")
        for c in ("client", "requests", "tokens", "longest pause s", "verified", "errors"):
            t.add_column(c, justify="right")
        for c in load["clients"]:
            t.add_row(str(c["client"]), str(c["requests"]), str(c["tokens"]), f"{c['max_gap_s']:.3f}",
                      f"{c['verified']}/{c['requests']}", str(c["errors"]))
        console.print(t)
        console.print(f"tokens: {load['tokens']} received, lost {load['tokens_lost']}, duplicated "
                      f"{load['tokens_duplicated']}, mismatched {load['tokens_mismatched']}; texts differing "
                      f"{load['text_mismatched']}; client errors "
                      f"{load['client_errors']}; longest blackout {load['blackout_max_s']:.2f}s; "
                      f"total {rep['total_s']:.0f}s")
        console.print("[green]OK[/]" if rep["ok"] else "[red]FAILED[/]")
    if not rep["ok"]:
        raise typer.Exit(1)
