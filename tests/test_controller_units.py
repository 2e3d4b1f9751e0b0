"""Unit tests without Ray or CRIU: the chunked checksummed image stream, placement, config,
fault injection from the environment, and the agent's re-adoption of cells."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from adapters.base import EngineFingerprint
from relocator.agent.transfer import TransferError, iter_chunks, receive_chunks
from relocator.controller.controller import env_faults
from relocator.controller.inventory import best_fit
from relocator.snapshot.fingerprint import Fingerprint, host_fingerprint
from relocator.snapshot.manifest import CellInfo, Manifest, hash_files, read_manifest, write_manifest


def fake_image(d: Path, sizes=(0, 1, 5000, 3 << 20)) -> Path:
    d.mkdir()
    for i, n in enumerate(sizes):
        (d / f"pages-{i}.img").write_bytes(os.urandom(n))
    fp = Fingerprint(host=host_fingerprint(), engine=EngineFingerprint(
        engine="vllm", engine_version="0", model_id="m", weight_sha256="0" * 64, dtype="bf16", max_model_len=64))
    write_manifest(d, Manifest(files=hash_files(d), fingerprint=fp,
                               cell=CellInfo(engine="vllm", port=8000, source_cell="c1")))
    return d


@pytest.mark.parametrize("rehash", [False, True])
def test_stream_roundtrip_is_verified(tmp_path: Path, rehash: bool) -> None:
    src = fake_image(tmp_path / "src")
    chunks = list(iter_chunks(src, chunk_bytes=1 << 20, rehash=rehash))
    assert len(chunks) > 5 and chunks[-1][0] == "manifest.json"
    out = receive_chunks(iter(chunks), tmp_path / "dst")
    assert out["verified"] and out["files"] == 4
    assert out["bytes"] == sum(p.stat().st_size for p in src.iterdir())
    for p in src.iterdir():
        assert (tmp_path / "dst" / p.name).read_bytes() == p.read_bytes()
    assert read_manifest(tmp_path / "dst").files == read_manifest(src).files
    from relocator.snapshot.manifest import stamp_is_fresh

    # hashed on arrival: restore("auto") will not hash these files again
    assert stamp_is_fresh(tmp_path / "dst", read_manifest(tmp_path / "dst"))


@pytest.mark.parametrize("damage", ["flip", "drop", "truncate_stream"])
def test_damaged_stream_is_refused_and_cleaned(tmp_path: Path, damage: str) -> None:
    src = fake_image(tmp_path / "src")
    chunks = list(iter_chunks(src, chunk_bytes=1 << 20))
    big = max(range(len(chunks)), key=lambda i: len(chunks[i][2]))
    if damage == "flip":
        name, off, data, dig = chunks[big]
        chunks[big] = (name, off, bytes([data[0] ^ 1]) + data[1:], dig)
    elif damage == "drop":
        del chunks[big]
    else:
        chunks = chunks[: big]
    with pytest.raises(TransferError):
        receive_chunks(iter(chunks), tmp_path / "dst")
    assert not (tmp_path / "dst").exists()


def test_file_changed_on_sender_disk_is_refused(tmp_path: Path) -> None:
    src = fake_image(tmp_path / "src")
    victim = src / "pages-3.img"
    data = bytearray(victim.read_bytes())
    data[100] ^= 0xFF
    victim.write_bytes(bytes(data))
    for rehash in (False, True):
        with pytest.raises(TransferError):
            receive_chunks(iter_chunks(src, chunk_bytes=1 << 20, rehash=rehash), tmp_path / f"dst{rehash}")


def test_best_fit_and_planner_agree() -> None:
    free = {"n1": 2, "n2": 4, "n3": 3}
    totals = {"n1": 4, "n2": 4, "n3": 4}
    assert best_fit(free, 2) == "n1"
    assert best_fit(free, 3) == "n3"
    assert best_fit(free, 4) == "n2"
    assert best_fit(free, 5) is None
    assert best_fit(free, 2, exclude=("n1",)) == "n3"
    assert best_fit(free, 2, totals=totals) in ("n1",)


def test_env_faults(monkeypatch) -> None:
    monkeypatch.setenv("RELOCATOR_FAULTS", "dump, Restore")
    assert env_faults() == {"dump": True, "restore": True}


def test_config_file_env_and_overrides(monkeypatch, tmp_path: Path) -> None:
    from relocator.cluster.config import LocalConfig

    f = tmp_path / "c.yaml"
    f.write_text("cluster: {nodes: 3, gpus_per_node: 8}\ncontroller: {transfer: stream}\n")
    monkeypatch.setenv("RELOCATOR_CLUSTER__NODES", "2")
    cfg = LocalConfig.load(f, cluster={"base_dir": "/tmp/x"})
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.base_dir) == (2, 8, "/tmp/x")
    assert cfg.controller.transfer == "stream"
    with pytest.raises(Exception):
        LocalConfig.load(f, controller={"transfer": "carrier-pigeon"})
    assert cfg.router.session_nice == -5  # the router in a session of its own, favoured
    monkeypatch.setenv("RELOCATOR_ROUTER__SESSION_NICE", "null")  # the daemon's session (None)
    assert LocalConfig.load(f).router.session_nice is None
    monkeypatch.setenv("RELOCATOR_ROUTER__SESSION_NICE", "-30")  # beyond nice's range
    with pytest.raises(Exception):
        LocalConfig.load(f)


def test_agent_forgets_dead_cells_and_readopts_live_ones(tmp_path: Path, monkeypatch) -> None:
    from relocator.agent.agent import NodeAgent
    from relocator.cell.cell import Cell

    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("RELOCATOR_NET_DIR", str(tmp_path / "net"))
    live = Cell(id="live1", netns="rl-none-live", ip="10.251.255.2", port=8000, init_pid=os.getpid())
    dead = Cell(id="dead1", netns="rl-none-dead", ip="10.251.255.6", port=8000, init_pid=2 ** 22 + 1)
    live.save()
    dead.save()
    import relocator.cell.netns as netns

    monkeypatch.setattr(netns, "delete", lambda name: None)
    agent = NodeAgent("n1", str(tmp_path / "state"), str(tmp_path / "images"))
    assert agent.adopted == ["live1"]
    assert [c["id"] for c in agent.cells()] == ["live1"]
    assert agent.cell_state("live1") == "running" and agent.cell_state("nope") == "absent"
    assert agent.ping()["node"] == "n1"


def test_a_dead_node_keeps_its_name_in_the_inventory(monkeypatch) -> None:
    """Ray lists a dead node without its resources; the inventory names it from what it saw."""
    import ray
    from ray._private import state

    from relocator.controller.inventory import ray_nodes

    nodes = [{"NodeID": "a", "Alive": True, "Resources": {"GPU": 4.0, "relocator_node:n1": 1.0}},
             {"NodeID": "b", "Alive": False, "Resources": {}},
             {"NodeID": "c", "Alive": False, "Resources": {}}]
    monkeypatch.setattr(ray, "nodes", lambda: nodes)
    monkeypatch.setattr(state, "available_resources_per_node", lambda: {"a": {"GPU": 3.0}})
    out = ray_nodes({"b": "n2"})
    assert set(out) == {"n1", "n2"}
    assert out["n1"].alive and out["n1"].gpus_free == 3
    assert not out["n2"].alive and out["n2"].gpus_free == 0
    assert set(ray_nodes()) == {"n1"}


# ------------------------------------------------ the controller's placement and time limits (fakes)
class FakeAgents:
    """The backend calls a suspend makes; `dump` fails while `dump_error` is set."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.dump_error: Exception | None = None

    def __getattr__(self, name: str):
        return lambda *a, **k: self.calls.append((name, *a))

    def dump(self, node, cell, image):
        self.calls.append(("dump", node, cell))
        if self.dump_error is not None:
            raise self.dump_error
        return {"bytes": 1}

    def cell_state(self, node, cell, timeout=None):
        return "stopped"

    @property
    def agents(self) -> "FakeAgents":  # the typed agent client: calls recorded by name here too
        return self


