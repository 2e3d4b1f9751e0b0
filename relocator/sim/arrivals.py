"""Resampled arrivals for a replay (relocator.sim.replay): a Poisson stream at the offered load
with the trace's pod mix and durations, different for every seed.

The trace's own stream (:func:`relocator.sim.stream.build_stream`, ``arrivals="trace"``) keeps
the pods' creation order and gaps, so for a list with times the seed changes nothing but policy
ties (on the default list none were drawn: seeds gave identical replays). ``arrivals="poisson"``
(:func:`poisson_stream`):

1. every pass is the whole pod list (each pod once, with its own duration and QoS, so the pass
   has exactly the trace's mix) in an order drawn with the seed;
2. the gaps between consecutive arrivals are independent exponential draws (a Poisson process);
3. one factor scales all gaps so that the offered load over the measured window is ``load``, as
   for the trace's stream (same bisection, same definition); the first ``warmup_passes`` passes
   fill the cluster and are not measured. Lists without times borrow them from ``times_from``
   as for the trace's stream.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import numpy as np

from relocator.choices import Choice
from relocator.sim.stream import (Job, ReplayError, Stream, _fill_times, _priority, build_stream, check_stream_args,
                                  demand_class, scale_to_load)
from relocator.sim.trace import TracePod


class Arrivals(Choice):
    """Where a replay's arrival times come from."""

    TRACE = "trace"  # the trace's creation order and (clipped) gaps, replayed pass after pass
    POISSON = "poisson"  # each pass a seeded shuffle of the list, exponential gaps


def poisson_stream(
    pods: Sequence[TracePod],
    load: float,
    capacity_milli: int,
    seed: int = 42,
    passes: int = 2,
    warmup_passes: int = 1,
    times_from: Sequence[TracePod] | None = None,
) -> Stream:
    """The resampled arrival stream for one load and seed (see the module docstring)."""
    check_stream_args(load, passes, warmup_passes)
    rows = _fill_times(pods, times_from, seed)
    rows.sort(key=lambda r: r[0].workload.id)  # the seed alone decides the order
    n = len(rows)
    rng = np.random.default_rng([seed, 0x5EED_A11])
    order = np.concatenate([rng.permutation(n) for _ in range(passes)])
    base = np.cumsum(rng.exponential(1.0, size=n * passes))
    dur = np.array([float(rows[i][2]) for i in order])
    gpu = np.array([float(rows[i][0].workload.total_gpu_milli) for i in order])
    m0 = warmup_passes * n
    scale, reached = scale_to_load(base, dur, gpu, m0, load, capacity_milli, f"{passes} passes of {n} pods")
    a = base * scale
    jobs = []
    for j, i in enumerate(order.tolist()):
        k = j // n
        p = rows[i][0]
        w = p.workload if k == 0 else replace(p.workload, id=f"{p.workload.id}#{k}")
        jobs.append(Job(j, w, float(a[j]), float(dur[j]), _priority(p.qos), k >= warmup_passes, demand_class(w)))
    return Stream(jobs, scale, (float(a[m0]), float(a[-1])), reached)


def make_stream(
    arrivals: str,
    pods: Sequence[TracePod],
    load: float,
    capacity_milli: int,
    seed: int,
    passes: int,
    warmup_passes: int,
    times_from: Sequence[TracePod] | None = None,
) -> Stream:
    """The stream of one replay: the trace's (``trace``) or resampled (``poisson``)."""
    kind = Arrivals(arrivals)  # unknown: ValueError naming the valid values
    if kind is Arrivals.POISSON:
        return poisson_stream(pods, load, capacity_milli, seed, passes, warmup_passes, times_from=times_from)
    return build_stream(pods, load, capacity_milli, seed, passes, warmup_passes, times_from=times_from)
