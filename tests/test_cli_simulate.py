"""`relocator simulate` and `relocator bench sim` on synthetic traces."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from relocator.cli import _register, app

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sim import POD_HDR, synth, write  # noqa: E402

runner = CliRunner()
_register()


def test_simulate_json(tmp_path):
    d = synth(tmp_path)
    res = runner.invoke(app, ["simulate", "--trace", str(d), "--pods", str(d / "openb_pod_list_default.csv"),
                              "--policy", "best-fit,fgd", "--relocate", "--seeds", "42..43", "--json",
                              "--plot", str(tmp_path / "a.png")])
    assert res.exit_code == 0, res.output
    start = res.stdout.index("{")
    data = json.loads(res.stdout[start:])
    assert len(data["results"]) == 4
    keys = {"policy", "relocate", "unalloc_gpus_at_100", "unalloc_gpus_at_130", "alloc_pct_at_100",
            "alloc_pct_at_130", "moves", "moved_gpus"}
    for r in data["results"]:
        assert keys <= set(r)
    assert {(r["policy"], r["relocate"]) for r in data["results"]} == {("best-fit", False), ("best-fit", True), ("fgd", False), ("fgd", True)}
    assert (tmp_path / "a.png").stat().st_size > 1000


def test_simulate_table(tmp_path):
    d = synth(tmp_path)
    res = runner.invoke(app, ["simulate", "--trace", str(d), "--policy", "random"])
    assert res.exit_code == 0, res.output
    assert "random" in res.stdout


def test_simulate_bad_inputs(tmp_path):
    d = synth(tmp_path)
    bad = write(tmp_path / "bad.csv", POD_HDR, [["p0", "-1", "1", "1", "500", "", "", "", "0", "", ""]])
    res = runner.invoke(app, ["simulate", "--trace", str(d), "--pods", str(bad)])
    assert res.exit_code == 2
    assert "line 2" in res.output and "cpu_milli" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["simulate", "--trace", str(tmp_path / "missing")])
    assert res.exit_code == 2 and "does not exist" in res.output
    res = runner.invoke(app, ["simulate", "--trace", str(d), "--policy", "nope"])
    assert res.exit_code == 2 and "unknown policy" in res.output
    res = runner.invoke(app, ["simulate", "--trace", str(d), "--seeds", "x..y"])
    assert res.exit_code == 2 and "seed" in res.output
