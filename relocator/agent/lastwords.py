"""A dead worker's last words: the end of its log, kept after its cell is gone.

A cell's worker log lives in the cell's private /run (a tmpfs that moves with the cell), so it
vanishes with the cell: a worker that crashed (a segfault, an engine that died) left nothing
to say why. The agent holds its log open while the cell runs (an open descriptor keeps the
file readable after the cell's mount is gone) and, once the cell is found dead, keeps the
tail in `<state>/lastwords/<cell>.log` for the controller's `worker_lost` event.
"""

from __future__ import annotations

import os
import re
import threading
from pathlib import Path

TAIL_BYTES = 64 << 10
#: lines that say how a worker died (the first one wins)
_FATAL = re.compile(r"Segfault|Segmentation fault|Fatal Python error|core dumped|SIGSEGV|SIGBUS|Bus error|"
                    r"out of memory|Killed", re.IGNORECASE)


def _tail(fd: int, max_bytes: int = TAIL_BYTES) -> str:
    size = os.fstat(fd).st_size
    start = max(0, size - max_bytes)
    data = os.pread(fd, size - start, start)
    text = data.decode(errors="replace")
    return text.split("\n", 1)[1] if start and "\n" in text else text  # no cut first line


def summary(text: str, lines: int = 12) -> str:
    """The lines worth reading of a log's tail (at most `lines`): from its first fatal line (a
    segfault, a kill), else its last lines (a Python traceback ends there)."""
    rows = [r for r in text.splitlines() if r.strip()]
    fatal = next((i for i, r in enumerate(rows) if _FATAL.search(r)), None)
    return "\n".join(rows[-lines:] if fatal is None else rows[fatal:fatal + lines])


def crashed(text: str) -> bool:
    """The log says the worker crashed (a fatal line), not that something killed it quietly."""
    return any(_FATAL.search(r) for r in text.splitlines())


def cause(text: str) -> str:
    """One line for a lost worker's error: the fatal line, else the log's last line."""
    rows = [r for r in text.splitlines() if r.strip()]
    return next((r for r in rows if _FATAL.search(r)), rows[-1] if rows else "")


class LastWords:
    def __init__(self, state_dir: Path) -> None:
        self.dir = Path(state_dir) / "lastwords"
        self._fds: dict[str, int] = {}
        self._guard = threading.Lock()

    def watch(self, cell_id: str, log_path: Path) -> None:
        """Hold the log of a running cell open (again after a restart of the agent: adopt)."""
        with self._guard:
            if cell_id in self._fds:
                return
            try:
                self._fds[cell_id] = os.open(log_path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                pass  # no log (yet): nothing to keep

    def keep(self, cell_id: str) -> str | None:
        """The cell is dead: write down the end of its log, let the log go; its text."""
        with self._guard:
            fd = self._fds.pop(cell_id, None)
        if fd is None:
            return self.read(cell_id)
        try:
            text = _tail(fd)
        except OSError:
            return None
        finally:
            os.close(fd)
        self.dir.mkdir(parents=True, exist_ok=True)
        tmp = self.dir / f".{cell_id}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.dir / f"{cell_id}.log")
        return text

    def forget(self, cell_id: str) -> None:
        """The cell was stopped on purpose (kill, a move's release): nothing to keep."""
        with self._guard:
            fd = self._fds.pop(cell_id, None)
        if fd is not None:
            os.close(fd)

    def read(self, cell_id: str) -> str | None:
        try:
            return (self.dir / f"{cell_id}.log").read_text()
        except OSError:
            return None