def _fake_controller(tmp_path: Path, nodes: dict[str, tuple[int, int]], workers: list) -> "Controller":
    from relocator.controller.controller import Controller
    from relocator.controller.inventory import NodeInfo
    from relocator.controller.store import Store

    store = Store(tmp_path / "controller.db")  # no Ray: the store, a fixed inventory, fake agents
    for w in workers:
        store.save_worker(w)
    events: list = []
    inv = {n: NodeInfo(n, n, total, free) for n, (total, free) in nodes.items()}
    c = Controller.without_ray({"base_dir": tmp_path}, FakeAgents(),
                               lambda kind, **fields: events.append((str(kind), fields)), inv, store)
    c.events = events
    c.relocations.spawn = lambda rel, recover=False: pytest.fail("a relocation started")
    return c


def _worker(wid: str, node: str, gpus: int, **kw):
    from relocator.controller.model import WorkerRecord

    return WorkerRecord(id=wid, model="m", node=node, gpus=gpus, cell_id=f"{wid}-c", reservation=f"pg-{wid}",
                        state="running", **kw)


def test_cordoned_nodes_receive_no_worker(tmp_path: Path) -> None:
    """`drain --by` cordons: a replacement or a relocation without --to (place), an explicit
    --to, a consolidation: none of them puts anything there."""
    c = _fake_controller(tmp_path, {"n1": (4, 1), "n2": (4, 3), "n3": (4, 4)},
                         [_worker("w1", "n1", 3), _worker("w2", "n2", 1)])
    assert c.place(1) == "n1"  # best fit: the fullest node
    c.store.put("cordon", "n1", {"node": "n1", "at": 0, "by": 0})
    assert c.place(1) == "n2" and c.place(4) == "n3"
    assert c.place(1, exclude=("n2",)) == "n3"
    with pytest.raises(ValueError, match="'n1' is cordoned.*uncordon n1"):
        c.relocate("w2", to="n1")
    assert not c.claims.busy and not c.store.relocations()
    c.store.delete("cordon", "n1")
    c.store.put("cordon", "n2", {"node": "n2", "at": 0, "by": 0})
    plan = c.consolidate(dry_run=True)
    assert all(m["to"] != "n2" for m in plan["moves"]), plan


