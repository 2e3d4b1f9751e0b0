"""`relocator bench replay --runs-file`: every finished run kept as it ends, a second start
reads them back instead of making them again (relocator/sim/runlog.py)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from relocator.cli import _register, app
from relocator.sim.replay import ReplayConfig
from relocator.sim.runlog import RunLogError, append_run, inputs_digest, load_runs, run_key
from tests.test_replay import synth_trace

_register()
runner = CliRunner()


def test_key_names_the_list_the_inputs_and_every_option(tmp_path):
    cfg = ReplayConfig(policy="fgd", mode="moves", load=0.9, queue="easy", seed=43, arrivals="poisson", passes=4)
    k = run_key("default", "d1", cfg)
    assert k == run_key("default", "d1", replace(cfg))
    assert k != run_key("gpushare80", "d1", cfg)
    assert k != run_key("default", "d2", cfg)
    assert k != run_key("default", "d1", replace(cfg, seed=44))
    assert k != run_key("default", "d1", replace(cfg, budget_cap=8.0))
    assert k == run_key("default", "d1", replace(cfg, pack_every_s=7.0))  # read by moves+pack only
    pack = replace(cfg, mode="moves+pack")
    assert run_key("default", "d1", replace(pack, pack_every_s=5.0)) != run_key("default", "d1", replace(pack, pack_every_s=7.0))
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("x\n")
    b.write_text("y\n")
    assert inputs_digest([a, b]) == inputs_digest([b, a, a])
    d = inputs_digest([a, b])
    b.write_text("z\n")
    assert inputs_digest([a, b]) != d


def test_runs_file_round_trip_and_a_cut_last_line(tmp_path):
    f = tmp_path / "runs.jsonl"
    assert load_runs(f) == {}
    append_run(f, "k1", {"seed": 42, "wait_s_p99": 10.0})
    append_run(f, "k2", {"seed": 43, "wait_s_p99": None})
    assert load_runs(f) == {"k1": {"seed": 42, "wait_s_p99": 10.0}, "k2": {"seed": 43, "wait_s_p99": None}}
    with f.open("a") as fh:
        fh.write('{"key": "k3", "run": {"se')  # the bench killed while writing
    assert set(load_runs(f)) == {"k1", "k2"}


@pytest.mark.parametrize("text, why", [
    ('not json\n{"key": "k", "run": {}}\n', "line 1: not JSON"),
    ('{"results": []}\n', "line 1: not a run of relocator bench replay"),
])
def test_a_file_that_is_not_a_runs_file_is_named(tmp_path, text, why):
    f = tmp_path / "runs.jsonl"
    f.write_text(text)
    with pytest.raises(RunLogError, match=why):
        load_runs(f)


def _bench(d, f, seeds: int):
    return runner.invoke(app, ["bench", "replay", "--trace", str(d), "--policy", "best-fit", "--mode", "none,moves", "--load", "1.3",
                               "--queue", "fifo", "--seeds", str(seeds), "--passes", "3", "--jobs", "1", "--json", "--plot",
                               str(d / "r.png"), "--runs-file", str(f)])


def test_cli_resumes_from_the_runs_file(tmp_path):
    d = synth_trace(tmp_path)
    f = tmp_path / "runs.jsonl"
    first = _bench(d, f, 1)
    assert first.exit_code == 0, first.output
    assert len(f.read_text().splitlines()) == 2, f.read_text()
    again = _bench(d, f, 2)  # seed 42 read back, seed 43 made
    assert again.exit_code == 0, again.output
    assert len(f.read_text().splitlines()) == 4, f.read_text()  # only seed 43's two runs were added
    fresh = _bench(d, tmp_path / "fresh.jsonl", 2)
    assert fresh.exit_code == 0, fresh.output

    def figures(res):
        return sorted((r["mode"], r["seed"], r["wait_s_p99"], r["alloc_ratio_mean"]) for r in json.loads(res.stdout)["runs"])

    assert figures(again) == figures(fresh)  # read back or made, the same runs
    assert "series" not in json.loads(again.stdout)["runs"][0]


def test_cli_bad_runs_file_is_one_line_exit_2(tmp_path):
    d = synth_trace(tmp_path)
    f = tmp_path / "runs.jsonl"
    f.write_text("garbage\nmore\n")
    res = _bench(d, f, 1)
    assert res.exit_code == 2, res.output
    assert "runs file" in res.output and "line 1: not JSON" in res.output and "Traceback" not in res.output
