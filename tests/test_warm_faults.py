"""Chaos faults for warm images (issue 28, relocator.warm.faults): a corrupt image, a truncated
image, a full store and the only holder lost, each through the agent's real start path
(relocator.warm.launch.WarmStarts with a real store and the real restore's checks; only the
engine launch and CRIU are fakes): detected, and the start falls back to cold with the reason
said, never a crashed launch or a hang."""

from __future__ import annotations

from pathlib import Path

import pytest

from relocator.warm import faults as F
from relocator.warm import launch as L
from relocator.warm.store import ImageStore, StoreFull
from tests.test_warm_store import _fake_image, _fingerprint, _key


class FakeCell:
    engine, port, devices, init_pid = "vllm", 8000, {}, 1
    launch = {"served_model_name": "tiny"}

    def __init__(self, cid: str) -> None:
        self.id, self.killed = cid, False

    def kill(self) -> None:
        self.killed = True

    def is_alive(self) -> bool:
        return True

    def is_stopped(self) -> bool:
        return False

    def pids(self) -> list[int]:
        return []


@pytest.fixture
def node(monkeypatch, tmp_path):
    """A node's WarmStarts over a real store of 10,000 bytes; launches and CRIU faked."""
    import relocator.warm.capture as C
    import relocator.warm.start as S
    import relocator.worker as W

    store = ImageStore(tmp_path / "store", max_bytes=10_000)
    launched: list[str] = []

    async def ready(cell, timeout=0, poll=0):
        return 0.01

    def launch_worker(spec, engine, cell_id, gpu_ids):
        launched.append(cell_id)
        return FakeCell(cell_id)

    def criu_restore(*_a, **_k):
        raise AssertionError("a damaged image reached CRIU")

    monkeypatch.setattr(W, "launch_worker", launch_worker)
    monkeypatch.setattr(W, "wait_ready", ready)
    monkeypatch.setattr(S, "key_for_launch", lambda spec, engine, gpu_ids: _key())
    monkeypatch.setattr(C, "key_of_cell", lambda cell, fingerprint=None: _key())
    monkeypatch.setattr(C, "fingerprint_of", lambda cell: _fingerprint())
    monkeypatch.setattr("relocator.snapshot.snapshot._criu_restore", criu_restore)
    monkeypatch.setattr(L.WarmStarts, "store", lambda self, cfg: store)
    monkeypatch.setenv("RELOCATOR_WARM__CAPTURE__ENABLED", "0")
    monkeypatch.delenv("RELOCATOR_WARM__ENABLED", raising=False)
    ws = L.WarmStarts("n1", tmp_path)
    return ws, store, launched


def _start(ws: L.WarmStarts, cid: str = "c1") -> dict:
    _cell, _ready, warm = ws.start(None, "vllm", cid, None, 10)
    return warm


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_a_damaged_image_is_refused_removed_and_the_start_is_cold(node, tmp_path: Path, damage: str) -> None:
    ws, store, launched = node
    key = _key()
    store.put(key, _fake_image(tmp_path / "img", size=4000))
    done = getattr(F, damage)(store.path_of(key))
    assert done["file"] == "pages-1.img", done
    warm = _start(ws)
    assert F.check_start(damage, warm) == [], warm
    assert launched == ["c1"] and "removed" in warm["reason"], warm  # cold, the image quarantined
    assert store.list() == [], [e.key for e in store.list()]  # the next start of that kind captures again


def test_a_corrupt_byte_keeps_the_size_and_mtime_so_only_the_checksums_find_it(tmp_path: Path) -> None:
    img = _fake_image(tmp_path / "img", size=4000)
    before = (img / "pages-1.img").stat()
    F.corrupt(img)
    after = (img / "pages-1.img").stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)
    assert (img / "pages-1.img").read_bytes() != b"\x07" * 4000


def test_a_full_store_refuses_the_capture_before_it_dumps_and_the_next_start_says_so(node, tmp_path: Path,
                                                                                      monkeypatch) -> None:
    import relocator.warm.capture as C

    ws, store, launched = node
    other = _key(weights="other")
    store.put(other, _fake_image(tmp_path / "other", weights="other", size=7000))
    monkeypatch.setenv("RELOCATOR_WARM__CAPTURE__ENABLED", "1")
    monkeypatch.setattr(C, "_dump_running", lambda *a: pytest.fail("dumped into a full store"))
    monkeypatch.setattr("relocator.procs.rss_bytes", lambda pids: 8000)
    with F.hold(store) as held:  # the other kind's image is being restored from: not evictable
        assert held == [other]
        first = _start(ws, "c1")
        second = _start(ws, "c2")
    assert first["how"] == "cold" and first["capture"]["dumped"] is False, first
    assert "StoreFull" in first["capture"]["reason"], first
    assert F.check_start("full", second) == [], second  # "its last capture here was not filed: StoreFull"
    assert launched == ["c1", "c2"] and [e.key for e in store.list()] == [other]
    assert list((store.root / "tmp").iterdir()) == []


def test_a_copy_refused_by_a_full_store_is_a_cold_start_that_says_so(node) -> None:
    ws, _store, launched = node

    def fetch(key: str) -> dict:
        raise StoreFull("no room for 900000000 bytes: 4294967296 of 4294967296 used by images in use")

    ws.fetch = fetch
    warm = _start(ws)
    assert F.check_start("full", warm) == [] and "the copy from a peer failed" in warm["reason"], warm
    assert launched == ["c1"]


def test_the_only_holder_lost_is_a_cold_start_that_says_no_peer_holds_it(node) -> None:
    ws, _store, launched = node
    asked: list[str] = []
    ws.fetch = lambda key: asked.append(key) or None  # fetch_warm_from_peers: no live peer has it
    warm = _start(ws)
    assert asked == [_key()] and launched == ["c1"], (asked, launched)
    assert F.check_start("holder-lost", warm) == [] and "no live peer holds one" in warm["reason"], warm


def test_asking_peers_skips_a_lost_holder_within_its_timeout(monkeypatch) -> None:
    """The lost node's agent never answers: asked with PEER_ASK_S, then the next peer; none has
    it, so None (the start goes cold) instead of a hang."""
    from types import SimpleNamespace

    import ray

    from relocator.agent import warmcopy as A

    calls: list[tuple[str, float | None]] = []

    class Handle:
        def __init__(self, name: str) -> None:
            self.name = name
            self.warm_keys = SimpleNamespace(remote=lambda: name)

    def get(ref, timeout=None):
        calls.append((ref, timeout))
        if ref.endswith("lost"):
            raise ray.exceptions.GetTimeoutError("no answer")
        return []  # alive, holds nothing

    monkeypatch.setattr(A, "peer_nodes", lambda me: ["lost", "n3"])
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: Handle(name))
    monkeypatch.setattr(ray, "get", get)
    ops = A.WarmCopyOps()
    ops.node = "n2"
    assert ops.fetch_warm_from_peers(_key()) is None
    assert [t for _r, t in calls] == [A.PEER_ASK_S, A.PEER_ASK_S], calls


def test_a_start_that_fails_or_is_warm_after_a_fault_is_reported() -> None:
    assert F.check_start("corrupt", None, error="CriuError: boom")[0].startswith("the launch failed")
    assert "not cold" in F.check_start("corrupt", {"how": "warm", "reason": ""})[0]
    assert "does not say" in F.check_start("truncate", {"how": "cold", "reason": "NoWarmImage: none"})[0]
