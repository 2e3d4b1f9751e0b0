"""The transfer-mode registry and strategies against a fake backend: `auto` resolved in order
(handoff where the target starts warm, shared, postcopy, stream) with its reasons, an explicit mode checked, every phase handled."""

from __future__ import annotations

import pytest

from relocator.controller import transfers
from relocator.controller.errors import PlanError
from relocator.controller.machine import Machine
from relocator.controller.model import Phase, WorkerRecord
from relocator.vocab import TransferMode

OK = {"uffd_noncoop": [True, "supported"], "lazy_dump_pipes": [True, "fs.pipe-max-size is 4194304"]}
NO_UFFD = {**OK, "uffd_noncoop": [False, "UFFD is not supported"]}


class Nodes:
    """What PLAN asks of the nodes: the image-store probe and each node's transfer_info."""

    def __init__(self, shared: bool, info: dict[str, dict]) -> None:
        self.shared, self.info, self.asked = shared, info, []

    def shared_storage(self, src: str, dst: str) -> bool:
        self.asked.append(("shared_storage", src, dst))
        return self.shared

    def transfer_info(self, node: str) -> dict:
        self.asked.append(("transfer_info", node))
        return self.info[node]


W = WorkerRecord(id="w1", model="m", node="n1", gpus=1, cell_id="c1")


@pytest.mark.parametrize("shared, info, mode, why", [
    (True, {}, "shared", "n2 sees n1's image store"),
    (False, {"n1": OK, "n2": OK}, "postcopy", "no shared image store; both kernels support post-copy"),
    (False, {"n1": OK, "n2": NO_UFFD}, "stream",
     "no shared image store; no post-copy: target: no non-cooperative userfaultfd (UFFD is not supported)"),
])
def test_auto_takes_the_first_possible_mode(shared, info, mode, why) -> None:
    chosen, reason = transfers.choose(Nodes(shared, info), W, "n2", "auto")
    # a handoff is tried first and not taken (W has no launch record: docs/handoff.md, "What auto does")
    no_handoff = "no handoff: no launch record (model_dir) to start a second copy from"
    assert (chosen.mode, reason) == (mode, f"{no_handoff}; {why}")


@pytest.mark.parametrize("gpu_node", ["n1", "n2"])
def test_auto_never_picks_postcopy_on_gpu_nodes(gpu_node) -> None:
    """cuda restore inside RESTORE reads every checkpointed page: post-copy gains nothing there,
    so `auto` takes stream and says why; an explicit postcopy is still checked as before."""
    info = {"n1": dict(OK), "n2": dict(OK)}
    info[gpu_node]["nvidia_gpus"] = 8
    chosen, reason = transfers.choose(Nodes(False, info), W, "n2", "auto")
    side = "source" if gpu_node == "n1" else "target"
    assert chosen.mode is TransferMode.STREAM
    assert f"no post-copy on GPU nodes ({side} has 8 NVIDIA GPU(s))" in reason
    assert "cuda restore reads all checkpointed device memory inside RESTORE" in reason
    assert transfers.choose(Nodes(False, info), W, "n2", "postcopy")[0].mode is TransferMode.POSTCOPY
    # Ray's fake GPU counts are not NVIDIA GPUs: a CPU node reports none and keeps post-copy
    assert transfers.choose(Nodes(False, {"n1": {**OK, "nvidia_gpus": 0}, "n2": OK}), W, "n2", "auto")[0].mode \
        is TransferMode.POSTCOPY


def test_an_explicit_mode_is_checked_not_resolved() -> None:
    nodes = Nodes(True, {"n1": OK, "n2": NO_UFFD})
    assert transfers.choose(nodes, W, "n2", "stream")[0].mode is TransferMode.STREAM
    assert nodes.asked == []  # shared and stream need nothing of the nodes
    with pytest.raises(PlanError, match="transfer postcopy is not possible: target: no non-cooperative"):
        transfers.choose(nodes, W, "n2", "postcopy")
    assert ("shared_storage", "n1", "n2") not in nodes.asked  # an explicit mode is never `auto`


