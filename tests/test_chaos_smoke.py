"""The chaos smoke scenario (issue 6, part 4) on the session's shared cluster
(`relocator_cluster` from conftest.py: 3 raylets x 4 fake GPUs, router, controller).

One 1-GPU worker of its own, greedy streams checked token by token, two forced moves and
every fault once — except `node-loss`, which takes a raylet away from the cluster the other
integration tests share (`relocator chaos --smoke` on its own cluster runs it). The worker is
stopped at the end and nothing may be left behind.
"""

from __future__ import annotations

import pytest

from relocator.chaos import FAULTS
from relocator.chaos.runner import ChaosConfig, run_chaos

pytestmark = pytest.mark.integration

# The 2 s "serving again" target is a figure `relocator chaos` reports (docs/
# benchmarks.md, "Chaos"); on a loaded 2-core CI machine recoveries take 0.1-4.5 s (a restarted
# controller actor or router process ~2-4 s, 14 s once beside other sessions' load), so the test
# bounds them (no hang) without timing them against the target.
SERVE_AGAIN_BOUND_S = 30.0


def test_chaos_smoke(relocator_cluster, tmp_path) -> None:
    faults = [f for f in FAULTS if not FAULTS[f].destructive and FAULTS[f].smoke]  # the handoff faults: `relocator chaos`
    cfg = ChaosConfig.smoke(moves=2, faults=faults, streams=4, output_tokens=(32, 64),
                            png=str(tmp_path / "chaos.png"))
    rep = run_chaos(cfg, ctl=relocator_cluster, say=print)
    assert rep["relocations"] == 2 + len(faults)
    assert rep["faults_injected"] == len(faults), rep["faults"]
    bad = {}
    for name, o in rep["faults"].items():
        slow = [p for p in o["problems"] if p.startswith("serving again after")]
        if slow:
            print(f"{name}: {slow[0]} (reported, not asserted)")
        probs = [p for p in o["problems"] if not p.startswith("serving again after")]
        if probs:
            bad[name] = probs
        assert o["serve_again_s"] is not None and o["serve_again_s"] < SERVE_AGAIN_BOUND_S, o
    assert not bad, bad
    assert rep["plain_moves_done"] == rep["plain_moves"] == 2
    # a router restart is a SIGTERM hand-over now: not one request may fail, even there
    assert rep["failed_requests"] == 0, rep["failed"]
    assert (rep["tokens_lost"], rep["tokens_duplicated"], rep["tokens_mismatched"]) == (0, 0, 0), rep["token_bad"]
    assert rep["tokens_checked_requests"] > 0
    assert not any(rep["leaked"].values()), rep["leaked"]
    assert (tmp_path / "chaos.png").stat().st_size > 0
