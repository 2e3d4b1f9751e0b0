"""The relocation state machine against a fake backend: phases, persistence, rollback at every
phase, fault injection, and recovery after a controller crash at every phase."""

from __future__ import annotations

import pytest

from relocator.controller.machine import Machine, SimulatedCrash
from relocator.controller.model import DONE, FAILED, PHASES, ROLLED_BACK, Relocation, WorkerRecord
from relocator.controller.store import Store


class FakeBackend:
    """Cells as a dict {(node, cell): state}; records every call."""

    def __init__(self) -> None:
        self.cells: dict[tuple[str, str], str] = {("n1", "c1"): "running"}
        self.images: set[tuple[str, str]] = set()
        self.reserved: set[str] = {"pg-w1"}
        self.router: dict[str, dict] = {"w1": {"endpoint": "http://a", "held": False}}
        self.calls: list[tuple] = []
        self.fail: dict[str, Exception] = {}
        self.incompatible: list[str] = []
        self.gpu_ids: dict[str, list[int]] = {}  # what reserve() says Ray gave, per node

    def _call(self, name: str, *args) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise self.fail[name]

    def pick_target(self, worker):
        self._call("pick_target", worker.id)
        return "n2"

    def compatible(self, worker, node):
        self._call("compatible", worker.id, node)
        return self.incompatible

    def transient_image_dir(self, worker, node, rid):
        return self.image_dir(node, rid), "disk", "fake backend"

    def image_dir(self, node, rid):
        return f"/img/{node}/{rid}"

    def reserve(self, worker, node, name):
        self._call("reserve", node, name)
        self.reserved.add(name)
        return self.gpu_ids.get(node)

    def free(self, name):
        self._call("free", name)
        self.reserved.discard(name)

    def hold(self, wid):
        self._call("hold", wid)
        self.router[wid]["held"] = True

    def switch(self, wid, endpoint):
        self._call("switch", wid, endpoint)
        self.router[wid] = {"endpoint": endpoint, "held": False}
        return {"moved_streams": 2, "released": 1}

    def release(self, wid):
        self._call("release", wid)
        self.router[wid]["held"] = False

    def dump(self, node, cell, image_dir, page_server=None):
        assert self.cells[(node, cell)] == "running"
        self.cells[(node, cell)] = "stopped"  # like CRIU --leave-stopped
        self._call("dump", node, cell)
        self.images.add((node, image_dir))
        self.dump_page_server = page_server
        return {"bytes": 1234}

    def open_page_server(self, node, image_dir):  # transfer stream: the target's page server
        self._call("open_page_server", node)
        self.images.add((node, image_dir))
        return {"address": "127.0.0.1", "port": 1, "image_dir": image_dir}

    def transfer(self, src, dst, image_dir, dst_image_dir):
        self._call("transfer", src, dst)
        self.images.add((dst, dst_image_dir))
        return {"bytes": 1234, "chunks": 3}

    def restore(self, node, image_dir, cell, verified=False, gpu_ids=None):
        self.cells[(node, cell)] = "running"
        self._call("restore", node, cell)
        self.restore_gpu_ids = gpu_ids
        self.restore_verified = verified
        return {"endpoint": f"http://{node}/{cell}", "cell_id": cell}

    def cell_state(self, node, cell):
        self._call("cell_state", node, cell)
        return self.cells.get((node, cell), "absent")

    def resume(self, node, cell):
        self._call("resume", node, cell)
        self.cells[(node, cell)] = "running"

    def kill(self, node, cell):
        self._call("kill", node, cell)
        self.cells.pop((node, cell), None)

    def remove_image(self, node, path):
        self.images.discard((node, path))

    # invariants
    def live(self) -> list[tuple[str, str]]:
        return [k for k, v in self.cells.items() if v == "running"]

    def copies(self) -> list[tuple[str, str]]:
        return list(self.cells)


@pytest.fixture
def env(tmp_path):
    store = Store(tmp_path / "c.db")
    store.save_worker(WorkerRecord(id="w1", model="m", node="n1", gpus=2, cell_id="c1", endpoint="http://a",
                                   state="running", reservation="pg-w1"))
    return store, FakeBackend()


def _crash(_after: float) -> None:
    raise SimulatedCrash()


def test_happy_path_runs_eight_phases_in_order(env) -> None:
    store, be = env
    m = Machine(store, be)
    rel = m.run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == DONE, rel.error
    assert [p["name"] for p in rel.phases] == list(PHASES)
    assert all(p["ok"] for p in rel.phases)
    assert be.live() == [("n2", "w1-r1")] and be.copies() == [("n2", "w1-r1")]
    assert be.reserved == {"relocator-w1-r1"}  # source GPUs freed, target kept
    assert be.router["w1"] == {"endpoint": "http://n2/w1-r1", "held": False}
    w = store.worker("w1")
    assert (w.node, w.cell_id, w.state, w.reservation) == ("n2", "w1-r1", "running", "relocator-w1-r1")
    order = [c[0] for c in be.calls if c[0] in ("reserve", "hold", "dump", "restore", "switch", "kill", "free")]
    assert order == ["reserve", "hold", "dump", "restore", "switch", "kill", "free"]
    assert be.images == set()
    assert store.relocation("r1").result == DONE
    assert set(rel.phase_seconds()) == set(PHASES)


