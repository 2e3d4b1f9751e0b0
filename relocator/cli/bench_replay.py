"""`relocator bench replay`: the replay with departures, per pod list x policy x mode x load
(x seed), in one table (docs/benchmarks.md, "Replay with departures")."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Optional

import typer

from relocator.cli import bench_app
from relocator.cli.replay import MODE_LIST, _load_list, _mode_list, load_list_option, make_configs, print_results, run_configs
from relocator.cli.replay_baselines import (BASELINE_KEYS, QUEUE_HELP, QUEUE_LIST, arrivals_option, pm, print_baselines,
                                            queue_list, with_best_baseline)
from relocator.cli.replay_gpushare import GPUSHARE_KEYS, PACK_EVERY, print_gpushare, set_pack_every, with_frag_ratio
from relocator.cli.simulate import POLICY_LIST, fail, load_inputs, parse_choices
from relocator.sim.arrivals import Arrivals
from relocator.sim.replay import ReplayMode
from relocator.sim.runlog import RunLogError, append_run, inputs_digest, load_runs, run_key

#: figures averaged over seeds (mean, sd, min, max)
AGG_KEYS = ("wait_s_p50", "wait_s_p99", "wait_s_max", "wait_s_p99_all", "alloc_ratio_mean", "queue_len_mean", "moves",
            "moves_per_hour", "moves_per_100_arrivals", "interventions_per_100_arrivals", "suspensions", "plans",
            "plans_wasted", "blackout_s_total", "pod_hours_lost", "kill_restart_pod_hours_lost", "measured_arrivals",
            "window_h", "seconds", "p99_cut", "p50_cut", "alloc_gain") + GPUSHARE_KEYS + BASELINE_KEYS


def _stats(xs: list[float]) -> dict:
    import numpy as np

    a = np.array(xs, dtype=np.float64)
    return {"mean": float(a.mean()), "sd": float(a.std(ddof=1)) if len(a) > 1 else 0.0, "min": float(a.min()), "max": float(a.max())}


def with_gains(results: list[dict]) -> None:
    """Per run with moves: the cut of the >= 4-GPU p99 (and p50) wait and the gain in mean
    allocation against the run without moves of the same pod list, policy, queue, load and seed."""
    base = {(r.get("pods"), r["policy"], r["queue"], r["load"], r["seed"]): r for r in results if r["mode"] == ReplayMode.NONE.value}
    for r in results:
        b = base.get((r.get("pods"), r["policy"], r["queue"], r["load"], r["seed"]))
        if b is None:
            continue
        for k, cut in (("wait_s_p99", "p99_cut"), ("wait_s_p50", "p50_cut")):
            if b[k] and r[k] is not None:
                r[cut] = round(1.0 - r[k] / b[k], 4)
        r["alloc_gain"] = round(r["alloc_ratio_mean"] - b["alloc_ratio_mean"], 4)


def aggregate(results: list[dict]) -> list[dict]:
    """One entry per pod list x policy x queue x mode x load: the mean over seeds under each figure's
    own key, and ``spread`` {key: {mean, sd, min, max}} (sd with n-1; 0 for one seed)."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r.get("pods"), r["policy"], r["queue"], r["mode"], r["load"]), []).append(r)
    out = []
    for (pods, policy, queue, mode, load), rs in groups.items():
        e: dict = {"pods": pods, "policy": policy, "mode": mode, "load": load, "queue": queue,
                   "seeds": [r["seed"] for r in rs], "spread": {}}
        for k in AGG_KEYS:
            xs = [r[k] for r in rs if r.get(k) is not None]
            if len(xs) < len(rs):
                e[k] = None
                continue
            s = _stats(xs)
            e["spread"][k] = {x: round(v, 4) for x, v in s.items()}
            e[k] = round(s["mean"], 4)
        e["per_seed"] = [{k: r.get(k) for k in ("seed", "wait_s_p50", "wait_s_p99", "alloc_ratio_mean", "moves_per_100_arrivals",
                                                 "interventions_per_100_arrivals", "plans", "plans_wasted", "p99_cut",
                                                 "p99_vs_best_baseline")} for r in rs]
        out.append(e)
    return out


