"""Post-copy: the worker runs on the target before its memory has arrived.

Source: `criu dump --lazy-pages` writes every image but the worker's anonymous memory, then
keeps the tree frozen and serves that memory from a page server (`LazySource`). Target:
`criu restore --lazy-pages` starts the tree at once with that memory registered with
userfaultfd; the `criu lazy-pages` daemon fills it from the source, a faulting page first and
everything else in the background (`Keeper`).

The daemon does not talk to the source directly but through the **keeper**, a small process of
its own (it outlives the agent that started it) that relays the page-server protocol, counts
what arrives, and owns the one dangerous moment of post-copy: when the source stops answering,
the daemon would give up and the kernel would hand the worker zero-filled pages instead of its
memory. The keeper kills the target's tree first (SIGKILL to its PID-namespace init) and only
then lets the daemon go, so a worker whose memory cannot arrive never runs on without it. The
same holds for a stall: requests outstanding and nothing from the source for `stall_s` (a
network cut). The controller then rolls back (source alive) or replaces the worker (source
lost), see docs/snapshots.md "Post-copy".

The keeper records its progress in `<cell dir>/postcopy.json` (state: starting, ready,
running, done, failed; pages bytes; why it failed), which the agent reads.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STATE_FILE = "postcopy.json"
PAGE_SIZE = 4096
# struct page_server_iov {u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id} (natural alignment)
PSI = struct.Struct("<I4xQQQ")
PS_IOV_GET, PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE = 7, 0x1023, 0x1024
PS_CMD_MASK = (1 << 16) - 1


class PostCopyFailed(RuntimeError):
    """The post-copy did not complete; `why` is one of: target (its tree died), source (the
    page server went away), stall (no answer: network cut), daemon (lazy-pages failed)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


# -- state file -------------------------------------------------------------------------------
def write_state(cell_dir: Path, **fields: Any) -> dict:
    path = Path(cell_dir) / STATE_FILE
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    state.update(fields, updated=time.time())
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)
    return state


