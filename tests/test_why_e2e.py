"""`relocator why` on the session's local Ray cluster (3 nodes x 4 fake GPUs), without starting
a worker: a launch bigger than every node is refused at once with the reason; every free GPU
taken by another tenant's placement groups makes a launch wait, and `why` (Python, HTTP, CLI,
status --json) says capacity with the real free map. Nothing of the session's workers moves:
with no GPU free anywhere, no move can make room."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import wait_for

pytestmark = pytest.mark.integration
TENANT = "test-tenant-why"
REPO = Path(__file__).resolve().parents[1]


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _cli(base: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relocator", "why", *args, "--cluster-dir", base],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_why_refuses_what_never_fits_and_explains_a_full_cluster(relocator_cluster) -> None:
    import ray
    from ray.util import placement_group, remove_placement_group

    ctl = relocator_cluster
    base = ctl.info["base_dir"]
    with pytest.raises(ValueError, match="5 GPU.* can never fit: the largest node, n1, has 4"):
        ctl.launch("tiny-llama", 5)
    assert all(d["id"] for d in ctl.pending()) and not any(d["gpus"] == 5 for d in ctl.pending())
    pgs = []
    demand = None
    try:
        for n in ctl.status()["nodes"]:  # every free GPU held by another tenant (not a worker: never moved)
            if n["alive"] and n["gpus_free"] > 0:
                pg = placement_group([{"GPU": n["gpus_free"], f"relocator_node:{n['id']}": 0.001}],
                                     strategy="STRICT_PACK", name=f"{TENANT}-{n['id']}")
                ray.get(pg.ready(), timeout=60)
                pgs.append(pg)
        wait_for(lambda: all(n["gpus_free"] == 0 for n in ctl.status()["nodes"]), 60, "no GPU free")
        out = ctl.launch("tiny-llama", 1, priority=-1000)  # nothing of lower priority to suspend: it waits
        assert out["state"] == "pending", out
        demand = out["id"]
        wait_for(lambda: ctl.why(demand)["checks"][1]["ok"], 60, "every node registered")
        why = ctl.why(demand)
        assert why["cause"] == "capacity", why["line"]
        assert [c["check"] for c in why["checks"]] == ["fits_at_all", "nodes", "priority", "room"]
        assert set(why["free"]) == {"n1", "n2", "n3"} and all(v == [0.0] * 4 for v in why["free"].values())
        assert why["plan"]["node"] is None and why["plan"]["reason"]
        st = ctl.status()
        mine = [p for p in st["pending"] if p["id"] == demand]
        assert mine and mine[0]["why"]["cause"] == "capacity"
        code, body = _get(f"{st['api']}/v1/why/{demand}")
        assert code == 200 and body["cause"] == "capacity"
        code, body = _get(f"{st['api']}/v1/why/no-such-demand")
        assert code == 404 and "unknown demand" in body["error"]
        proc = _cli(base, demand, "--json")
        assert proc.returncode == 0, proc.stderr
        assert json.loads(proc.stdout)["cause"] == "capacity"
        proc = _cli(base, "no-such-demand")
        assert proc.returncode == 2 and "unknown demand" in proc.stderr and "Traceback" not in proc.stderr
    finally:
        if demand is not None:
            wait_for(lambda: _cancelled(ctl, demand), 60, f"demand {demand} cancelled")
        for pg in pgs:
            remove_placement_group(pg)


def _cancelled(ctl, demand: str) -> bool:
    try:
        ctl.cancel(demand)
    except KeyError:
        return True  # already gone
    except RuntimeError:  # being placed by a retry this instant: again
        return False
    return True
