"""The router process under the cluster daemon: restarts without refused connections or a
lost routing table (docs/router.md, "Restarts").

The supervisor owns the public listening socket (127.0.0.1:port, backlog 1024) and passes it to
every router process it starts (`--fd`-style inheritance, RELOCATOR_ROUTER_LISTEN_FD), so while
no router accepts, new connections wait in the kernel backlog instead of being refused. The
routing table survives in a state file. A SIGTERMed router stops accepting and signals us
(SIGUSR1): we start its replacement at once and reap the old one when it has drained; a router
that died is replaced within one `poll` period (0.05 s in the daemon)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from relocator import procs

log = logging.getLogger("relocator.cluster")


def listening_socket(port: int = 0, host: str = "127.0.0.1") -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, port))
    s.listen(1024)
    s.set_inheritable(True)
    return s


class RouterSupervisor:
    """Call `start()` once, `poll()` often (from the thread that installed the SIGUSR1 handler
    or any other), `stop()` at the end. `install_signal()` must run in the main thread before
    the first router can be SIGTERMed (SIGUSR1's default action would kill us)."""

    def __init__(self, *, port: int, control_port: int, state_file: Path, log_file: IO[bytes],
                 env: dict[str, str] | None = None, cwd: str | Path | None = None,
                 extra_args: list[str] | None = None, host: str = "127.0.0.1",
                 session_nice: int | None = None) -> None:
        self.sock = listening_socket(port, host)
        self.port = self.sock.getsockname()[1]
        self.control_port = control_port
        self.state_file = Path(state_file)
        self.log_file = log_file
        self.cwd = cwd
        self.env = {**(env if env is not None else os.environ),
                    "RELOCATOR_ROUTER_CONTROL_PORT": str(control_port),
                    "RELOCATOR_ROUTER_LISTEN_FD": str(self.sock.fileno()),
                    "RELOCATOR_ROUTER_SUPERVISED": "1",
                    "RELOCATOR_ROUTER_STATE_FILE": str(self.state_file)}
        self.cmd = [sys.executable, "-m", "relocator.router", "--host", host,
                    "--port", str(self.port), *(extra_args or [])]
        self.handed_over = threading.Event()
        self.router: subprocess.Popen | None = None
        self.draining: list[subprocess.Popen] = []
        self.restarts = 0
        self.session_nice = session_nice

    def install_signal(self) -> None:
        signal.signal(signal.SIGUSR1, lambda *_: self.handed_over.set())

    def start(self) -> subprocess.Popen:
        self.router = self._spawn()
        return self.router

    def _spawn(self) -> subprocess.Popen:
        own_session = self.session_nice is not None
        p = subprocess.Popen(self.cmd, cwd=self.cwd, env=self.env, pass_fds=(self.sock.fileno(),),
                             stdin=subprocess.DEVNULL, stdout=self.log_file, stderr=subprocess.STDOUT,
                             start_new_session=own_session)
        if own_session:
            # its own autogroup, weighed before the Ray processes of this session (config.py)
            if not procs.set_group_nice([p.pid], int(self.session_nice)):
                log.info("router %d: its session's autogroup nice not set (no autogroup here, or not"
                         " permitted); it runs at the default weight", p.pid)
        return p

    def poll(self) -> bool:
        """Reap drained routers; start a replacement for one that handed over or died.
        True when a new router was started."""
        self.draining = [p for p in self.draining if p.poll() is None]
        r = self.router
        if r is None or (not self.handed_over.is_set() and r.poll() is None):
            return False
        self.handed_over.clear()
        if r.poll() is None:  # SIGTERMed: it finishes its streams, the new one accepts
            log.info("router %d hands over (draining); starting a replacement", r.pid)
            self.draining.append(r)
        else:
            log.error("router %d exited with %s; restarting it", r.pid, r.returncode)
        self.router = self._spawn()
        self.restarts += 1
        return True

    def pids(self) -> list[int]:
        """Draining routers first, the current one last."""
        return [p.pid for p in self.draining if p.poll() is None] + ([self.router.pid] if self.router else [])

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM (a supervised router starts draining), again (it goes at once), then SIGKILL."""
        live = [p for p in [*self.draining, self.router] if p is not None and p.poll() is None]
        for _ in range(2):
            for p in live:
                if p.poll() is None:
                    p.terminate()
            if live:
                time.sleep(0.3)
        deadline = time.monotonic() + grace_s
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.sock.close()
