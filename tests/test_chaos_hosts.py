"""relocator/chaos/hosts.py: where the chaos runner reads a node's files (pure, no cluster)."""

from __future__ import annotations

from pathlib import Path

from relocator.chaos.faults import FAULTS, SMOKE_FAULTS
from relocator.chaos.hosts import EMULATED_SKIPS, EmulatedView, LocalView, split_faults
from relocator.cluster.emulate import plan


def _view(tmp_path: Path) -> EmulatedView:
    info = {"emulated": plan(3, tmp_path / "emulated").to_dict()}
    return EmulatedView(info, "/var/lib/relocator/deploy/d1", controller_host="h2")


def test_paths_map_to_the_hosts_own_directories(tmp_path: Path) -> None:
    v = _view(tmp_path)
    hosts = tmp_path / "emulated" / "hosts"
    assert v.path("h2", "/var/lib/relocator/deploy/d1/nodes/h2/images/i1") == \
        hosts / "h2" / "var-lib" / "deploy/d1/nodes/h2/images/i1"
    assert v.path("h3", "/tmp/x") == hosts / "h3" / "tmp" / "x"
    assert v.path("h1", "/run/relocator") == hosts / "h1" / "run"
    assert v.path("h1", "/work/model") == Path("/work/model")  # not private to a host
    assert v.state_dir("h3") == hosts / "h3" / "var-lib" / "deploy/d1/nodes/h3/state"
    assert v.protected == {"h1", "h2"}  # the head and the controller's host
    v.dead.add("h3")
    assert [r.parent.parent.parent.name for r in v.roots()] == ["h1", "h2"]


def test_faults_that_cannot_apply_are_skipped_with_a_reason(tmp_path: Path) -> None:
    assert set(EMULATED_SKIPS) <= set(FAULTS)
    kept, skipped = split_faults(SMOKE_FAULTS, _view(tmp_path))
    assert set(kept) | set(skipped) == set(SMOKE_FAULTS) and not set(kept) & set(skipped)
    assert all(skipped.values()) and "node-loss" in kept and "flip-byte" in kept
    local = LocalView(tmp_path)
    assert split_faults(SMOKE_FAULTS, local) == (list(SMOKE_FAULTS), {})
    assert local.path("n1", "/var/lib/relocator/x") == Path("/var/lib/relocator/x")
