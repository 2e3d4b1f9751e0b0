"""The source agent's side of a post-copy: the lazy dump of a cell (`criu dump --lazy-pages`,
its page server and the pump), found again after an agent restart, waited for and ended.
Runs in the agent."""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
import time
from pathlib import Path

from relocator import procs, waits
from relocator.agent.postcopy.base import connect


class LazySource:
    """The lazy dump of one cell on its source node, recorded in `<cell dir>/lazy_dump.json`
    (pid, port) so that a restarted agent finds it again."""

    FILE = "lazy_dump.json"

    def __init__(self, cell_dir: Path) -> None:
        self.cell_dir = Path(cell_dir)

    def record(self, pid: int, address: str, port: int, image_dir: str, front_pid: int = 0) -> None:
        """`front_pid`: the TLS front that holds the port and the dump's socket (relocator.agent.front)."""
        (self.cell_dir / self.FILE).write_text(json.dumps(
            {"pid": pid, "address": address, "port": port, "image_dir": image_dir, "started_at": time.time(),
             "front_pid": front_pid}))

    def info(self) -> dict | None:
        try:
            return json.loads((self.cell_dir / self.FILE).read_text())
        except (OSError, ValueError):
            return None

    def running(self) -> bool:
        info = self.info()
        return bool(info) and procs.alive(info["pid"]) and is_dump(info["pid"], info.get("image_dir", ""))

    def wait(self, timeout: float, proc=None) -> dict:
        """Until the lazy dump has exited (every page served, or the transfer broke)."""
        info = self.info() or {}
        rc = None
        if proc is not None:
            try:
                rc = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                return {"done": False}
        elif not waits.gone(self.running, timeout, every=0.05):  # not our child (the agent restarted)
            return {"done": False}
        return {"done": True, "rc": rc, "pid": info.get("pid")}

    def abort(self, proc=None) -> str:
        """End the lazy dump so that its tree can be resumed: a dump not yet connected is
        connected to (TLS, as a keeper) and left (it then ends as if done, the tree stopped); a
        connected one gets its socket destroyed (`ss -K`: CRIU sees the transfer fail and lets
        the tree run); SIGKILL if neither ends it."""
        info = self.info()
        if not info or not self.running():
            self.clear()
            return "not running"
        how = self._end_front(info) or self._end(info["pid"], info["address"], info["port"])
        if proc is not None:
            try:
                proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                pass
        self.clear()
        return how

    def _end_front(self, info: dict) -> str:
        """A dump behind a TLS front: ending the front closes the dump's socket (EOF: a dump
        not yet connected ends as after a session, a connected one as after a cut); "" when
        there is no front or that did not end the dump in 5 s."""
        fpid = int(info.get("front_pid") or 0)
        if not fpid or not procs.alive(fpid) or "relocator.agent.front" not in " ".join(procs.cmdline(fpid)):
            return ""
        try:
            os.kill(fpid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return "front closed" if waits.gone(self.running, 5, every=0.02) else ""

    def _end(self, pid: int, address: str, port: int) -> str:
        """Knock, then destroy the socket after a second, then SIGKILL after 5 s: how it ended."""
        try:
            knock(address, port)
        except (OSError, RuntimeError):
            _destroy_sockets(port)
            if waits.gone(self.running, 5, every=0.02):
                return "socket destroyed"
        else:
            if waits.gone(self.running, 1, every=0.02):
                return "connected and closed"
            _destroy_sockets(port)  # the knock did not end it: as for a connected dump
            if waits.gone(self.running, 4, every=0.02):
                return "socket destroyed"
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        waits.gone(lambda: procs.alive(pid), 5, every=0.02)
        return "killed"

    def clear(self) -> None:
        from relocator.agent import pump

        pump.stop(self.cell_dir)  # it ends by itself with the dump; this makes sure
        (self.cell_dir / self.FILE).unlink(missing_ok=True)


def _destroy_sockets(port: int) -> None:
    """`ss -K`: the kernel ends the page server's connections (CRIU sees the transfer fail)."""
    subprocess.run(["ss", "-K", "-t", "state", "established", f"( sport = :{port} )"], capture_output=True)


def knock(address: str, port: int) -> None:
    """Connect to a lazy dump's page server as a keeper would (TLS, this node's certificate: a
    refused handshake would fail the dump and let its tree run) and leave at once, cleanly: it
    then ends as after a session, the tree stopped."""
    from relocator.credentials import client_context

    sock = connect(address, port, 2.0, client_context())
    try:
        if isinstance(sock, ssl.SSLSocket):
            sock.settimeout(0.3)
            try:  # take in the server's records after the handshake (TLS 1.3 session tickets):
                sock.recv(1)  # a socket closed with them unread resets the connection
            except OSError:
                pass
            try:
                sock = sock.unwrap()  # close_notify: CRIU reads the end of the session
            except OSError:
                pass
    finally:
        sock.close()


def is_dump(pid: int, image_dir: str) -> bool:
    """`pid` is a lazy dump (of `image_dir`, when given): not a reused pid."""
    argv = procs.cmdline(pid)
    return bool(argv) and argv[0].endswith("criu") and "--lazy-pages" in argv and (
        not image_dir or image_dir in argv)

