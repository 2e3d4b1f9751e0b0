"""Pure logic of `relocator deploy` and the emulated hosts: naming, checks across hosts,
configuration, address plans. No Ray, no root."""

from __future__ import annotations

import ipaddress

import pytest
from pydantic import ValidationError

from relocator.cluster import emulate
from relocator.cluster.config import LocalConfig
from relocator.cluster.emulated import deploy_config
from relocator.deploy import hosts
from relocator.deploy.config import DeployConfig


def _node(nid: str, host: str, ip: str) -> dict:
    return {"NodeID": nid, "NodeManagerHostname": host, "NodeManagerAddress": ip}


def _report(pool: str, routes=("10.250.0.0/24",), gpus=0, shared=None) -> dict:
    r = {"cell_pool": pool, "cell_routes": list(routes), "gpus": [{}] * gpus, "checks": []}
    if shared is not None:
        r["shared_seen"] = shared
    return r


def test_nodes_are_named_by_hostname_and_told_apart_by_node_id():
    nodes = [_node("aaaaaaaa11", "gpu-a", "10.0.0.1"), _node("bbbbbbbb22", "gpu-b", "10.0.0.2"),
             _node("cccccccc33", "gpu-b", "10.0.0.3")]
    names = hosts.name_nodes(nodes, "hostname")
    assert names["aaaaaaaa11"] == "gpu-a"
    # two raylets with one hostname (or two hosts named alike) never share a name
    assert names["bbbbbbbb22"] != names["cccccccc33"]
    assert names["bbbbbbbb22"].startswith("gpu-b-")
    assert hosts.name_nodes(nodes, "ip")["cccccccc33"] == "10.0.0.3"
    assert hosts.node_name(_node("x" * 20, "we!rd host", "1.2.3.4"), "hostname") == "we-rd-host"


def test_cross_checks_refuse_overlapping_cell_subnets_fake_gpus_and_unshared_storage():
    ok = {"h1": _report("10.252.16.0/20"), "h2": _report("10.252.32.0/20")}
    assert hosts.cross_checks(ok, {"h1": 4, "h2": 4}, fake_gpus=True, shared=False) == {"h1": [], "h2": []}
    clash = {"h1": _report("10.251.0.0/16"), "h2": _report("10.251.0.0/16")}
    got = hosts.cross_checks(clash, {}, fake_gpus=True, shared=False)
    assert any("overlaps" in f for f in got["h1"]) and any("overlaps" in f for f in got["h2"])
    fake = hosts.cross_checks(ok, {"h1": 4, "h2": 0}, fake_gpus=False, shared=False)
    assert any("declares 4 GPU" in f for f in fake["h1"]) and fake["h2"] == []
    real = {"h1": _report("10.252.16.0/20", gpus=8)}
    assert hosts.cross_checks(real, {"h1": 8}, fake_gpus=False, shared=False) == {"h1": []}
    unshared = {"h1": _report("10.252.16.0/20", shared=True), "h2": _report("10.252.32.0/20", shared=False)}
    got = hosts.cross_checks(unshared, {}, fake_gpus=True, shared=True)
    assert got["h1"] == [] and any("shared" in f for f in got["h2"])
    no_routes = {"h1": _report("10.252.16.0/20", routes=()), "h2": _report("10.252.32.0/20")}
    assert any("RELOCATOR_CELL_ROUTES" in f for f in hosts.cross_checks(no_routes, {}, fake_gpus=True,
                                                                         shared=False)["h1"])


def test_summarize_separates_failures_from_warnings():
    r = {"checks": [{"name": "criu", "ok": False, "detail": "missing", "fix": "install"},
                    {"name": "lock", "ok": False, "detail": "drift", "warning": True},
                    {"name": "root", "ok": True, "detail": "euid 0"}]}
    s = hosts.summarize(r, ["cell subnet overlaps"])
    assert not s["ok"] and s["failed"] == ["criu: missing (install)", "cell subnet overlaps"]
    assert s["warnings"] == ["lock: drift"]


