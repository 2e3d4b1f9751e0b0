"""The target agent's side of a post-copy: it starts the keeper for a restore
(snapshot.restore's `lazy` hook) and stops it when the cell is killed. Runs in the agent."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from relocator import procs
from relocator.agent.postcopy.base import is_ours, read_state

REPO = str(Path(__file__).resolve().parents[3])


class TargetSession:
    """What a target agent starts for one post-copy restore (snapshot.restore's `lazy` hook)."""

    def __init__(self, source: str, port: int, stall_s: float = 3.0, throttle_bps: float = 0.0,
                 ready_timeout: float = 60.0, pump_port: int = 0, pump_unix: str = "",
                 credential: dict | None = None) -> None:
        self.source, self.port, self.pump_port, self.pump_unix = source, port, pump_port, pump_unix
        self.credential = credential  # this move's (the source's make_move): the keeper's identity
        self.stall_s, self.throttle_bps, self.ready_timeout = stall_s, throttle_bps, ready_timeout
        self.proc = None

    def argv(self, image_dir: Path, cell_dir: Path, lazy: int) -> list[str]:
        # `python -S`: the keeper needs the standard library and this package only, and starts
        # in a few tens of milliseconds instead of the site's (editable installs) ~0.15 s
        return [sys.executable, "-S", "-m", "relocator.agent.postcopy", "--cell-dir", str(cell_dir),
                "--image-dir", str(image_dir), "--source", self.source, "--source-port", str(self.port),
                "--stall-s", str(self.stall_s), "--throttle-bps", str(self.throttle_bps), "--lazy-bytes", str(lazy),
                # off by default: with a 3 GB image, fetching ahead (even fault-friendly) doubled
                # the health check and the blackout on a 2-core node (docs/benchmarks.md, issue 14);
                # RELOCATOR_POSTCOPY_PREFETCH=1 turns it on
                "--prefetch", os.environ.get("RELOCATOR_POSTCOPY_PREFETCH", "0"), "--pump-port", str(self.pump_port),
                "--pump-unix", self.pump_unix,
                # pre-paging: the first MiB of the push before the tree starts (0: none)
                "--prefill-bytes", str(prefill_mb() << 20)]

    def start(self, image_dir: Path, cell_dir: Path) -> None:
        from relocator.credentials import tls_files
        from relocator.snapshot import criu
        from relocator.snapshot.images import lazy_bytes

        try:
            lazy = lazy_bytes(image_dir)
        except Exception:  # noqa: BLE001 - only a figure
            lazy = 0
        from relocator.credentials import ENV_MOVE, install_move, remove_move

        # this move's credential, on disk only until the keeper has loaded it (it does before
        # it connects, and says ready after): without one, this node's own
        tls_dir = str(install_move(self.credential)) if self.credential else ""
        try:
            tls_files(tls_dir or None)  # the certificates, or a CredentialsError naming what is missing
            env = {**os.environ, "PYTHONPATH": REPO, **({ENV_MOVE: tls_dir} if tls_dir else {})}
            self.proc = criu.CriuProcess(self.argv(image_dir, cell_dir, lazy), cell_dir / "keeper.log",
                                         "post-copy keeper", cwd=REPO, env=env)
            self.proc.start(timeout=self.ready_timeout)
        except criu.CriuError as exc:
            state = read_state(cell_dir) or {}
            raise criu.CriuError(f"post-copy could not start: {state.get('error') or exc}") from None
        finally:
            remove_move(tls_dir)

    def abort(self) -> None:
        """The restore failed: stop the keeper (and with it the daemon and the source link)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.kill(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=5)
            except Exception:  # noqa: BLE001
                self.proc.kill()


def prefill_mb() -> int:
    """RELOCATOR_POSTCOPY_PREFILL_MB (default 1024; 0: the tree starts with none of its memory)."""
    raw = os.environ.get("RELOCATOR_POSTCOPY_PREFILL_MB", "1024")
    try:
        return max(0, int(raw))
    except ValueError:
        raise ValueError(f"RELOCATOR_POSTCOPY_PREFILL_MB must be a whole number of MiB, not {raw!r}") from None


def stop_keeper(cell_dir: Path) -> None:
    """Stop a cell's keeper and daemon if they still run (the cell is being killed)."""
    st = read_state(cell_dir) or {}
    for key in ("keeper_pid", "daemon_pid"):
        pid = st.get(key)
        if pid and procs.alive(pid) and is_ours(pid, cell_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
