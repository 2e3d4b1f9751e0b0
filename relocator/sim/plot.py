"""Matplotlib PNG: GPU allocation vs arrived load, one line per policy variant (seed means)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from relocator.sim.engine import SimResult


def plot_allocation(out: Sequence[tuple[dict, list[SimResult]]], path: Path | str, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    grid = np.linspace(0, 130, 261)
    for agg, runs in out:
        ys = [np.interp(grid, r.curve_arrived_pct, r.curve_alloc_pct) for r in runs if r.curve_arrived_pct]
        if not ys:
            continue
        label = f"{agg['policy']}{' + moves' if agg['relocate'] else ''} ({agg['unalloc_gpus_at_130']:.0f} GPUs idle @130%)"
        ax.plot(grid, np.mean(ys, axis=0), label=label, linestyle="--" if agg["relocate"] else "-")
    ax.plot([0, 100], [0, 100], color="grey", linewidth=0.8, linestyle=":", label="ideal")
    ax.axhline(100, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("arrived GPU demand (% of cluster GPU capacity)")
    ax.set_ylabel("GPU allocation (% of capacity)")
    ax.set_xlim(0, 132)
    ax.set_ylim(0, 102)
    ax.set_title(title or "openb trace: allocation vs arrived load (mean over seeds)")
    ax.legend(loc="lower right", fontsize=8)
    ax.grid(alpha=0.3)
    inset = ax.inset_axes([0.08, 0.55, 0.38, 0.35])
    for line in ax.get_lines()[:-2]:
        inset.plot(line.get_xdata(), line.get_ydata(), linestyle=line.get_linestyle(), color=line.get_color())
    inset.set_xlim(90, 131)
    inset.set_ylim(84, 100)
    inset.grid(alpha=0.3)
    inset.tick_params(labelsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_replay(results: Sequence[dict], path: Path | str, title: str | None = None) -> Path:
    """Allocation ratio and pending-queue length over simulated time, one line per run (a run's
    ``series``: ``t``, ``alloc``, ``queue``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6.5), dpi=120, sharex=True)
    for r in results:
        s = r.get("series") or {}
        if not s.get("t"):
            continue
        t = np.array(s["t"]) / 3600.0
        label = f"{r['policy']} {r['mode']} (alloc {r['alloc_ratio_mean']:.3f}, p99 wait >=4 GPU {r['wait_s_p99']} s)"
        style = {"none": "-", "moves": "--", "moves+suspend": ":"}.get(r["mode"], "-")
        ax1.plot(t, 100 * np.array(s["alloc"]), linestyle=style, label=label)
        ax2.plot(t, s["queue"], linestyle=style, label=f"{r['policy']} {r['mode']}")
    ax1.set_ylabel("GPU allocation (% of capacity)")
    ax2.set_ylabel("pending pods")
    ax2.set_xlabel("simulated time (h); the first pass is warm-up")
    ax1.legend(loc="lower right", fontsize=7)
    ax2.legend(loc="upper left", fontsize=7)
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.set_title(title or "replay with departures")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
