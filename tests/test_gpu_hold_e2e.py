"""GPUs held by count on the session cluster's fake GPUs (issue 33): two idle GPUs of a node
marked with a pending row remap through the controller are held (two fewer free GPUs, shown
by `relocator gpus list`), and `relocator gpus clear` releases both. No worker is involved."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import wait_for

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[1]


def _cli(base: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relocator", "gpus", *args, "--cluster-dir", base],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def _node(ctl, node: str) -> dict:
    st = ctl.status()
    return {"free": next(n["gpus_free"] for n in st["nodes"] if n["id"] == node),
            "held": sorted(g["gpu"] for g in st["gpu_health"] if g["node"] == node and g.get("held")),
            "states": [g for g in st["gpu_health"] if g["node"] == node]}


def _wait(pred, ctl, node: str, what: str, timeout: float = 30.0) -> None:
    """Until `pred(_node(...))`; on a timeout the assertion says what the node looked like."""
    try:
        wait_for(lambda: pred(_node(ctl, node)), timeout, what)
    except TimeoutError:
        pytest.fail(f"not within {timeout:g} s: {what}; {node} now: {_node(ctl, node)}")


def test_two_fake_gpus_held_by_count_then_cleared(relocator_cluster) -> None:
    ctl = relocator_cluster
    base = ctl.info["base_dir"]
    nodes = [n for n in ctl.status()["nodes"] if n["alive"] and n["gpus_free"] >= 2]
    assert nodes, f"no node with 2 free GPUs: {ctl.status()['nodes']}"
    node = max(nodes, key=lambda n: (n["gpus_free"], n["id"]))["id"]
    before = _node(ctl, node)
    assert before["states"] == [], f"{node} already has unhealthy GPUs: {before}"
    with pytest.raises(ValueError, match="unknown node"):
        ctl.mark_gpus("no-such-node", "remap", count=1)
    marked = ctl.mark_gpus(node, "remap", count=2)["gpus"]
    try:
        assert len(marked) == 2, marked
        _wait(lambda n: n["held"] == marked and n["free"] == before["free"] - 2, ctl, node,
              f"GPUs {marked} of {node} held (2 fewer free than {before['free']})")
        listed = _cli(base, "list", "--node", node, "--json")
        assert listed.returncode == 0, listed.stderr
        states = {g["gpu"]: g for g in json.loads(listed.stdout)["gpus"]}
        assert sorted(states) == marked and all(g["state"] == "ready_for_reset" for g in states.values()), states
        bad = _cli(base, "clear", node, "9")
        assert bad.returncode == 2 and "no GPU 9" in bad.stderr, (bad.stdout, bad.stderr)
        cleared = _cli(base, "clear", node, "--json")
        assert cleared.returncode == 0, (cleared.stdout, cleared.stderr)
        out = json.loads(cleared.stdout)
        assert out["cleared"] == marked and out["still_unhealthy"] == [], out
    finally:
        ctl.clear_gpus(node, marked)
    _wait(lambda n: n["free"] == before["free"] and not n["states"], ctl, node,
          f"{node}'s GPUs released ({before['free']} free again)")