def test_stream_transfer_and_target_choice(env) -> None:
    store, be = env
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", transfer="stream"))
    assert rel.result == DONE and rel.dst == "n2"
    assert ("transfer", "n1", "n2") in be.calls
    assert ("open_page_server", "n2") in be.calls and be.dump_page_server["port"] == 1  # memory straight there
    assert be.restore_verified  # streamed bytes were hashed on arrival: no second pass
    assert rel.dst_image_dir == "/img/n2/r1" and be.images == set()


def test_the_copy_gets_the_gpu_ids_of_its_reservation(env) -> None:
    """The target reservation's GPU indices go to the restore and, once switched, into the
    worker's record; a rollback leaves the source's."""
    store, be = env
    w = store.worker("w1")
    w.gpu_ids = [0, 1]
    store.save_worker(w)
    be.gpu_ids = {"n2": [2, 3]}
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == DONE and rel.dst_gpu_ids == [2, 3]
    assert be.restore_gpu_ids == [2, 3] and store.worker("w1").gpu_ids == [2, 3]
    be.gpu_ids = {"n1": [1, 0]}
    rel = Machine(store, be).run(Relocation(id="r2", worker="w1", src="n2", dst="n1", faults={"restore": True}))
    assert rel.result == ROLLED_BACK and be.restore_gpu_ids == [1, 0]
    assert store.worker("w1").gpu_ids == [2, 3]


def test_each_phase_is_persisted_before_it_starts(env) -> None:
    store, be = env
    seen: list[tuple[str, str | None]] = []
    orig = be.dump

    def dump(node, cell, image_dir):
        seen.append(("dump", store.relocation("r1").phase))
        return orig(node, cell, image_dir)

    be.dump = dump
    Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert seen == [("dump", "DUMP")]


@pytest.mark.parametrize("phase", ["DUMP", "TRANSFER", "RESTORE"])
def test_injected_fault_rolls_back(env, phase: str) -> None:
    store, be = env
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="stream",
                                            faults={phase.lower(): True}))
    assert rel.result == ROLLED_BACK and rel.error.startswith(phase)
    assert be.live() == [("n1", "c1")] and be.copies() == [("n1", "c1")]  # one copy, serving
    assert be.reserved == {"pg-w1"}
    assert be.router["w1"] == {"endpoint": "http://a", "held": False}
    assert ("resume", "n1", "c1") in be.calls
    assert be.images == set()
    w = store.worker("w1")
    assert (w.node, w.cell_id, w.state) == ("n1", "c1", "running")
    assert rel.rollback["from_phase"] == phase and not rel.rollback["errors"]


@pytest.mark.parametrize("phase", ["RESERVE", "HOLD"])
def test_failure_before_dump_releases_without_touching_source(env, phase: str) -> None:
    store, be = env
    be.fail[phase.lower()] = RuntimeError("boom")
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == ROLLED_BACK
    assert not any(c[0] in ("dump", "resume") for c in be.calls)
    assert be.reserved == {"pg-w1"} and be.router["w1"]["held"] is False
    assert store.worker("w1").state == "running"


def test_switch_failure_rolls_back_to_source(env) -> None:
    store, be = env
    real_switch = be.switch
    be.switch = lambda wid, ep: (_ for _ in ()).throw(RuntimeError("router down")) if ep != "http://a" else real_switch(wid, ep)
    rel = Machine(store, be, switch_retries=2).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == ROLLED_BACK and be.live() == [("n1", "c1")] and be.copies() == [("n1", "c1")]


def test_release_failure_still_done(env) -> None:
    store, be = env
    be.fail["kill"] = RuntimeError("agent gone")
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == DONE and "RELEASE" in rel.error
    w = store.worker("w1")
    # it serves from its target: running there (movable, suspendable, re-registered, replaced)
    assert (w.node, w.cell_id, w.state) == ("n2", "w1-r1", "running")


def test_release_failure_after_a_controller_restart_leaves_the_worker_running(env) -> None:
    store, be = env
    with pytest.raises(SimulatedCrash):
        Machine(store, be, on_crash=_crash).run(
            Relocation(id="r1", worker="w1", src="n1", dst="n2", faults={"crash": {"phase": "RELEASE"}}))
    be.fail["kill"] = RuntimeError("agent gone")
    rel = Machine(store, be).recover(store.open_relocations()[0])
    assert rel.result == DONE and "RELEASE" in rel.error
    w = store.worker("w1")
    assert (w.node, w.cell_id, w.state) == ("n2", "w1-r1", "running")