def test_deploy_config_defaults_and_validation(tmp_path):
    cfg = DeployConfig()
    assert cfg.controller.transfer.value == "stream"  # hosts share nothing unless told
    assert cfg.nodes.resource == "relocator" and not cfg.nodes.fake_gpus
    f = tmp_path / "d.yaml"
    f.write_text("controller:\n  transfer: shard\n")
    with pytest.raises(ValidationError, match="transfer"):
        DeployConfig.load(f)
    f.write_text("nodes:\n  resorce: gpu\n")
    with pytest.raises(ValidationError, match="resorce"):
        DeployConfig.load(f)
    with pytest.raises(ValidationError, match="absolute"):
        DeployConfig(base_dir="relative/dir")
    f.write_text("router:\n  port: 8000\n")
    assert DeployConfig.load(f, controller={"node": "h2", "policy": None}).controller.node == "h2"


def test_emulated_cluster_deploys_with_stream_not_shared():
    cfg = deploy_config(LocalConfig())  # configs/local.yaml says shared
    assert cfg["controller"]["transfer"] == "stream" and cfg["nodes"]["fake_gpus"] is True
    DeployConfig(**cfg)  # a valid deploy configuration


def test_emulated_host_plan_gives_each_host_its_own_address_and_cell_subnet(tmp_path):
    c = emulate.plan(3, tmp_path)
    assert [h.name for h in c.hosts] == ["h1", "h2", "h3"]
    assert len({h.ip for h in c.hosts}) == 3 and c.bridge_ip not in {h.ip for h in c.hosts}
    assert all(ipaddress.ip_address(h.ip) in ipaddress.ip_network(c.subnet) for h in c.hosts)
    pools = [ipaddress.ip_network(h.cell_pool) for h in c.hosts]
    assert not any(a.overlaps(b) for i, a in enumerate(pools) for b in pools[i + 1:])
    # never the local cluster's cell pool, nor the bridge subnet
    assert not any(p.overlaps(ipaddress.ip_network("10.251.0.0/16")) for p in pools)
    assert not any(p.overlaps(ipaddress.ip_network(c.subnet)) for p in pools)
    assert c.client_address == f"ray://{c.hosts[0].ip}:10001"
    assert emulate.EmulatedCluster.from_dict(c.to_dict()).hosts == c.hosts
    with pytest.raises(emulate.EmulationError):
        emulate.plan(16, tmp_path)


def test_in_host_binds_private_state_dirs():
    h = emulate.plan(2, "/x").hosts[1]
    argv = emulate.in_host(h, ["ray", "start"])
    assert argv[:4] == ["ip", "netns", "exec", h.netns] and argv[-2:] == ["ray", "start"]
    script = argv[argv.index("-c") + 1]
    for target in ("/var/lib/relocator", "/run/relocator", "/tmp"):
        assert target in script


def test_in_host_mounts_the_private_dir_that_holds_the_host_dir_last():
    """A cluster under /var/lib/relocator (the default base dir): bound over first, the host's
    own /var/lib/relocator would hide the sources of /run/relocator and /tmp."""
    h = emulate.plan(2, "/var/lib/relocator/bench/emulated").hosts[0]
    argv = emulate.in_host(h, ["true"])
    script = argv[argv.index("-c") + 1]
    binds = [script.index(f'mount --rbind "$0/{k}" {t}') for k, t in emulate.PRIVATE.items()]
    assert binds[list(emulate.PRIVATE).index("var-lib")] == max(binds), script


def test_cli_refuses_a_bad_deploy_config_before_connecting(tmp_path):
    from typer.testing import CliRunner

    from relocator.cli import _register, app

    _register()
    f = tmp_path / "d.yaml"
    f.write_text("controller: {transfer: shard}\n")
    res = CliRunner().invoke(app, ["deploy", "--address", "ray://127.0.0.1:1", "--config", str(f)])
    assert res.exit_code == 2 and res.output.startswith("error: ") and "controller.transfer" in res.output
    res = CliRunner().invoke(app, ["up", "--emulate-hosts", "16"])
    assert res.exit_code == 2, res.output