def print_aggregate(results: list[dict], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    cols = ("pods", "policy", "queue", "mode", "load", "seeds", "wait p50 >=4 GPU s", "wait p99 >=4 GPU s", "p99 cut", "alloc mean",
            "alloc gain", "moves/100 arr.", "interv./100 arr.", "plans (wasted)", "blackout s")
    for c in cols:
        t.add_column(c, justify="left" if c in ("pods", "policy", "queue", "mode") else "right")
    for e in results:
        t.add_row(e["pods"] or "", e["policy"], e["queue"], e["mode"], f"{e['load']:.1f}", str(len(e["seeds"])), pm(e, "wait_s_p50", ".0f"),
                  pm(e, "wait_s_p99", ".0f"), pm(e, "p99_cut", ".1%"), pm(e, "alloc_ratio_mean", ".3f"), pm(e, "alloc_gain", "+.3f"),
                  pm(e, "moves_per_100_arrivals", ".2f"), pm(e, "interventions_per_100_arrivals", ".2f"),
                  f"{e['plans'] or 0:.0f} ({e['plans_wasted'] or 0:.0f})", pm(e, "blackout_s_total", ".0f"))
    Console(width=240).print(t)


@bench_app.command("replay")
def bench_replay(
    trace: Optional[Path] = typer.Option(None, "--trace", help="openb folder (default ../shared/data/openb or $RELOCATOR_OPENB_DIR)."),
    variants: str = typer.Option("default", "--variants", help="Pod lists in --trace, comma-separated: default, multigpu50, gpushare80 ... (openb_pod_list_<name>.csv). Lists without times take them from the default list."),
    policy: str = typer.Option("fgd,best-fit", "--policy", callback=POLICY_LIST, help="Policies, comma-separated."),
    mode: str = typer.Option(",".join(m for m in ReplayMode.values() if m != ReplayMode.MOVES_PACK), "--mode",
                             callback=MODE_LIST, help="Modes, comma-separated (moves+pack: for the gpushare lists)."),
    load: str = typer.Option("0.9,1.3", "--load", callback=load_list_option, help="Offered loads, comma-separated."),
    queue: str = typer.Option("fifo,easy", "--queue", callback=QUEUE_LIST, help=QUEUE_HELP),
    arrivals: Arrivals = arrivals_option(Arrivals.POISSON),
    seed: int = typer.Option(42, "--seed", help="First seed."),
    seeds: int = typer.Option(5, "--seeds", help="Seeds per configuration (seed, seed+1, ...): figures are the mean over them, with their spread (sd, min, max)."),
    passes: int = typer.Option(4, "--passes", help="Passes of the pod list (the first is warm-up)."),
    moves_per_pod: int = typer.Option(4, "--moves-per-pod", help="Most moves to seat one pod."),
    budget: float = typer.Option(1.0, "--budget", help="Moves (and suspensions) per 100 arrivals (a bucket capped at --budget-cap)."),
    budget_cap: Optional[float] = typer.Option(None, "--budget-cap", help="Most moves the budget bucket holds (default: --moves-per-pod)."),
    pack_every: float = PACK_EVERY,
    jobs: int = typer.Option(2, "--jobs", help="Runs in parallel (processes)."),
    plot: Optional[Path] = typer.Option(Path("docs/img/replay_default.png"), "--plot", help="PNG of the first pod list and policy, at the first load and seed: allocation and queue over time per mode."),
    plot_arms: Optional[Path] = typer.Option(None, "--plot-arms", help="PNG (e.g. docs/img/replay_baselines.png) of the >= 4-GPU p99 wait per queue and mode, one panel per pod list and load (first policy)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object: {results: [...] (means over seeds), runs: [...] (one per seed)}."),
    runs_file: Optional[Path] = typer.Option(None, "--runs-file", help="JSON lines, one per finished run, written as each ends; runs already in it (same list, inputs and options) are read back, not run again, so a stopped bench resumes. Start a new file after changing the code."),
) -> None:
    """Replay with departures: queueing delay, allocation and moves, with and without relocation."""
    from relocator.sim.trace import NODE_FILE, POD_FILE, TraceError, load_pods

    policies, _ = parse_choices(policy, "42")
    if passes < 2:
        raise fail("--passes must be >= 2")
    if seeds < 1:
        raise fail("--seeds must be >= 1")
    if budget < 0 or (budget_cap is not None and budget_cap < 0):
        raise fail("--budget and --budget-cap must not be negative")
    tdir, nodes, default_pods = load_inputs(trace, None)
    try:
        done = load_runs(runs_file) if runs_file is not None else {}
    except RunLogError as exc:
        raise fail(str(exc)) from None
    names = [v.strip() for v in variants.split(",") if v.strip()]
    if not names:
        raise fail("no pod list given in --variants")
    loads = _load_list(load)
    queues = queue_list(queue)
    runs: list[dict] = []
    first_series: list[dict] = []
    for name in names:
        path = tdir / (POD_FILE if name == "default" else f"openb_pod_list_{name}.csv")
        try:
            pods = default_pods if name == "default" else load_pods(path)
        except TraceError as exc:
            raise fail(str(exc)) from None
        cfgs = [replace(c, arrivals=arrivals.value) for s in range(seed, seed + seeds) for q in queues
                for c in make_configs(policies, _mode_list(mode), loads, s, q, passes, moves_per_pod, budget,
                                      None, None, 0.0, None, False, budget_cap)]
        set_pack_every(cfgs, pack_every)
        if not as_json:
            typer.echo(f"{name}: {len(cfgs)} runs", err=True)
        out = _run_or_read(nodes, pods, cfgs, default_pods, jobs, as_json, name, runs_file, done,
                           (tdir / NODE_FILE, path, tdir / POD_FILE))
        for r in out:
            r["pods"] = name
        if not first_series:
            first_series = [r for r in out if r["policy"] == policies[0] and r["load"] == loads[0] and r["seed"] == seed
                            and r["queue"] == queues[0]]
            if plot is not None:
                from relocator.sim.plot import plot_replay

                plot_replay(first_series, plot, title=f"openb {name}, {policies[0]}, offered load {loads[0]:.1f}x, {queues[0]}, seed {seed}")
        for r in out:
            r.pop("series", None)
        runs.extend(out)
    _report(runs, policies[0], seeds, arrivals.value, plot, plot_arms, as_json)


def _run_or_read(nodes, pods, cfgs, donor, jobs: int, quiet: bool, name: str, runs_file: Optional[Path], done: dict[str, dict],
                 inputs: tuple[Path, ...]) -> list[dict]:
    """The runs of `cfgs` in order: those in the runs file read back, the others made (and, with a
    runs file, added to it as each ends)."""
    if runs_file is None:
        return run_configs(nodes, pods, cfgs, donor, max(1, jobs), quiet=quiet)
    digest = inputs_digest(inputs)
    keys = [run_key(name, digest, c) for c in cfgs]
    todo = [c for c, k in zip(cfgs, keys) if k not in done]
    if not quiet:
        typer.echo(f"{name}: {len(cfgs) - len(todo)} runs read from {runs_file}, {len(todo)} to make", err=True)

    def keep(c, r: dict) -> None:
        k = run_key(name, digest, c)
        append_run(runs_file, k, {**r, "pods": name})
        done[k] = r

    try:
        run_configs(nodes, pods, todo, donor, max(1, jobs), quiet=quiet, on_run=keep)
    except OSError as exc:
        raise fail(f"cannot write runs file {runs_file}: {exc}") from None
    return [dict(done[k]) for k in keys]


def _report(runs: list[dict], policy: str, seeds: int, arrivals: str, plot: Optional[Path], plot_arms: Optional[Path],
            as_json: bool) -> None:
    """The figures against the runs without moves, the means over seeds, the plots, the tables or the JSON."""
    with_gains(runs)
    with_best_baseline(runs)
    with_frag_ratio(runs)
    results = aggregate(runs)
    if plot_arms is not None and any(e.get("wait_s_p99") is not None for e in results):
        from relocator.sim.plot_arms import plot_arms as draw_arms

        draw_arms(results, plot_arms, policy)
    if as_json:
        sys.stdout.write(json.dumps({"results": results, "runs": runs, "plot": str(plot) if plot else None}, indent=2) + "\n")
        return
    if seeds == 1:
        print_results(runs, "replay with departures")
    print_aggregate(results, f"replay with departures, mean ± sd over {seeds} seed(s)")
    print_baselines(results, f"against the best baseline (lowest >= 4-GPU p99 without moves), {arrivals} arrivals, mean ± sd over {seeds} seed(s)")
    print_gpushare(runs, "GPU sharing: fragmented GPUs (the FGD authors' measure) and nodes with all GPUs free, per seed")
    if plot is not None:
        typer.echo(f"plot: {plot}")
