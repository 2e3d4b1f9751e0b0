"""Options with a fixed set of values refuse anything else, naming the valid values, wherever
they are read: the CLI (one line, exit 2), the config files (a validation error), the controller
and the router's control API (an error / HTTP 400). Nothing falls back to a default (issue 19)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading

import aiohttp
import pytest
import typer
from hypothesis import HealthCheck, assume, given, settings, strategies as st
from pydantic import ValidationError
from typer.testing import CliRunner

from relocator.cli import _register, app

runner = CliRunner()
_register()

TRANSFER = ("shared", "stream", "postcopy", "handoff", "auto")
PLACEMENT = ("random", "best-fit", "dot-product", "fgd")


# --------------------------------------------------------------------------------- the CLI
def _refused(args: list[str], option: str, valid: tuple[str, ...] | list[str]) -> str:
    res = runner.invoke(app, args)
    assert res.exit_code == 2, res.output
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    assert option in lines[0], lines[0]
    for v in valid:
        assert v in lines[0], (v, lines[0])
    return lines[0]


def test_bench_relocation_transfer(monkeypatch) -> None:
    import relocator.cli.bench_relocation as mod

    monkeypatch.setattr(mod, "run_bench", lambda *a, **k: pytest.fail("the benchmark ran"))
    line = _refused(["bench", "relocation", "--transfer", "precopy", "--json"], "--transfer", (*TRANSFER, "all"))
    assert "'precopy'" in line


def test_demo_transfer() -> None:
    _refused(["demo", "--transfer", "copy"], "--transfer", TRANSFER)


def test_relocate_transfer_and_fault() -> None:
    _refused(["relocate", "w1", "--transfer", "precopy"], "--transfer", TRANSFER)
    _refused(["relocate", "w1", "--fault", "dmp"], "--fault", ("dump", "transfer", "restore"))


def test_drain_transfer() -> None:
    _refused(["drain", "n1", "--transfer", "Shared"], "--transfer", TRANSFER)  # case matters


def test_snapshot_restore_verify(tmp_path) -> None:
    _refused(["snapshot", "restore", str(tmp_path), "--verify", "partial"], "--verify", ("auto", "full", "none"))


def test_cell_launch_engine() -> None:
    from adapters import Engine

    _refused(["cell", "launch", "--engine", "tgi"], "--engine", Engine.values())


def test_router_serve_policy_and_log_level() -> None:
    from relocator.router.policies import POLICIES

    _refused(["router", "serve", "--policy", "random"], "--policy", list(POLICIES))
    _refused(["router", "serve", "--log-level", "loud"], "--log-level",
             ("debug", "info", "warning", "error", "critical"))


def test_simulate_order_and_policies() -> None:
    _refused(["simulate", "--order", "random"], "--order", ("shuffle", "submission"))
    _refused(["simulate", "--policy", "fgd,bestfitt"], "--policy", PLACEMENT)
    _refused(["simulate", "--policy", " , "], "--policy", PLACEMENT)


def test_bench_sim_policies() -> None:
    _refused(["bench", "sim", "--policy", "first-fit"], "--policy", PLACEMENT)


def test_chaos_faults() -> None:
    from relocator.chaos.faults import FAULTS

    _refused(["chaos", "--faults", "flip-byte,flip-bit"], "--faults", list(FAULTS))


# ------------------------------------------------------------- every choice option, at random
def _leaves(group, path=()):
    for name, cmd in group.commands.items():
        if hasattr(cmd, "commands"):
            yield from _leaves(cmd, path + (name,))
        else:
            yield path + (name,), cmd


def _choices(param) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(valid values, other accepted words) of a parameter with a fixed set of values."""
    from enum import Enum
    from typing import Literal, get_args, get_origin

    t = getattr(param, "type", None)
    if t is not None and hasattr(t, "choices"):  # click.Choice (typer before it vendored click)
        return tuple(str(getattr(c, "value", c)) for c in t.choices), ()
    cb = getattr(param, "callback", None)
    if cb is not None and hasattr(cb, "choices"):  # relocator.cli.common.choice_list
        return tuple(cb.choices()), tuple(cb.words())
    ann = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    if isinstance(ann, type) and issubclass(ann, Enum):
        return tuple(str(m.value) for m in ann), ()
    if get_origin(ann) is Literal:
        return tuple(map(str, get_args(ann))), ()
    return None


