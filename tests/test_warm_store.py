"""Warm images (issue 28): the key, the node store (atomic put, LRU, integrity), its root,
capture and warm start, on small fake images (no CRIU, no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adapters.base import EngineFingerprint
from relocator.agent.transient import Space
from relocator.snapshot import criu
from relocator.snapshot.fingerprint import Fingerprint, HostFingerprint
from relocator.snapshot.manifest import CellInfo, ImageError, Manifest, hash_files, write_manifest
from relocator.warm import capture as capture_mod
from relocator.warm import roots, start
from relocator.warm.config import WarmConfig
from relocator.warm.key import is_key, key_of, key_of_manifest, kind_of
from relocator.warm.store import ImageInUse, ImageStore, StoreFull

LAUNCH = {"model_dir": "/models/tiny", "served_model_name": "tiny", "port": 8000, "host": "0.0.0.0",
          "dtype": "bfloat16", "max_model_len": 2048, "extra_args": [], "env": {}}


def _fingerprint(weights: str = "ab") -> Fingerprint:
    return Fingerprint(
        host=HostFingerprint(arch="x86_64", cpu_model="cpu", kernel="6.18", criu_version="4.2.1"),
        engine=EngineFingerprint(engine="vllm", engine_version="0.32.0", model_id="tiny", weight_sha256=weights,
                                 dtype="bfloat16", max_model_len=2048),
    )


def _key(weights: str = "ab", launch: dict = LAUNCH) -> str:
    return key_of(kind_of(_fingerprint(weights), launch, {}))


def _fake_image(where: Path, weights: str = "ab", size: int = 1000, launch: dict = LAUNCH) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    (where / "pages-1.img").write_bytes(b"\x07" * size)
    (where / "core-1.img").write_bytes(b"core")
    (where / "dump.log").write_text("criu's log")
    manifest = Manifest(files=hash_files(where), fingerprint=_fingerprint(weights),
                        cell=CellInfo(engine="vllm", port=8000, launch=launch, source_cell="c1"))
    write_manifest(where, manifest)
    return where


@pytest.fixture
def store(tmp_path: Path) -> ImageStore:
    return ImageStore(tmp_path / "store", max_bytes=10_000)


# -- the key ---------------------------------------------------------------------------------
def test_key_is_stable_and_names_the_kind() -> None:
    key = _key()
    assert key == _key() and is_key(key) and key.startswith("vllm-0.32.0-")
    assert _key(weights="cd") != key  # other weights, another kind
    assert _key(launch={**LAUNCH, "max_model_len": 4096}) != key  # another launch option
    assert _key(launch={**LAUNCH, "port": 9000, "host": "127.0.0.1"}) == key  # per instance only
    newer_patch = _fingerprint()
    newer_patch.host.criu_version = "4.2.2"  # the restore gate accepts it, so the kind is the same
    assert key_of(kind_of(newer_patch, LAUNCH, {})) == key


def test_key_of_a_manifest_and_of_its_gpus(tmp_path: Path) -> None:
    from relocator.snapshot.manifest import read_manifest

    assert key_of_manifest(read_manifest(_fake_image(tmp_path / "i"))) == _key()
    gpus = {"gpus": [{"index": 3, "minor": 3, "uuid": "GPU-x", "model": "H200"}]}
    assert key_of(kind_of(_fingerprint(), LAUNCH, gpus)) != _key()
    other_index = {"gpus": [{"index": 5, "minor": 5, "uuid": "GPU-y", "model": "H200"}]}
    assert key_of(kind_of(_fingerprint(), LAUNCH, gpus)) == key_of(kind_of(_fingerprint(), LAUNCH, other_index))


@pytest.mark.parametrize("bad", ["../x-" + "0" * 32, "vllm", "a/b-" + "0" * 32, ""])
def test_bad_keys_are_refused(store: ImageStore, bad: str) -> None:
    assert not is_key(bad)
    with pytest.raises(ValueError):
        store.path_of(bad)


# -- put, get, list, rm ------------------------------------------------------------------------
def test_put_get_list_rm(store: ImageStore, tmp_path: Path) -> None:
    key = _key()
    assert store.get(key) is None
    entry = store.put(key, _fake_image(tmp_path / "src"))
    assert entry.path == store.path_of(key) and (entry.path / "manifest.json").is_file()
    assert entry.bytes >= 1004 and entry.engine == "vllm" and entry.model_id == "tiny"
    assert [e.key for e in store.list()] == [key]
    assert list((store.root / "tmp").iterdir()) == []  # staging renamed away
    assert store.get(key).bytes == entry.bytes
    assert store.rm(key) is True and store.get(key) is None and store.list() == []
    assert store.rm(key) is False


def test_a_second_put_of_a_kind_keeps_the_first(store: ImageStore, tmp_path: Path) -> None:
    key = _key()
    first = store.put(key, _fake_image(tmp_path / "a", size=100))
    again = store.put(key, _fake_image(tmp_path / "b", size=200))
    assert again.bytes == first.bytes and len(store.list()) == 1
    assert list((store.root / "tmp").iterdir()) == []


def test_put_refuses_an_edited_manifest(store: ImageStore, tmp_path: Path) -> None:
    src = _fake_image(tmp_path / "src")
    data = json.loads((src / "manifest.json").read_text())
    data["cell"]["port"] = 9
    (src / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ImageError, match="digest"):
        store.put(_key(), src)
    assert store.list() == [] and list((store.root / "tmp").iterdir()) == []


def test_put_refuses_a_flipped_byte_and_a_wrong_key(store: ImageStore, tmp_path: Path) -> None:
    src = _fake_image(tmp_path / "src")
    with pytest.raises(ImageError, match="kind"):
        store.put(_key(weights="other"), src)
    (src / "pages-1.img").write_bytes(b"\x08" + b"\x07" * 999)
    with pytest.raises(ImageError, match="corrupt"):
        store.put(_key(), src)
    assert store.list() == []


def test_a_truncated_image_is_removed_on_get(store: ImageStore, tmp_path: Path) -> None:
    key = _key()
    store.put(key, _fake_image(tmp_path / "src"))
    (store.path_of(key) / "pages-1.img").write_bytes(b"\x07" * 10)
    with pytest.raises(ImageError, match="truncated"):
        store.get(key)
    assert store.list() == [] and store.get(key) is None


# -- the bound ---------------------------------------------------------------------------------
def test_least_recently_used_goes_first(store: ImageStore, tmp_path: Path) -> None:
    keys = [_key(weights=w) for w in ("a", "b", "c")]
    store.put(keys[0], _fake_image(tmp_path / "a", "a", size=3000))
    store.put(keys[1], _fake_image(tmp_path / "b", "b", size=3000))
    store.get(keys[0])  # used again: b is now the least recently used
    store.put(keys[2], _fake_image(tmp_path / "c", "c", size=3000))
    assert {e.key for e in store.list()} == {keys[0], keys[2]}
    assert store.used_bytes() <= store.max_bytes


def test_an_image_in_use_is_never_evicted(store: ImageStore, tmp_path: Path) -> None:
    a, b = _key(weights="a"), _key(weights="b")
    store.put(a, _fake_image(tmp_path / "a", "a", size=6000))
    with store.use(a) as entry:
        assert entry is not None and entry.key == a
        with pytest.raises(StoreFull, match="in use"):
            store.put(b, _fake_image(tmp_path / "b", "b", size=6000))
        with pytest.raises(ImageInUse):
            store.rm(a)
    assert [e.key for e in store.list()] == [a]
    store.put(b, _fake_image(tmp_path / "b2", "b", size=6000))  # a is free now: evicted
    assert [e.key for e in store.list()] == [b]


def test_an_image_larger_than_the_bound_is_refused(store: ImageStore, tmp_path: Path) -> None:
    with pytest.raises(StoreFull, match="exceeds"):
        store.put(_key(), _fake_image(tmp_path / "big", size=20_000))
    assert store.list() == []


# -- root and config -------------------------------------------------------------------------
def _cfg(tmp_path: Path, root: str = "auto", max_gb: float = 1.0) -> WarmConfig:
    return WarmConfig(store={"root": root, "tmpfs_dir": str(tmp_path / "shm"), "disk_dir": str(tmp_path / "disk"),
                             "max_gb": max_gb})


def test_root_is_the_tmpfs_when_it_has_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roots, "probe", lambda _p: Space("tmpfs", 8 << 30, 8 << 30))
    path, _ = roots.store_root(_cfg(tmp_path), "n1")
    assert path == tmp_path / "shm" / "n1"
    path, why = roots.store_root(_cfg(tmp_path, max_gb=16), "n1")
    assert path == tmp_path / "disk" / "n1" and "free" in why
    with pytest.raises(roots.NoTmpfsRoom):
        roots.store_root(_cfg(tmp_path, root="tmpfs", max_gb=16), "n1")


def test_root_sticks_where_the_store_already_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(roots, "probe", lambda _p: Space("ext4", 8 << 30, 8 << 30))
    store = roots.open_store("n1", _cfg(tmp_path))
    assert store.root == tmp_path / "disk" / "n1"
    monkeypatch.setattr(roots, "probe", lambda _p: Space("tmpfs", 8 << 30, 8 << 30))
    assert roots.store_root(_cfg(tmp_path), "n1")[0] == tmp_path / "disk" / "n1"
    assert roots.store_root(_cfg(tmp_path), "n2")[0] == tmp_path / "shm" / "n2"
    with pytest.raises(ValueError):
        roots.store_root(_cfg(tmp_path), "../n1")


def test_config_file_and_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = WarmConfig.load()  # configs/images.yaml
    assert cfg.store.max_bytes == int(cfg.store.max_gb * (1 << 30)) and cfg.prefetch.copies == 1
    monkeypatch.setenv("RELOCATOR_WARM__STORE__MAX_GB", "2")
    assert WarmConfig.load().store.max_bytes == 2 << 30
    bad = tmp_path / "bad.yaml"
    bad.write_text("store:\n  max_gigs: 3\n")
    with pytest.raises(ValueError):
        WarmConfig.load(bad)


# -- capture and warm start (CRIU and the engine faked) ---------------------------------------
class _FakeCell:
    id, engine, port, init_pid, devices = "c1", "vllm", 8000, 1, {}
    launch = LAUNCH

    def is_alive(self) -> bool:
        return True

    def is_stopped(self) -> bool:
        return False

    def pids(self) -> list[int]:
        return []


def test_capture_files_a_kind_once(store: ImageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    dumps: list[Path] = []

    def fake_dump(_cell, image_dir: Path, timings: dict) -> None:
        dumps.append(image_dir)
        (image_dir / "pages-1.img").write_bytes(b"\x01" * 500)
        timings["criu_dump_s"] = 0.0

    monkeypatch.setattr(capture_mod, "fingerprint_of", lambda _c: _fingerprint())
    monkeypatch.setattr(capture_mod, "_dump_running", fake_dump)
    entry, dumped = capture_mod.capture(_FakeCell(), store)
    assert dumped and entry.key == _key() and store.get(_key()) is not None
    entry2, dumped2 = capture_mod.capture(_FakeCell(), store)
    assert not dumped2 and entry2.key == entry.key and len(dumps) == 1


def test_a_failed_capture_leaves_nothing(store: ImageStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing(_cell, image_dir: Path, _t: dict) -> None:
        (image_dir / "pages-1.img").write_bytes(b"half")
        raise criu.CriuError("criu dump failed")

    monkeypatch.setattr(capture_mod, "fingerprint_of", lambda _c: _fingerprint())
    monkeypatch.setattr(capture_mod, "_dump_running", failing)
    with pytest.raises(criu.CriuError):
        capture_mod.capture(_FakeCell(), store)
    assert store.list() == [] and list((store.root / "tmp").iterdir()) == []


def test_leave_running_reaches_criu() -> None:
    try:
        cmd = criu._dump_cmd(1, Path("/x"), 2, False, (), leave_running=True)
    except criu.CriuError:
        pytest.skip("no CRIU binary here")
    assert "--leave-running" in cmd and "--leave-stopped" not in cmd
    assert "--leave-running" not in criu._dump_cmd(1, Path("/x"), 2, True, (), leave_running=True)


def test_warm_start_restores_and_quarantines_a_corrupt_image(store: ImageStore, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key()
    with pytest.raises(start.NoWarmImage):
        start.restore_warm(store, key)
    store.put(key, _fake_image(tmp_path / "src"))
    seen: list[Path] = []
    monkeypatch.setattr(start, "restore", lambda path, _t: seen.append(path) or "cell")
    assert start.restore_warm(store, key) == "cell" and seen == [store.path_of(key)]

    def corrupt(_path, _t):
        raise ImageError("image file pages-1.img is corrupt")

    monkeypatch.setattr(start, "restore", corrupt)
    with pytest.raises(ImageError, match="removed"):
        start.restore_warm(store, key)
    assert store.list() == []  # the next start of that kind is cold, then captured again


def test_the_key_of_a_launch_is_the_key_of_the_cell_it_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    from adapters.base import LaunchSpec
    from relocator.worker import spec_to_dict

    fp = _fingerprint()
    monkeypatch.setattr(start, "host_fingerprint", lambda: fp.host)
    monkeypatch.setattr(start, "engine_fingerprint_for", lambda _launch, _engine: fp.engine)
    spec = LaunchSpec(model_dir=Path("/models/tiny"), served_model_name="tiny", port=8123, host="127.0.0.1")
    cell = _FakeCell()
    cell.launch = {**spec_to_dict(spec), "host": "0.0.0.0"}  # as launch_worker records it
    assert start.key_for_launch(spec, "vllm") == capture_mod.key_of_cell(cell, fp)


def test_room_is_checked_before_a_copy_or_a_capture_writes_a_byte(store: ImageStore, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil as sh

    from relocator.warm import store as store_mod

    store.check_room(9_000)  # empty: fits
    with pytest.raises(StoreFull, match="exceeds the store's bound"):
        store.check_room(20_000)
    key = _key()
    store.put(key, _fake_image(tmp_path / "a", size=6000))
    store.check_room(9_000)  # the image in store is unused: evicted at commit, so it fits
    with store.use(key):
        with pytest.raises(StoreFull, match="used by images in use"):
            store.check_room(5_000)  # a full store: the bound held by an image being restored from
    real = sh.disk_usage
    monkeypatch.setattr(store_mod.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=store_mod.FS_HEADROOM_BYTES + 100))
    with pytest.raises(StoreFull, match="filesystem"):
        store.check_room(1_000)  # the tmpfs itself is full: refused before the staging fills it


def test_a_capture_into_a_full_store_dumps_nothing(store: ImageStore, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from relocator import procs

    key = _key(weights="other")
    store.put(key, _fake_image(tmp_path / "a", weights="other", size=8000))
    monkeypatch.setattr(capture_mod, "fingerprint_of", lambda _c: _fingerprint())
    monkeypatch.setattr(capture_mod, "_dump_running", lambda *a: pytest.fail("dumped into a full store"))
    monkeypatch.setattr(procs, "rss_bytes", lambda pids: 8000)
    with store.use(key), pytest.raises(StoreFull):
        capture_mod.capture(_FakeCell(), store)
    assert [e.key for e in store.list()] == [key] and list((store.root / "tmp").iterdir()) == []