@pytest.mark.parametrize("result, state", [("done", "running"), ("rolled_back", "running"), ("failed", "lost")])
def test_the_worker_state_follows_the_outcome(env, result: str, state: str) -> None:
    """One rule, whatever path finished the move (a finish the machine did not expect too)."""
    from relocator.controller.machine import worker_state_after

    store, be = env
    w = store.worker("w1")
    w.state = "relocating"
    store.save_worker(w)
    rel = Relocation(id="r1", worker="w1", src="n1", dst="n2", result=result)
    assert worker_state_after(rel) == state
    Machine(store, be).settle_worker(rel)
    assert store.worker("w1").state == state


def test_incompatible_target_touches_nothing(env) -> None:
    store, be = env
    be.incompatible = ["host.cpu_model: expected X, found Y"]
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == FAILED and "cpu_model" in rel.error
    assert [c[0] for c in be.calls] == ["compatible"]
    assert store.worker("w1").state == "running"


def test_busy_worker_is_refused(env) -> None:
    store, be = env
    w = store.worker("w1")
    w.state = "relocating"
    store.save_worker(w)
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == FAILED and store.worker("w1").state == "relocating"


@pytest.mark.parametrize("phase", PHASES)
def test_crash_at_any_phase_then_recover(env, phase: str) -> None:
    """The controller dies when `phase` starts; a new controller with the same store finishes
    the job: rolled back before SWITCH, completed from SWITCH on; never two live copies."""
    store, be = env
    with pytest.raises(SimulatedCrash):
        Machine(store, be, on_crash=_crash).run(
            Relocation(id="r1", worker="w1", src="n1", dst="n2", faults={"crash": {"phase": phase}}))
    assert store.relocation("r1").result == "running" and store.relocation("r1").phase == phase
    (open_rel,) = store.open_relocations()
    rel = Machine(store, be).recover(open_rel)
    assert rel.recovered
    assert len(be.live()) == 1 and len(be.copies()) == 1
    assert be.router["w1"]["held"] is False
    w = store.worker("w1")
    assert w.state == "running"
    if PHASES.index(phase) >= PHASES.index("SWITCH"):
        assert rel.result == DONE and be.live() == [("n2", "w1-r1")] and w.node == "n2"
        assert be.reserved == {"relocator-w1-r1"}
    else:
        assert rel.result == ROLLED_BACK and be.live() == [("n1", "c1")] and w.node == "n1"
        assert be.reserved == {"pg-w1"}
        assert be.router["w1"]["endpoint"] == "http://a"


def test_crash_after_restore_completed_rolls_back_cleanly(env) -> None:
    """Crash in RESTORE after the agent restored the copy: recovery kills the copy first."""
    store, be = env
    orig = be.restore

    def restore_then_die(node, image_dir, cell, verified=False, gpu_ids=None):
        orig(node, image_dir, cell)
        raise SimulatedCrash()

    be.restore = restore_then_die
    with pytest.raises(SimulatedCrash):
        Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert len(be.live()) == 1  # target running, source stopped
    kills: list = []
    be_kill = be.kill
    be.kill = lambda n, c: (kills.append((n, c)), be_kill(n, c))
    rel = Machine(store, be).recover(store.open_relocations()[0])
    assert rel.result == ROLLED_BACK and be.live() == [("n1", "c1")] and kills[0] == ("n2", "w1-r1")
    # the target copy was killed before the source resumed
    names = [c[0] for c in be.calls]
    assert names.index("kill") < names.index("resume")


def test_store_survives_reopen(tmp_path) -> None:
    s = Store(tmp_path / "x.db")
    s.save_relocation(Relocation(id="r9", worker="w", src="a", phase="DUMP"))
    s.close()
    s2 = Store(tmp_path / "x.db")
    assert [r.id for r in s2.open_relocations()] == ["r9"]


def test_rollback_waits_for_a_restarting_router(env) -> None:
    """A router that is down when the rollback points it back (restarting) is retried until it
    answers, so the worker ends routed to its resumed source, not to the dead target."""
    store, be = env
    real_switch = be.switch
    downs = {"n": 0}

    def switch(wid, ep):
        if ep == "http://a" and downs["n"] < 3:  # the router is restarting: three refusals
            downs["n"] += 1
            raise ConnectionError("router restarting")
        return real_switch(wid, ep)

    be.switch = switch
    rel = Machine(store, be, router_retry_s=5.0).run(
        Relocation(id="r1", worker="w1", src="n1", dst="n2", faults={"restore": True}))
    assert rel.result == ROLLED_BACK and not rel.rollback["errors"]
    assert downs["n"] == 3 and be.router["w1"] == {"endpoint": "http://a", "held": False}
    assert be.live() == [("n1", "c1")]


