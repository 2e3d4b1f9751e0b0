"""What `relocator deploy` refuses unless told `--insecure` (issue 26 items 3, 4): a router
beyond loopback with no API key, a Ray cluster without token authentication. No Ray."""

from __future__ import annotations

import pytest

from relocator.cluster.config import LocalConfig
from relocator.cluster.emulated import deploy_config
from relocator.deploy import security
from relocator.deploy.config import DeployConfig
from relocator.router import auth


@pytest.fixture(autouse=True)
def _no_env_key(monkeypatch):
    monkeypatch.delenv(auth.ENV_KEY, raising=False)


def test_router_problem():
    assert security.router_problem("10.0.0.5", [], insecure=False)
    assert security.router_problem("0.0.0.0", [], insecure=False)
    assert security.router_problem("10.0.0.5", ["k"], insecure=False) is None
    assert security.router_problem("10.0.0.5", [], insecure=True) is None
    assert security.router_problem("127.0.0.1", [], insecure=False) is None


def test_router_keys_from_config_file_and_env(tmp_path, monkeypatch):
    f = tmp_path / "keys"
    f.write_text("kf\n\n# note\nka\n")
    monkeypatch.setenv(auth.ENV_KEY, "ke")
    assert security.router_keys(["ka"], str(f)) == ["ka", "ke", "kf"]


def test_ray_problem():
    # a driver with no token got in: the cluster is open
    assert "RAY_AUTH_MODE=token" in security.ray_problem(False, None, insecure=False)
    # a driver with a token, and a client without one was answered too
    assert security.ray_problem(True, True, insecure=False)
    assert security.ray_problem(True, False, insecure=False) is None
    assert security.ray_problem(False, None, insecure=True) is None
    assert security.ray_problem(True, True, insecure=True) is None


def test_key_file_is_private(tmp_path):
    p = security.write_key_file(tmp_path / "k", ["a", "b"])
    assert p.read_text() == "a\nb\n" and p.stat().st_mode & 0o777 == 0o600
    assert auth.read_key_file(p) == ["a", "b"]


def test_emulated_hosts_deploy_insecure():
    """`up --emulate-hosts`: Ray there has no tokens; its deploy says so instead of failing."""
    assert DeployConfig(**deploy_config(LocalConfig())).insecure


def _invoke(args, monkeypatch):
    from typer.testing import CliRunner

    from relocator.cli import _register, app
    import importlib

    dmod = importlib.import_module("relocator.deploy.deploy")

    def no_ray(address):
        raise RuntimeError("reached init_ray")

    monkeypatch.setattr(dmod, "init_ray", no_ray)
    _register()
    return CliRunner().invoke(app, ["deploy", "--address", "ray://127.0.0.1:1", *args])


def test_cli_refuses_a_router_beyond_loopback_without_a_key(tmp_path, monkeypatch):
    f = tmp_path / "d.yaml"
    f.write_text("router: {host: 0.0.0.0}\n")
    res = _invoke(["--config", str(f)], monkeypatch)
    assert res.exit_code == 1, res.output
    assert res.output.startswith("error: the router would listen on 0.0.0.0 with no API key")
    assert "--api-key" in res.output and "reached init_ray" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output  # one line, not wrapped
    # given a key, or told --insecure, it goes on (to connecting, here refused by the stub)
    for extra in (["--api-key", "sk-1"], ["--insecure"]):
        res = _invoke(["--config", str(f), *extra], monkeypatch)
        assert "reached init_ray" in res.output, res.output