def _choice_options():
    """The app's click command, with every command made to fail if it runs, and its options
    with choices: (command path, command, option, valid values, accepted words, arguments)."""
    cmd = typer.main.get_command(app)
    out = []
    for path, leaf in _leaves(cmd):
        # if a value were ever accepted by mistake, the command must not run (a cluster...)
        leaf.callback = lambda *a, _path=path, **k: pytest.fail(f"{' '.join(_path)} ran")
        args = ["x" for p in leaf.params if p.param_type_name == "argument" and p.required]
        for p in leaf.params:
            found = _choices(p) if p.param_type_name == "option" else None
            if found:
                out.append((path, leaf, p.opts[0], found[0], found[1], args))
    return cmd, out


ROOT, CHOICE_OPTIONS = _choice_options()


def test_every_choice_option_is_found() -> None:
    found = {(" ".join(path), opt) for path, _, opt, *_ in CHOICE_OPTIONS}
    assert {("bench relocation", "--transfer"), ("demo", "--transfer"), ("relocate", "--transfer"),
            ("relocate", "--fault"), ("drain", "--transfer"), ("snapshot restore", "--verify"),
            ("cell launch", "--engine"), ("router serve", "--policy"), ("router serve", "--log-level"),
            ("simulate", "--order"), ("simulate", "--policy"), ("bench sim", "--policy"),
            ("chaos", "--faults")} <= found


def _invoke(args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            ROOT.main(args, prog_name="relocator")
        except SystemExit as exc:
            return int(exc.code or 0), out.getvalue() + err.getvalue()
    return 0, out.getvalue() + err.getvalue()


VALUES = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=",\x00"), max_size=24)


@pytest.mark.parametrize("option", CHOICE_OPTIONS, ids=lambda o: f"{' '.join(o[0])} {o[2]}")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=VALUES)
def test_choice_options_refuse_random_strings(option, value: str) -> None:
    path, _, opt, valid, words, args = option
    if words:  # a comma list: items are stripped, and aliases or "all" count too
        assume(value.strip() and value.strip().lower() not in {*valid, *words})
    else:
        assume(value not in valid)
    code, output = _invoke([*path, *args, f"{opt}={value}"])
    assert code == 2, output
    assert output.count("\n") == 1 and output.startswith("error: "), output
    assert opt in output and all(v in output for v in valid), output


# ------------------------------------------------------------------------------ config files
def test_cluster_config_refuses_unknown_policy_transfer_and_keys(tmp_path, monkeypatch) -> None:
    from relocator.cluster.config import LocalConfig
    from relocator.planner.policies import PlacementPolicy

    f = tmp_path / "c.yaml"
    f.write_text("controller: {policy: bestfitt}\n")
    with pytest.raises(ValidationError) as e:
        LocalConfig.load(f)
    assert "controller.policy" in str(e.value) and all(p in str(e.value) for p in PLACEMENT)
    f.write_text("controller: {transfer: precopy}\n")
    with pytest.raises(ValidationError, match="'shared', 'stream', 'postcopy', 'handoff' or 'auto'"):
        LocalConfig.load(f)
    f.write_text("controller: {polcy: fgd}\n")  # a misspelled key is no default either
    with pytest.raises(ValidationError, match="polcy"):
        LocalConfig.load(f)
    f.write_text("controller: {policy: bestfit, transfer: stream}\n")  # the planner's alias
    c = LocalConfig.load(f).controller
    assert (c.policy, c.transfer) == (PlacementPolicy.BEST_FIT, "stream")
    monkeypatch.setenv("RELOCATOR_CONTROLLER__POLICY", "fdg")
    with pytest.raises(ValidationError, match="controller.policy"):
        LocalConfig.load(f)


def test_router_config_refuses_unknown_policy_and_engine(tmp_path) -> None:
    from relocator.router.config import RouterSettings

    with pytest.raises(ValidationError, match="'round_robin', 'least_in_flight' or 'affinity'"):
        RouterSettings(policy="fastest")
    f = tmp_path / "r.yaml"
    f.write_text("router: {engine: tgi}\n")  # an engine relocator has no adapter for
    with pytest.raises(ValidationError, match="'sglang', 'vllm' or 'none'"):
        RouterSettings.load(f)


def test_router_process_options(capsys) -> None:
    from relocator.router.__main__ import main

    for args in (["--policy", "fastest"], ["--log-level", "loud"]):
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2
        assert "invalid choice" in capsys.readouterr().err


# ----------------------------------------------------------------- controller and machine
def _controller(tmp_path):
    from relocator.controller.controller import Controller
    from relocator.controller.inventory import NodeInfo
    from relocator.controller.model import WorkerRecord

    nodes = {n: NodeInfo(n, n, 4, 3) for n in ("n1", "n2")}
    c = Controller.without_ray({"base_dir": tmp_path}, None, lambda kind, **fields: None, nodes)  # without Ray
    c.store.save_worker(WorkerRecord(id="w1", model="m", node="n1", gpus=1, state="running"))
    c.relocations.spawn = lambda rel: pytest.fail("a relocation started")
    return c


