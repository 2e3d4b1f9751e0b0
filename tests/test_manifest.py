"""Manifest and image-integrity logic, on small synthetic image directories."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from adapters.base import EngineFingerprint
from relocator.snapshot.fingerprint import Fingerprint, HostFingerprint
from relocator.snapshot.manifest import (
    CellInfo,
    stamp_is_fresh,
    write_stamp,
    ImageError,
    Manifest,
    hash_files,
    read_manifest,
    verify_files,
    write_manifest,
)


def _fingerprint() -> Fingerprint:
    return Fingerprint(
        host=HostFingerprint(arch="x86_64", cpu_model="cpu", kernel="6.18", criu_version="4.2.1"),
        engine=EngineFingerprint(engine="vllm", engine_version="0.32.0", model_id="m", weight_sha256="ab",
                                 dtype="bfloat16", max_model_len=2048),
    )


@pytest.fixture
def image(tmp_path: Path) -> Path:
    (tmp_path / "pages-1.img").write_bytes(bytes(range(256)) * 1000)
    (tmp_path / "core-1.img").write_bytes(b"core")
    (tmp_path / "dump.log").write_text("criu log, not checksummed")
    manifest = Manifest(files=hash_files(tmp_path), fingerprint=_fingerprint(),
                        cell=CellInfo(engine="vllm", port=8000, source_cell="c1"), timings={"criu_dump_s": 1.0})
    write_manifest(tmp_path, manifest)
    return tmp_path


def test_roundtrip_and_verify(image: Path) -> None:
    m = read_manifest(image)
    assert set(m.files) == {"pages-1.img", "core-1.img"}
    assert m.files["core-1.img"].size == 4
    assert m.total_bytes == 256_000 + 4
    verify_files(image, m)  # no error


def test_flipped_byte_is_refused(image: Path) -> None:
    data = bytearray((image / "pages-1.img").read_bytes())
    data[1234] ^= 0x01
    (image / "pages-1.img").write_bytes(bytes(data))
    with pytest.raises(ImageError, match="pages-1.img is corrupt"):
        verify_files(image, read_manifest(image))


def test_truncated_file_is_refused(image: Path) -> None:
    with open(image / "pages-1.img", "r+b") as fh:
        fh.truncate(1000)
    with pytest.raises(ImageError, match="truncated"):
        verify_files(image, read_manifest(image))


def test_missing_and_extra_files(image: Path) -> None:
    (image / "core-1.img").unlink()
    with pytest.raises(ImageError, match="missing core-1.img"):
        verify_files(image, read_manifest(image))
    (image / "core-1.img").write_bytes(b"core")
    (image / "intruder.img").write_bytes(b"x")
    with pytest.raises(ImageError, match="intruder.img"):
        verify_files(image, read_manifest(image))


def test_tampered_manifest_is_refused(image: Path) -> None:
    data = json.loads((image / "manifest.json").read_text())
    data["fingerprint"]["engine"]["weight_sha256"] = "cd"
    (image / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ImageError, match="digest does not match"):
        read_manifest(image)


def test_manifest_edited_checksum_is_refused(image: Path) -> None:
    data = json.loads((image / "manifest.json").read_text())
    data["files"]["core-1.img"]["sha256"] = "0" * 64
    (image / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ImageError, match="digest"):
        read_manifest(image)


@pytest.mark.parametrize(
    "content, message",
    [("{not json", "unreadable manifest"), ('{"schema_version": 99}', "schema_version is 99"),
     ('{"schema_version": 1, "files": {}}', "invalid manifest at fingerprint"), ("[]", "schema_version")],
)
def test_bad_manifests(image: Path, content: str, message: str) -> None:
    (image / "manifest.json").write_text(content)
    with pytest.raises(ImageError, match=message):
        read_manifest(image)


def test_not_an_image(tmp_path: Path) -> None:
    with pytest.raises(ImageError, match="manifest.json is missing"):
        read_manifest(tmp_path)


def _other_cluster(tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """This process becomes a node of another cluster (its own credentials directory)."""
    from relocator import credentials

    d = credentials.install(credentials.for_node(credentials.make_cluster("other"), "x"), tmp / "other-creds",
                            export=False)
    monkeypatch.setenv(credentials.ENV_DIR, str(d))


def test_manifest_signed_with_another_clusters_key_is_refused(image: Path, tmp_path_factory,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    m = read_manifest(image)  # signed with this cluster's key
    ours = m.digest
    _other_cluster(tmp_path_factory.mktemp("other"), monkeypatch)
    with pytest.raises(ImageError, match="digest does not match"):
        read_manifest(image)
    write_manifest(image, m)  # re-signed by the other cluster: readable there only
    assert read_manifest(image).digest != ours


def test_a_node_without_the_image_key_is_told_what_is_missing(image: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from relocator import credentials

    monkeypatch.delenv(credentials.ENV_DIR, raising=False)
    monkeypatch.delenv(credentials.ENV_KEY, raising=False)
    with pytest.raises(credentials.CredentialsError, match="no image key.*relocator up"):
        read_manifest(image)  # never a plain sha256 that anyone could recompute
    monkeypatch.setenv(credentials.ENV_KEY, "by-hand key")  # the documented by-hand way
    with pytest.raises(ImageError, match="digest"):
        read_manifest(image)  # ... which is another key than the cluster's


def test_altered_page_file_with_a_rewritten_stamp_is_refused_at_restore(image: Path) -> None:
    from relocator.snapshot.manifest import STAMP, _boot_id, _file_stats
    from relocator.snapshot.snapshot import RestoreTarget, restore

    m = read_manifest(image)
    verify_files(image, m)  # a genuine stamp: restore with verify=auto would skip hashing
    pages = image / "pages-1.img"
    data = bytearray(pages.read_bytes())
    data[77] ^= 0x5A
    pages.write_bytes(bytes(data))
    # the attacker rewrites the stamp to describe the altered file (without the cluster's key)
    forged = {"digest": m.digest, "boot_id": _boot_id(), "stats": _file_stats(image, sorted(m.files)),
              "mac": "0" * 64}
    (image / STAMP).write_text(json.dumps(forged))
    assert not stamp_is_fresh(image, m)
    del forged["mac"]  # the stamp as it was before it was authenticated
    (image / STAMP).write_text(json.dumps(forged))
    assert not stamp_is_fresh(image, m)
    with pytest.raises(ImageError, match="pages-1.img is corrupt"):
        restore(image, RestoreTarget(verify="auto"))  # hashed in full, refused before CRIU runs


def test_stamp_is_fresh_until_any_file_changes(image: Path) -> None:
    m = read_manifest(image)
    assert not stamp_is_fresh(image, m)  # never hashed on this host
    verify_files(image, m)  # a full verify leaves a stamp
    assert stamp_is_fresh(image, m)
    pages = image / "pages-1.img"
    st = pages.stat()
    data = bytearray(pages.read_bytes())
    data[10] ^= 0xFF
    pages.write_bytes(bytes(data))
    os.utime(pages, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back: ctime still moved
    assert not stamp_is_fresh(image, m)
    with pytest.raises(ImageError, match="corrupt"):
        verify_files(image, m)


def test_stamp_of_another_manifest_is_not_fresh(image: Path) -> None:
    m = read_manifest(image)
    write_stamp(image, m)
    other = m.model_copy(update={"digest": "0" * 64})
    assert not stamp_is_fresh(image, other)


def test_by_hand_commands_sign_with_the_machines_own_key(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`relocator snapshot ...` by hand, with no cluster: one key per machine (0600), made once;
    a cluster's credentials, when given, win."""
    from typer.testing import CliRunner

    from relocator import credentials
    from relocator.cli import _register, app

    _register()
    monkeypatch.delenv(credentials.ENV_DIR, raising=False)
    monkeypatch.delenv(credentials.ENV_KEY, raising=False)
    monkeypatch.setenv(credentials.ENV_MACHINE_KEY, str(tmp_path / "m" / "machine.key"))
    with pytest.raises(credentials.CredentialsError):
        credentials.image_key()  # an agent's view: no key is an error, never a default
    res = CliRunner().invoke(app, ["snapshot", "inspect", str(tmp_path / "none")])
    assert res.exit_code != 0 and "no such image" in res.output and "image key" not in res.output
    key_file = tmp_path / "m" / "machine.key"
    assert (key_file.stat().st_mode & 0o777) == 0o600
    first = credentials.image_key()
    monkeypatch.delenv(credentials.ENV_KEY)
    assert credentials.use_machine_key() == key_file and credentials.image_key() == first
    monkeypatch.setenv(credentials.ENV_KEY, "given")
    assert credentials.use_machine_key() is None and credentials.image_key() == b"given"
