"""At agent start: remove what moves that crashed left in this agent's state directory.

A move killed midway (its agent, CRIU or the host went down) can leave behind the unix sockets
it listened on (`links/<16 hex>.sock`: the stream's same-host route and the pump's, made by
relocator.agent.locallink; `cells/<cell>/lazy-pages.socket`: CRIU's lazy-pages daemon, made in
the cell's directory by -W) and a move's credentials (`move-credentials/<16 hex>/`, made by
relocator.credentials.install_move). Only those names are touched, and only when older than
`min_age_s` and, for a socket, when nothing listens on it any more (/proc/net/unix): a move in
progress, of this agent or of a pump that outlived it, keeps its socket. Nothing is followed:
a symbolic link, anywhere on the way, is left alone (never a path outside these directories).
"""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

from relocator.credentials import MOVE_NAME, remove_move

LINK_NAME = re.compile(r"^[0-9a-f]{16}\.sock$")  # relocator.agent.locallink.new_path
LAZY_SOCKET = "lazy-pages.socket"  # criu lazy-pages -W <cell dir>
MIN_AGE_S = 600.0  # longer than any move's listening window (the front waits 300 s at most)


def listening_paths() -> set[str]:
    """Unix sockets something listens on now (relocator.procs reads /proc/net/unix)."""
    from relocator.procs import listening_unix_paths

    return listening_unix_paths()


def _real_dir(path: Path) -> bool:
    """`path` is a directory itself, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _old(st: os.stat_result, now: float, min_age_s: float) -> bool:
    return now - st.st_mtime >= min_age_s


def _stale_socket(path: Path, now: float, min_age_s: float, live: set[str]) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISSOCK(st.st_mode) and _old(st, now, min_age_s) and str(path) not in live


def stale(state_dir: Path, now: float | None = None, min_age_s: float = MIN_AGE_S,
          live: set[str] | None = None) -> list[Path]:
    """What `sweep` would remove under `state_dir`."""
    now = time.time() if now is None else now
    live = listening_paths() if live is None else live
    base = Path(state_dir)
    if not _real_dir(base):
        return []
    out: list[Path] = []
    links = base / "links"
    if _real_dir(links):
        out += [links / e.name for e in os.scandir(links)
                if LINK_NAME.match(e.name) and _stale_socket(links / e.name, now, min_age_s, live)]
    cells = base / "cells"
    if _real_dir(cells):
        for e in os.scandir(cells):
            sock = cells / e.name / LAZY_SOCKET
            if e.is_dir(follow_symlinks=False) and _stale_socket(sock, now, min_age_s, live):
                out.append(sock)
    moves = base / "move-credentials"
    if _real_dir(moves):
        for e in os.scandir(moves):
            d = moves / e.name
            if MOVE_NAME.match(e.name) and _real_dir(d) and _old(os.lstat(d), now, min_age_s):
                out.append(d)
    return sorted(out)


def sweep(state_dir: Path, now: float | None = None, min_age_s: float = MIN_AGE_S,
          live: set[str] | None = None) -> list[str]:
    """Remove the stale sockets and move credentials under `state_dir`; what was removed."""
    removed = []
    for path in stale(state_dir, now, min_age_s, live):
        try:
            if _real_dir(path):
                remove_move(path)
                if path.exists():
                    continue
            else:
                path.unlink()
        except OSError:
            continue
        removed.append(str(path))
    return removed
