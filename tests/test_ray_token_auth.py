"""Ray's token authentication, live (issue 26 item 4): a head started with RAY_AUTH_MODE=token
on a free loopback port refuses a GCS client with no token and one with a wrong token, and
answers one with the right token; `relocator deploy` finds such a cluster closed and goes on,
and refuses a head without token authentication unless `--insecure`. Two small Ray heads of
this test's own (`ray start --head --block`, stopped by their pid), nothing else."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from relocator.deploy import security
from relocator.ports import free_port

pytestmark = pytest.mark.integration
RAY = str(Path(sys.executable).with_name("ray"))


def _env(home: Path, mode: str, token: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in security.RAY_AUTH_ENV and not k.startswith("RAY_ADDRESS")}
    env.update(HOME=str(home), RAY_AUTH_MODE=mode, RAY_USAGE_STATS_ENABLED="0")
    if token is not None:
        env["RAY_AUTH_TOKEN"] = token
    return env


def _probe(address: str, env: dict[str, str]) -> str:
    """The GCS probe of relocator.deploy.security, run as a client with `env`: 'open' or 'refused ...'."""
    out = subprocess.run([sys.executable, "-c", security._PROBE, address], env=env, timeout=60,
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    return out.stdout.strip() or f"no answer: {out.stderr[-300:]}"


class _Head:
    def __init__(self, tmp: Path, token: str | None) -> None:
        self.port = free_port("127.0.0.1")
        self.address = f"127.0.0.1:{self.port}"
        self.home = tmp / "home"
        self.home.mkdir(parents=True)
        self.env = _env(self.home, "token" if token else "disabled", token)
        self.log = open(tmp / "ray.log", "wb")
        self.temp = tempfile.mkdtemp(prefix="rtok-", dir="/tmp")  # short: Ray's socket paths
        self.proc = subprocess.Popen(
            [RAY, "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(self.port),
             "--num-cpus", "1", "--num-gpus", "0", "--include-dashboard", "false", "--disable-usage-stats",
             "--object-store-memory", str(80 << 20), "--temp-dir", self.temp,
             # Ray's fixed default ports would clash with the other clusters of this machine
             *[arg for opt in ("--ray-client-server-port", "--dashboard-agent-listen-port",
                               "--runtime-env-agent-port", "--metrics-export-port")
               for arg in (opt, str(free_port("127.0.0.1")))]],
            env=self.env, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
            start_new_session=True)

    def wait_up(self, probe_env: dict[str, str], timeout: float = 120.0) -> str:
        """The first probe answer that is not a connection failure of a GCS still starting."""
        deadline = time.monotonic() + timeout
        got = ""
        while time.monotonic() < deadline and self.proc.poll() is None:
            got = _probe(self.address, probe_env)
            if got == "open" or ("refused" in got and "Unavailable" not in got and "Timeout" not in got):
                return got
        return got

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # `ray start --block` stops what it started
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        self.log.close()
        shutil.rmtree(self.temp, ignore_errors=True)


def _deploy_cli(address: str, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relocator", "deploy", "--address", address, *extra],
                          env=env, timeout=180, capture_output=True, text=True, stdin=subprocess.DEVNULL)


def test_a_token_head_refuses_no_and_wrong_tokens_and_deploy_checks_it(tmp_path: Path) -> None:
    token = secrets.token_hex(16)
    head = _Head(tmp_path / "token", token)
    try:
        right = head.wait_up(_env(tmp_path, "token", token))
        assert right == "open", (right, (tmp_path / "token" / "ray.log").read_text(errors="replace")[-2000:])
        none = _probe(head.address, _env(tmp_path, "disabled", None))
        wrong = _probe(head.address, _env(tmp_path, "token", secrets.token_hex(16)))
        print(f"token head {head.address}: right -> {right}; none -> {none}; wrong -> {wrong}")
        assert none.startswith("refused"), none
        assert wrong.startswith("refused"), wrong
        # deploy's own check, from a driver with the token: the cluster is closed to others
        check = ("import ray, sys; from relocator.deploy import security as s; ray.init(address=sys.argv[1], "
                 "logging_level='error'); print(s.ray_problem(s.driver_has_token(), "
                 "s.anonymous_gcs_access(sys.argv[1]), False))")
        out = subprocess.run([sys.executable, "-c", check, head.address], env=_env(tmp_path, "token", token),
                             timeout=180, capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert out.stdout.strip().splitlines()[-1:] == ["None"], (out.stdout[-500:], out.stderr[-1500:])
    finally:
        head.stop()


def test_deploy_refuses_a_head_without_token_authentication(tmp_path: Path) -> None:
    head = _Head(tmp_path / "open", None)
    try:
        assert head.wait_up(_env(tmp_path, "disabled", None)) == "open"  # anyone gets in
        res = _deploy_cli(head.address, _env(tmp_path, "disabled", None))
        assert res.returncode == 1, (res.stdout[-500:], res.stderr[-1500:])
        assert "accepts clients without a token" in res.stdout + res.stderr
        assert "--insecure" in res.stdout + res.stderr
    finally:
        head.stop()
