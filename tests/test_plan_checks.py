"""What a move's PLAN checks on the target before anything is touched (issue 14): the target
fingerprints the worker's launch record itself (other weights or engine version: refused at
PLAN, and the engine part is then cached for the restore), and where the target keeps a
stream/postcopy image (`transient_images`: a tmpfs with room, else disk)."""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from relocator.agent import transient as T
from relocator.agent.agent import NodeAgent, _image_size_hint
from relocator.chaos import leaks
from relocator.agent.transient import remove_roots
from relocator.controller.machine import Machine, PlanError
from relocator.controller.model import DONE, FAILED, Relocation
from relocator.snapshot import snapshot as S
from relocator.snapshot.fingerprint import Fingerprint, host_fingerprint
from relocator.worker import default_spec, spec_to_dict
from tests.test_controller_machine import FakeBackend, env  # noqa: F401 - the fixture

GIB = 1 << 30
ENGINE = "vllm"


def _fresh_caches() -> None:
    """As in another agent process: nothing fingerprinted yet."""
    import adapters.base as base_adapters

    S._engine_fingerprint.cache_clear()
    base_adapters.weight_hash.cache_clear()


@pytest.fixture
def agent(tmp_path: Path, monkeypatch) -> NodeAgent:
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path / "state"))  # restored after the test
    monkeypatch.setenv("RELOCATOR_TRANSIENT_ROOT", str(tmp_path / "shm"))
    base = tmp_path / "cluster"
    return NodeAgent("n2", str(base / "nodes" / "n2" / "state"), str(base / "nodes" / "n2" / "images"))


@pytest.fixture
def launch(tmp_path: Path) -> dict:
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights as the source has them")
    _fresh_caches()
    yield spec_to_dict(default_spec(model, "tiny", engine=ENGINE))
    _fresh_caches()  # the next test's model dir may reuse a path


# ------------------------------------------------------- the target fingerprints the worker
def test_target_with_other_weights_is_refused_at_plan(agent: NodeAgent, launch: dict) -> None:
    source = Fingerprint(host=host_fingerprint(), engine=S.engine_fingerprint_for(launch, ENGINE))
    # the target's copy of the model differs (its agent is another process: nothing cached)
    (Path(launch["model_dir"]) / "model.safetensors").write_bytes(b"weights the target has")
    _fresh_caches()
    reasons = agent.compatible(source.model_dump(), launch, ENGINE)
    assert len(reasons) == 1 and reasons[0].startswith("engine.weight_sha256: image has")
    # the old call (host part only, the source's engine part reused) could not see it
    assert agent.compatible(source.model_dump()) == []


def test_same_weights_are_compatible_and_cached_for_the_restore(agent: NodeAgent, launch: dict,
                                                                monkeypatch) -> None:
    source = Fingerprint(host=host_fingerprint(), engine=S.engine_fingerprint_for(launch, ENGINE))
    _fresh_caches()
    assert agent.compatible(source.model_dump(), launch, ENGINE) == []
    # restore's own check (expected_fingerprint) now needs no adapter: it was computed at PLAN
    monkeypatch.setattr(S, "get_adapter", lambda name: pytest.fail(f"{name} fingerprinted again"))
    manifest = SimpleNamespace(cell=SimpleNamespace(launch=dict(reversed(list(launch.items()))), engine=ENGINE))
    assert S.expected_fingerprint(manifest).engine == source.engine
    assert S._engine_fingerprint.cache_info().hits >= 1


def test_cached_fingerprint_is_a_copy(launch: dict) -> None:
    a = S.engine_fingerprint_for(launch, ENGINE)
    a.model_id = "changed by a caller"
    assert S.engine_fingerprint_for(launch, ENGINE).model_id == "tiny"


def test_target_without_the_engine_is_refused_with_a_reason(agent: NodeAgent, launch: dict) -> None:
    source = Fingerprint(host=host_fingerprint(), engine=S.engine_fingerprint_for(launch, ENGINE))
    reasons = agent.compatible(source.model_dump(), launch, "no-such-engine")
    assert len(reasons) == 1 and "cannot fingerprint no-such-engine here" in reasons[0]


