"""What every post-copy process shares: the page-server wire format, the state files, the
connection to the source, and the few process facts the keeper and pump need.

This is the **stdlib-only corner** of the tree. The keeper (relocator.agent.postcopy.keeper)
and the pump (relocator.agent.pump) run under `python -S`: every page fault of a restored
worker waits on them, and without the site (editable installs, ~0.15 s) they start in a few
tens of milliseconds. So neither may import psutil or tenacity, nor anything that does: this
module and the keeper's modules read /proc themselves (`alive`, `is_ours`) and keep their own
small deadline loops, instead of relocator.procs and relocator.waits used everywhere else.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
import struct
import time
from pathlib import Path
from typing import Any

STATE_FILE = "postcopy.json"
PAGE_SIZE = 4096
# struct page_server_iov {u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id} (natural alignment)
PSI = struct.Struct("<I4xQQQ")
PS_IOV_GET, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 7, 0x1023, 0x1024
PS_CMD_MASK = (1 << 16) - 1
# the push channel's frame header (relocator.agent.pump): pagemap id, vaddr, bytes
FRAME = struct.Struct("<QQI")
PRIORITY = -10  # nice value of the processes a post-copy's page faults wait on


class PostCopyFailed(RuntimeError):
    """The post-copy did not complete; `why` is one of: target (its tree died), source (the
    page server went away), stall (no answer: network cut), daemon (lazy-pages failed)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


# -- state file -------------------------------------------------------------------------------
def write_state(cell_dir: Path, state_file: str = STATE_FILE, **fields: Any) -> dict:
    """Merge `fields` into a cell's state file (the keeper's; the pump's is pump.json)."""
    path = Path(cell_dir) / state_file
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    state.update(fields, updated=time.time())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return state


def read_state(cell_dir: Path, state_file: str = STATE_FILE) -> dict | None:
    try:
        return json.loads((Path(cell_dir) / state_file).read_text())
    except (OSError, ValueError):
        return None


# -- processes, stdlib only (see the module's docstring) ----------------------------------------
def alive(pid: int | None) -> bool:
    """`pid` exists and is not a zombie (relocator.procs.alive, without psutil)."""
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def is_ours(pid: int, cell_dir: Path, marker: str = "") -> bool:
    """`pid` still runs a keeper, daemon (or, with `marker` in its arguments, a pump) of this
    cell (not a reused pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(cell_dir) in argv and marker in argv


def raise_priority(pid: int, nice: int = PRIORITY) -> None:
    try:
        os.setpriority(os.PRIO_PROCESS, pid, nice)
    except OSError:  # not root: as is
        pass


def lazy_ranges(image_dir: Path) -> list[tuple[int, int, int]]:
    """(pagemap id, vaddr, pages) of every run of pages the image left in the source. The id
    is what the page server knows the process by (the daemon asks with the same)."""
    from relocator.snapshot import images

    out = []
    for p in sorted(Path(image_dir).glob("pagemap-*.img")):
        try:
            pid = int(p.stem.split("-", 1)[1])
            runs = images.lazy_runs(p)
        except (ValueError, images.ImageFormatError):
            continue
        out += [(pid, vaddr, n) for vaddr, n in runs]
    return out


# -- the connection to the source -----------------------------------------------------------------
def connect(host: str, port: int, timeout: float, tls: ssl.SSLContext | None, rcvbuf: int = 0) -> socket.socket:
    """A connection to the source (its page server or pump): TLS, the source's certificate
    checked against the cluster's CA and this node's presented, unless `tls` is None."""
    sock = socket.create_connection((host, port), timeout=timeout)
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if tls is None:
        return sock
    try:
        return tls.wrap_socket(sock)
    except BaseException:
        sock.close()
        raise


def recv_some(sock: socket.socket, buf: bytearray) -> int | None:
    """What `sock` has now, without blocking (select said it is readable): a TLS socket may have
    only part of a record, or a record with no data of the peer in it (TLS 1.3 session tickets):
    None then, where a blocking read would wait for the next answer."""
    if not isinstance(sock, ssl.SSLSocket):
        return sock.recv_into(buf)
    timeout = sock.gettimeout()
    sock.setblocking(False)
    try:
        return sock.recv_into(buf)
    except ssl.SSLWantReadError:
        return None
    finally:
        sock.settimeout(timeout)


def pending(sock: socket.socket) -> bool:
    """TLS bytes decrypted already: select cannot see them."""
    return isinstance(sock, ssl.SSLSocket) and sock.pending() > 0
