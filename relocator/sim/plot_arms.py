"""Matplotlib PNG of `bench replay`'s arms: the >= 4-GPU p99 wait (mean over seeds, sd as the
error bar, each seed a dot) per queue discipline with and without moves, one panel per pod list
and load (the entries of `relocator.cli.bench_replay.aggregate`, one policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def plot_arms(results: Sequence[dict], path: Path | str, policy: str, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = [e for e in results if e["policy"] == policy and e.get("wait_s_p99") is not None]
    panels = sorted({(str(e["pods"]), e["load"]) for e in rows})
    arms = sorted({(e["queue"], e["mode"]) for e in rows}, key=lambda a: (a[1] != "none", a[1], a[0]))
    if not panels:
        raise ValueError(f"no results with a >= 4-GPU p99 wait for policy {policy!r}")
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels) + 1, 4.2), dpi=120, squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (pods, load) in zip(axes[0], panels):
        by = {(e["queue"], e["mode"]): e for e in rows if str(e["pods"]) == pods and e["load"] == load}
        for k, arm in enumerate(arms):
            e = by.get(arm)
            if e is None:
                continue
            sd = e.get("spread", {}).get("wait_s_p99", {}).get("sd", 0.0)
            ax.bar(k, e["wait_s_p99"] / 3600.0, yerr=sd / 3600.0, color=colors[k % len(colors)], alpha=0.8, capsize=3,
                   hatch="//" if arm[1] != "none" else None)
            seeds = [s["wait_s_p99"] for s in e.get("per_seed", []) if s.get("wait_s_p99") is not None]
            ax.plot(np.full(len(seeds), k), np.array(seeds) / 3600.0, "k.", markersize=3)
        ax.set_xticks(range(len(arms)))
        ax.set_xticklabels([f"{q}\n{m}" for q, m in arms], fontsize=7)
        ax.set_title(f"{pods}, load {load:.1f}", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("p99 wait of >= 4-GPU pods (h)")
    fig.suptitle(title or f"replay arms, {policy}: mean over seeds (bar), sd (line), each seed (dot)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