def test_backend_hands_the_launch_record_to_the_target() -> None:
    from relocator.controller.backend import BackendPorts, RayBackend
    from relocator.controller.model import WorkerRecord

    calls: list[tuple] = []
    answers = {"worker_profile": {"fingerprint": {"fp": 1}, "launch": {"model_dir": "/m"}, "engine": "vllm",
                                  "image_bytes": 123},
               "compatible": ["engine.weight_sha256: image has 'a', target has 'b'"],
               "transient_image_dir": {"path": "/dev/shm/x/n2/images/r1", "on": "tmpfs", "why": "room"}}

    class Agents:  # the typed agent client, answering from the table
        def worker_profile(self, node, cell_id):
            calls.append((node, "worker_profile", cell_id))
            return answers["worker_profile"]

        def compatible(self, node, fingerprint, launch=None, engine=None):
            calls.append((node, "compatible", fingerprint, launch, engine))
            return answers["compatible"]

        def transient_image_dir(self, node, name, size_hint, mode):
            calls.append((node, "transient_image_dir", name, size_hint, mode))
            return answers["transient_image_dir"]

    config: dict = {}
    be = RayBackend(BackendPorts(inventory=lambda refresh=False: {"n1": 1, "n2": 1},
                                 node_dir=lambda n: Path("/b/nodes") / n, place=None, router=None, worker=None,
                                 setting=config.get))
    be.agents = Agents()
    w = WorkerRecord(id="w1", model="m", node="n1", gpus=0, cell_id="c1", endpoint="http://a", state="running")
    assert be.compatible(w, "n2") == answers["compatible"]
    assert calls == [("n1", "worker_profile", "c1"), ("n2", "compatible", {"fp": 1}, {"model_dir": "/m"}, "vllm")]
    # the size from that answer goes to the target's choice; no second call to the source
    assert be.transient_image_dir(w, "n2", "r1") == ("/dev/shm/x/n2/images/r1", "tmpfs", "room")
    assert calls[-1] == ("n2", "transient_image_dir", "r1", 123, "auto")
    answers["transient_image_dir"] = {"refused": "not a tmpfs (ext4)"}
    config["transient_images"] = "tmpfs"
    with pytest.raises(PlanError, match="n2 cannot keep the image on a tmpfs: not a tmpfs"):
        be.transient_image_dir(w, "n2", "r2")
    assert calls[-2][1] == "worker_profile"  # nothing remembered for this one: asked again
    n = len(calls)
    config["transient_images"] = "disk"  # today's behaviour: no agent asked
    assert be.transient_image_dir(w, "n2", "r3") == ("/b/nodes/n2/images/r3", "disk", "transient_images: disk")
    assert len(calls) == n


# ----------------------------------------------------- where a stream/postcopy image goes
def _space(free_gib: float, fstype: str | None = "tmpfs", mem_gib: float | None = 64.0) -> T.Space:
    return T.Space(fstype=fstype, free_bytes=int(free_gib * GIB),
                   mem_available=None if mem_gib is None else int(mem_gib * GIB))


def test_decide_auto_takes_tmpfs_with_room_for_twice_the_image() -> None:
    need = 2 * 3 * GIB + T.HEADROOM_BYTES
    assert T.decide("auto", 3 * GIB, T.Space("tmpfs", need))[0] == "tmpfs"
    on, why = T.decide("auto", 3 * GIB, T.Space("tmpfs", need - 1))
    assert on == "disk" and "needs 6.25 GiB" in why
    on, why = T.decide("auto", 3 * GIB, _space(100, fstype="ext4"))
    assert on == "disk" and why == "tmpfs: not a tmpfs (ext4)"
    on, why = T.decide("auto", 3 * GIB, _space(100, mem_gib=2))  # a big tmpfs on a full node
    assert on == "disk" and "memory available" in why


def test_decide_without_a_size_assumes_the_fixed_figure() -> None:
    fallback = 2 * T.FALLBACK_IMAGE_BYTES + T.HEADROOM_BYTES
    assert T.decide("auto", None, T.Space("tmpfs", fallback))[0] == "tmpfs"
    assert T.decide("auto", 0, T.Space("tmpfs", fallback - 1))[0] == "disk"


def test_decide_tmpfs_refuses_and_disk_never_looks() -> None:
    assert T.decide("tmpfs", GIB, _space(10))[0] == "tmpfs"
    with pytest.raises(T.TransientRefused, match="not a tmpfs"):
        T.decide("tmpfs", GIB, _space(10, fstype="xfs"))
    with pytest.raises(T.TransientRefused, match="needs"):
        T.decide("tmpfs", GIB, _space(1))
    assert T.decide("tmpfs", GIB, _space(10, mem_gib=0.1))[0] == "tmpfs"  # explicit: free space only
    assert T.decide("disk", GIB, _space(1000)) == ("disk", "transient_images: disk")
    with pytest.raises(ValueError, match="unknown transient images 'ram'; valid: auto, tmpfs, disk"):
        T.decide("ram", GIB, _space(10))


