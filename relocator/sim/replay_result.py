"""The result dict of one replay run (relocator.sim.replay): waits by class, allocation,
moves and suspensions, their cost, and the sampled series."""

from __future__ import annotations

from typing import Any

import numpy as np

from relocator.planner.cluster import MILLI
from relocator.sim import gpushare
from relocator.sim.stream import CLASSES, Job


def replay_result(r: Any, seconds: float) -> dict:
    """`r`: the finished `Replay` run; `seconds`: its wall time."""
    cfg = r.cfg
    measured = [j for j in r.jobs if j.measured and j.start is not None]
    unstarted = sum(1 for j in r.jobs if j.measured and j.start is None)

    def stats(js: list[Job]) -> dict:
        if not js:
            return {"n": 0, "p50": None, "p99": None, "max": None, "mean": None}
        w = np.array([j.start - j.arrival for j in js])  # type: ignore[operator]
        return {"n": len(js), "p50": round(float(np.percentile(w, 50)), 1), "p99": round(float(np.percentile(w, 99)), 1),
                "max": round(float(w.max()), 1), "mean": round(float(w.mean()), 1)}

    by_class = {c: stats([j for j in measured if j.cls == c]) for c in CLASSES}
    big = stats([j for j in measured if j.cls in ("4", "8")])
    hours = max(r.w1 - r.w0, 1e-9) / 3600.0
    return {
        "policy": r.policy,
        "mode": r.mode.value,
        "load": cfg.load,
        "queue": r.queue_kind.value,
        "seed": cfg.seed,
        "wait_s_p50": big["p50"],
        "wait_s_p99": big["p99"],
        "wait_s_max": big["max"],
        "wait_s_p99_all": stats(measured)["p99"],
        "wait_by_class": by_class,
        "alloc_ratio_mean": round(r.acc_alloc / max(r.acc_t, 1e-9), 4),
        "queue_len_mean": round(r.acc_queue / max(r.acc_t, 1e-9), 1),
        "moves": r.moves,
        "moves_measured": r.m_moves,
        "moves_per_hour": round(r.m_moves / hours, 2),
        "moves_per_100_arrivals": round(100.0 * r.m_moves / max(r.m_arrivals, 1), 3),
        "interventions_measured": r.m_interventions,
        "interventions_per_100_arrivals": round(100.0 * r.m_interventions / max(r.m_arrivals, 1), 3),
        "budget_per_100": cfg.budget_per_100,
        "budget_cap": r.token_cap,
        "moved_gpus": round(r.moved_milli / MILLI, 2),
        "plans": r.plans,
        "plans_wasted": r.plans_wasted,
        "suspensions": r.suspensions,
        "suspended_pod_hours": round(r.suspended_s / 3600.0, 2),
        "blackout_s_total": round(r.blackout_s, 1),
        "pod_hours_lost": round(r.blackout_s / 3600.0, 2),
        "kill_restart_pod_hours_lost": round(r.kill_loss_s / 3600.0, 2),
        "arrivals": r.arrived,
        "measured_arrivals": r.m_arrivals,
        "rejected": r.rejected,
        "unstarted": unstarted,
        "window_h": round(hours, 2),
        "gap_scale": r.stream.scale,
        "offered_load": round(r.stream.offered_load, 3),
        "seconds": round(seconds, 2),
        "pack_moves": r.pack_moves,
        **gpushare.summary(r),  # fragmented GPUs, nodes with all GPUs free (sim/gpushare.py)
        "series": {k: [round(x, 4) for x in v] for k, v in r.series.items()},
    }
