"""A node lost for good under streaming load (issue 6, `node-loss`), end to end through the CLI:
`relocator chaos --smoke --faults node-loss` starts its own 3-node cluster (this test must not
take a raylet from the session's shared cluster), moves a worker, SIGKILLs the target node's
raylet during RESTORE and checks the outcome. Whether Ray declares the node dead before SWITCH
(rolled back) or after (done, then the controller replaces the lost worker from its last
image), the worker must serve on a live node with no request failed and nothing left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

SERVE_AGAIN_BOUND_S = 15.0  # the 2 s target is reported by `relocator chaos`, not asserted here


def test_node_loss_under_load(tmp_path) -> None:
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "relocator", "chaos", "--smoke", "--moves", "0", "--faults", "node-loss",
         "--streams", "4", "--cluster-dir", str(tmp_path / "cluster"), "--out", str(tmp_path / "rep.json"), "--json"],
        capture_output=True, text=True, timeout=900, env=env)
    assert (tmp_path / "rep.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rep = json.loads((tmp_path / "rep.json").read_text())
    o = rep["faults"]["node-loss"]
    print(json.dumps(o, indent=1))
    move = next(m for m in rep["moves"] if m.get("fault") == "node-loss")
    assert move["injected"], move
    assert o["result"] in ("rolled_back", "done"), o
    assert move["serving"] and move["worker_node_alive"], move
    assert move["worker_after"]["node"] != move["to"] or o["result"] == "rolled_back"
    assert o["serve_again_s"] is not None and o["serve_again_s"] < SERVE_AGAIN_BOUND_S, o
    assert rep["failed_requests"] == 0, rep["failed"][:5]
    assert (rep["tokens_lost"], rep["tokens_duplicated"], rep["tokens_mismatched"]) == (0, 0, 0)
    assert rep["tokens_checked_requests"] > 0
    assert not any(rep["leaked"].values()), rep["leaked"]
    slow = [p for p in o["problems"] if p.startswith("serving again after")]
    assert not [p for p in o["problems"] if p not in slow], o["problems"]
    assert proc.returncode in (0, 1)  # 1 only for a recovery slower than the 2 s target
    assert proc.returncode == 0 or slow