def test_cluster_key_is_the_base_dir_normalised() -> None:
    assert T.cluster_key("/var/lib/relocator/cluster") == T.cluster_key("/var/lib/relocator//cluster/")
    assert T.cluster_key("/var/lib/relocator/cluster") != T.cluster_key("/var/lib/relocator/deploy")


def test_probe_reads_this_machine(tmp_path: Path) -> None:
    s = T.probe(tmp_path / "not" / "yet")  # nearest existing parent
    assert s.fstype and s.free_bytes > 0
    if Path("/dev/shm").is_dir():
        assert T.fstype_of(Path("/dev/shm/relocator/x/n1/images")) == "tmpfs"


def test_agent_puts_the_image_on_its_tmpfs(agent: NodeAgent, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(T, "probe", lambda path: _space(32))
    got = agent.transient_image_dir("r1", 2 * GIB)
    root = tmp_path / "shm" / T.cluster_key(tmp_path / "cluster")
    assert got == {"path": str(root / "n2" / "images" / "r1"), "on": "tmpfs",
                   "why": "tmpfs has room (32.00 GiB free for ~2.00 GiB)"}
    assert (root / "n2" / "images").is_dir()
    monkeypatch.setattr(T, "probe", lambda path: _space(3))
    got = agent.transient_image_dir("r2", 2 * GIB)
    assert got["on"] == "disk" and got["path"] == str(tmp_path / "cluster" / "nodes" / "n2" / "images" / "r2")
    assert "needs 4.25 GiB" in got["why"]
    refused = agent.transient_image_dir("r3", 2 * GIB, "tmpfs")["refused"]
    assert refused.startswith(str(root / "n2" / "images")) and "needs 4.25 GiB" in refused
    assert agent.transient_image_dir("r4", None, "ram") == {"refused": "unknown transient images 'ram'; "
                                                                       "valid: auto, tmpfs, disk"}
    assert agent.transient_image_dir("r5", 1, "disk")["on"] == "disk"


def test_image_size_hint_is_the_cells_memory() -> None:
    me = SimpleNamespace(pids=lambda: [os.getpid()], gpu_ids=[])
    rss = _image_size_hint(me)
    assert rss is not None and rss > 10 << 20
    assert _image_size_hint(SimpleNamespace(pids=lambda: [], gpu_ids=[])) is None


def test_leaked_tmpfs_image_is_reported_and_down_removes_the_root(agent: NodeAgent, tmp_path: Path,
                                                                  monkeypatch) -> None:
    monkeypatch.setattr(T, "probe", lambda path: _space(32))
    base = tmp_path / "cluster"
    before = leaks.images(base)
    path = Path(agent.transient_image_dir("r1", GIB)["path"])
    path.mkdir()
    (path / "pages-1.img").write_bytes(b"x")
    (base / "nodes" / "n2" / "images" / "r0").mkdir(parents=True)
    after = leaks.images(base)
    assert after - before == {"n2/tmpfs:r1", "n2/r0"}
    assert leaks.images(base, transient=False) - before == {"n2/r0"}
    agent.remove_image(str(path))  # the agent's removal path handles these dirs as any other
    assert leaks.transient_images(base) == set()
    path.mkdir()
    assert remove_roots(base) == [str(T.transient_root(base))] and not T.transient_root(base).exists()
    assert remove_roots(base) == []


def test_down_of_emulated_hosts_removes_every_deployments_root(tmp_path: Path, monkeypatch) -> None:
    """A deployment's base dir is <deploy base_dir>/<id>, and each (re)deploy a new id."""
    monkeypatch.setenv("RELOCATOR_TRANSIENT_ROOT", str(tmp_path / "shm"))
    for dep in ("/var/lib/relocator/deploy/d1", "/var/lib/relocator/deploy/d2", "/var/lib/relocator/deployx"):
        assert T.make_node_images(dep, "h1") == T.node_images(dep, "h1")
        assert (T.transient_root(dep) / T.BASE_FILE).read_text() == dep
    roots = {str(T.transient_root(f"/var/lib/relocator/deploy/{d}")) for d in ("d1", "d2")}
    assert set(remove_roots("/var/lib/relocator/deploy", below=True)) == roots
    assert [p.name for p in (tmp_path / "shm").iterdir()] == [T.cluster_key("/var/lib/relocator/deployx")]


# ------------------------------------------------------------------------------- the PLAN phase
class TmpfsBackend(FakeBackend):
    def __init__(self, refuse: str | None = None) -> None:
        super().__init__()
        self.refuse = refuse

    def transfer_info(self, node):
        return {"uffd_noncoop": [True, "ok"], "lazy_dump_pipes": [True, "ok"]}  # both can post-copy

    def transient_image_dir(self, worker, node, rid):
        self._call("transient_image_dir", worker.id, node, rid)
        if self.refuse:
            raise PlanError(self.refuse)
        return f"/dev/shm/relocator/k/{node}/images/{rid}", "tmpfs", "tmpfs has room"


def test_plan_puts_a_postcopy_image_on_the_targets_tmpfs(env) -> None:  # noqa: F811
    store, _ = env
    rel = Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="postcopy")
    out = Machine(store, TmpfsBackend())._plan(rel, store.worker("w1"))
    assert out == {"to": "n2", "transfer": "postcopy", "image_on": "tmpfs", "image_why": "tmpfs has room"}
    assert rel.dst_image_dir == "/dev/shm/relocator/k/n2/images/r1" and rel.image_dir == "/img/n1/r1"


