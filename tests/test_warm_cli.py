"""`relocator images list|rm|prefetch` over a store in a temporary directory (fake images)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from relocator.cli import _register, app
from relocator.warm.config import WarmConfig
from relocator.warm.roots import open_store
from tests.test_warm_store import _fake_image, _key

_register()


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "images.yaml"
    path.write_text(f"store:\n  root: disk\n  disk_dir: {tmp_path / 'disk'}\n  max_gb: 1\n")
    return path


def test_list_and_rm(tmp_path: Path) -> None:
    cfg = _config(tmp_path)
    store = open_store("n1", WarmConfig.load(cfg))
    store.put(_key(), _fake_image(tmp_path / "src"))
    runner = CliRunner()
    out = runner.invoke(app, ["images", "list", "--node", "n1", "--config", str(cfg), "--json"])
    assert out.exit_code == 0, out.output
    listed = json.loads(out.stdout)
    assert [i["key"] for i in listed["images"]] == [_key()] and listed["max_bytes"] == 1 << 30
    assert runner.invoke(app, ["images", "rm", _key(), "--node", "n1", "--config", str(cfg)]).exit_code == 0
    assert store.list() == []
    again = runner.invoke(app, ["images", "rm", _key(), "--node", "n1", "--config", str(cfg)])
    assert again.exit_code == 1 and "no warm image" in again.output


def test_prefetch_refuses_a_bad_key_and_a_missing_cluster(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["images", "prefetch", "n2", "--key", "not-a-key"])
    assert out.exit_code == 2 and "not a warm image key" in out.output
    out = CliRunner().invoke(app, ["images", "prefetch", "n2", "--cluster-dir", str(tmp_path / "none")])
    assert out.exit_code != 0 and "no local cluster" in out.output