def test_controller_refuses_unknown_transfer_and_faults(tmp_path) -> None:
    c = _controller(tmp_path)
    with pytest.raises(ValueError, match="unknown transfer mode 'precopy'; valid: shared, stream, postcopy, handoff, auto"):
        c.relocate("w1", "n2", transfer="precopy")
    with pytest.raises(ValueError, match="unknown fault 'dmp'; valid: dump, transfer, restore"):
        c.relocate("w1", "n2", faults={"dmp": True})
    with pytest.raises(ValueError, match="'crash' needs"):
        c.relocate("w1", "n2", faults={"crash": {"phase": "DUMPP"}})
    assert not c.claims.busy and not list(c.store.open_relocations())  # nothing held, nothing recorded
    with pytest.raises(ValueError, match="valid: shared, stream, postcopy, handoff, auto"):
        c.drain("n1", transfer="rsync")


def test_env_faults_refuses_unknown_names(monkeypatch) -> None:
    from relocator.controller.controller import env_faults

    monkeypatch.setenv("RELOCATOR_FAULTS", "dump,restor")
    with pytest.raises(ValueError,
                       match="RELOCATOR_FAULTS: unknown phase fault 'restor'; valid: dump, transfer, restore"):
        env_faults()


def test_placement_refuses_unknown_policy() -> None:
    from relocator.controller.inventory import best_fit

    free, totals = {"n1": 2, "n2": 4}, {"n1": 4, "n2": 4}
    with pytest.raises(ValueError, match="unknown placement policy 'bestfitt'; valid: random, best-fit"):
        best_fit(free, 2, totals=totals, policy="bestfitt")  # was: best-fit, silently
    assert best_fit(free, 2, totals=totals, policy="fgd") in free


def test_machine_refuses_unknown_transfer_before_touching_anything(tmp_path) -> None:
    from relocator.controller.machine import Machine
    from relocator.controller.model import FAILED, Relocation, WorkerRecord
    from relocator.controller.store import Store
    from tests.test_controller_machine import FakeBackend

    with pytest.raises(ValueError, match="valid: shared, stream, postcopy, handoff, auto"):
        Relocation(id="r0", worker="w1", src="n1", transfer="precopy")
    store, be = Store(tmp_path / "db"), FakeBackend()
    store.save_worker(WorkerRecord(id="w1", model="m", node="n1", gpus=1, cell_id="c1",
                                   endpoint="http://a", reservation="pg-w1", state="running"))
    rel = Relocation(id="r1", worker="w1", src="n1", dst="n2")
    rel.transfer = "precopy"  # e.g. a record written by a newer controller
    rel = Machine(store, be).run(rel)
    assert rel.result == FAILED and rel.error.startswith("PLAN: unknown transfer mode 'precopy'")
    assert be.calls == [] and store.worker("w1").state == "running"


# ------------------------------------------------------------------------ the other owners
def test_snapshot_verify_mode() -> None:
    from relocator.snapshot import RestoreTarget

    with pytest.raises(ValueError, match="unknown verify mode 'partial'; valid: auto, full, none"):
        RestoreTarget(verify="partial")
    assert RestoreTarget(verify="none").verify == "none"


def test_sim_arrival_order() -> None:
    from relocator.sim.engine import build_workload

    with pytest.raises(ValueError, match="unknown arrival order 'random'; valid: shuffle, submission"):
        build_workload([], 42, 0, 1000, order="random")


def test_router_control_api_refuses_a_non_boolean_release() -> None:
    from relocator.router.config import BackendConfig, RouterSettings
    from relocator.router.server import RouterServer

    async def go() -> tuple[int, dict]:
        s = RouterSettings(port=0, control_port=0,
                           backends=[BackendConfig(model="m", url="http://127.0.0.1:9", worker_id="w1")])
        srv = await RouterServer(s).start()
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(srv.control_url + "/control/workers/w1/switch",
                                        json={"endpoint": "http://127.0.0.1:10", "release": "false"}) as r:
                    return r.status, await r.json()
        finally:
            await srv.stop()

    status, body = asyncio.run(go())
    assert status == 400 and body["error"]["param"] == "release", body
    assert "true or false" in body["error"]["message"]


def test_choice_base_names_the_valid_values() -> None:
    from relocator.choices import LogLevel

    with pytest.raises(ValueError, match="unknown log level 'loud'; valid: debug, info, warning, error, critical"):
        LogLevel("loud")
