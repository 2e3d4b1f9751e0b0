"""Emulated hosts left by a killed run (bridge and namespaces, no process) are removed by the
next `up`; hosts that still run a process are refused. A killed fresh-clone run once left
rlemu0 behind and the next CI's emulated tests all failed at setup."""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from relocator.cluster import emulate

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("ip") is None,
                                reason="needs root and iproute2 (network namespaces)")

BRIDGE, PREFIX = "rlemut0", "rlemut-h"  # not the real cluster's names: one may be up beside


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _cluster(tmp_path) -> emulate.EmulatedCluster:
    return emulate.EmulatedCluster(base_dir=str(tmp_path), bridge=BRIDGE, bridge_ip="10.249.0.1",
                                   subnet="10.249.0.0/24")


@pytest.fixture
def stale():
    _ip("link", "add", BRIDGE, "type", "bridge")
    for i in (1, 2):
        _ip("netns", "add", f"{PREFIX}{i}")
    yield
    for i in (1, 2):
        subprocess.run(["ip", "netns", "del", f"{PREFIX}{i}"], capture_output=True)
    subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True)


def test_nothing_there_is_nothing_to_reclaim(tmp_path):
    assert emulate.reclaim_stale(_cluster(tmp_path), prefix=PREFIX) is False


def test_stale_hosts_are_removed(stale, tmp_path, capsys):
    assert emulate.reclaim_stale(_cluster(tmp_path), prefix=PREFIX) is True
    assert not any(p.name.startswith(PREFIX) for p in os.scandir("/run/netns"))
    assert subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0
    assert "removed stale emulated hosts" in capsys.readouterr().err


def test_hosts_with_a_live_process_are_refused(stale, tmp_path):
    sleeper = subprocess.Popen(["ip", "netns", "exec", f"{PREFIX}2", "sleep", "60"])
    try:
        for _ in range(50):  # until the sleeper is inside the namespace
            if subprocess.run(["ip", "netns", "pids", f"{PREFIX}2"], capture_output=True, text=True).stdout.strip():
                break
            subprocess.run(["sleep", "0.1"])
        with pytest.raises(emulate.EmulationError, match=rf"{PREFIX}2: 1 process\b"):
            emulate.reclaim_stale(_cluster(tmp_path), prefix=PREFIX)
        assert os.path.exists(f"/run/netns/{PREFIX}1")  # nothing removed
    finally:
        sleeper.kill()
        sleeper.wait()
