"""relocator.agent.lastwords: a dead worker's log tail outlives its cell's tmpfs."""

from __future__ import annotations

import os

from relocator.agent.lastwords import LastWords, summary


def test_the_tail_is_kept_after_the_log_is_gone(tmp_path):
    log = tmp_path / "run" / "worker.log"
    log.parent.mkdir()
    log.write_text("INFO: started\n")
    words = LastWords(tmp_path / "state")
    words.watch("c1", log)
    with open(log, "a") as f:  # written after the watch began, as a worker goes on logging
        f.write("INFO: POST /v1/completions 200\n!!!!!!! Segfault encountered !!!!!!!\n  File libc\n")
    log.unlink()  # the cell's /run went with the cell
    text = words.keep("c1")
    assert text is not None and "Segfault encountered" in text and "started" in text
    assert words.read("c1") == text  # kept on disk for a later question
    assert (tmp_path / "state" / "lastwords" / "c1.log").is_file()
    assert summary(text).splitlines()[0] == "!!!!!!! Segfault encountered !!!!!!!"


def test_a_killed_cell_leaves_nothing_and_no_descriptor(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("x\n")
    words = LastWords(tmp_path)
    before = len(os.listdir("/proc/self/fd"))
    words.watch("c2", log)
    words.watch("c2", log)  # once per cell
    assert len(os.listdir("/proc/self/fd")) == before + 1
    words.forget("c2")
    assert len(os.listdir("/proc/self/fd")) == before
    assert words.keep("c2") is None and words.read("c2") is None
    words.watch("c3", tmp_path / "missing.log")  # no log: nothing held, no error
    assert words.keep("c3") is None


def test_summary_without_a_fatal_line_is_the_last_lines():
    from relocator.agent.lastwords import cause

    text = "\n".join(f"line {i}" for i in range(30))
    assert summary(text, lines=3) == "line 27\nline 28\nline 29" and cause(text) == "line 29"
    # a warning that says "error" early in the log is not why it died (CI: a killed cell)
    warned = "WARNING failed to increase the ulimit with error x\nINFO: POST 200\nINFO: POST 200\n"
    assert cause(warned) == "INFO: POST 200" and summary(warned).startswith("WARNING")
    crash = "ok\n!!!!!!! Segfault encountered !!!!!!!\n" + "ERROR Traceback\nEngineDeadError: x\n" * 20
    assert summary(crash).splitlines()[0] == "!!!!!!! Segfault encountered !!!!!!!"  # how it died first


def test_a_long_log_keeps_its_end_only(tmp_path):
    log = tmp_path / "worker.log"
    log.write_text("".join(f"{i:08d} padding padding padding\n" for i in range(10000)))
    words = LastWords(tmp_path)
    words.watch("c4", log)
    text = words.keep("c4")
    assert text is not None and len(text) <= 64 << 10 and text.endswith("00009999 padding padding padding\n")
    assert text.splitlines()[0].endswith("padding")  # no half line at the start


def test_a_lost_worker_says_why_in_its_event_and_error():
    """The controller asks the agent for a dead cell's last words and puts them in the
    worker_lost event (all of them) and the worker's error (the line that says how it died)."""
    from relocator.controller.claims import Claims
    from relocator.controller.model import WorkerRecord, WorkerState
    from relocator.controller.store import Store
    from relocator.controller.workers import WorkerManager

    class Agents:
        def cell_state(self, node, cell, timeout=30):
            return "absent"

        def last_words(self, node, cell):
            return "INFO: serving\n!!!!!!! Segfault encountered !!!!!!!\n  File libc_sigaction.c\n"

    class Backend:
        agents = Agents()
        removed: list[tuple[str, str]] = []

        def remove_image(self, node, image):
            self.removed.append((node, image))

    store = Store(":memory:")
    w = WorkerRecord(id="w1", model="m", node="n1", gpus=1, cell_id="c1", state=WorkerState.RUNNING,
                     last_image="/img/n1/r1", last_image_node="n1")
    store.save_worker(w)
    events: list[tuple] = []
    mgr = WorkerManager(store, Backend(), Claims(), lambda kind, **kw: events.append((kind, kw)),
                        router=lambda: None, place=lambda *a, **k: None, spawn=lambda *a: None)
    assert mgr._mark_if_lost(w)
    lost = store.worker("w1")
    assert lost.state == WorkerState.LOST
    assert lost.error == "cell c1 is gone; its log ends: !!!!!!! Segfault encountered !!!!!!!"
    kinds = {str(k): kw for k, kw in events}
    assert "Segfault encountered" in kinds["worker_lost"]["last_words"]
    # it crashed: the image it ran from is dropped, its next copy starts fresh
    assert lost.last_image == "" and Backend.removed == [("n1", "/img/n1/r1")]
    # killed quietly (a policy's fence, a chaos kill): the image stays for a warm restart
    Agents.last_words = lambda self, node, cell: "INFO: serving\nINFO: POST 200\n"
    w2 = WorkerRecord(id="w2", model="m", node="n1", gpus=1, cell_id="c2", state=WorkerState.RUNNING,
                      last_image="/img/n1/r2", last_image_node="n1")
    store.save_worker(w2)
    assert mgr._mark_if_lost(w2)
    assert store.worker("w2").last_image == "/img/n1/r2" and len(Backend.removed) == 1
