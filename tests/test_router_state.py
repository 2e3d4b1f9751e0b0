"""The persisted routing table (relocator/router/state.py) and its use by RouterServer."""

from __future__ import annotations

import asyncio
import json
import logging

import pytest

from relocator.router import state
from relocator.router.client import RouterControl
from relocator.router.config import BackendConfig, RouterSettings
from relocator.router.server import RouterServer
from relocator.router.table import ReplicaState, RoutingTable

aio = pytest.mark.asyncio(loop_scope="session")


def _table() -> RoutingTable:
    t = RoutingTable("round_robin")
    t.add("w1", "m", "http://a:1/")
    t.add("w2", "m", "http://b:1")
    t.add("w3", "other", "http://c:1")
    t.hold("w2")
    t.switch("w3", "http://d:1")
    return t


def test_save_load_restore_roundtrip(tmp_path):
    p = tmp_path / "sub" / "state.json"
    state.save(p, _table())
    assert not list(p.parent.glob("*.tmp"))  # atomic: the temporary file was renamed
    reps = state.load(p)
    assert reps is not None and {e["worker_id"] for e in reps} == {"w1", "w2", "w3"}
    t = RoutingTable()
    assert state.restore(t, reps) == 3
    assert t.get("w1").endpoint == "http://a:1"
    assert t.get("w2").state is ReplicaState.HELD
    assert t.get("w3").endpoint == "http://d:1" and t.get("w3").generation == 1
    assert t.models() == ["m", "other"]


@pytest.mark.parametrize("content", [b"", b"{not json", b"[]", b'{"version": 99, "replicas": []}',
                                     b'{"version": 1}', b'{"version": 1, "replicas": [{"worker_id": 3}]}',
                                     b'{"version": 1, "replicas": [{"worker_id": "w", "model": "m", '
                                     b'"endpoint": "ftp://x"}]}', b"\xff\xfe"])
def test_corrupt_file_warns_and_gives_none(tmp_path, caplog, content):
    p = tmp_path / "state.json"
    p.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="relocator.router.state"):
        assert state.load(p) is None
    assert "corrupt" in caplog.text


def test_missing_file_is_silent(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        assert state.load(tmp_path / "nope.json") is None
    assert caplog.text == ""


def test_unreadable_path_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="relocator.router.state"):
        assert state.load(tmp_path) is None  # a directory
    assert "unreadable" in caplog.text


@aio
async def test_follow_applies_switch_release_hold_add():
    old = _table()
    new = RoutingTable()
    state.restore(new, state.dump(old)["replicas"])
    fut_owner = old.get("w2")
    waiter = asyncio.ensure_future(old.wait_for(fut_owner))
    await asyncio.sleep(0)
    new.switch("w2", "http://e:1", release=True)  # the relocation finished in the new process
    new.hold("w1")
    new.add("w4", "m", "http://f:1")
    new.remove("w3")  # removals are not followed
    done = state.follow(old, state.dump(new)["replicas"])
    assert ("switch", "w2") in done and ("hold", "w1") in done and ("add", "w4") in done
    assert old.get("w2").endpoint == "http://e:1" and old.get("w2").state is ReplicaState.ACTIVE
    assert old.get("w2").generation == new.get("w2").generation
    assert (await waiter) is old.get("w2")  # its queued request was released
    assert old.get("w1").state is ReplicaState.HELD
    assert old.get("w3").endpoint == "http://d:1"
    # nothing new: nothing done; a release alone
    assert state.follow(old, state.dump(new)["replicas"]) == []
    new.release("w1")
    assert state.follow(old, state.dump(new)["replicas"]) == [("release", "w1")]


@aio
async def test_server_persists_every_control_change_and_reloads(tmp_path):
    p = tmp_path / "state.json"
    s = RouterSettings(port=0, control_port=0, state_file=p,
                       backends=[BackendConfig(model="m", url="http://cfg:1", worker_id="w1")])
    srv = await RouterServer(s).start()
    try:
        async with RouterControl(srv.control_url) as rc:
            async def reps():
                return {e["worker_id"]: e for e in json.loads(p.read_text())["replicas"]}

            await rc.add_replica("w2", "m", "http://x:1")
            assert set(await reps()) == {"w1", "w2"}
            await rc.hold("w2")
            assert (await reps())["w2"]["held"] is True
            await rc.switch("w2", "http://y:1", release=False)
            r = await reps()
            assert r["w2"]["endpoint"] == "http://y:1" and r["w2"]["generation"] == 1
            await rc.release("w2")
            assert (await reps())["w2"]["held"] is False
            await rc.switch("w1", "http://z:1")
            await rc.add_replica("w3", "m", "http://w:1")
            await rc.remove_replica("w3")
            assert set(await reps()) == {"w1", "w2"}
    finally:
        await srv.stop()
    # a new router: the state file wins over the config's backend for w1
    srv2 = RouterServer(s)
    assert srv2.table.get("w1").endpoint == "http://z:1"
    assert srv2.table.get("w2").endpoint == "http://y:1"
    assert srv2.table.get("w2").generation == 1


@aio
async def test_server_starts_empty_on_corrupt_state(tmp_path, caplog):
    p = tmp_path / "state.json"
    p.write_text('{"version": 1, "replicas": [')
    with caplog.at_level(logging.WARNING, logger="relocator.router.state"):
        srv = await RouterServer(RouterSettings(port=0, control_port=0, state_file=p)).start()
    try:
        assert srv.table.replicas() == []
        assert "corrupt" in caplog.text
    finally:
        await srv.stop()


def test_settings_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RELOCATOR_ROUTER_STATE_FILE", str(tmp_path / "s.json"))
    monkeypatch.setenv("RELOCATOR_ROUTER_LISTEN_FD", "7")
    monkeypatch.setenv("RELOCATOR_ROUTER_SUPERVISED", "1")
    s = RouterSettings()
    assert s.state_file == tmp_path / "s.json" and s.listen_fd == 7 and s.supervised is True