def test_a_worker_past_its_limit_is_only_announced_when_nobody_waits(tmp_path: Path) -> None:
    import threading
    import time

    c = _fake_controller(tmp_path, {"n1": (4, 3)}, [_worker("w1", "n1", 1, time_limit_s=5, deadline=time.time() - 1)])
    suspends: list = []
    c.demands.seaters.suspend = lambda *a, **k: suspends.append(a)
    c.update_deadlines()
    c.update_deadlines()
    for t in threading.enumerate():  # the old rule suspended it on a thread of its own
        if t.name.startswith("time-limit-"):
            t.join()
    assert suspends == [] and c.backend.calls == []
    assert [k for k, _ in c.events] == ["worker_preemptible"] and c.events[0][1]["worker"] == "w1"
    assert c.store.worker("w1").state == "running"


def test_a_waiting_demand_suspends_a_worker_past_its_limit(tmp_path: Path) -> None:
    """Full cluster: a launch of any priority may suspend a worker past its limit (even one of
    higher priority), never one within it, never one whose failed suspend backs off."""
    import time

    from relocator.controller.model import Demand

    past = time.time() - 1
    c = _fake_controller(tmp_path, {"n1": (4, 0)}, [_worker("a", "n1", 2, priority=5, time_limit_s=5, deadline=past),
                                                     _worker("b", "n1", 2)])
    demand = Demand(id="x", kind="launch", model="m", gpus=2)
    s = c.demands.plan_seating(demand, make_room=True)
    assert (s.how, s.node, s.suspends) == ("preempt", "n1", ["a"])
    a = c.store.worker("a")
    a.deadline = time.time() + 60
    c.store.save_worker(a)
    assert c.demands.plan_seating(demand, make_room=True).node is None
    a.deadline, a.suspend_retry_at = past, time.time() + 30
    c.store.save_worker(a)
    assert c.demands.plan_seating(demand, make_room=True).node is None


def test_a_failed_suspend_backs_off_and_is_reported(tmp_path: Path) -> None:
    import time

    from relocator.controller.controller import SUSPEND_BACKOFF_MAX_S, SUSPEND_BACKOFF_S
    from relocator.controller.metrics import ControllerCollector

    c = _fake_controller(tmp_path, {"n1": (4, 3)}, [_worker("w1", "n1", 1, time_limit_s=5, deadline=time.time() - 1)])
    c.backend.dump_error = RuntimeError("criu: dump failed")
    delays = []
    for _ in range(7):
        t0 = time.time()
        with pytest.raises(RuntimeError, match="serves again"):
            c.suspend("w1", reason="time_limit")
        w = c.store.worker("w1")
        assert w.state == "running" and "criu" in w.suspend_error and w.suspend_backing_off(time.time())
        delays.append(round(w.suspend_retry_at - t0, -1))
    assert delays == [SUSPEND_BACKOFF_S * 2 ** i for i in range(6)] + [SUSPEND_BACKOFF_MAX_S]
    failed = [f for k, f in c.events if k == "suspend_failed"]
    assert len(failed) == 7 and failed[-1]["failures"] == 7 and failed[-1]["reason"] == "time_limit"
    got = {m.name: m.samples[0].value for m in ControllerCollector.demand_metrics([], c.store.workers())}
    assert got["relocator_suspend_backoff_workers"] == 1 and got["relocator_preemptible_workers"] == 1
    c.backend.dump_error = None  # a suspend that works ends the back-off
    c.suspensions.router = lambda: pytest.fail("no sibling: the router keeps holding it")
    c.suspensions.queue = lambda demand, reason: None
    c.suspend("w1", reason="time_limit")
    w = c.store.worker("w1")
    assert (w.state, w.suspend_failures, w.suspend_retry_at, w.suspend_error) == ("suspended", 0, None, "")


def test_a_drain_with_a_deadline_sets_aside_workers_past_their_limit_first(tmp_path: Path) -> None:
    """Room for one of n1's two workers elsewhere: the one within its limit moves, the one past
    it is suspended (whatever order the store lists them in)."""
    import time

    from relocator.controller.model import DONE, Relocation

    c = _fake_controller(tmp_path, {"n1": (4, 2), "n2": (4, 1)},
                         [_worker("a", "n1", 1, time_limit_s=5, deadline=time.time() - 1), _worker("b", "n1", 1),
                          _worker("c", "n2", 3)])

    def relocate(wid, to=None, transfer=None, wait=True):
        rel = Relocation(id=f"r-{wid}", worker=wid, src="n1", dst=to, result=DONE)
        c.store.save_relocation(rel)
        return rel.summary()

    c.drains.relocate = relocate
    c.drains.suspend = lambda wid, reason="operator", by=None: {"worker": wid, "reason": str(reason)}
    out = c.drain("n1", by="60s")
    assert [(r["worker"], r["to"]) for r in out["relocations"]] == [("b", "n2")], out
    assert out["suspended"] == [{"worker": "a", "reason": "drain"}], out