def test_rollback_gives_up_on_a_router_that_stays_down(env) -> None:
    store, be = env
    real_switch = be.switch
    be.switch = lambda wid, ep: (_ for _ in ()).throw(ConnectionError("down")) if ep == "http://a" else real_switch(wid, ep)
    rel = Machine(store, be, router_retry_s=0.5).run(
        Relocation(id="r1", worker="w1", src="n1", dst="n2", faults={"dump": True}))
    assert rel.result == ROLLED_BACK
    assert any(e.startswith("router back to source") for e in rel.rollback["errors"])
    assert be.live() == [("n1", "c1")]  # the source serves; the reconcile loop re-points the router


@pytest.mark.parametrize("when", ["before", "after"])
def test_target_dying_after_restore_rolls_back_to_the_stopped_source(env, when: str) -> None:
    """RESTORE said healthy, then the target copy died: the source (stopped, resumable) must
    not be killed; the relocation rolls back and the source serves."""
    store, be = env
    real_restore, real_switch = be.restore, be.switch

    def restore(node, image_dir, cell, verified=False, gpu_ids=None):
        info = real_restore(node, image_dir, cell, verified)
        if when == "before":
            be.cells[(node, cell)] = "absent"  # killed between RESTORE and SWITCH
        return info

    def switch(wid, ep):
        info = real_switch(wid, ep)
        if when == "after" and ep != "http://a":
            be.cells.pop(("n2", "w1-r1"), None)  # died right after the router moved to it
        return info

    be.restore, be.switch = restore, switch
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == ROLLED_BACK and "target copy" in rel.error
    assert be.live() == [("n1", "c1")] and ("kill", "n1", "c1") not in be.calls
    assert be.router["w1"] == {"endpoint": "http://a", "held": False}
    assert store.worker("w1").node == "n1"


def test_target_node_lost_before_switch_rolls_back(env) -> None:
    """The target node is declared dead after RESTORE (its agent answers `lost`): no switch to
    it, the stopped source resumes and serves, the target copy is killed (fenced)."""
    store, be = env
    real_restore = be.restore

    def restore(node, image_dir, cell, verified=False, gpu_ids=None):
        info = real_restore(node, image_dir, cell, verified)
        be.cells[(node, cell)] = "lost"
        return info

    be.restore = restore
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == ROLLED_BACK and "lost" in rel.error
    assert ("kill", "n2", "w1-r1") in be.calls
    assert be.live() == [("n1", "c1")]
    assert be.router["w1"] == {"endpoint": "http://a", "held": False}
    assert not [c for c in be.calls if c[0] == "switch" and c[2] != "http://a"]


def test_source_node_lost_leaves_the_worker_lost_and_held(env) -> None:
    """The source node goes while its copy is dumped and the target restore fails: there is no
    copy left; the worker is marked lost (the controller replaces it) and stays held, instead
    of the router being pointed back at a dead endpoint."""
    store, be = env
    real_dump = be.dump

    def dump(node, cell, image_dir):
        info = real_dump(node, cell, image_dir)
        be.cells[(node, cell)] = "lost"
        return info

    be.dump = dump
    rel = Machine(store, be).run(Relocation(id="r1", worker="w1", src="n1", dst="n2", faults={"restore": True}))
    assert rel.result == FAILED
    w = store.worker("w1")
    assert w.state == "lost" and "gone" in w.error
    assert be.router["w1"]["held"] is True
    assert not any(c[0] == "switch" for c in be.calls)
    assert be.live() == []


def test_last_image_is_kept_for_a_warm_restart_and_the_older_one_dropped(env) -> None:
    store, be = env
    m = Machine(store, be, keep_last_image=True)
    rel = m.run(Relocation(id="r1", worker="w1", src="n1", dst="n2"))
    assert rel.result == DONE
    w = store.worker("w1")
    assert (w.last_image_node, w.last_image) == ("n1", "/img/n1/r1")
    assert be.images == {("n1", "/img/n1/r1")}
    rel = m.run(Relocation(id="r2", worker="w1", src="n2", dst="n1"))
    assert rel.result == DONE
    w = store.worker("w1")
    assert (w.last_image_node, w.last_image) == ("n2", "/img/n2/r2")
    assert be.images == {("n2", "/img/n2/r2")}  # only the newest


def test_streamed_moves_keep_no_image(env) -> None:
    """Without shared storage the image lives on one node's disk: not kept."""
    store, be = env
    rel = Machine(store, be, keep_last_image=True).run(
        Relocation(id="r1", worker="w1", src="n1", dst="n2", transfer="stream"))
    assert rel.result == DONE and be.images == set() and store.worker("w1").last_image == ""
