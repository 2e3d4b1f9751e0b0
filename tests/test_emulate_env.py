"""What an emulated host's raylet inherits: its own RELOCATOR_* settings, plus the bench
settings its agents must see (a `--kv-pool-mb` bench on emulated hosts was silently ignored)."""

from __future__ import annotations

from types import SimpleNamespace

from relocator.cluster import emulate


def test_host_env_passes_the_bench_settings_and_drops_other_relocator_variables(monkeypatch) -> None:
    monkeypatch.setenv("RELOCATOR_KV_POOL_MB", "2048")
    monkeypatch.setenv("RELOCATOR_BENCH_PLAINTEXT_TRANSFERS", "1")
    monkeypatch.setenv("RELOCATOR_SOMETHING_ELSE", "x")
    host = SimpleNamespace(cell_pool="10.250.1.0/24")
    env = emulate.host_env(SimpleNamespace(subnet="10.250.0.0/16"), host)
    assert env["RELOCATOR_KV_POOL_MB"] == "2048"
    assert env["RELOCATOR_BENCH_PLAINTEXT_TRANSFERS"] == "1"
    assert "RELOCATOR_SOMETHING_ELSE" not in env
    assert env["RELOCATOR_NET_POOL"] == "10.250.1.0/24"


def test_host_env_leaves_out_bench_settings_that_are_not_set(monkeypatch) -> None:
    for name in emulate.PASSED_THROUGH:
        monkeypatch.delenv(name, raising=False)
    env = emulate.host_env(SimpleNamespace(subnet="10.250.0.0/16"), SimpleNamespace(cell_pool="p"))
    assert not set(emulate.PASSED_THROUGH) & set(env)
