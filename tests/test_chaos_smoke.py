"""The chaos smoke scenario (issue 6, part 4) on the session's shared cluster
(`relocator_cluster` from conftest.py: 3 raylets x 4 fake GPUs, router, controller).

One 1-GPU worker of its own, greedy streams checked token by token, a few forced moves and
every fault once — except `node-loss`, which would take a raylet away from the cluster the
other integration tests share (`relocator chaos --smoke` on its own cluster runs it). The
worker is stopped at the end and nothing may be left behind.
"""

from __future__ import annotations

import pytest

from relocator.chaos import FAULTS
from relocator.chaos.runner import ChaosConfig, run_chaos

pytestmark = pytest.mark.integration


def test_chaos_smoke(relocator_cluster, tmp_path) -> None:
    faults = [f for f in FAULTS if not FAULTS[f].destructive]
    cfg = ChaosConfig.smoke(moves=2, faults=faults, streams=4, output_tokens=(32, 64),
                            png=str(tmp_path / "chaos.png"))
    rep = run_chaos(cfg, ctl=relocator_cluster, say=print)
    assert rep["relocations"] == 2 + len(faults)
    assert rep["faults_injected"] == len(faults), rep["faults"]
    bad = {k: v["problems"] for k, v in rep["faults"].items() if not v["ok"]}
    assert not bad, bad
    assert rep["plain_moves_done"] == rep["plain_moves"] == 2
    allowed = sum(v for k, v in rep["failed_requests_by_fault"].items() if FAULTS.get(k) and FAULTS[k].requests_may_fail)
    assert rep["failed_requests"] == allowed, rep["failed"]
    assert (rep["tokens_lost"], rep["tokens_duplicated"], rep["tokens_mismatched"]) == (0, 0, 0), rep["token_bad"]
    assert rep["tokens_checked_requests"] > 0
    assert not any(rep["leaked"].values()), rep["leaked"]
    assert (tmp_path / "chaos.png").stat().st_size > 0
    assert rep["ok"]
