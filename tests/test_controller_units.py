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
