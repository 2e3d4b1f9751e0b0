"""The vectorised FGD fragmentation gives exactly (to the bit) what the per-shape loop gave.

``_reference`` is the loop the replay used before it was vectorised; any difference, even in
the last bit of a float, could change a placement tie and so a replay's results."""

from __future__ import annotations

import numpy as np
import pytest

from relocator.planner.policies import TypicalPods, fragmentation


def _reference(cpu_left, gpu_left, model, typical, model_codes):
    """The loop over typical shapes (relocator/planner/policies.py before the vectorisation)."""
    total = gpu_left.sum(axis=1).astype(np.float64)
    out = np.zeros(len(cpu_left), dtype=np.float64)
    for t in range(len(typical)):
        f = typical.freq[t]
        m = int(typical.gpu_milli[t])
        if m == 0:
            out += f * total
            continue
        big = gpu_left >= m
        ok = (big.sum(axis=1) >= typical.num_gpu[t]) & (cpu_left >= typical.cpu[t])
        if typical.model[t]:
            code = model_codes.get(typical.model[t], -1)
            ok &= model == code
        small = np.where(big, 0, gpu_left).sum(axis=1)
        out += f * np.where(ok, small, total)
    return out


MODELS = ("", "V100M32", "A10", "T4", "G2")  # "G2": a model no node has
CODES = {"V100M32": 0, "A10": 1, "T4": 2, "P100": 3}


def _typical(rng: np.random.Generator, n: int) -> TypicalPods:
    num_gpu = rng.choice([0, 1, 1, 1, 2, 4, 8], n)
    share = rng.random(n) < 0.4
    milli = np.where(num_gpu == 0, 0, np.where(share & (num_gpu == 1), rng.choice([50, 100, 250, 333, 500, 700, 999], n), 1000))
    freq = rng.random(n)
    return TypicalPods(
        cpu=rng.choice([0, 1000, 4000, 8000, 32000, 96000], n).astype(np.int64),
        num_gpu=num_gpu.astype(np.int64),
        gpu_milli=milli.astype(np.int64),
        model=tuple(str(m) for m in rng.choice(MODELS, n, p=[0.7, 0.1, 0.1, 0.05, 0.05])),
        freq=freq / freq.sum(),
    )


def _state(rng: np.random.Generator, m: int, g: int):
    cap = np.where(np.arange(g)[None, :] < rng.choice([0, 1, 2, 4, 8], m)[:, None], 1000, 0)[:, :g]
    used = np.where(rng.random((m, g)) < 0.5, rng.choice([0, 50, 100, 250, 333, 500, 1000], (m, g)), 0)
    gpu_left = np.clip(cap - used, 0, None).astype(np.int64)
    cpu_left = rng.integers(-2000, 128_000, m).astype(np.int64)
    model = rng.integers(0, 4, m).astype(np.int64)
    return cpu_left, gpu_left, model


@pytest.mark.parametrize("seed", range(40))
def test_vectorised_fragmentation_equals_the_loop_bit_for_bit(seed: int) -> None:
    rng = np.random.default_rng(seed)
    typical = _typical(rng, int(rng.integers(1, 40)))
    m = int(rng.choice([0, 1, 2, 3, 8, 17, 64, 300]))
    args = (*_state(rng, m, 8), typical, CODES)
    got, want = fragmentation(*args), _reference(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    bad = np.nonzero(got != want)[0]
    assert len(bad) == 0, f"seed {seed}: nodes {bad[:5]} differ: {got[bad[:5]]} vs reference {want[bad[:5]]}"


def test_cpu_only_and_empty_typical() -> None:
    rng = np.random.default_rng(7)
    cpu_left, gpu_left, model = _state(rng, 20, 8)
    cpu_only = TypicalPods(np.array([4000]), np.array([0]), np.array([0]), ("",), np.array([1.0]))
    got = fragmentation(cpu_left, gpu_left, model, cpu_only, CODES)
    assert np.array_equal(got, gpu_left.sum(axis=1).astype(np.float64)), "a CPU-only workload cannot use any free GPU"
    assert np.array_equal(got, _reference(cpu_left, gpu_left, model, cpu_only, CODES))
    empty = TypicalPods.from_workloads([])
    assert np.array_equal(fragmentation(cpu_left, gpu_left, model, empty, CODES), np.zeros(20))


def test_typical_from_the_trace_on_candidate_states() -> None:
    """The states FGD scores for a GPU-sharing pod: every GPU of a node minus the share."""
    from relocator.planner.cluster import Workload

    rng = np.random.default_rng(3)
    pods = []
    for i in range(500):
        n = int(rng.choice([0, 1, 1, 2, 8]))
        milli = 0 if n == 0 else int(rng.choice([100, 250, 500, 1000])) if n == 1 else 1000
        pods.append(Workload(f"p{i}", cpu_milli=int(rng.choice([1000, 4000, 8000])), num_gpu=n, gpu_milli=milli))
    typical = TypicalPods.from_workloads(pods)
    cpu_left, left, model = _state(rng, 50, 8)
    cand = (np.repeat(left[:, None, :], 8, axis=1) - np.eye(8, dtype=np.int64)[None] * 250).reshape(400, 8)
    args = (np.repeat(cpu_left, 8), cand, np.repeat(model, 8), typical, CODES)
    assert np.array_equal(fragmentation(*args), _reference(*args))
