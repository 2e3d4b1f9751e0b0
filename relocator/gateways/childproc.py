"""A gateway server run as a child process (Envoy, the LiteLLM proxy): wait until its health
URL answers 200, read its log's tail, stop it. Subclasses start the process."""

from __future__ import annotations

import subprocess
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from relocator import waits


class ChildServer:
    name = "server"
    poll_s = 0.1  # between health probes
    probe_timeout_s = 1.0
    stop_grace_s = 10.0  # SIGTERM, then SIGKILL

    proc: subprocess.Popen | None = None
    log_path: Path

    def _wait_ready(self, url: str, timeout_s: float) -> None:
        """Until `url` answers 200; the process exiting or `timeout_s` passing (then it is
        stopped) raise RuntimeError with the log's tail."""
        assert self.proc is not None
        if not waits.settle(lambda: self._answers(url), timeout_s, every=self.poll_s):
            self.stop()
            raise RuntimeError(f"{self.name} not ready after {timeout_s:g}s: {self.tail()}")

    def _answers(self, url: str) -> bool:
        """`url` answers 200 now; the process having exited raises (and so ends the wait)."""
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=self.probe_timeout_s) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(self.stop_grace_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

    def start(self, timeout_s: float) -> Any:
        raise NotImplementedError

    def __enter__(self) -> Any:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
