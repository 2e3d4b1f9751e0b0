"""Matplotlib PNG of a `relocator bench scheduling --json` result: per arm, the multi-GPU
launch waits (p50, p99, max) and, beside them, failed client requests and tokens of work lost.

    python -m relocator.bench.scheduling_plot RESULT.json OUT.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from relocator.bench.scheduling import ARMS


def plot_arms(res: dict, path: Path | str, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if a in res]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120, gridspec_kw={"width_ratios": [3, 2]})
    width = 0.26
    for i, (key, label) in enumerate((("wait_s_p50", "p50"), ("wait_s_p99", "p99"), ("wait_s_max", "max"))):
        xs = [j + (i - 1) * width for j in range(len(arms))]
        ax.bar(xs, [res[a].get(key) or 0 for a in arms], width, label=label)
    ax.set_xticks(range(len(arms)), arms, fontsize=8)
    ax.set_ylabel("wait of launches of >= 2 GPUs (s of the day)")
    ax.set_title("multi-GPU launch waits (a launch never served counts to its stop)", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    for j, a in enumerate(arms):
        ax.annotate(f"{res[a]['launch_failures']} of {res[a]['launches']} failed", (j, 0), xytext=(0, -28),
                    textcoords="offset points", ha="center", fontsize=7)
    xs = range(len(arms))
    bx.bar([x - 0.2 for x in xs], [res[a]["failed_requests"] for a in arms], 0.4, label="failed client requests")
    bx2 = bx.twinx()
    bx2.bar([x + 0.2 for x in xs], [res[a]["tokens_of_work_lost"] for a in arms], 0.4, color="tab:red",
            label="tokens of work lost")
    bx.set_xticks(list(xs), arms, fontsize=8)
    bx.set_ylabel("failed client requests")
    bx2.set_ylabel("tokens of work lost")
    bx.set_title("what clients lost", fontsize=9)
    (h1, l1), (h2, l2) = bx.get_legend_handles_labels(), bx2.get_legend_handles_labels()
    bx.legend(h1 + h2, l1 + l2, loc="upper left", fontsize=7)
    fig.suptitle(title or "relocator bench scheduling: one day, one arm per preemption rule", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python -m relocator.bench.scheduling_plot RESULT.json OUT.png")
    print(plot_arms(json.loads(Path(sys.argv[1]).read_text()), sys.argv[2]))
