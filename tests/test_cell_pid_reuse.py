"""A cell's record names its init by PID and start time: PIDs wrap around (pid_max 32768 on the
machines we run on, and CI wrapped), so a dead cell's PID may belong to another process later,
even another worker's thread. Such a cell is dead: never signalled, dumped or adopted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict

from relocator import procs
from relocator.cell.cell import Cell


def _cell(pid: int, **kw) -> Cell:
    return Cell(id="c-reuse", netns="rl-none", ip="10.0.0.2", port=8000, init_pid=pid, **kw)


def test_a_new_record_names_its_init_by_start_time_too():
    cell = _cell(os.getpid())
    assert cell.init_started == procs.started_at(os.getpid()) and cell.is_alive()
    again = Cell(**json.loads(json.dumps(asdict(cell))))  # as load_cell reads it back
    assert again.init_started == cell.init_started and again.is_alive()


def test_a_pid_that_another_process_started_with_is_not_the_cell():
    cell = _cell(os.getpid(), init_started=procs.started_at(os.getpid()) - 3600.0)  # its init: an hour ago
    assert not cell.is_alive()


def test_a_dead_init_is_dead_and_an_old_record_still_reads():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert not _cell(p.pid, init_started=1.0).is_alive()
    old = {k: v for k, v in asdict(_cell(os.getpid())).items() if k != "init_started"}
    assert Cell(**old).is_alive()  # a record from before the field: PID only, as before
