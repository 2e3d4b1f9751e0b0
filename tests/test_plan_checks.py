"""What a move's PLAN checks on the target before anything is touched (issue 14): the target
fingerprints the worker's launch record itself (other weights or engine version: refused at
PLAN, and the engine part is then cached for the restore)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from relocator.agent.agent import NodeAgent
from relocator.snapshot import snapshot as S
from relocator.snapshot.fingerprint import Fingerprint, host_fingerprint
from relocator.worker import default_spec, spec_to_dict

ENGINE = "vllm"


def _fresh_caches() -> None:
    """As in another agent process: nothing fingerprinted yet."""
    import adapters.vllm.adapter as vllm_adapter

    S._engine_fingerprint.cache_clear()
    vllm_adapter._weight_hash.cache_clear()


@pytest.fixture
def agent(tmp_path: Path, monkeypatch) -> NodeAgent:
    monkeypatch.setenv("RELOCATOR_STATE_DIR", str(tmp_path / "state"))  # restored after the test
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


def test_backend_hands_the_launch_record_to_the_target(monkeypatch) -> None:
    from relocator.controller.backend import RayBackend
    from relocator.controller.model import WorkerRecord

    calls: list[tuple] = []
    answers = {"worker_profile": {"fingerprint": {"fp": 1}, "launch": {"model_dir": "/m"}, "engine": "vllm"},
               "compatible": ["engine.weight_sha256: image has 'a', target has 'b'"]}

    def call(node, method, *args, **kw):
        calls.append((node, method, *args))
        return answers[method]

    be = RayBackend(SimpleNamespace(inventory=lambda: {"n1": 1, "n2": 1}, config={}))
    monkeypatch.setattr(be, "call", call)
    w = WorkerRecord(id="w1", model="m", node="n1", gpus=0, cell_id="c1", endpoint="http://a", state="running")
    assert be.compatible(w, "n2") == answers["compatible"]
    assert calls == [("n1", "worker_profile", "c1"), ("n2", "compatible", {"fp": 1}, {"model_dir": "/m"}, "vllm")]
