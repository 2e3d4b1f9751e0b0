"""A worker run as a plain local process on loopback (no cell): for tests, baselines and demos."""

from __future__ import annotations

import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from adapters.base import EngineAdapter, LaunchSpec
from relocator import waits
from relocator.paths import tail
from relocator.ports import free_port


@dataclass
class LocalWorker:
    adapter: EngineAdapter
    spec: LaunchSpec
    proc: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"

    @property
    def model(self) -> str:
        return self.spec.served_model_name

    def log_tail(self, lines: int = 30) -> str:
        return tail(self.log_path, lines)

    async def wait_ready(self, timeout: float = 240.0) -> float:
        """Wait until the server serves; returns seconds since launch."""
        async def serving() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"worker exited with {self.proc.returncode}:\n{self.log_tail()}")
            return await self.adapter.is_ready(self.base_url)

        try:
            await waits.until_async(serving, timeout, every=0.5, what="the local worker")
        except waits.WaitTimeout:
            raise TimeoutError(f"worker not ready after {timeout:.0f}s:\n{self.log_tail()}") from None
        return time.monotonic() - self.started_at

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def start_local_worker(adapter: EngineAdapter, spec: LaunchSpec, log_dir: Path | None = None) -> LocalWorker:
    spec.host = "127.0.0.1"
    if not spec.port:
        spec.port = free_port()
    if spec.cache_dir is None:
        from relocator.tinymodel import cache_root

        spec.cache_dir = str(cache_root())
    argv, env = adapter.command(spec)
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="relocator-worker-"))
    log_path = log_dir / f"{spec.served_model_name}-{spec.port}.log"
    log = open(log_path, "wb")
    repo = Path(__file__).resolve().parent.parent
    full_env = {**os.environ, **env, "PYTHONPATH": f"{repo}:{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen(
        argv, env=full_env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True, cwd=repo,
    )
    log.close()
    return LocalWorker(adapter=adapter, spec=spec, proc=proc, log_path=log_path)