def test_every_mode_but_auto_has_a_strategy_and_auto_has_none() -> None:
    assert set(transfers.STRATEGIES) == set(TransferMode) - {TransferMode.AUTO}
    with pytest.raises(Exception, match="no implementation"):
        transfers.strategy("auto")


def test_the_machine_handles_every_phase_in_order(tmp_path) -> None:
    from relocator.controller.store import Store

    m = Machine(Store(tmp_path / "c.db"), backend=None)  # type: ignore[arg-type]
    assert list(m.handlers) == list(Phase)


def test_only_shared_keeps_the_image_and_streamed_images_skip_the_second_hash() -> None:
    keeps = {m for m, s in transfers.STRATEGIES.items() if s.keeps_image}
    verified = {m for m, s in transfers.STRATEGIES.items() if s.verified_on_arrival}
    assert keeps == {TransferMode.SHARED} and verified == {TransferMode.STREAM, TransferMode.POSTCOPY}


def test_the_ray_backend_has_every_modes_agent_calls() -> None:
    from relocator.controller.backend import RayBackend

    for name in ("shared_storage", "open_page_server", "transfer_info", "dump_lazy", "postcopy_wait",
                 "lazy_dump_wait", "postcopy_status"):
        assert callable(getattr(RayBackend, name, None)), name


# ------------------------------------------------------------- the typed agent client, fake Ray
class _FakeRay:
    """ray.wait / get / cancel over refs that are ready after `ready_after` waits."""

    class exceptions:  # noqa: N801 - as ray.exceptions
        class ActorDiedError(Exception):
            pass

    def __init__(self, ready_after: int) -> None:
        self.ready_after, self.waits, self.cancelled = ready_after, 0, []

    def wait(self, refs, timeout=None):
        self.waits += 1
        return (refs, []) if self.waits > self.ready_after else ([], refs)

    def get(self, ref):
        return {"answer": ref}

    def cancel(self, ref, force=False):
        self.cancelled.append(ref)


class _Handle:
    class gpus:  # noqa: N801 - an actor method: `.remote()` gives its ref
        @staticmethod
        def remote():
            return "ref-gpus"


def _client(monkeypatch, fake_ray: _FakeRay, alive):
    import sys

    from relocator.controller.backend import AgentClient

    monkeypatch.setitem(sys.modules, "ray", fake_ray)
    client = AgentClient(alive)
    client._handles["n1"] = _Handle()
    return client


def test_agent_call_answers_once_its_ref_is_ready(monkeypatch) -> None:
    fake = _FakeRay(ready_after=2)
    assert _client(monkeypatch, fake, lambda node, fresh: True).gpus("n1") == {"answer": "ref-gpus"}
    assert fake.waits == 3 and fake.cancelled == []


def test_agent_call_on_a_dead_node_fails_fast_and_cancels(monkeypatch) -> None:
    from relocator.controller.errors import NodeLost

    fake = _FakeRay(ready_after=10**6)
    with pytest.raises(NodeLost):  # declared dead before: nothing is sent
        _client(monkeypatch, fake, lambda node, fresh: False).gpus("n1")
    assert fake.waits == 0
    answers = iter([True, True, False])  # alive when sent, dead at the second check
    with pytest.raises(NodeLost):
        _client(monkeypatch, fake, lambda node, fresh: next(answers)).gpus("n1")
    assert fake.cancelled == ["ref-gpus"]


def test_agent_call_that_never_answers_times_out_naming_the_call(monkeypatch) -> None:
    fake = _FakeRay(ready_after=10**6)
    client = _client(monkeypatch, fake, lambda node, fresh: True)
    with pytest.raises(TimeoutError, match="agent of n1: gpus did not answer within 0s"):
        client.gpus("n1", timeout=0.01)
    assert fake.cancelled == ["ref-gpus"]
