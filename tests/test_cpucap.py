"""The CPU cap of a low start (relocator/cpucap.py) on this host's cgroup v1 cpu hierarchy: the
start thread joins the capped group and what it forks stays there until released; the thread
itself goes back where it was."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from relocator import cpucap, procs

pytestmark = pytest.mark.skipif(not (cpucap.CPU_ROOT / "tasks").exists() or os.geteuid() != 0,
                                reason="no writable cgroup v1 cpu hierarchy here (a cgroup v2 only host caps nothing)")


def _where(pid: int, tid: int | None = None) -> str | None:
    return procs.cgroup_of(pid, tid)


def test_a_capped_thread_and_what_it_forks_are_capped_until_released() -> None:
    home = _where(os.getpid(), threading.get_native_id())
    with cpucap.this_thread_capped(0.25) as capped:
        assert capped
        assert _where(os.getpid(), threading.get_native_id()) == "/" + cpucap.GROUP
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert _where(os.getpid(), threading.get_native_id()) == home  # the thread went back
        assert _where(child.pid) == "/" + cpucap.GROUP  # its child stays capped
        quota = int((cpucap.CPU_ROOT / cpucap.GROUP / "cpu.cfs_quota_us").read_text())
        assert quota == cpucap.PERIOD_US // 4, quota
        assert cpucap.release([child.pid, 999999999]) >= 1
        assert _where(child.pid) == _where(os.getpid())
        assert cpucap.release([child.pid]) == 0  # nothing left to move
    finally:
        child.kill()
        child.wait()


def test_no_cap_asked_changes_nothing(tmp_path) -> None:
    home = _where(os.getpid(), threading.get_native_id())
    with cpucap.this_thread_capped(None) as capped:
        assert not capped and _where(os.getpid(), threading.get_native_id()) == home
    assert cpucap.cap_group(0.5, root=tmp_path / "absent") is None  # no hierarchy: none, said once
