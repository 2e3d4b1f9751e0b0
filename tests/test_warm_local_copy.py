"""A warm image copied between two nodes of one host reads the peer's store in place (issue 29:
a handoff's on-demand copy through the raylets' object stores took the serving source's CPU),
and the bench's clients spread over one request's length. Fake images, no Ray cluster."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from adapters.base import EngineFingerprint
from relocator.agent import warmcopy as A
from relocator.agent.transfer import TransferError
from relocator.snapshot.fingerprint import Fingerprint, HostFingerprint
from relocator.snapshot.manifest import CellInfo, Manifest, hash_files, write_manifest
from relocator.warm.key import key_of, kind_of
from relocator.warm.store import ImageInUse, ImageStore, held_image

LAUNCH = {"model_dir": "/models/tiny", "served_model_name": "tiny", "port": 8000, "host": "0.0.0.0",
          "dtype": "bfloat16", "max_model_len": 2048, "extra_args": [], "env": {}}
FP = Fingerprint(host=HostFingerprint(arch="x86_64", cpu_model="cpu", kernel="6.18", criu_version="4.2.1"),
                 engine=EngineFingerprint(engine="vllm", engine_version="0.32.0", model_id="tiny", weight_sha256="ab",
                                          dtype="bfloat16", max_model_len=2048))
KEY = key_of(kind_of(FP, LAUNCH, {}))


def _filed(store: ImageStore, tmp: Path, size: int = 5000) -> Path:
    """A fake image of KEY filed in `store` (its path there)."""
    src = tmp / "made"
    src.mkdir()
    (src / "pages-1.img").write_bytes(bytes(range(256)) * (size // 256))
    (src / "core-1.img").write_bytes(b"core")
    write_manifest(src, Manifest(files=hash_files(src), fingerprint=FP,
                                 cell=CellInfo(engine="vllm", port=8000, launch=LAUNCH, source_cell="c1")))
    return store.put(KEY, src).path


@pytest.fixture
def stores(tmp_path: Path) -> tuple[ImageStore, ImageStore, Path]:
    peer, mine = ImageStore(tmp_path / "n1", 100_000), ImageStore(tmp_path / "n2", 100_000)
    return peer, mine, _filed(peer, tmp_path)


def test_a_peer_image_is_readable_here_only_on_this_host_and_mount_namespace(stores) -> None:
    _peer, _mine, image = stores
    where = A.where_held(image)
    assert A.readable_here(where) == image, where
    assert A.readable_here({**where, "host": "another-boot/1"}) is None  # another host, or an emulated one's namespace
    assert A.readable_here({**where, "ino": where["ino"] + 1}) is None  # the same path, another directory
    assert A.readable_here({**where, "path": str(image.parent / "gone")}) is None
    assert A.readable_here(None) is None and A.readable_here({"host": A.host_id()}) is None


def test_a_local_copy_files_the_peer_image_verified_and_holds_it_while_reading(stores, tmp_path) -> None:
    peer, mine, image = stores

    got, entry = A.copy_local(mine, image, KEY, 1024, False, threading.Event(), "test")
    assert got["via"] == "local" and got["verified"] is True, got
    assert entry.key == KEY and mine.get(KEY) is not None
    assert (entry.path / "pages-1.img").read_bytes() == (image / "pages-1.img").read_bytes()
    assert list((mine.root / "tmp").iterdir()) == []
    with held_image(image) as held:  # what the copy holds while it reads: the peer's rm waits
        assert held == image
        with pytest.raises(ImageInUse):
            peer.rm(KEY)
    assert peer.rm(KEY) is True
    with held_image(image) as held:
        assert held is None  # removed since it was asked for: the copy says so, copies nothing


def test_a_damaged_peer_image_or_a_cancel_leaves_nothing_here(stores) -> None:
    _peer, mine, image = stores
    stop = threading.Event()
    stop.set()
    with pytest.raises(A.CopyCancelled):
        A.copy_local(mine, image, KEY, 1024, True, stop, "test")
    assert mine.list() == [] and list((mine.root / "tmp").iterdir()) == []
    (image / "pages-1.img").write_bytes(b"\x00" * 5000)  # flipped on the peer's side since it was filed
    with pytest.raises(TransferError):
        A.copy_local(mine, image, KEY, 1024, False, threading.Event(), "test")
    assert mine.list() == [] and list((mine.root / "tmp").iterdir()) == []


class _Remote:
    def __init__(self, fn):
        self.remote = fn


def test_fetch_takes_the_local_copy_for_a_peer_on_this_host_and_ray_for_any_other(stores, monkeypatch) -> None:
    import ray

    peer, mine, image = stores
    answers = {"where": A.where_held(image)}
    streamed: list[str] = []
    src = SimpleNamespace(warm_bytes=_Remote(lambda key: peer.list()[0].bytes),
                          warm_where=_Remote(lambda key: answers["where"]),
                          stream_warm=SimpleNamespace(options=lambda **kw: _Remote(
                              lambda *a: streamed.append("ray") or iter(()))))
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace=None: src)
    monkeypatch.setattr(ray, "get", lambda ref, timeout=None: ref)

    class Ops(A.WarmCopyOps):
        node = "n2"
        warm = SimpleNamespace(store=lambda cfg: mine)

    got = Ops().fetch_warm("n1", KEY, background=False)
    assert got["copied"] is True and got["via"] == "local" and streamed == [], got
    mine.rm(KEY)
    answers["where"] = {**answers["where"], "host": "elsewhere/1"}  # a peer on another host: through Ray
    with pytest.raises(TransferError):  # the fake stream brings nothing
        Ops().fetch_warm("n1", KEY, background=False)
    assert streamed == ["ray"] and mine.list() == []


def test_clients_start_spread_over_one_request_and_at_once_without_a_stagger() -> None:
    from relocator.cluster.streams import RequestResult, request_s, start_offsets

    assert start_offsets(8, 2.0) == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75]
    assert start_offsets(8, 0.0) == [0.0] * 8 and start_offsets(3, -1.0) == [0.0] * 3
    ref = {0: RequestResult(0, 0, times=[10.0, 10.5, 12.0]), 1: RequestResult(0, 1, times=[3.0, 4.0]),
           2: RequestResult(0, 2, times=[5.0])}  # one token event short of a span: left out
    assert request_s(ref) == pytest.approx(1.5)
    assert request_s({}) == 0.0


def test_the_bench_says_where_in_its_phase_each_phases_longest_gap_began() -> None:
    from relocator.cli.bench_relocation import gap_by_phase, gap_by_phase_at

    rel = {"phases": [{"name": "RESTORE", "started": 100.0, "ended": 110.0},
                      {"name": "SWITCH", "started": 110.0, "ended": 111.0}]}
    gaps = [[1.0, 1.5], [4.0, 4.2], [9.8, 10.3], [10.9, 11.0]]  # monotonic; wall = +100
    assert gap_by_phase(rel, gaps, 100.0) == {"RESTORE": 0.5, "SWITCH": 0.5}
    assert gap_by_phase_at(rel, gaps, 100.0) == {"RESTORE": 1.0, "SWITCH": -0.2}
