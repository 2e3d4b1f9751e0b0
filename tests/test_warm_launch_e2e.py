"""Issue 28 on the session's loopback cluster: the first worker of a kind starts cold and is
captured; a second of that kind on the same node is restored from the warm image and serves;
both stop and leave nothing but the node's image (which goes with `relocator down`)."""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import wait_for, workers

pytestmark = pytest.mark.integration
MODEL = "tiny-llama"


def _started(ctl, worker: str) -> dict:
    evs = [e for e in ctl.events(since=0, kinds=["worker_started"], idle_timeout=1, wait_s=1)
           if e["worker"] == worker]
    assert evs, f"no worker_started event for {worker}"
    return evs[-1]


def _complete(endpoint: str) -> dict:
    body = json.dumps({"model": MODEL, "prompt": "warm", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(endpoint.rstrip("/") + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def test_second_launch_of_a_kind_is_a_warm_restore(relocator_cluster) -> None:
    from relocator.warm.roots import cluster_dirs

    ctl = relocator_cluster
    a = ctl.launch(MODEL, gpus=1, worker_id="warm-a")
    try:
        first = _started(ctl, "warm-a")
        # cold here, unless an earlier test of the session already filed this kind's image
        assert first["how"] == "warm" or first["capture"]["dumped"] or "already" in first["capture"]["reason"], first
        node = a["node"]
        base = Path("/var/tmp") / f"relocator-test-{os.getpid()}"  # the relocator_cluster fixture's
        b = ctl.launch(MODEL, gpus=1, node=node, worker_id="warm-b")
        try:
            second = _started(ctl, "warm-b")
            assert second["how"] == "warm", second  # restored from the image, not loaded again
            assert second["key"] == first["key"] and second["node"] == node
            print(f"launch through the controller: first ({first['how']}) {first['seconds']} s, "
                  f"second ({second['how']}) {second['seconds']} s; capture {first['capture']}")
            ws = workers(ctl)
            assert ws["warm-b"]["state"] == "running" and ws["warm-b"]["cell"] != ws["warm-a"]["cell"]
            assert ws["warm-b"]["endpoint"] != ws["warm-a"]["endpoint"]
            for w in ("warm-a", "warm-b"):  # both serve, each at its own endpoint
                assert _complete(ws[w]["endpoint"])["choices"][0]["text"] is not None
            # the node's store lies in the cluster's own directories (removed by `relocator down`)
            assert any((d / "images" / second["key"]).is_dir() for d in cluster_dirs(base, node))
        finally:
            ctl.stop_worker("warm-b")
    finally:
        ctl.stop_worker("warm-a")
    wait_for(lambda: "warm-a" not in json.dumps(ctl.cells()) and "warm-b" not in json.dumps(ctl.cells()),
             60, "the warm test's cells gone")
    assert not {"warm-a", "warm-b"} & set(workers(ctl))


def _holders(base: Path, key: str, nodes: list[str]) -> set[str]:
    from relocator.warm.roots import cluster_dirs

    return {n for n in nodes if any((d / "images" / key).is_dir() for d in cluster_dirs(base, n))}


def test_images_are_copied_ahead_of_need_and_on_demand(relocator_cluster) -> None:
    """A kind's image reaches a second node by itself (prefetch.copies: 1, checksummed), and a
    start on a node without it copies it from a peer and restores instead of starting cold."""
    from relocator.warm.roots import open_cluster_store

    ctl = relocator_cluster
    base = Path("/var/tmp") / f"relocator-test-{os.getpid()}"
    nodes = sorted(n["id"] for n in ctl.status()["nodes"] if n["alive"])
    a = ctl.launch(MODEL, gpus=1, worker_id="warm-c")
    try:
        first = _started(ctl, "warm-c")
        key = first["key"]
        # the capture (cold start) or an earlier test filed it; the controller copies it on
        wait_for(lambda: len(_holders(base, key, nodes)) >= 2, 120, f"image {key} on two nodes")
        # copied ahead of need (a warm_image_copied event), or on demand by a start elsewhere
        # first: copies ahead of need give way to any move or start in the cluster (docs/images.md),
        # and a busy session's starts may fetch it before a quiet moment comes
        seen = list(ctl.events(since=0, kinds=["warm_image_copied", "worker_started"], idle_timeout=1, wait_s=1))
        ahead = [e for e in seen if e["kind"] == "warm_image_copied" and e["key"] == key]
        fetched = [e for e in seen if e["kind"] == "worker_started" and e.get("key") == key
                   and (e.get("copied") or {}).get("copied")]
        assert (ahead and ahead[0]["bytes"] > 0) or fetched, "the image reached a second node with no copy event"
        holders = _holders(base, key, nodes)
        others = sorted(set(nodes) - {a["node"]})
        target = others[0]
        if len(holders) == len(nodes):  # every node has it already: take it from one, which then must copy
            open_cluster_store(base, target).rm(key)
        elif target in holders:
            target = others[1]
        ctl.launch(MODEL, gpus=1, node=target, worker_id="warm-d")
        try:
            second = _started(ctl, "warm-d")
            assert second["how"] == "warm" and second["key"] == key, second
            assert second["copied"] and second["copied"]["copied"] and second["copied"]["bytes"] > 0, second
            assert target in _holders(base, key, nodes)
            assert _complete(workers(ctl)["warm-d"]["endpoint"])["choices"][0]["text"] is not None
            print(f"on-demand copy to {target}: {second['copied']}; start {second['seconds']} s")
        finally:
            ctl.stop_worker("warm-d")
    finally:
        ctl.stop_worker("warm-c")
