"""relocator.procs: the process module, on this test's own processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from relocator import procs


def _child(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args])


def test_liveness_cmdline_and_status_of_a_child():
    child = _child("marker-arg")
    try:
        assert procs.alive(child.pid)
        for _ in range(500):  # the exec'd image's argv is readable a moment after the spawn
            if procs.cmdline(child.pid)[-1:] == ["marker-arg"]:
                break
            time.sleep(0.01)
        assert procs.cmdline(child.pid)[-1] == "marker-arg"
        assert child.pid in procs.children(os.getpid())
        assert procs.process_table()[child.pid] == (os.getpid(), procs.cmdline(child.pid))
        os.kill(child.pid, signal.SIGSTOP)
        for _ in range(200):  # the stop is asynchronous
            if procs.stopped(child.pid):
                break
            time.sleep(0.01)
        assert procs.stopped(child.pid)
        os.kill(child.pid, signal.SIGKILL)
        for _ in range(200):  # killed, not yet reaped: a zombie is not alive
            if not procs.alive(child.pid):
                break
            time.sleep(0.01)
        assert not procs.alive(child.pid) and procs.status(child.pid) == "zombie"
    finally:
        child.kill()
        child.wait()
    assert not procs.alive(child.pid) and procs.cmdline(child.pid) == [] and procs.status(child.pid) is None


def test_nonsense_pids_are_never_alive():
    assert not procs.alive(0) and not procs.alive(-1) and not procs.alive(None)
    assert procs.children(None) == [] and procs.tree(0) == []


def test_memory_readers_agree_and_gone_counts_zero():
    me = os.getpid()
    rss = procs.rss_bytes([me])
    assert rss > 1 << 20
    assert procs.status_bytes([me]) > 1 << 20
    assert procs.rss_bytes([2 ** 22 + 12345]) == 0 and procs.status_bytes([2 ** 22 + 12345]) == 0


def test_descendants_and_criu_processes_from_a_table():
    table = {1: (0, ["init"]), 10: (1, ["/usr/local/sbin/criu", "dump", "-D", "/x/img"]),
             11: (10, ["child"]), 12: (11, ["grandchild"]), 20: (1, ["other"])}
    assert sorted(procs.descendants(10, table)) == [11, 12]
    assert procs.criu_processes(table, "dump", "/x/") == [10]
    assert procs.criu_processes(table, "restore") == []


def test_host_facts():
    assert procs.boot_id() and procs.boot_id() == procs.boot_id()
    assert procs.pid_ns(os.getpid()) == procs.pid_ns(os.getppid())
    assert procs.pid_ns(2 ** 22 + 12345) is None


def test_namespaces_of_this_process():
    assert procs.namespace("net").startswith("net:[")
    assert procs.namespace("mnt", os.getpid()) == procs.namespace("mnt")
    assert procs.namespace("nosuch") is None


def test_all_stopped_needs_one_process_there():
    assert not procs.all_stopped([2 ** 22 + 12345])
    assert not procs.all_stopped([os.getpid()])


def test_chaos_finds_a_stray_engine_by_its_state_dir_and_pid_namespace(tmp_path):
    from relocator.chaos import leaks

    env = {**os.environ, "RELOCATOR_STATE_DIR": str(tmp_path / "nodes" / "a" / "state")}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "vllm"], env=env)
    try:
        for _ in range(200):  # the child's argv is its own once exec'd
            if procs.cmdline(child.pid)[-1:] == ["vllm"]:
                break
            time.sleep(0.01)
        strays = leaks.engine_processes(tmp_path, [])
        assert any(s.startswith(f"{child.pid}:") for s in strays)
        assert leaks.engine_processes(tmp_path / "other", []) == set()

        class Cell:  # a live cell in our own PID namespace: its processes are not strays
            init_pid = os.getpid()

            def is_alive(self):
                return True

        assert not any(s.startswith(f"{child.pid}:") for s in leaks.engine_processes(tmp_path, [Cell()]))
    finally:
        child.kill()
        child.wait()


def test_host_facts_from_proc(tmp_path):
    assert procs.fs_type("/proc") == "proc"
    assert procs.fs_type(tmp_path / "not" / "there") == procs.fs_type(tmp_path) is not None
    assert "/proc" in [m for _d, m, _t in procs.mounts()]
    assert procs.mem_available() > 0
    assert procs.sysctl("kernel.ostype") == "Linux" and procs.sysctl("no.such.setting") is None
    assert procs.ns_inode("net") == os.stat("/proc/self/ns/net").st_ino and procs.ns_inode("net", 2 ** 22 + 1) is None
    assert (procs.root(os.getpid()) / "proc" / "self").exists()
    assert procs._unescape("/mnt/a\\040b") == "/mnt/a b"


def test_set_nice_reaches_every_thread_of_a_process():
    """Linux schedules threads: a handoff favours its source by the nice value of each one."""

    import psutil

    code = "import threading,time; [threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(3)]; print(1, flush=True); time.sleep(30)"
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"1"
        tids = [t.id for t in psutil.Process(p.pid).threads()]
        assert len(tids) >= 4
        assert procs.set_nice([p.pid, 999999999], 7) == len(tids)  # a gone pid is skipped
        assert {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {7}
    finally:
        p.kill()
        p.wait()


def test_this_thread_niced_sets_and_restores_only_this_thread() -> None:
    import os
    import threading

    from relocator.procs import this_thread_niced

    main = threading.get_native_id()
    before = os.getpriority(os.PRIO_PROCESS, main)
    seen: dict[str, int] = {}

    def worker() -> None:  # a pool thread: niced for the block, its old value back after
        tid = threading.get_native_id()
        with this_thread_niced(15):
            seen["inside"] = os.getpriority(os.PRIO_PROCESS, tid)
            seen["main"] = os.getpriority(os.PRIO_PROCESS, main)
        seen["after"] = os.getpriority(os.PRIO_PROCESS, tid)
        with this_thread_niced(None):
            seen["none"] = os.getpriority(os.PRIO_PROCESS, tid)

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == {"inside": 15, "main": before, "after": before, "none": before}


def _autogroup_text(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/autogroup") as f:
            return f.read().strip()
    except OSError as exc:
        return str(exc)


def _autogroups_enabled() -> str:
    try:
        with open("/proc/sys/kernel/sched_autogroup_enabled") as f:
            return f.read().strip()
    except OSError:
        return "absent"


@pytest.mark.skipif(not os.path.exists("/proc/self/autogroup"), reason="this kernel has no scheduler autogroups")
def test_set_group_nice_sets_a_sessions_autogroup_and_never_the_callers_own() -> None:
    """With autogroups on, the kernel shares the CPU between sessions before threads: a cell (its
    own session) at thread nice -10 weighed no more than the raylets' session beside it (issue 29)."""
    code = "import time; print(1, flush=True); time.sleep(30)"
    own = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    same = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)  # this session's
    try:
        assert own.stdout.readline().strip() == b"1" and same.stdout.readline().strip() == b"1"
        if procs.autogroup(own.pid) is None:  # a machine's fact, not a race: the file reads empty
            pytest.skip(f"this kernel shows no autogroup for a new session ({_autogroup_text(own.pid)!r};"
                        f" sched_autogroup_enabled {_autogroups_enabled()!r}): nothing to set")
        # None: this process is in the kernel's default group (no session leader above it since
        # boot; the fresh CI machine's case), which set_group_nice cannot change either
        mine = procs.autogroup(os.getpid())
        assert procs.autogroup(same.pid) == mine
        assert mine is None or procs.autogroup(own.pid)[0] != mine[0]
        got = procs.set_group_nice([own.pid, same.pid, 999999999], 7)
        assert got == [procs.autogroup(own.pid)[0]] and procs.autogroup(own.pid)[1] == 7, got
        assert procs.autogroup(os.getpid()) == mine  # the caller's own group is left alone
        assert procs.set_nice([own.pid], 3, group=0) == len(psutil.Process(own.pid).threads())
        assert procs.autogroup(own.pid)[1] == 0 and os.getpriority(os.PRIO_PROCESS, own.pid) == 3
    finally:
        for p in (own, same):
            p.kill()
            p.wait()