def read_state(cell_dir: Path) -> dict | None:
    try:
        return json.loads((Path(cell_dir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


# -- the protocol, as far as the relay needs it -------------------------------------------------
class _Requests:
    """Parses the daemon's requests (fixed-size headers) into a queue of what the source owes."""

    def __init__(self) -> None:
        self.buf = b""
        self.queue: list[tuple[int, int]] = []  # (cmd, nr_pages) in order
        self.count = 0

    def feed(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= PSI.size:
            cmd, nr, _vaddr, _dst = PSI.unpack_from(self.buf)
            self.buf = self.buf[PSI.size:]
            self.queue.append((cmd & PS_CMD_MASK, nr))
            self.count += 1


class _Answers:
    """Follows the source's answers: a header and its pages for each GET, a status for CLOSE.
    Knows whether anything is still owed (a stall only counts then) and the page bytes."""

    def __init__(self, requests: _Requests) -> None:
        self.req = requests
        self.need = 0  # bytes still expected for the current piece
        self.piece: str | None = None  # "head" | "pages" | "status"
        self.head = b""
        self.page_bytes = 0
        self.closed = False  # the CLOSE was answered: the transfer completed

    def owed(self) -> bool:
        return self.piece is not None or bool(self.req.queue)

    def _next(self) -> bool:
        if not self.req.queue:
            return False
        cmd, _ = self.req.queue.pop(0)
        if cmd in (PS_IOV_CLOSE, PS_IOV_FORCE_CLOSE):
            self.piece, self.need = "status", 4
        else:
            self.piece, self.need, self.head = "head", PSI.size, b""
        return True

    def feed(self, data: memoryview) -> None:
        pos = 0
        while pos < len(data):
            if self.piece is None and not self._next():
                return  # unsolicited bytes: passed on, not counted
            take = min(self.need, len(data) - pos)
            if self.piece == "head":
                self.head += bytes(data[pos:pos + take])
            elif self.piece == "pages":
                self.page_bytes += take
            pos += take
            self.need -= take
            if self.need:
                continue
            if self.piece == "head":
                _cmd, nr, _v, _d = PSI.unpack(self.head)
                self.piece, self.need = ("pages", nr * PAGE_SIZE) if nr else (None, 0)
            else:
                if self.piece == "status":
                    self.closed = True
                self.piece = None


# -- the keeper process ---------------------------------------------------------------------------
class Keeper:
    def __init__(self, args: argparse.Namespace) -> None:
        self.a = args
        self.cell_dir = Path(args.cell_dir)
        self.daemon: subprocess.Popen | None = None
        self.t0 = time.monotonic()
        self.last_flush = 0.0

    def state(self, **fields: Any) -> None:
        write_state(self.cell_dir, **fields)

    def kill_tree(self) -> int | None:
        """SIGKILL the restored tree (its init: the whole PID namespace goes) and wait for it."""
        try:
            pid = int((self.cell_dir / "init.pid").read_text().strip())
        except (OSError, ValueError):
            return None  # not restored yet: the daemon's failure makes the restore fail instead
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return pid
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.005)
        return pid

    def stop_daemon(self) -> int | None:
        if self.daemon is None:
            return None
        if self.daemon.poll() is None:
            self.daemon.kill()
        return self.daemon.wait()

    def run(self) -> int:
        a = self.a
        self.state(state="starting", keeper_pid=os.getpid(), upstream=f"{a.source}:{a.source_port}",
                   page_bytes=0, lazy_bytes=a.lazy_bytes, started_at=time.time())
        lst = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        lst.bind(("127.0.0.1", 0))
        lst.listen(1)
        port = lst.getsockname()[1]
        try:
            up = socket.create_connection((a.source, a.source_port), timeout=a.connect_timeout)
        except OSError as exc:
            self.state(state="failed", why="source", error=f"cannot reach the source's page server: {exc}")
            return 3
        up.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        from relocator.snapshot import criu

        try:
            d = criu.lazy_pages(Path(a.image_dir), self.cell_dir, "127.0.0.1", port)
        except criu.CriuError as exc:
            up.close()
            self.state(state="failed", why="daemon", error=str(exc)[:2000])
            return 4
        self.daemon = d.proc
        self.state(state="ready", daemon_pid=d.pid, port=port)
        if a.status_fd >= 0:
            os.write(a.status_fd, b"\0")
            os.close(a.status_fd)
        try:
            return self.relay(lst, up)
        finally:
            lst.close()

    def _accept(self, lst: socket.socket) -> socket.socket | None:
        # the daemon connects once `criu restore` has handed it the userfaultfds
        while True:
            r, _, _ = select.select([lst], [], [], 0.2)
            if r:
                down, _ = lst.accept()
                down.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return down
            if self.daemon is not None and self.daemon.poll() is not None:
                return None

    def relay(self, lst: socket.socket, up: socket.socket) -> int:
        a = self.a
        down = self._accept(lst)
        if down is None:
            rc = self.stop_daemon()
            up.close()
            self.state(state="failed", why="daemon", error=f"lazy-pages exited ({rc}) before it connected")
            return 5
        reqs = _Requests()
        ans = _Answers(reqs)
        buf = bytearray(1 << 20)
        view = memoryview(buf)
        last_up = time.monotonic()
        self.state(state="running", connected_at=time.time())
        why = error = None
        throttle_until = 0.0
        while True:
            now = time.monotonic()
            wait = 0.2
            socks = [down]
            if now >= throttle_until:
                socks.append(up)
            else:
                wait = min(wait, throttle_until - now)
            r, _, _ = select.select(socks, [], [], wait)
            now = time.monotonic()
            if down in r:
                try:
                    data = down.recv(65536)
                except OSError:
                    data = b""
                if not data:
                    break  # the daemon is done (or died): see below
                reqs.feed(data)
                if not ans.owed():
                    last_up = now
                try:
                    up.sendall(data)
                except OSError as exc:
                    why, error = "source", f"the source's page server went away: {exc}"
                    break
            if up in r:
                try:
                    n = up.recv_into(buf)
                except OSError as exc:
                    n, error = 0, str(exc)
                if not n:
                    why, error = "source", f"the source's page server closed the connection {error or ''}".strip()
                    break
                last_up = now
                ans.feed(view[:n])
                try:
                    down.sendall(view[:n])
                except OSError:
                    break  # the daemon died: see below
                if a.throttle_bps:
                    throttle_until = max(now, throttle_until) + n / a.throttle_bps
            if ans.owed() and now - last_up > a.stall_s:
                why, error = "stall", f"no answer from the source's page server for {a.stall_s:g}s (network cut?)"
                break
            if now - self.last_flush > 0.2:
                self.last_flush = now
                self.state(page_bytes=ans.page_bytes, requests=reqs.count)
        if why is not None:
            # the memory cannot arrive: the tree must never run on without it
            killed = self.kill_tree()
            self.stop_daemon()
            down.close()
            up.close()
            self.state(state="failed", why=why, error=error, killed_pid=killed, page_bytes=ans.page_bytes,
                       requests=reqs.count, seconds=round(time.monotonic() - self.t0, 3), ended_at=time.time())
            return 6
        # the daemon closed its side: after a CLOSE the source answered, every page arrived
        up.close()
        down.close()
        try:
            rc = self.daemon.wait(timeout=30) if self.daemon else None
        except subprocess.TimeoutExpired:
            rc = self.stop_daemon()
        tree_alive = True
        try:
            tree_alive = _alive(int((self.cell_dir / "init.pid").read_text().strip()))
        except (OSError, ValueError):
            tree_alive = False
        fields = dict(page_bytes=ans.page_bytes, requests=reqs.count, daemon_rc=rc,
                      seconds=round(time.monotonic() - self.t0, 3), ended_at=time.time())
        if rc == 0 and ans.closed and tree_alive:
            self.state(state="done", **fields)
            return 0
        if not tree_alive:
            self.state(state="failed", why="target", error="the restored tree died during post-copy", **fields)
            return 7
        killed = self.kill_tree()  # the daemon failed: its userfaultfds are gone with it
        self.state(state="failed", why="daemon", error=f"lazy-pages ended (exit {rc}) before every page arrived",
                   killed_pid=killed, **fields)
        return 8


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m relocator.agent.postcopy")
    p.add_argument("--cell-dir", required=True)
    p.add_argument("--image-dir", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--source-port", type=int, required=True)
    p.add_argument("--stall-s", type=float, default=3.0)
    p.add_argument("--throttle-bps", type=float, default=0.0)
    p.add_argument("--lazy-bytes", type=int, default=0)
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--status-fd", type=int, default=-1)
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return Keeper(args).run()
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - recorded for the agent
        write_state(Path(args.cell_dir), state="failed", why="keeper", error=f"{type(exc).__name__}: {exc}")
        raise


# -- the agent's side ------------------------------------------------------------------------------
class TargetSession:
    """What a target agent starts for one post-copy restore (snapshot.restore's `lazy` hook)."""

    def __init__(self, source: str, port: int, stall_s: float = 3.0, throttle_bps: float = 0.0,
                 ready_timeout: float = 60.0) -> None:
        self.source, self.port = source, port
        self.stall_s, self.throttle_bps, self.ready_timeout = stall_s, throttle_bps, ready_timeout
        self.proc = None

    def start(self, image_dir: Path, cell_dir: Path) -> None:
        from relocator.snapshot import criu
        from relocator.snapshot.images import lazy_bytes

        try:
            lazy = lazy_bytes(image_dir)
        except Exception:  # noqa: BLE001 - only a figure
            lazy = 0
        repo = str(Path(__file__).resolve().parents[2])
        # `python -S`: the keeper needs the standard library and this package only, and starts
        # in a few tens of milliseconds instead of the site's (editable installs) ~0.15 s
        argv = [sys.executable, "-S", "-m", "relocator.agent.postcopy", "--cell-dir", str(cell_dir),
                "--image-dir", str(image_dir), "--source", self.source, "--source-port", str(self.port),
                "--stall-s", str(self.stall_s), "--throttle-bps", str(self.throttle_bps), "--lazy-bytes", str(lazy)]
        env = {**os.environ, "PYTHONPATH": repo}
        try:
            self.proc = criu.CriuProcess(argv, cell_dir / "keeper.log", "post-copy keeper", cwd=repo, env=env)
            self.proc.start(timeout=self.ready_timeout)
        except criu.CriuError as exc:
            state = read_state(cell_dir) or {}
            raise criu.CriuError(f"post-copy could not start: {state.get('error') or exc}") from None

    def abort(self) -> None:
        """The restore failed: stop the keeper (and with it the daemon and the source link)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                self.proc.kill()


def stop_keeper(cell_dir: Path) -> None:
    """Stop a cell's keeper and daemon if they still run (the cell is being killed)."""
    st = read_state(cell_dir) or {}
    for key in ("keeper_pid", "daemon_pid"):
        pid = st.get(key)
        if pid and _alive(pid) and _is_ours(pid, cell_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _is_ours(pid: int, cell_dir: Path) -> bool:
    """`pid` still runs a keeper or daemon of this cell (not a reused pid)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return str(cell_dir) in argv


# -- the source's side ------------------------------------------------------------------------------
class LazySource:
    """The lazy dump of one cell on its source node, recorded in `<cell dir>/lazy_dump.json`
    (pid, port) so that a restarted agent finds it again."""

    FILE = "lazy_dump.json"

    def __init__(self, cell_dir: Path) -> None:
        self.cell_dir = Path(cell_dir)

    def record(self, pid: int, address: str, port: int, image_dir: str) -> None:
        (self.cell_dir / self.FILE).write_text(json.dumps(
            {"pid": pid, "address": address, "port": port, "image_dir": image_dir, "started_at": time.time()}))

    def info(self) -> dict | None:
        try:
            return json.loads((self.cell_dir / self.FILE).read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        info = self.info()
        return bool(info) and _alive(info["pid"]) and _is_dump(info["pid"], info.get("image_dir", ""))

    def wait(self, timeout: float, proc=None) -> dict:
        """Until the lazy dump has exited (every page served, or the transfer broke)."""
        info = self.info() or {}
        deadline = time.monotonic() + timeout
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return {"done": False}
        else:  # not our child (the agent restarted): watch the pid
            while self.running():
                if time.monotonic() > deadline:
                    return {"done": False}
                time.sleep(0.05)
        return {"done": True, "rc": rc, "pid": info.get("pid")}

    def abort(self, proc=None) -> str:
        """End the lazy dump so that its tree can be resumed: a dump not yet connected is
        connected to and left (it then ends as if done, the tree stopped); a connected one gets
        its socket destroyed (`ss -K`: CRIU sees the transfer fail and lets the tree run);
        SIGKILL if neither ends it."""
        info = self.info()
        if not info or not self.running():
            self.clear()
            return "not running"
        pid, port, address = info["pid"], info["port"], info["address"]
        how = "connected and closed"
        try:
            socket.create_connection((address, port), timeout=0.5).close()
        except OSError:
            how = "socket destroyed"
            subprocess.run(["ss", "-K", "-t", "state", "established", f"( sport = :{port} )"],
                           capture_output=True)
        deadline = time.monotonic() + 5
        while self.running() and time.monotonic() < deadline:
            if how == "connected and closed" and time.monotonic() > deadline - 4:
                how = "socket destroyed"
                subprocess.run(["ss", "-K", "-t", "state", "established", f"( sport = :{port} )"],
                               capture_output=True)
            time.sleep(0.02)
        if self.running():
            how = "killed"
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            while _alive(pid) and time.monotonic() < deadline + 5:
                time.sleep(0.02)
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                pass
        self.clear()
        return how

    def clear(self) -> None:
        (self.cell_dir / self.FILE).unlink(missing_ok=True)


def _is_dump(pid: int, image_dir: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return bool(argv) and argv[0].endswith(b"criu") and b"--lazy-pages" in argv and (
        not image_dir or image_dir.encode() in argv)


if __name__ == "__main__":
    sys.exit(main())