def test_plan_puts_a_streamed_image_on_the_targets_tmpfs(env) -> None:  # noqa: F811
    store, _ = env
    be = TmpfsBackend()
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="stream"))
    assert rel.result == DONE, rel.error
    assert rel.dst_image_dir == "/dev/shm/relocator/k/n2/images/r1"
    plan = rel.phases[0]
    assert plan["name"] == "PLAN" and plan["info"]["image_on"] == "tmpfs", plan
    assert plan["info"]["image_why"] == "tmpfs has room"
    assert ("transient_image_dir", "w1", "n2", "r1") in be.calls


def test_plan_shared_keeps_the_image_store(env) -> None:  # noqa: F811
    store, _ = env
    be = TmpfsBackend()
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == DONE and rel.dst_image_dir == rel.image_dir == "/img/n1/r1"
    assert rel.phases[0]["info"]["image_on"] == "disk"
    assert "transient_image_dir" not in [c[0] for c in be.calls]


def test_plan_with_a_backend_that_has_no_choice_uses_disk(env) -> None:  # noqa: F811
    store, be = env
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="stream"))
    assert rel.result == DONE and rel.dst_image_dir == "/img/n2/r1"
    assert rel.phases[0]["info"]["image_on"] == "disk"


def test_plan_refused_when_tmpfs_is_required_and_missing(env) -> None:  # noqa: F811
    store, _ = env
    be = TmpfsBackend(refuse="transient_images tmpfs: n2 cannot keep the image on a tmpfs: not a tmpfs (ext4)")
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="stream"))
    assert rel.result == FAILED and "not a tmpfs (ext4)" in rel.error
    assert [c[0] for c in be.calls] == ["compatible", "transient_image_dir"]  # before HOLD: nothing touched
    assert store.worker("w1").state == "running" and be.live() == [("n1", "c1")]


def test_emulated_hosts_leak_check_reads_the_shared_tmpfs_root(tmp_path: Path, monkeypatch) -> None:
    from relocator.chaos.hosts import EmulatedView
    from relocator.cluster.emulate import plan

    monkeypatch.setenv("RELOCATOR_TRANSIENT_ROOT", str(tmp_path / "shm"))
    for name in ("netns", "placement_groups"):
        monkeypatch.setattr(leaks, name, lambda: set())
    monkeypatch.setattr(leaks, "engine_processes", lambda base, cells: set())
    monkeypatch.setattr(leaks, "transfer_processes", lambda base: set())
    dep = "/var/lib/relocator/deploy/d1"  # host-internal: the key every host's agent uses
    v = EmulatedView({"emulated": plan(3, tmp_path / "emulated").to_dict()}, dep, controller_host="h1")
    for node, image in (("h2", "r1"), ("h3", "r2")):
        (T.node_images(dep, node) / image).mkdir(parents=True)
    assert v.collect()["images"] == {"h2/tmpfs:r1", "h3/tmpfs:r2"}
    v.dead.add("h3")  # its tmpfs went with it on a real machine
    assert v.collect()["images"] == {"h2/tmpfs:r1"}
